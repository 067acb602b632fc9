"""--samples K (report/samples.py): repeats and sampling defaults on the task configs, each sample's
answer through the task's own filters, maj@k / pass@k / best@k into results.json, and the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest

from ortevals.errors import OrtEvalsError
from ortevals.report.samples import SampleFacts, add_scaling, sample_answers
from ortevals.tasks import sampling_kwargs, with_samples


@pytest.fixture(scope="module")
def cot_config():
    """mmlu_pro_biology's own YAML config (regex 'answer is (X)' then take_first; exact_match ignore_case)."""
    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro-cot"]
    return task_specs(preset, resolve_data(preset, "bundled"))[0]


def test_configs_get_repeats_and_sampling_defaults(cot_config, caplog):
    """--samples rewrites each generate_until task's own settings to sample; the YAML says do_sample: false,
    temperature: 0.0 (a temperature given with --samples used to leave it greedy: K identical samples)."""
    assert cot_config["generation_kwargs"]["do_sample"] is False  # the task as lm-eval ships it
    [cfg] = with_samples([cot_config], 8, None)
    assert cfg["repeats"] == 8 and "repeats" not in cot_config  # a copy: the caller's config is untouched
    assert cfg["generation_kwargs"] == {**cot_config["generation_kwargs"], "do_sample": True, "temperature": 0.7}
    assert "do_sample False -> True, temperature 0.0 -> 0.7" in caplog.text  # said in the output
    [cfg] = with_samples([cot_config], 4, None, {"temperature": 0.9})  # the user's temperature, sampled
    assert cfg["generation_kwargs"]["do_sample"] is True and cfg["generation_kwargs"]["temperature"] == 0.9
    assert cfg["generation_kwargs"]["until"] == ["Question:"]  # the task's other settings stay
    sampling = {**cot_config, "generation_kwargs": {"until": ["Q:"], "do_sample": True, "temperature": 0.2}}
    assert sampling_kwargs(sampling["generation_kwargs"], None, 4) == (sampling["generation_kwargs"], "")
    assert sampling_kwargs(sampling["generation_kwargs"], {"temperature": "0.5"}, 4)[0]["temperature"] == 0.5
    for greedy in ({"do_sample": False}, {"temperature": 0}, {"do_sample": "false", "temperature": 0.9}):
        with pytest.raises(OrtEvalsError, match=r"^--samples 4 with --gen-kwargs do_sample=false/temperature=0 "):
            with_samples([cot_config], 4, None, greedy)
    with pytest.raises(OrtEvalsError, match=r"^--samples 4 needs generate_until tasks; .*use --cot\)$"):
        with_samples([{**cot_config, "output_type": "multiple_choice"}], 4, None)


def test_cli_samples_with_a_temperature_sample_a_greedy_task(tiny_pkg, tmp_path):
    """`ortevals run --tasks T --samples 4 --gen-kwargs temperature=0.9` on a task whose YAML says
    do_sample: false: the 4 samples differ (they were 4 copies of the greedy text)."""
    from click.testing import CliRunner

    from ortevals.cli import cli

    tasks = json_task(tmp_path, "greedy_task", """generation_kwargs:
  until: ["Question"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 12
""")
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--include-path", str(tasks), "--tasks",
                                      "greedy_task", "--samples", "4", "--gen-kwargs", "temperature=0.9",
                                      "--no-resume", "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "samples_greedy_task.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        texts = line["resps"][0]
        assert len(texts) == 4 and len(set(texts)) > 1, texts
    body = json.loads((out / "results.json").read_text())
    kwargs = body["configs"]["greedy_task"]["generation_kwargs"]
    assert kwargs["do_sample"] is True and kwargs["temperature"] == 0.9


def test_each_sample_keeps_its_own_answer(cot_config):
    texts = ["so the answer is (B).", "The answer is C", "no idea", "the answer is (B)"]
    assert sample_answers(cot_config, texts, {}) == {"custom-extract": ["B", "C", None, "B"]}


def facts(metas) -> SampleFacts:
    """What add_scaling reads of the run: each sample's (summed log-prob, tokens, scored tokens) by store key,
    no self-certainty, no store, 1000 parameters (the FLOPs axis of compute.png)."""
    return SampleFacts(metas, {}, None, lambda text: pytest.fail(f"no count kept for {text!r}"), 1000)


def test_scaling_metrics_in_lm_eval_layout(cot_config, tmp_path):
    """Two questions, K=4, answers and log-probs chosen by hand; the values are worked out below."""
    cfg = {**cot_config, "repeats": 4}
    kw = {"until": ["Question:"]}
    q1 = ["answer is (B)", "answer is (C)", "answer is (B)", "nothing"]  # target B: 2 right, C once, 1 abstains
    q2 = ["answer is (A)", "answer is (A)", "answer is (D)", "answer is (D)"]  # target D: 2 right, tie 2-2
    samples = [{"doc_id": 0, "doc": {}, "target": "B", "resps": [q1], "arguments": [("p1", kw)]},
               {"doc_id": 1, "doc": {}, "target": "D", "resps": [q2], "arguments": [("p2", kw)]}]
    lps = {"p1": [-1.0, -0.1, -2.0, -3.0], "p2": [-0.5, -0.4, -0.3, -0.2]}  # summed, over 10 scored tokens each
    metas = {json.dumps([p, kw, j]): (lp, 10, 10) for p, row in lps.items() for j, lp in enumerate(row)}
    results = {"results": {cfg["task"]: {}}, "samples": {cfg["task"]: samples}}
    points = add_scaling(results, [cfg], facts(metas), tmp_path)
    got = results["results"][cfg["task"]]
    assert set(got) >= {"maj@1,custom-extract", "pass@4,custom-extract", "best@2_stderr,custom-extract"}
    # pass@1: mean correct share = (2/4 + 2/4) / 2; pass@2: 1 - C(2,2)/C(4,2) = 5/6 for both questions
    assert got["pass@1,custom-extract"] == pytest.approx(0.5)
    assert got["pass@2,custom-extract"] == pytest.approx(5 / 6)
    # best@1 = pass@1; best@4: q1's best mean log-prob is sample 1 (C, wrong), q2's is sample 3 (D, right)
    assert got["best@4,custom-extract"] == pytest.approx(0.5)
    # maj_avg@4: q1 votes B,C,B -> B right; q2 ties A/D 2-2 -> right with probability 1/2
    assert got["maj_avg@4,custom-extract"] == pytest.approx(0.75)
    # maj@4 (lm-eval's): q1 B,C,B,[invalid] -> B right; q2's 2-2 tie goes to A, seen first: wrong
    assert got["maj@4,custom-extract"] == pytest.approx(0.5)
    assert results["scaling"]["questions"] == 2 and (tmp_path / "scaling.png").stat().st_size > 1000
    assert (tmp_path / "compute.png").stat().st_size > 1000
    assert results["scaling"]["bon_certainty_missing"].startswith("2 of 2 questions")  # the fake kept none
    assert [p.k for p in points if p.estimator == "maj"] == [1, 2, 4]
    # Brown et al.'s fit through the hand pass@k values (1: 0.5, 2: 5/6, 4: 1), fitted here with scipy alone
    want = scipy_coverage_fit([1, 2, 4], [0.5, 5 / 6, 1.0])
    for fit in (results["scaling"]["coverage_fit"], results["scaling"]["coverage_fit_by_task"][cfg["task"]]):
        assert {k: fit[k] for k in want} == pytest.approx(want, rel=1e-4)


def scipy_coverage_fit(ks, coverage) -> dict:
    """log coverage = a · k^b by least squares (scipy's curve_fit), and k = (log t / a)^(1/b) for t = 0.5, 0.9."""
    from scipy.optimize import curve_fit

    k, y = np.asarray(ks, float), np.log(coverage)
    (a, b), _ = curve_fit(lambda x, a, b: a * x ** b, k, y, p0=(-1.0, -1.0), bounds=([-np.inf] * 2, [0, 0]))
    return {"a": a, "b": b, **{f"k_for_{t}": max(1.0, (np.log(t) / a) ** (1 / b)) for t in (0.5, 0.9)}}


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
    assert (out / "compute.png").stat().st_size > 1000 and (out / "scaling.png").is_file()
    passes = [business[f"pass@{k},custom-extract"] for k in (1, 2)]
    fits = (body["scaling"]["coverage_fit"], body["scaling"]["coverage_fit_by_task"]["mmlu_pro_business"])
    if min(passes) > 0:  # the tiny model got one right: the fit against scipy's
        assert {k: fits[1][k] for k in ("a", "b")} == pytest.approx(scipy_coverage_fit([1, 2], passes), rel=1e-4)
    else:  # no right sample: nothing to fit, and results.json says why
        assert all(f["a"] is None and "coverage in (0, 1]" in f["why"] for f in fits)


def test_best_of_k_scores_the_whole_sequence_eos_included(cot_config):
    """One question, K=4, by hand. Each sample's (log-prob of the whole sequence with its EOS, generated
    tokens, scored tokens = generated + the EOS): a sample ending at once scores log p(EOS) = -2.3 (it
    scored 0 and won every subset when the EOS was left out), and the EOS counts in the mean."""
    cfg = {**cot_config, "repeats": 4}
    kw = {"until": ["Question:"]}
    texts = ["", "answer is (B)", "answer is (C)", "nothing"]  # target B
    meta = [(-2.3, 0, 1),  # EOS at once: score -2.3
            (-2.0, 3, 4),  # 3 tokens + EOS: -2.0 / 4 = -0.5 (best)
            (-1.2, 2, 2),  # ended by the stop string, no EOS: -0.6
            (-6.0, 5, 6)]  # -1.0
    metas = {json.dumps(["p", kw, j]): m for j, m in enumerate(meta)}
    samples = [{"doc_id": 0, "doc": {}, "target": "B", "resps": [texts], "arguments": [("p", kw)]}]
    results = {"results": {cfg["task"]: {}}, "samples": {cfg["task"]: samples}}
    add_scaling(results, [cfg], facts(metas), None)
    got = results["results"][cfg["task"]]
    # order by score: (B) -0.5, (C) -0.6, nothing -1.0, EOS -2.3; only (B) is right, ranked first
    assert got["best_avg@1,custom-extract"] == pytest.approx(1 / 4)
    assert got["best_avg@2,custom-extract"] == pytest.approx(3 / 6)  # (B) wins the C(3,1) subsets holding it
    assert got["best_avg@4,custom-extract"] == pytest.approx(1.0)
    # the first k: the EOS sample alone (wrong), then (B) beats it and everything after
    assert [got[f"best@{k},custom-extract"] for k in (1, 2, 4)] == [0.0, 1.0, 1.0]


def json_task(tmp_path, name: str, settings: str) -> Path:
    """A task folder: ``name`` on two questions of a JSON file, exact_match, with the YAML ``settings``."""
    rows = [{"question": f"Question {i}: the cat sat on the", "answer": "mat"} for i in range(2)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "data.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
""" + settings)
    return tasks


def first_k_task(tmp_path, k: int) -> Path:
    """lm-eval's gsm8k_cot_self_consistency filter layout (score-first; maj@k: take_first_k k, regex,
    majority_vote, take_first)."""
    return json_task(tmp_path, "sc_task", f"""repeats: 64
generation_kwargs:
  until: ["Question"]
  do_sample: true
  temperature: 0.9
  max_gen_toks: 6
filter_list:
  - name: "score-first"
    filter:
      - function: "regex"
        regex_pattern: "(\\\\w+)"
      - function: "take_first"
  - name: "maj@{k}"
    filter:
      - function: "take_first_k"
        k: {k}
      - function: "regex"
        regex_pattern: "(\\\\w+)"
      - function: "majority_vote"
      - function: "take_first"
""")


def test_take_first_k_filter_is_scored_on_the_samples_it_keeps(tiny_pkg, tmp_path):
    """lm-eval's self-consistency layout with --samples 4 on the raw path (self-certainty on): each filter's @k
    metrics on exactly its samples (maj@2: the first 2, so k = 1, 2), lm-eval's own exact_match under that
    filter equal to ortevals' maj@2 of it; it used to raise after all generation, before any file was written."""
    from click.testing import CliRunner

    from ortevals.cli import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--include-path", str(first_k_task(tmp_path, 2)),
                                      "--tasks", "sc_task", "--samples", "4", "--no-resume", "--output", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())["results"]["sc_task"]
    assert {"maj@4,score-first", "bon_certainty@4,score-first", "maj@2,maj@2", "bon_certainty@2,maj@2"} <= set(res)
    assert "maj@4,maj@2" not in res and "pass@4,maj@2" not in res
    assert res["maj@2,maj@2"] == res["exact_match,maj@2"]  # lm-eval's own majority_vote of the first 2
    lines = [json.loads(x) for x in (out / "samples_sc_task.jsonl").read_text().splitlines()]
    kept = {x["filter"]: len(x["filtered_resps"]) for x in lines}
    assert kept == {"score-first": 4, "maj@2": 2} and all(len(x["sample_tokens"]) == 4 for x in lines)
    assert "maj@k: lm-eval's maj@k: majority vote of the first k samples" in result.output  # which estimator


def test_a_take_first_k_beyond_the_samples_is_one_line(tiny_pkg, tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli

    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--include-path", str(first_k_task(tmp_path, 8)),
                                      "--tasks", "sc_task", "--samples", "4", "--no-resume"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "--samples 4: task sc_task's filter 'maj@8' takes the first 8 samples (take_first_k); give --samples 8 " \
        "or more" in result.output


def test_a_reporting_error_after_the_work_keeps_every_sample(tiny_pkg, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.report import samples

    def broken(*args, **kwargs):
        raise RuntimeError("reporting broke")

    monkeypatch.setattr(samples, "add_scaling", broken)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--include-path", str(first_k_task(tmp_path, 2)),
                                      "--tasks", "sc_task", "--samples", "2", "--no-resume", "--output", str(out)])
    assert result.exit_code != 0
    body = json.loads((out / "results.json").read_text())
    assert body["ortevals"] == {"unreported": "RuntimeError: reporting broke",
                                "files": ["results.json", "samples_sc_task.jsonl"]}
    lines = [json.loads(x) for x in (out / "samples_sc_task.jsonl").read_text().splitlines()]
    assert {x["doc_id"] for x in lines} == {0, 1} and all(len(x["resps"][0]) == 2 for x in lines)
