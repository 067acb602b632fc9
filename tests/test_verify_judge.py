"""Verifiers, issue 25 continued: a GenAI package as the judge (P(True) on that package against lm-eval's hf
backend on the same weights, its prompt run once for a question's answers), PRM step prefixes sharing KV
(counted tokens, values against a raw-onnxruntime oracle), the verifier's parameters and FLOPs, bad folders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortevals.engine.generate.search.prm import split_steps
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.integrations.self_eval import prompt
from ortevals.integrations.verify import Question, SelfVerifier, open_verifier, verify_run
from ortevals.report.compute import compute_points, run_cost
from ortevals.report.scaling import CurvePoint
from tests.test_verify import ANSWERS, CONTEXT, _cli, oracle_p_true, radix_tokens

STEPPED = (" First, france is a country in europe.\n\nIts capital is the city of paris.\n\nSo paris.",
           " The seine flows to the sea.\n\nBerlin is on the spree, so berlin.",
           " madrid is in spain.\n\nSo paris.")


@pytest.fixture(scope="module")
def policy(fixture_cache, tiny_pkg):
    """A policy that is not the judge: the tiny package dynamically quantized (other numbers)."""
    from tests.fixtures.dynquant import build_dynquant

    return OrtLM.from_package(ModelArgs(pkg=str(build_dynquant(tiny_pkg, fixture_cache))))


def _inputs(lm, texts) -> list[list[int]]:
    """Each P(True) request's model input (the whole text but its last token), (A) then (B) per text."""
    return [lm.tok_encode(prompt(CONTEXT, t) + o)[:-1] for t in texts for o in (" (A)", " (B)")]


def test_genai_judge_equals_transformers_and_runs_the_prompt_once(policy, tiny):
    """The judge is the tiny fp32 package (not the policy): P(True) equal to lm-eval's hf backend on the tiny
    HF checkpoint, and a question's prompt run once for its answers (tokens counted)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from scipy.special import expit

    judge = open_verifier(str(tiny[1]), policy)
    assert (judge.kind, judge.name) == ("genai", str(tiny[1]))
    out = verify_run(judge, [Question(("t", 0), CONTEXT, ANSWERS)])
    hf = HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=512)
    reqs = [Instance("loglikelihood", {}, (prompt(CONTEXT, a), o), 0) for a in ANSWERS for o in (" (A)", " (B)")]
    ll = np.array([x[0] for x in hf.loglikelihood(reqs)])
    np.testing.assert_allclose(out.scores[("t", 0)], expit(ll[0::2] - ll[1::2]), atol=1e-4)
    own = verify_run(SelfVerifier(policy.ptrue_model()), [Question(("t", 0), CONTEXT, ANSWERS)]).scores[("t", 0)]
    assert np.max(np.abs(np.subtract(own, out.scores[("t", 0)]))) > 1e-3  # the policy's own P(True) differs
    inputs = _inputs(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]))), dict.fromkeys(ANSWERS))  # the judge's ids
    tree = radix_tokens(inputs)  # the prompt once, each answer once, each (A)/(B) pair's common text once
    assert tree <= out.tokens <= tree + 2 * len(inputs) and out.tokens < 0.3 * sum(map(len, inputs))


def test_prm_step_prefixes_share_kv_and_score_as_alone(tiny_pkg):
    """Each answer's step prefixes (and each (A)/(B) pair) share their common tokens: the tokens run are a
    radix tree's over all inputs plus at most 2 per input (before: 1,265 on this case, the tree's 836). Each
    step's score equals its prefix scored alone on one plain pass; the outcome score is the last step's."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)))
    verifier = SelfVerifier(lm.ptrue_model())
    verifier.score_texts(CONTEXT, ["warm"])  # the invariance canary runs on a first call: not counted here
    out = verify_run(verifier, [Question(("t", 1), CONTEXT, STEPPED)], prm=True)
    prefixes = [["".join(split_steps(a)[:i + 1]) for i in range(len(split_steps(a)))] for a in STEPPED]
    assert [len(p) for p in out.steps[("t", 1)]] == [3, 2, 2] and [p[-1] for p in prefixes] == list(STEPPED)
    for got, texts in zip(out.steps[("t", 1)], prefixes, strict=True):
        np.testing.assert_allclose(got, [oracle_p_true(lm, tiny_pkg, CONTEXT, t) for t in texts], atol=1e-4)
    assert out.scores[("t", 1)] == [s[-1] for s in out.steps[("t", 1)]]
    inputs = _inputs(lm, [t for p in prefixes for t in p])
    tree = radix_tokens(inputs)
    assert tree <= out.tokens <= tree + 2 * len(inputs), (out.tokens, tree)


def test_verifier_parameters_and_their_flops_on_the_points(tiny_orm, tiny, policy):
    """The classifier's parameters: its initializers' sizes summed by hand with onnx; the judge's: transformers'
    count of the same weights. A run's bon point pays 2 · verifier params · the verifier's tokens per sample
    for each of its k samples; maj pays nothing more."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    orm = open_verifier(str(tiny_orm[1]), policy)
    graph = onnx.load(str(tiny_orm[1] / "model.onnx")).graph
    assert orm.kind == "classifier" and orm.params == sum(int(np.prod(t.dims)) for t in graph.initializer)
    judge = open_verifier(str(tiny[1]), policy)
    hf = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    assert judge.params == sum(p.numel() for p in hf.parameters())  # rotary caches are not weights
    info = {"params": orm.params, "samples": 8, "tokens_run": 1000}
    cost = run_cost(policy.package.parameters, info)
    pts = [CurvePoint("bon", 4, 0.5, 0.1, 0.3, 0.7, 40.0), CurvePoint("maj", 4, 0.5, 0.1, 0.3, 0.7, 40.0)]
    bon, maj = compute_points(pts, cost)
    p = policy.package.parameters
    assert bon.flops == pytest.approx(2 * p * 40 + 2 * orm.params * 4 * 125) and maj.flops == 2 * p * 40


@pytest.mark.parametrize("make", ["missing", "empty", "file", "bad_package"])
def test_bad_verifier_paths_are_one_line_errors(tiny_pkg, tmp_path, make):
    path = tmp_path / "v"
    needle = {"missing": "no such folder", "empty": "neither genai_config.json nor model.onnx",
              "file": "not a folder", "bad_package": "genai_config.json"}[make]
    if make == "empty":
        path.mkdir()
    elif make == "file":
        path.write_text("x")
    elif make == "bad_package":
        path.mkdir()
        (path / "genai_config.json").write_text("{not json")
    result = _cli(["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "1",
                   "--max-gen-toks", "4", "--no-resume", "--samples", "2", "--verifier", str(path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0] and str(path) in lines[0], result.output
    if make != "bad_package":
        assert "self, a GenAI package folder, or an ONNX sequence classifier folder" in lines[0]


def test_cli_genai_judge(tiny_pkg, tmp_path):
    """--verifier PKG through the CLI: results name the kind and parameters; the samples' verifier scores are
    the judge's P(True) recomputed on a fresh run of it."""
    out = tmp_path / "run"
    result = _cli(["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "1",
                   "--max-gen-toks", "6", "--samples", "2", "--no-resume", "--truncate", "left",
                   "--verifier", str(tiny_pkg), "--output", str(out)])
    assert result.exit_code == 0, result.output
    v = json.loads((out / "results.json").read_text())["verifier"]
    assert (v["kind"], v["name"], v["samples"]) == ("genai", str(tiny_pkg), 2) and v["params"] == 139584
    line = json.loads((out / "samples_mmlu_pro_business.jsonl").read_text().splitlines()[0])
    args = line["arguments"]
    ctx = args["gen_args_0"]["arg_0"] if isinstance(args, dict) else args[0][0]
    fresh = SelfVerifier(OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), truncate="left")).ptrue_model())
    np.testing.assert_allclose(line["verifier_scores"], fresh.score_texts(ctx, line["resps"][0]), atol=1e-6)


def test_search_weights_a_judges_p_true_as_a_probability(tiny_pkg, tiny_orm):
    """--search with a GenAI judge: particle weights from logit(P(True)), as for self; a classifier's too (its score
    is a probability now: runtime/reward.py)."""
    kinds = {}
    for spec in (str(tiny_pkg), str(tiny_orm[1])):
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), search="particles", verifier=spec))
        kinds[spec] = lm.run.search_reward
    assert kinds == {str(tiny_pkg): "logit", str(tiny_orm[1]): "logit"}
