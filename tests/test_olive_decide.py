"""OrtEvalsEvaluator with ``against`` (issue 56): an Olive metric's max-degradation goal decided by the live loop.

Driven through Olive's own evaluator class, Metric and ONNXModelHandler (no `olive run`: its start-up is 15-30 s).
The oracle reads the reference's and the candidate's samples files itself, draws the documented order and feeds
report/decide.py's ConfidenceSequence by hand; Olive's goal check is its engine's formula (olive/engine/engine.py,
resolve_goals: threshold = baseline - value for max-degradation, baseline * (1 - value / 100) for percent-).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("olive")

from ortevals.cli import cli  # noqa: E402
from ortevals.errors import OrtEvalsError  # noqa: E402
from ortevals.report.decide import ConfidenceSequence, verdict  # noqa: E402
from tests.decide_oracle import guided_oracle  # noqa: E402

TASK = "leaderboard_mmlu_pro"
KEY = f"{TASK}-acc"


def read(folder) -> dict[int, int]:
    lines = (folder / f"samples_{TASK}.jsonl").read_text().splitlines()
    return {int(r["doc_id"]): int(r["acc"]) for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(tiny_pkg, tmp_path_factory):
    """A finished run of the tiny package (the original model) on 60 questions drawn at random."""
    out = tmp_path_factory.mktemp("olive-decide") / "ref"
    got = CliRunner().invoke(cli, ["mmlu-pro", "--data", "bundled", "--truncate", "left", "--pkg", str(tiny_pkg),
                                   "--sample", "60", "--seed", "1", "--output", str(out)], catch_exceptions=False)
    assert got.exit_code == 0, got.output
    return out


def metric(kind: str, value: float, name: str = "acc"):
    from olive.evaluator.metric import Metric

    return Metric(name=TASK, type="custom", sub_types=[{"name": name, "priority": 1, "higher_is_better": True,
                                                        "goal": {"type": kind, "value": value}}])


def evaluate(pkg, metrics, **settings):
    from olive.model import ONNXModelHandler

    from ortevals.integrations.olive import OrtEvalsEvaluator

    evaluator = OrtEvalsEvaluator(tasks=["mmlu-pro"], data="bundled", truncate="left", **settings)
    model = ONNXModelHandler(model_path=str(pkg), onnx_file_name="model.onnx")
    return evaluator.evaluate(model, metrics, execution_providers=["CPUExecutionProvider"])


def by_hand(ref: dict[int, int], cand: dict[int, int], seed: int, margin: float, part: int):
    ids = sorted(ref)
    order = [ids[k] for k in np.random.default_rng(seed).permutation(len(ids))]
    cs, decided = ConfidenceSequence(len(ids)), None
    while cs.t < len(ids) and decided is None:
        chunk = order[cs.t:cs.t + part]
        cs.update(np.array([cand[i] - ref[i] for i in chunk]))
        decided = verdict(cs.low, cs.high, margin)
    return decided or "cap", cs.t, cs.low, cs.high


@pytest.fixture(scope="module")
def candidate(tiny_int4, reference):
    """The int4 package's own 0/1 answers on the reference's 60 questions: an ordinary run with the same draw."""
    out = reference.parent / "int4-whole"
    got = CliRunner().invoke(cli, ["mmlu-pro", "--data", "bundled", "--truncate", "left", "--pkg", str(tiny_int4),
                                   "--sample", "60", "--seed", "1", "--output", str(out)], catch_exceptions=False)
    assert got.exit_code == 0, got.output
    return read(out)


def test_the_reference_package_is_the_baseline_its_runs_accuracy(tiny_pkg, reference):
    """Olive evaluates the input model first (its goals' baseline): the package the run scored returns the run's
    accuracy over its questions, nothing scored."""
    ref = read(reference)
    got = evaluate(tiny_pkg, [metric("max-degradation", 0.04)], against=str(reference))
    assert got.get_value(TASK, "acc") == pytest.approx(np.mean(list(ref.values())), abs=1e-12)


@pytest.mark.parametrize("kind,value", [("max-degradation", 0.04), ("percent-max-degradation", 30.0)])
def test_a_max_degradation_goal_is_decided_and_olives_check_gives_the_verdict(tiny_int4, reference, candidate,
                                                                              kind, value):
    ref = read(reference)
    baseline = float(np.mean(list(ref.values())))
    margin = value if kind == "max-degradation" else baseline * value / 100
    decided, used, low, high = by_hand(ref, candidate, 3, margin, 10)
    got = evaluate(tiny_int4, [metric(kind, value)], against=str(reference), decide_seed=3, decide_part=10)
    returned = got.get_value(TASK, "acc")
    assert returned == pytest.approx(max(0.0, baseline + low), abs=1e-12)
    # Olive's own check of the goal (engine.resolve_goals, then value >= threshold for higher-is-better)
    threshold = baseline - value if kind == "max-degradation" else baseline * (1 - value / 100)
    assert (returned >= threshold - 1e-12) == (low >= -margin - 1e-12)
    if decided in ("equivalent", "better"):
        assert returned >= threshold - 1e-12
    if decided == "worse":
        assert returned < threshold
    assert used <= 60 and sum(candidate[i] != ref[i] for i in ref) > 0  # the int4 package flips some answers


def test_a_guided_order_is_passed_to_the_decision(tiny_int4, reference, candidate):
    """decide_order guided: the reference's accuracy plus the low end of the guided order's weighted sequence."""
    records = {int(r["doc_id"]): r for r in map(json.loads, (reference / f"samples_{TASK}.jsonl").read_text()
                                                .splitlines())}
    _, cs, _, _ = guided_oracle(records, candidate, 3, 4.0, 10)
    got = evaluate(tiny_int4, [metric("max-degradation", 0.04)], against=str(reference), decide_seed=3,
                   decide_part=10, decide_order="guided")
    baseline = np.mean([int(r["acc"]) for r in records.values()])
    assert got.get_value(TASK, "acc") == pytest.approx(max(0.0, baseline + cs.low), abs=1e-12)


def test_a_cap_returns_the_interval_of_the_questions_used(tiny_int4, reference, candidate):
    ref = read(reference)
    ids = sorted(ref)
    order = [ids[k] for k in np.random.default_rng(0).permutation(len(ids))]
    cs = ConfidenceSequence(len(ids))
    cs.update(np.array([candidate[i] - ref[i] for i in order[:10]]))
    got = evaluate(tiny_int4, [metric("max-degradation", 0.001)], against=str(reference), decide_part=10,
                   decide_cap=10)
    assert got.get_value(TASK, "acc") == pytest.approx(max(0.0, np.mean(list(ref.values())) + cs.low), abs=1e-12)


@pytest.mark.parametrize("settings,goal,message", [
    ({"decide_part": 5}, None, "decide_part sets the decision against a finished run: add against"),
    ({"against": "MISSING"}, None, "against 'MISSING': not found"),
    ({"against": "PKG"}, None, "against PKG: a GenAI package; the evaluator decides against a finished run"),
    ({"against": "REF", "limit": 5}, None, "limit and against: the decision scores the run's own questions"),
    ({"against": "REF", "decide_alpha": 1.5}, None, "decide_alpha must be a level above 0 and below 1"),
    ({"against": "REF", "decide_cap": 0}, None, "decide_cap must be an integer >= 1"),
    ({"against": "REF", "decide_order": "guide"}, None, "decide_order must be one of uniform, guided in the "
                                                        "evaluator config, got 'guide' (did you mean 'guided'?)"),
    ({"decide_order": "guided"}, None, "decide_order sets the decision against a finished run: add against"),
    ({"against": "REF"}, ("threshold", 0.1, "acc"), "the evaluator's metrics have 0, expected one"),
    ({"against": "REF"}, ("max-degradation", 1.0, "acc"), "acc's max-degradation goal value 1.0: expected a "
                                                          "fraction of the accuracy (0.01: one point)"),
    ({"against": "REF"}, ("percent-max-degradation", 0.5, "acc_stderr"), "acc_stderr's percent-max-degradation "
                                                                         "goal: against decides a 0/1 score"),
])
def test_bad_decision_keys_are_one_line_before_the_model(tmp_path, reference, settings, goal, message):
    """In the evaluator (Olive builds it, then calls evaluate) and in the workflow check, before any package is
    read (the model's folder holds no package: an empty model.onnx)."""
    from ortevals.integrations.olive_workflow import check_workflow

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "genai_config.json").write_text("{}")
    places = {"REF": str(reference), "PKG": str(tmp_path / "pkg")}
    settings = {k: places.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    message = message.replace("PKG", places["PKG"])
    metrics = [] if goal is None else [metric(*goal)]
    (tmp_path / "no-package").mkdir()
    (tmp_path / "no-package" / "model.onnx").write_bytes(b"")
    with pytest.raises(OrtEvalsError, match=re.escape(message)) as e:
        evaluate(tmp_path / "no-package", metrics, **settings)
    assert "\n" not in str(e.value)
    entry = {"type": "OrtEvalsEvaluator", "tasks": ["mmlu-pro"], **settings,
             "metrics": [] if goal is None else [{"name": TASK, "type": "custom", "sub_types": [
                 {"name": goal[2], "priority": 1, "higher_is_better": True,
                  "goal": {"type": goal[0], "value": goal[1]}}]}]}
    config = tmp_path / "w.json"
    config.write_text(json.dumps({"input_model": {"type": "ONNXModel", "model_path": str(reference)},
                                  "evaluators": {"e": entry}}))
    with pytest.raises(OrtEvalsError, match=re.escape(message)):
        check_workflow(config)
