"""--self-eval (issue 24): P(True) requests share the prompt's KV (counted tokens), score as if run alone,
reach results and samples; runs without it are unchanged; the hook's metrics in lm-eval's layout."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from click.testing import CliRunner
from lm_eval.api.instance import Instance

from ortevals.cli import cli
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.integrations.self_eval import choice_requests, generation_scores
from ortevals.report import calibration as cal
from ortevals.report.calibration_results import add_calibration

SHOTS = "".join(f"Question: what is {i} plus {i}?\nA. {i}\nB. {2 * i}\nC. {3 * i}\nD. 0\nAnswer: B\n\n"
                for i in range(12))
PROMPTS = [SHOTS + f"Question: what is {k} times two, in the decimal system?\nA. {k}\nB. {2 * k}\nC. 7\nD. 1\nAnswer:"
           for k in (3, 5, 9)]
WRITTEN_OUT = "\n\nIs the proposed answer:\n (A) True\n (B) False\nThe proposed answer is:"  # the paper's format


CHOICES = (" the", " of", " and", " to")  # one token each in the tiny tokenizer (" A" is two)


def questions() -> list[Instance]:
    return [Instance("loglikelihood", {}, (q, c), j, ("task", d, 1)) for d, q in enumerate(PROMPTS)
            for j, c in enumerate(CHOICES)]


def test_p_true_reruns_no_prompt_token(tiny_pkg):
    """Tokens run through the decoder (canary excluded): with --self-eval, exactly each P(True) input's own
    new tokens (its answer, the question and its option) plus two: the prompt's last two tokens, which the
    question's own scores read in their own pass (never a one-token pass: see the int8 test). Not one token
    more of any prompt."""
    runs = {}
    for self_eval in (False, True):
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), self_eval=self_eval))
        scores = lm.loglikelihood(questions(), disable_tqdm=True)
        runs[self_eval] = (lm, scores, lm.engine.tokens_run - lm.engine.canary_tokens)
    lm = runs[True][0]
    extra = choice_requests(questions())
    assert len(extra) == 2 * 4 * 3
    prompt_tokens = [len(lm.tok_encode(q)) for q in PROMPTS]
    new = sum(len(lm.tok_encode(r.args[0] + r.args[1])) - 1 - prompt_tokens[r.doc_id] for r in extra)
    assert runs[True][2] - runs[False][2] == new + 2 * len(extra)
    assert runs[True][2] - runs[False][2] < sum(prompt_tokens) * 2  # the 24 inputs' prompts would be 24 × 537
    np.testing.assert_allclose(np.array(runs[True][1])[:, 0], np.array(runs[False][1])[:, 0], atol=1e-4)


def test_p_true_scores_equal_each_request_scored_alone(tiny_pkg):
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), self_eval=True))
    lm.loglikelihood(questions(), disable_tqdm=True)
    alone = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), exact=True, prefix_cache=False))
    for d, q in enumerate(PROMPTS):
        for j, c in enumerate(CHOICES):
            ctx = q + c + WRITTEN_OUT
            (a, _), (b, _) = alone.loglikelihood([Instance("loglikelihood", {}, (ctx, " (A)"), 0),
                                                  Instance("loglikelihood", {}, (ctx, " (B)"), 0)], disable_tqdm=True)
            assert lm.self_eval_scores[("task", d)][j] == pytest.approx((a, b), abs=1e-4)


def test_generation_answers_are_asked_after_the_run(tiny_pkg):
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)))
    records = [{"doc_id": 4, "arguments": [["Q: two plus two?\nA:", {"until": ["\n"]}]], "resps": [[" 4, surely"]]},
               {"doc_id": 5, "arguments": {"gen_args_0": {"arg_0": "Q: one?\nA:", "arg_1": "{}"}}, "resps": [[" 1"]]},
               {"doc_id": 6, "arguments": [["Q: k?\nA:", {}]], "resps": [[" a", " b"]]}]  # K samples: left out
    scores = generation_scores(lm, {"samples": {"gen": records}})
    assert set(scores) == {("gen", 4), ("gen", 5)}
    (a, _), (b, _) = lm.loglikelihood([
        Instance("loglikelihood", {}, ("Q: two plus two?\nA: 4, surely" + WRITTEN_OUT, " (A)"), 0),
        Instance("loglikelihood", {}, ("Q: two plus two?\nA: 4, surely" + WRITTEN_OUT, " (B)"), 0)],
        disable_tqdm=True)
    assert scores[("gen", 4)][0] == pytest.approx((a, b), abs=1e-6)


@pytest.fixture(scope="module")
def cli_runs(tiny_pkg, tmp_path_factory):
    base = tmp_path_factory.mktemp("selfeval")
    out = {}
    for name, extra in (("plain", []), ("self", ["--self-eval"])):
        result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "3",
                                          "--max-length", "1024", "--truncate", "left", "--output",
                                          str(base / name), "--no-resume", *extra])
        assert result.exit_code == 0, result.output
        out[name] = (base / name, result.output)
    return out


def test_cli_self_eval_writes_p_true_and_plots(cli_runs):
    folder, output = cli_runs["self"]
    res = json.loads((folder / "results.json").read_text())["results"]["leaderboard_mmlu_pro"]
    samples = [json.loads(x) for x in (folder / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]
    for s in samples:
        assert len(s["p_true"]) == len(s["filtered_resps"]) and all(0 < p < 1 for p in s["p_true"])
    chosen = [s["p_true"][int(np.argmax([float(x[0]) for x in s["filtered_resps"]]))] for s in samples]
    assert res["ptrue_mean,none"] == pytest.approx(np.mean(chosen))
    assert res["ptrue_ece,none"] >= 0 and "ptrue_brier_binary_stderr,none" in res
    for png in ("reliability_leaderboard_mmlu_pro.png", "risk_coverage_leaderboard_mmlu_pro.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {folder / png}" in output


def test_runs_without_self_eval_pay_nothing(cli_runs):
    (plain, plain_out), (self_folder, _) = cli_runs["plain"], cli_runs["self"]
    res = json.loads((plain / "results.json").read_text())
    assert not any(k.startswith("ptrue") for k in res["results"]["leaderboard_mmlu_pro"])
    assert "p_true" not in (plain / "samples_leaderboard_mmlu_pro.jsonl").read_text()
    with_it = json.loads((self_folder / "results.json").read_text())["ortevals"]["requests"]
    questions = res["ortevals"]["questions"]
    assert 3 * res["ortevals"]["requests"] == with_it  # the choices only; --self-eval adds 2 requests per choice
    assert questions == 3
    # the summary's lm-eval table shows the calibration rows next to acc
    assert re.search(r"^leaderboard_mmlu_pro\s+none\s+ece\s+\d", plain_out, re.M), plain_out


def test_calibration_metrics_in_lm_eval_layout(cli_runs):
    from lm_eval.utils import make_table

    folder, _ = cli_runs["plain"]
    res = json.loads((folder / "results.json").read_text())
    samples = [json.loads(x) for x in (folder / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]
    lls = [[float(x[0]) for x in s["filtered_resps"]] for s in samples]
    conf = [math.exp(max(v)) / sum(math.exp(x) for x in v) for v in lls]
    correct = [float(s["acc"]) for s in samples]
    metrics = res["results"]["leaderboard_mmlu_pro"]
    assert metrics["ece,none"] == pytest.approx(cal.ece(np.array(conf), np.array(correct)), abs=1e-9)
    assert res["higher_is_better"]["leaderboard_mmlu_pro"]["ece"] is False
    table = make_table(res)
    assert "|ece" in table.replace(" ", "") and "brier" in table and "aurc" in table


def test_acc_norm_tasks_get_normalised_calibration():
    # lm-eval's acc_norm: argmax(log-likelihood / len(choice)); choice lengths 1, 6 and 3 characters
    labels = [" a", " bbbbbb", " ccc"]
    recs = []
    for i, lls in enumerate([[-2.0, -6.0, -4.0], [-1.0, -3.0, -2.5], [-3.0, -1.5, -9.0]]):
        norm = [ll / len(c.strip()) for ll, c in zip(lls, labels)]
        recs.append({"doc_id": i, "doc": {}, "target": 1, "arguments": [["Q?", c] for c in labels],
                     "resps": [[[v, False]] for v in lls], "filtered_resps": [[v, False] for v in lls],
                     "filter": "none", "acc": float(np.argmax(lls) == 1), "acc_norm": float(np.argmax(norm) == 1)})
    results = {"results": {"t": {}}, "samples": {"t": recs}, "configs": {"t": {"target_delimiter": " "}}}
    add_calibration(results)
    norm = np.array([[-2.0, -1.0, -4 / 3], [-1.0, -0.5, -2.5 / 3], [-3.0, -0.25, -3.0]])
    c = cal.calibrate(norm, np.array([1, 1, 1]))
    assert results["results"]["t"]["ece_norm,none"] == pytest.approx(c.ece.estimate)
    assert results["results"]["t"]["brier_multiclass_norm,none"] == pytest.approx(c.brier.estimate)
    recs[0]["acc_norm"] = 1.0 - recs[0]["acc_norm"]  # a stored acc_norm the rule does not reproduce
    results = {"results": {"t": {}}, "samples": {"t": recs}, "configs": {"t": {"target_delimiter": " "}}}
    add_calibration(results)
    assert "ece_norm,none" not in results["results"]["t"] and "ece,none" in results["results"]["t"]


def test_temperature_fit_on_the_validation_split(tiny_pkg, tmp_path):
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "4",
                                      "--max-length", "1024", "--truncate", "left", "--output", str(tmp_path),
                                      "--no-resume", "--model-args", "temperature_fit=split"])
    assert result.exit_code == 0, result.output
    res = json.loads((tmp_path / "results.json").read_text())
    assert list(res["results"]) == ["leaderboard_mmlu_pro"]  # the split copy is not part of the run's table
    block = res["calibration"]["leaderboard_mmlu_pro"]
    assert block["temperature_fitted_on"] == "validation split (4 questions)"
    fit = [json.loads(x) for x in (tmp_path / "calibration_fit_leaderboard_mmlu_pro@validation.jsonl")
           .read_text().splitlines()]
    lls = np.array([[float(x[0]) for x in s["filtered_resps"]] for s in fit])
    gold = np.array([int(s["target"]) if str(s["target"]).isdigit() else "ABCDEFGHIJ".index(s["target"])
                     for s in fit])
    want = cal.fit_temperature(lls, gold)
    name = "temperature_at_bound" if cal.at_bound(want) else "temperature"  # 4 questions: often a bound
    assert block["temperature_at_bound"] == cal.at_bound(want)
    assert res["results"]["leaderboard_mmlu_pro"][f"{name},none"] == pytest.approx(want, rel=1e-6)
    assert not any(p.name.startswith("samples_") and "@" in p.name for p in tmp_path.iterdir())


def test_no_pass_over_a_cached_prefix_runs_one_token(tiny_pkg):
    """Every pass on top of a cached prefix runs at least 2 new tokens per row (a question whose whole
    prompt is a prefix of its P(True) inputs included): the real runner, wrapped to record its passes."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), self_eval=True, check=False))
    runner = lm.engine.runner
    new_tokens: list[int] = []
    forward = runner.forward

    def recording(ids, mask, past=None, want_present=False, *rest):
        if past is not None:
            new_tokens.append(int(ids.shape[1]))
        return forward(ids, mask, past, want_present, *rest)

    runner.forward = recording
    lm.loglikelihood(questions(), disable_tqdm=True)
    assert new_tokens and min(new_tokens) >= 2


@pytest.fixture(scope="module")
def smollm2_int8():
    from ortevals.package.examples import smollm2_package

    return smollm2_package("int8")  # ~20 s with the builder, once, from the cached HF folder


def test_int8_prefix_reuse_equals_one_row_passes(smollm2_int8):
    """On the builder's int8 package (MatMulNBits accuracy_level=4) a one-token pass over cached KV gives
    other logits than the same position in a longer pass (0.12 nats here before the fix): with the P(True)
    requests each question's prompt is a prefix of longer inputs, and every score must still equal exact mode."""
    reqs = [Instance("loglikelihood", {}, (q[-900:], f" {c}"), j, ("task", d, 1)) for d, q in enumerate(PROMPTS[:2])
            for j, c in enumerate("ABCD")]
    reqs += choice_requests(reqs)
    scores = {}
    for name, kw in (("configured", {"check": False}), ("exact", {"exact": True})):
        lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2_int8), **kw))
        scores[name] = np.array([lp for lp, _ in lm.loglikelihood(reqs, disable_tqdm=True)])
    np.testing.assert_allclose(scores["configured"], scores["exact"], atol=1e-5)


def test_no_prefix_node_extends_its_parent_by_one_token():
    from ortevals.engine.score.prefix import plan_prefixes

    head = tuple(range(100, 120))  # 20 tokens every input shares
    inputs = [head + (7, 1000 + i, 2000 + i) for i in range(66)] + [head + (8, 3000 + i, 4000 + i) for i in range(4)]
    plan = plan_prefixes(inputs, [1] * len(inputs))
    # the head is a node; head + (7,) would save 65 × 1 = 65 ≥ 64 tokens but would be computed by a one-token pass
    assert [n.depth for n in plan.nodes] == [20]
    assert [n.depth for n in plan_prefixes(inputs, [1] * len(inputs), min_step=1).nodes] == [20, 21]


@pytest.mark.parametrize("args,needle", [
    ("temperature_fit=folds", "temperature_fit must be one of cv, split, got 'folds'"),
    ("self_eval=maybe", "self_eval must be true or false, got 'maybe'")])
def test_bad_calibration_options_are_one_line_errors(tiny_pkg, args, needle):
    from tests.test_cli import assert_one_line_error

    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                                      "--model-args", args])
    assert_one_line_error(result, needle)
