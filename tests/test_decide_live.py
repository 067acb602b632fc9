"""``ortevals mmlu-pro --against RUN --decide M`` (decision.py): a candidate scored against a finished run a part at a
time until decided. The oracle reads both runs' samples files itself, draws the documented order (the reference's
questions sorted by doc_id, permuted by numpy's PCG64 from the seed) and feeds report/decide.py's
ConfidenceSequence by hand, part by part, with the paired differences read from the files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.report.decide import ConfidenceSequence, verdict
from tests.decide_oracle import guided_oracle

TASK = "leaderboard_mmlu_pro"
BASE = ["mmlu-pro", "--data", "bundled", "--truncate", "left"]


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def read(folder) -> dict[int, dict]:
    lines = (folder / f"samples_{TASK}.jsonl").read_text().splitlines()
    return {int(r["doc_id"]): r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(tiny_pkg, tmp_path_factory):
    """A finished run of the tiny package on 60 questions drawn at random (the population of the decisions)."""
    out = tmp_path_factory.mktemp("decide") / "ref"
    got = run(*BASE, "--pkg", str(tiny_pkg), "--sample", "60", "--seed", "1", "--output", str(out))
    assert got.exit_code == 0, got.output
    return out


def oracle(ref: dict[int, dict], cand: dict[int, dict], seed: int, margin: float, part: int, cap: int | None = None):
    """(decision, questions used, low, high, the order) by hand: the candidate's file must hold the order's first
    ``used`` questions."""
    ids = sorted(i for i, r in ref.items() if r["acc"] in (0, 1))
    order = [ids[k] for k in np.random.default_rng(seed).permutation(len(ids))]
    cs, decided = ConfidenceSequence(len(ids)), None
    limit = len(ids) if cap is None else min(cap, len(ids))
    while cs.t < limit and decided is None:
        chunk = order[cs.t:min(cs.t + part, limit)]
        assert all(i in cand for i in chunk), "the candidate's file lacks a question of the order"
        cs.update(np.array([int(cand[i]["acc"]) - int(ref[i]["acc"]) for i in chunk]))
        decided = verdict(cs.low, cs.high, margin / 100)
    return decided or "cap", cs.t, cs.low, cs.high, order


def check(out, reference_folder, seed, margin, part, cap=None) -> dict:
    ref, cand = read(reference_folder), read(out)
    decision, used, low, high, order = oracle(ref, cand, seed, margin, part, cap)
    got = json.loads((out / "results.json").read_text())["decide"]
    assert (got["decision"], got["used"]) == (decision, used)
    assert got["difference"]["low"] == pytest.approx(low) and got["difference"]["high"] == pytest.approx(high)
    assert sorted(cand) == sorted(order[:used])  # exactly the order's first questions were scored
    d = [int(cand[i]["acc"]) - int(ref[i]["acc"]) for i in order[:used]]
    assert got["flips"] == int(np.count_nonzero(d)) and got["difference"]["estimate"] == pytest.approx(np.mean(d))
    acc = np.mean([r["acc"] for r in ref.values()])
    assert got["reference"]["questions"] == len(ref) and got["reference"]["accuracy"] == pytest.approx(acc)
    assert got["candidate_accuracy"]["low"] == pytest.approx(max(0.0, acc + low))
    assert got["candidate_accuracy"]["high"] == pytest.approx(min(1.0, acc + high))
    assert (got["seed"], got["part"], got["alpha"], got["margin_points"]) == (seed, part, 0.05, margin)
    return got


def test_the_same_package_is_decided_equivalent_with_the_interval_holding_zero(tmp_path, tiny_pkg, reference):
    out = tmp_path / "same"
    got = run(*BASE, "--pkg", str(tiny_pkg), "--against", str(reference), "--decide", "10", "--decide-part", "10",
              "--seed", "5", "--output", str(out))
    assert got.exit_code == 0, got.output
    record = check(out, reference, 5, 10, 10)
    assert record["decision"] == "equivalent" and record["used"] < 60 and record["flips"] == 0
    assert record["difference"]["low"] <= 0 <= record["difference"]["high"]
    assert "--decide ±10 points against" in got.output and "equivalent: within ±10 points" in got.output


def test_another_package_is_scored_live_and_decided_as_the_sequence_says(tmp_path, tiny_int4, reference):
    out = tmp_path / "int4"
    args = [*BASE, "--pkg", str(tiny_int4), "--against", str(reference), "--decide", "4", "--decide-part", "10"]
    got = run(*args, "--output", str(out))
    assert got.exit_code == 0, got.output
    record = check(out, reference, 0, 4, 10)
    assert record["flips"] > 0  # scored by another package: its own answers, not the reference's
    capped = tmp_path / "capped"
    got = run(*args, "--decide-cap", "20", "--seed", "3", "--output", str(capped))
    assert got.exit_code == 0, got.output
    check(capped, reference, 3, 4, 10, cap=20)


def test_a_no_resume_decision_scores_each_question_once(tmp_path, tiny_int4, reference):
    """--no-resume keeps no answer in the package's store, and the last evaluation (the table and files over the
    questions used) scored every question a second time: the decision keeps its parts' answers for it."""
    out = tmp_path / "no-resume"
    got = run(*BASE, "--pkg", str(tiny_int4), "--against", str(reference), "--decide", "4", "--decide-part", "10",
              "--decide-cap", "20", "--no-resume", "--output", str(out))
    assert got.exit_code == 0, got.output
    body = json.loads((out / "results.json").read_text())
    parts = [x for x in got.output.replace("\r", "\n").splitlines() if x.startswith("--decide: ")]
    scored = sum(int(x.split(" requests scored")[0].rsplit("(", 1)[1]) for x in parts)
    assert scored > 0 and body["ortevals"]["reused"] == scored  # the last evaluation read the parts' answers back
    assert body["ortevals"]["requests"] == 0  # and scored none again
    check(out, reference, 0, 4, 10, cap=20)


def test_the_order_is_a_function_of_the_seed_and_a_rerun_reuses_every_part(tmp_path, tiny_int4, reference):
    """The same command again (a resumed run): the same order, every part's answers from the result store."""
    from ortevals.decision import DecideSpec, plan_decision
    from ortevals.presets import BUNDLED, PRESETS, task_specs

    preset = PRESETS["mmlu-pro"]
    specs = task_specs(preset, BUNDLED / "mmlu_pro")
    one = plan_decision(DecideSpec(reference, 4, seed=7), specs, preset.task_manager())
    two = plan_decision(DecideSpec(reference, 4, seed=7), specs, preset.task_manager())
    other = plan_decision(DecideSpec(reference, 4, seed=8), specs, preset.task_manager())
    assert one.keys == two.keys and one.keys != other.keys and sorted(one.keys) == sorted(other.keys)
    args = [*BASE, "--pkg", str(tiny_int4), "--against", str(reference), "--decide", "4", "--decide-part", "10",
            "--seed", "7"]
    first = run(*args, "--decide-cap", "20", "--output", str(tmp_path / "a"))  # as if stopped after two parts
    again = run(*args, "--output", str(tmp_path / "b"))
    assert first.exit_code == 0 and again.exit_code == 0, again.output
    parts = [x for x in again.output.replace("\r", "\n").splitlines() if x.startswith("--decide: ")]
    assert len(parts) >= 3, again.output
    assert all(" (0 requests scored, " in x for x in parts[:2])  # the parts the capped run scored: all reused
    a, b = (json.loads((tmp_path / x / "results.json").read_text())["decide"] for x in "ab")
    assert b["looks"][:2] == a["looks"][:2]


def test_a_guided_order_draws_the_reference_margins_order_and_feeds_the_weighted_sequence(tmp_path, tiny_int4,
                                                                                           reference):
    out = tmp_path / "guided"
    got = run(*BASE, "--pkg", str(tiny_int4), "--against", str(reference), "--decide", "4", "--decide-part", "10",
              "--decide-order", "guided", "--seed", "2", "--output", str(out))
    assert got.exit_code == 0, got.output
    ref, cand = read(reference), read(out)
    decision, cs, used, d = guided_oracle(ref, {i: r["acc"] for i, r in cand.items()}, 2, 4, 10)
    record = json.loads((out / "results.json").read_text())["decide"]
    assert sorted(cand) == sorted(used)  # exactly the guided order's first questions were scored
    assert (record["decision"], record["used"], record["order"]) == (decision, cs.t, "guided")
    assert record["flips"] == int(np.count_nonzero(d)) > 0
    assert record["difference"]["low"] == pytest.approx(cs.low) and record["difference"]["high"] == pytest.approx(
        cs.high)
    assert record["difference"]["estimate"] == pytest.approx(cs.estimate)  # Des Raj's, not the plain mean
    assert "guided order, seed 2" in got.output
    uniform = run(*BASE, "--pkg", str(tiny_int4), "--against", str(reference), "--decide", "4", "--decide-part",
                  "10", "--seed", "2", "--decide-cap", "10", "--output", str(tmp_path / "uniform"))
    assert uniform.exit_code == 0 and sorted(read(tmp_path / "uniform")) != sorted(used[:10])


def test_a_guided_order_from_a_reference_without_choice_log_likelihoods_is_one_line(reference):
    """A generation reference (no per-choice log-likelihoods) gives no margin to draw by: refused, not uniform."""
    import dataclasses

    from ortevals.decision import DecideSpec, _weights
    from ortevals.errors import OrtEvalsError
    from ortevals.report.runs import load_run

    ref = load_run(reference)
    task = ref.tasks[TASK]
    ref = dataclasses.replace(ref, tasks={TASK: dataclasses.replace(task, loglik=np.full_like(task.loglik, -np.inf))})
    keys = [(TASK, int(i)) for i in task.doc_id]
    with pytest.raises(OrtEvalsError, match=r"^--decide-order guided: the reference .* holds no per-choice "
                                            r"log-likelihoods \(a generation task\?\)"):
        _weights(DecideSpec(reference, 1, order="guided"), ref, keys, {TASK: {i: j for j, (_, i) in enumerate(keys)}})


def test_a_package_scored_alongside_is_decided_on_both_packages_answers(tmp_path, tiny_pkg, tiny_int4):
    """--against PKG: the set is every MMLU-Pro test question (sorted by doc_id, permuted from the seed); each part is
    scored on both packages; the candidate's file and reference/'s hold exactly the order's first questions, and
    the sequence fed with their files' paired differences gives the record's decision and interval."""
    import pyarrow.parquet as pq

    from ortevals.presets import BUNDLED

    out = tmp_path / "alongside"
    got = run(*BASE, "--pkg", str(tiny_int4), "--against", str(tiny_pkg), "--decide", "4", "--decide-part", "10",
              "--decide-cap", "30", "--seed", "4", "--output", str(out))
    assert got.exit_code == 0, got.output
    population = pq.read_metadata(BUNDLED / "mmlu_pro" / "data" / "test-00000-of-00001.parquet").num_rows
    order = np.random.default_rng(4).permutation(population)  # doc_id = position in the test split
    cand, ref = read(out), read(out / "reference")
    record = json.loads((out / "results.json").read_text())["decide"]
    used = record["used"]
    assert sorted(cand) == sorted(ref) == sorted(int(i) for i in order[:used])
    cs, decided = ConfidenceSequence(population), None
    while cs.t < min(30, population) and decided is None:
        chunk = order[cs.t:cs.t + 10]
        cs.update(np.array([int(cand[i]["acc"]) - int(ref[i]["acc"]) for i in chunk]))
        decided = verdict(cs.low, cs.high, 0.04)
    assert (record["decision"], used) == (decided or "cap", cs.t)
    assert record["difference"]["low"] == pytest.approx(cs.low) and record["difference"]["high"] == pytest.approx(
        cs.high)
    assert record["reference"]["scored_alongside"] and record["reference"]["accuracy"] is None
    assert record["reference"]["accuracy_on_used"] == pytest.approx(np.mean([r["acc"] for r in ref.values()]))
    assert record["candidate_accuracy"] is None and record["reference"]["questions"] == population
    models = [json.loads((f / "results.json").read_text())["config"]["model_args"] for f in (out, out / "reference")]
    assert f"pkg={tiny_int4}," in models[0] and f"pkg={tiny_pkg}," in models[1]
    assert f"the package {tiny_pkg} scored alongside ({population} questions in the set)" in got.output


@pytest.mark.parametrize("args,message", [
    (("--against", "PKG", "--decide", "1", "--decide-order", "guided"), "--decide-order guided draws by a finished "
                                                                         "run's choice margins; --against PKG is a "
                                                                         "package scored alongside"),
    (("--against", "REF", "--decide", "1", "--decide-order", "guidde"), "--decide-order guidde: expected one of "
                                                                          "uniform, guided (did you mean 'guided'?)"),
    (("--decide-order", "guided"), "--decide-order sets the decision of --against RUN --decide MARGIN: add both"),
    (("--decide", "1"), "--decide 1 compares against a finished run: add --against RUN"),
    (("--against", "REF"), "--against REF: add --decide MARGIN"),
    (("--against", "REF", "--decide", "0"), "--decide 0: expected a margin in points, above 0 and below 100"),
    (("--against", "REF", "--decide", "-2"), "--decide -2: expected a margin in points, above 0 and below 100"),
    (("--against", "REF", "--decide", "1", "--decide-part", "0"), "--decide-part 0: expected at least 1"),
    (("--against", "REF", "--decide", "1", "--alpha", "1.5"), "--alpha 1.5: expected a level above 0 and below 1"),
    (("--decide-cap", "5",), "--decide-cap sets the decision of --against RUN --decide MARGIN: add both"),
    (("--against", "REF", "--decide", "1", "--sample", "5"), "--sample 5 and --against: the decision scores"),
    (("--against", "MISSING", "--decide", "1"), "--against: MISSING: run not found"),
    (("--against", "EMPTY", "--decide", "1"), "--against: EMPTY: no samples_*.jsonl in this run"),
    (("--against", "OTHER", "--decide", "1"), "--against OTHER: holds task arc_easy; this command scores "
                                              "leaderboard_mmlu_pro"),
    (("--against", "BEYOND", "--decide", "1"), "--against BEYOND: task leaderboard_mmlu_pro doc_id 20000 is beyond "
                                               "this data's 12032 documents"),
    (("--against", "ELSE", "--decide", "1"), "--against ELSE: task leaderboard_mmlu_pro doc_id {} is another "
                                             "question in this data"),
])
def test_bad_decision_inputs_are_one_line_before_the_model(tmp_path, reference, args, message):
    """Each refused before the package is read (it does not exist here)."""
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "OTHER").mkdir()
    line = json.loads((reference / f"samples_{TASK}.jsonl").read_text().splitlines()[0])
    (tmp_path / "OTHER" / "samples_arc_easy.jsonl").write_text(json.dumps(line) + "\n")
    for name, change in (("BEYOND", {"doc_id": 20000}), ("ELSE", {"doc_hash": "0" * 64})):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"samples_{TASK}.jsonl").write_text(json.dumps({**line, **change}) + "\n")
    (tmp_path / "PKG").mkdir()
    (tmp_path / "PKG" / "genai_config.json").write_text("{}")
    paths = {"REF": str(reference), **{k: str(tmp_path / k) for k in ("MISSING", "EMPTY", "OTHER", "BEYOND", "ELSE",
                                                                      "PKG")}}
    out = CliRunner().invoke(cli, [*BASE, "--pkg", str(tmp_path / "no-package"), *(paths.get(a, a) for a in args)])
    text = message.format(line["doc_id"])
    for k, v in paths.items():
        text = text.replace(f" {k}", f" {v}")
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert out.output.startswith(f"Error: {text}"), out.output


def test_bench_rows_are_decided_against_the_run(tmp_path, tiny_pkg, tiny_int4, reference):
    """``ortevals bench --against RUN --decide M``: each ortevals row is a live decision in its own process; the row's
    run holds the decision the hand-drawn order gives, and the table counts the questions it used."""
    out = tmp_path / "bench"
    got = run("bench", "--pkg", f"same={tiny_pkg}:truncate=left", "--pkg", f"int4={tiny_int4}:truncate=left",
              "--against", str(reference), "--decide", "4", "--output", str(out))
    assert got.exit_code == 0, got.output
    assert "failed" not in got.output  # the warm cache's untimed preparation too (one question, no decision)
    body = json.loads((out / "bench.json").read_text())
    for row in body["rows"]:
        folder = Path(body["runs"][row["label"]][0]["output"])
        record = check(folder, reference, 0, 4, 50)  # the default part, seed and order
        assert row["decision"]["decision"] == record["decision"] and row["questions"] == record["used"]
        assert f"{row['label']}: {record['decision'] if record['decision'] != 'cap' else 'not decided at the cap'} " \
               f"at ±4 points against {reference} after {record['used']} of its 60 questions" in got.output
    assert body["rows"][0]["decision"]["flips"] == 0 and "--against" in body["command"]


@pytest.mark.parametrize("args,message", [
    (("--decide", "1"), "--decide 1 compares against a finished run: add --against RUN"),
    (("--against", "REF"), "--against REF: add --decide MARGIN"),
    (("--against", "REF", "--decide", "1", "--limit", "5"), "--limit 5 and --against: the decision scores"),
    (("--against", "REF", "--decide", "1", "--decide-order", "guidde"), "--decide-order guidde: expected one of"),
    (("--against", "REF", "--decide", "1", "--tasks", "arc_easy"), "--decide decides MMLU-Pro runs"),
    (("--against", "REF", "--decide", "1", "--hf", "HF"), "--decide stops ortevals rows when decided; lm-eval's hf "
                                                          "scores every question and cannot"),
    (("--against", "MISSING", "--decide", "1"), "--against: MISSING: run not found"),
])
def test_bench_decision_inputs_are_one_line_before_any_row(tmp_path, tiny_pkg, reference, monkeypatch, args, message):
    def refuse(*a, **k):
        raise AssertionError("a row ran")
    monkeypatch.setattr("ortevals.bench.api.measure", refuse)
    (tmp_path / "HF").mkdir()
    (tmp_path / "HF" / "config.json").write_text("{}")
    paths = {"REF": str(reference), "MISSING": str(tmp_path / "MISSING"), "HF": str(tmp_path / "HF")}
    got = CliRunner().invoke(cli, ["bench", "--pkg", str(tiny_pkg), *(paths.get(a, a) for a in args)])
    text = message
    for k, v in paths.items():
        text = text.replace(f" {k}", f" {v}")
    assert got.exit_code == 2 and len(got.output.strip().splitlines()) == 1, got.output
    assert got.output.startswith(f"Error: {text}"), got.output


def test_a_decided_rows_questions_are_not_called_a_peer_limit():
    """Two decided rows stop at different counts: neither is "on fewer questions (--peer-limit)"; each has its line."""
    from ortevals.bench.rows import Row
    from ortevals.bench.write import notes
    from ortevals.report import stats

    def row(label, used, is_ref):
        decision = {"decision": "equivalent", "margin_points": 1.0, "reference": {"run": "runs/fp32", "questions": 900},
                    "used": used, "order": "uniform", "alpha": 0.05,
                    "difference": {"estimate": 0.0, "low": -0.01, "high": 0.01}}
        return Row(label=label, backend="ortevals", target="/p", args="", cache="warm", status="ok", note="",
                   is_ref=is_ref, runs=1, questions=used, rate=1.0, accuracy=stats.wilson(1, used), decision=decision)
    lines = notes([row("a", 600, True), row("b", 300, False)], "requests",
                  {"cores": 2, "load_start": 0.0, "load_end": 0.0})
    assert not any("On fewer questions" in x for x in lines), lines
    said = "b: equivalent at ±1 points against runs/fp32 after 300 of its 900 questions"
    assert any(x.startswith(said) for x in lines)
