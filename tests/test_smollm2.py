"""The real SmolLM2-135M-Instruct package on real MMLU-Pro questions."""

import json
import re

import lm_eval
import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.presets import PRESETS, resolve_data, task_specs

pytestmark = pytest.mark.slow
LIMIT = 3


@pytest.fixture(scope="module")
def mmlu_requests(smollm2):
    """The loglikelihood requests lm-eval makes for the first questions of leaderboard_mmlu_pro."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2[1])))
    preset = PRESETS["mmlu-pro"]
    res = lm_eval.simple_evaluate(model=lm, tasks=task_specs(preset, resolve_data(preset, "bundled")),
                                  limit=LIMIT, log_samples=True)
    samples = res["samples"]["leaderboard_mmlu_pro"]
    return [tuple(a) for s in samples for a in s["arguments"]], [float(r[0][0]) for s in samples for r in s["resps"]]


@pytest.fixture(scope="module")
def hf_scores(smollm2, mmlu_requests):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(smollm2[0]), device="cpu", batch_size=1, dtype="float32")
    args, _ = mmlu_requests
    return [lp for lp, _ in hf.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)])]


@pytest.mark.parametrize("variant", [{}, {"prefix_cache": "0"}, {"scoring_graph": "0"},
                                     {"prefix_cache": "0", "scoring_graph": "0", "batch_size": "4"},
                                     {"shared_prefix_batch": "on", "check": "0"}])
def test_loglikelihoods_equal_pytorch(smollm2, mmlu_requests, hf_scores, variant):
    lm = OrtLM.create_from_arg_obj({"pkg": str(smollm2[1]), **variant})
    args, _ = mmlu_requests
    ours = lm.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)])
    assert len(args) >= 10 * (LIMIT - 1)
    for (lp, _), ref in zip(ours, hf_scores):
        assert abs(lp - ref) <= 1e-4
    if variant.get("prefix_cache") != "0":
        # the 5-shot header ran once: far fewer tokens than one prompt per question
        # (the invariance canary's one-row reference passes run whole prompts: not counted here)
        assert lm.engine.tokens_run - lm.engine.canary_tokens < LIMIT * 700
    if variant.get("shared_prefix_batch") == "on":  # the questions under the header ran in one pass
        assert lm.engine.shared_stats["rows"] == LIMIT > lm.engine.shared_stats["passes"] == 1


def test_evaluate_and_engine_agree(mmlu_requests, hf_scores):
    _, via_lm_eval = mmlu_requests
    assert max(abs(a - b) for a, b in zip(via_lm_eval, hf_scores)) <= 1e-4


def test_cli_example_end_to_end(tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli

    result = CliRunner().invoke(cli, ["mmlu-pro", "--example", "--limit", str(LIMIT), "--output", str(tmp_path),
                                         "--no-resume"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^leaderboard_mmlu_pro +none +acc +\d\.\d{4} +\d\.\d{4}$", result.output, re.M), result.output
    assert "req/s" in result.output
    body = json.loads((tmp_path / "results.json").read_text())
    assert body["results"]["leaderboard_mmlu_pro"]["sample_len"] == LIMIT
    assert body["ortevals"]["requests"] >= 10 * (LIMIT - 1)


def test_gsm8k_style_chat_generation_equals_lm_eval_hf(smollm2):
    """Issue 22's acceptance on a few questions (24 gave 24/24 equal, docs/decoding.md): a
    gsm8k-style task, 3-shot as multi-turn chat with the chat template, greedy, special-token stops,
    through lm_eval.simple_evaluate with HFLM and with OrtLM: the same prompts and the same texts."""
    from tests.fixtures.gsm8k_chat import compare

    out = compare(questions=4, max_gen_toks=48)
    assert out["questions"] == 4 and out["same_prompt"] == 4
    assert out["same_text"] == 4, out["differences"]
