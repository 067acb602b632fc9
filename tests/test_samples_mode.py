"""--samples K (report/samples.py): repeats and sampling defaults on the task configs, each sample's
answer through the task's own filters, maj@k / pass@k / best@k into results.json, and the CLI."""

import json

import pytest

from ortevals.errors import OrtEvalsError
from ortevals.report.samples import add_scaling, sample_answers, sampling_gen_kwargs, with_samples


@pytest.fixture(scope="module")
def cot_config():
    """mmlu_pro_biology's own YAML config (regex 'answer is (X)' then take_first; exact_match ignore_case)."""
    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro-cot"]
    return task_specs(preset, resolve_data(preset, "bundled"))[0]


def test_configs_get_repeats_and_sampling_defaults(cot_config):
    [cfg] = with_samples([cot_config], 8, None)
    assert cfg["repeats"] == 8 and "repeats" not in cot_config  # a copy: the caller's config is untouched
    assert sampling_gen_kwargs(None) == {"do_sample": True, "temperature": 0.7}
    assert sampling_gen_kwargs({"max_gen_toks": 64}) == {"do_sample": True, "temperature": 0.7, "max_gen_toks": 64}
    assert sampling_gen_kwargs({"temperature": 0.2}) == {"temperature": 0.2}  # the user's temperature wins
    with pytest.raises(OrtEvalsError, match=r"^--samples 4 needs generate_until tasks; .*use --cot\)$"):
        with_samples([{**cot_config, "output_type": "multiple_choice"}], 4, None)


def test_each_sample_keeps_its_own_answer(cot_config):
    texts = ["so the answer is (B).", "The answer is C", "no idea", "the answer is (B)"]
    assert sample_answers(cot_config, texts, {}) == {"custom-extract": ["B", "C", None, "B"]}


class Model:
    """What add_scaling reads from the model: each sample's (summed log-prob, tokens) by store key."""

    def __init__(self, metas):
        self.sample_logprobs = metas
        self.store = None


def test_scaling_metrics_in_lm_eval_layout(cot_config, tmp_path):
    """Two questions, K=4, answers and log-probs chosen by hand; the values are worked out below."""
    cfg = {**cot_config, "repeats": 4}
    kw = {"until": ["Question:"]}
    q1 = ["answer is (B)", "answer is (C)", "answer is (B)", "nothing"]  # target B: 2 right, C once, 1 abstains
    q2 = ["answer is (A)", "answer is (A)", "answer is (D)", "answer is (D)"]  # target D: 2 right, tie 2-2
    samples = [{"doc_id": 0, "doc": {}, "target": "B", "resps": [q1], "arguments": [("p1", kw)]},
               {"doc_id": 1, "doc": {}, "target": "D", "resps": [q2], "arguments": [("p2", kw)]}]
    lps = {"p1": [-1.0, -0.1, -2.0, -3.0], "p2": [-0.5, -0.4, -0.3, -0.2]}  # summed, over 10 tokens each
    metas = {json.dumps([p, kw, j]): (lp, 10) for p, row in lps.items() for j, lp in enumerate(row)}
    results = {"results": {cfg["task"]: {}}, "samples": {cfg["task"]: samples}}
    points = add_scaling(results, [cfg], Model(metas), tmp_path)
    got = results["results"][cfg["task"]]
    assert set(got) >= {"maj@1,custom-extract", "pass@4,custom-extract", "best@2_stderr,custom-extract"}
    # pass@1: mean correct share = (2/4 + 2/4) / 2; pass@2: 1 - C(2,2)/C(4,2) = 5/6 for both questions
    assert got["pass@1,custom-extract"] == pytest.approx(0.5)
    assert got["pass@2,custom-extract"] == pytest.approx(5 / 6)
    # best@1 = pass@1; best@4: q1's best mean log-prob is sample 1 (C, wrong), q2's is sample 3 (D, right)
    assert got["best@4,custom-extract"] == pytest.approx(0.5)
    # maj@4: q1 votes B,C,B -> B right; q2 ties A/D 2-2 -> right with probability 1/2
    assert got["maj@4,custom-extract"] == pytest.approx(0.75)
    assert results["scaling"]["questions"] == 2 and (tmp_path / "scaling.png").stat().st_size > 1000
    assert [p.k for p in points if p.estimator == "maj"] == [1, 2, 4]


def test_cli_samples_reports_every_k(tiny_pkg, tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli

    out = tmp_path / "run"
    # --limit 2: the test split's first two questions, both business (issue 22: not two per subject)
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit",
                                      "2", "--max-gen-toks", "6", "--samples", "2", "--no-resume", "--truncate",
                                      "left", "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    body = json.loads((out / "results.json").read_text())
    business = body["results"]["mmlu_pro_business"]
    assert {"maj@1,custom-extract", "maj@2,custom-extract", "pass@2,custom-extract", "best@2,custom-extract"} \
        <= set(business)
    lines = [json.loads(x) for x in (out / "samples_mmlu_pro_business.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(len(x["resps"][0]) == 2 for x in lines)  # two questions, two samples each
    assert body["scaling"]["questions"] == 2 and body["scaling"]["samples"] == 2
