"""`ortevals compare`: hand-made runs whose statistics are known, misaligned runs, gates, the report,
and a real lm-eval hf samples file against the ortevals run on the same weights."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli

TASK = "leaderboard_mmlu_pro"
LABELS = ("A", "B", "C")
Z = 1.959963984540054

# Eight questions, gold always A, two categories. Answers chosen so that:
#   ref: A A A A B A A C   correct 1 1 1 1 0 1 1 0   (6/8)
#   run: B A C A A A B B   correct 0 1 0 1 1 1 0 0   (4/8)
# correct->wrong: q0 q2 q6 = 3; wrong->correct: q4 = 1; answer changes q0 q2 q4 q6 q7 = 5 (q7 C->B wrong->wrong)
CATS = ["math"] * 4 + ["law"] * 4
REF_ANSWERS = "AAAABAAC"
RUN_ANSWERS = "BACAAABB"


def loglik(answer: str, margin: float = 1.0) -> list[float]:
    """Per-choice log-likelihoods whose argmax is ``answer``."""
    return [-2.0 + (margin if lab == answer else 0.0) - 0.1 * i for i, lab in enumerate(LABELS)]


def record(doc_id: int, lls: list[float], gold: str = "A", category: str = "math", prompt: str | None = None,
           hashes: bool = True) -> dict:
    """An lm-eval sample record as ortevals writes it (lists, floats, the raw target)."""
    context = prompt if prompt is not None else f"Question {doc_id}?\nAnswer:"
    pick = LABELS[max(range(len(lls)), key=lambda i: lls[i])]
    rec = {"doc_id": doc_id, "doc": {"question": f"q{doc_id}", "category": category}, "target": gold,
           "arguments": [[context, f" {lab}"] for lab in LABELS[:len(lls)]],
           "resps": [[[v, False]] for v in lls], "filtered_resps": [[v, False] for v in lls],
           "filter": "none", "metrics": ["acc"], "acc": float(pick == gold)}
    if hashes:
        rec.update(doc_hash=f"d{doc_id}", prompt_hash=f"p{context}", target_hash="t")
    return rec


def as_lm_eval_tracker(rec: dict) -> dict:
    """The same record the way lm-eval's EvaluationTracker writes it (strings, gen_args dicts)."""
    out = dict(rec)
    out["arguments"] = {f"gen_args_{i}": {f"arg_{j}": x for j, x in enumerate(a)} for i, a in
                        enumerate(rec["arguments"])}
    out["resps"] = [[[str(v), str(g)] for v, g in r] for r in rec["resps"]]
    out["filtered_resps"] = [[str(v), str(g)] for v, g in rec["filtered_resps"]]
    out["target"] = str(rec["target"])
    return out


def write_ortevals_run(folder: Path, records: list[dict], task: str = TASK) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"results": {task: {}}}))
    (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def write_lm_eval_run(folder: Path, records: list[dict], task: str = TASK) -> Path:
    sub = folder / "org__model"  # lm-eval: <output_path>/<model_name_sanitized>/samples_<task>_<date>.jsonl
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "results_2026-11-23T02-10-00.123456.json").write_text("{}")
    (sub / f"samples_{task}_2026-11-23T02-10-00.123456.jsonl").write_text(
        "".join(json.dumps(as_lm_eval_tracker(r)) + "\n" for r in records))
    return folder


def hand_runs(tmp_path: Path, ref_layout=write_ortevals_run, **run_kw) -> tuple[Path, Path]:
    ref = ref_layout(tmp_path / "ref", [record(i, loglik(a), category=c) for i, (a, c) in
                                        enumerate(zip(REF_ANSWERS, CATS))])
    run = write_ortevals_run(tmp_path / "run", [record(i, loglik(a), category=c, **run_kw) for i, (a, c) in
                                                enumerate(zip(RUN_ANSWERS, CATS))])
    return ref, run


def invoke(*args: str):
    return CliRunner().invoke(cli, ["compare", *args])


def compare_json(tmp_path: Path, ref: Path, *runs: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    out = tmp_path / "cmp.json"
    result = invoke("--ref", str(ref), *map(str, runs), "--json", str(out), *extra)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def mcnemar_by_hand(b: int, c: int) -> float:
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n)


@pytest.mark.parametrize("layout", [write_ortevals_run, write_lm_eval_run], ids=["ortevals", "lm-eval"])
def test_hand_made_runs_flips_mcnemar_wilson_clustered(tmp_path, layout):
    ref, run = hand_runs(tmp_path, ref_layout=layout)
    (rec,) = compare_json(tmp_path, ref, run)
    assert rec["n"] == 8 and rec["task"] == TASK
    assert rec["correct_to_wrong"] == 3 and rec["wrong_to_correct"] == 1 and rec["answer_changes"] == 5
    assert rec["flip_rate"] == pytest.approx(4 / 8) and rec["agreement"] == pytest.approx(3 / 8)
    assert mcnemar_by_hand(3, 1) == pytest.approx(2 * (1 + 4) / 16)  # the formula itself, on numbers by hand
    assert rec["mcnemar_p"] == pytest.approx(0.625, abs=1e-12)
    assert rec["accuracy"] == 0.5 and rec["ref_accuracy"] == 0.75 and rec["delta"] == -0.25
    assert rec["accuracy_ci"] == pytest.approx(wilson_by_hand(4, 8), abs=1e-12)
    assert rec["ref_accuracy_ci"] == pytest.approx(wilson_by_hand(6, 8), abs=1e-12)
    # d = run − ref = [-1,0,-1,0 | 1,0,-1,0], mean -0.25; residuals per cluster sum to -1.0 (math) and
    # +1.0 (law): CR1 SE = sqrt(G/(G-1) · ((-1)² + 1²)) / 8 = sqrt(2 · 2) / 8 = 0.25 (G = 2 clusters).
    # The interval uses t with G-1 = 1 degree of freedom: 97.5% quantile tan(pi · 0.475) = 12.706.
    se, t1 = math.sqrt(2 * (1.0 + 1.0)) / 8, math.tan(math.pi * 0.475)
    assert rec["delta_clusters"] == 2
    assert rec["delta_se"] == pytest.approx(se, abs=1e-12)
    assert rec["delta_ci"] == pytest.approx([-0.25 - t1 * se, -0.25 + t1 * se], abs=1e-9)
    lo, hi = rec["delta_bootstrap_ci"]
    assert -1 <= lo < -0.25 < hi <= 0.5


def test_mcnemar_against_the_binomial_formula():
    from ortevals.report.stats import mcnemar_p

    for b, c in [(0, 0), (5, 0), (3, 1), (10, 4), (7, 7), (1, 20), (40, 25)]:
        assert mcnemar_p(b, c) == pytest.approx(mcnemar_by_hand(b, c), rel=1e-9)


def test_kl_and_dp_gold_by_hand_for_two_questions(tmp_path):
    ref_ll = [[-1.0, -2.0, -3.0], [-0.5, -0.7, -4.0]]
    run_ll = [[-1.5, -1.0, -3.0], [-0.5, -0.9, -3.0]]

    def softmax(v):
        e = [math.exp(x) for x in v]
        return [x / sum(e) for x in e]

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q))

    p = [softmax(v) for v in ref_ll]
    q = [softmax(v) for v in run_ll]
    ref = write_ortevals_run(tmp_path / "ref", [record(i, v) for i, v in enumerate(ref_ll)])
    run = write_ortevals_run(tmp_path / "run", [record(i, v) for i, v in enumerate(run_ll)])
    (rec,) = compare_json(tmp_path, ref, run)
    forward = [kl(p[0], q[0]), kl(p[1], q[1])]
    reverse = [kl(q[0], p[0]), kl(q[1], p[1])]
    assert rec["kl_mean"] == pytest.approx(sum(forward) / 2, rel=1e-10)
    assert rec["kl"]["max"] == pytest.approx(max(forward), rel=1e-10)
    assert rec["kl_reverse"]["mean"] == pytest.approx(sum(reverse) / 2, rel=1e-10)
    assert rec["kl"]["se"] == pytest.approx(abs(forward[0] - forward[1]) / 2, rel=1e-10)  # std(ddof=1)/√2
    assert rec["dp_gold"]["mean"] == pytest.approx((q[0][0] - p[0][0] + q[1][0] - p[1][0]) / 2, rel=1e-10)
    assert rec["answer_changes"] == 1 and rec["correct_to_wrong"] == 1  # q0: A -> B


def test_changed_questions_most_different_first(tmp_path):
    ref, run = hand_runs(tmp_path)
    out = tmp_path / "changed.jsonl"
    assert invoke("--ref", str(ref), str(run), "--changed", str(out)).exit_code == 0
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert sorted(r["doc_id"] for r in rows) == [0, 2, 4, 6, 7]
    assert [r["difference"] for r in rows] == sorted((r["difference"] for r in rows), reverse=True)
    q7 = next(r for r in rows if r["doc_id"] == 7)
    assert (q7["ref_answer"], q7["run_answer"], q7["gold"], q7["ref_correct"], q7["run_correct"]) == \
        ("C", "B", "A", False, False)
    assert sum(q7["run_probs"].values()) == pytest.approx(1.0)


def test_holm_across_tasks_by_hand():
    from ortevals.report.stats import holm

    # sorted p: 0.01·3, 0.02·2, 0.04·1 -> 0.03, 0.04, 0.04 (monotone), in the input order
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])


def assert_one_line_error(result, *needles: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    text = result.output.strip()
    assert "\n" not in text and "Traceback" not in text, text
    for n in needles:
        assert n in text, text


def test_different_doc_ids_are_one_line_error(tmp_path):
    ref, _ = hand_runs(tmp_path)
    recs = [record(i, loglik(a)) for i, a in enumerate(RUN_ANSWERS)]
    recs[5] = record(9, loglik("A"))
    run = write_ortevals_run(tmp_path / "other", recs)
    assert_one_line_error(invoke("--ref", str(ref), str(run)), "doc_id 5", str(ref), str(run), "--limit")


@pytest.mark.parametrize("hashes", [True, False], ids=["prompt_hash", "arguments"])
def test_changed_prompt_is_one_line_error(tmp_path, hashes):
    ref = write_ortevals_run(tmp_path / "ref", [record(i, loglik("A"), hashes=hashes) for i in range(4)])
    recs = [record(i, loglik("A"), hashes=hashes) for i in range(4)]
    recs[2] = record(2, loglik("A"), hashes=hashes, prompt="<|user|>Question 2?\nAnswer:")  # a chat template
    run = write_ortevals_run(tmp_path / "run", recs)
    assert_one_line_error(invoke("--ref", str(ref), str(run)), "prompt differs at doc_id 2", "chat template")


def test_bad_inputs_are_one_line_errors(tmp_path):
    ref, run = hand_runs(tmp_path)
    assert_one_line_error(invoke("--ref", str(tmp_path / "nope"), str(run)), "run not found")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("--ref", str(ref), str(tmp_path / "empty")), "--log_samples")
    bad = write_ortevals_run(tmp_path / "bad", [record(0, loglik("A"))])
    rec = record(0, loglik("A"))
    rec["acc"] = 0.0  # disagrees with argmax == gold
    (bad / f"samples_{TASK}.jsonl").write_text(json.dumps(rec) + "\n")
    assert_one_line_error(invoke("--ref", str(ref), str(bad)), "stored acc")


@pytest.mark.parametrize("gate, passing, failing", [
    ("--max-flip-rate", "0.5", "0.49"),  # flip rate 4/8
    ("--max-kl", "10", "0.001"),
    # Δ = -0.25, CR1 SE 0.25 over 2 clusters, t(1): lower bound -0.25 - 12.706·0.25 = -3.4266
    ("--margin", "3.43", "3.42"),
])
def test_gates(tmp_path, gate, passing, failing):
    ref, run = hand_runs(tmp_path)
    ok = invoke("--ref", str(ref), str(run), gate, passing)
    assert ok.exit_code == 0, ok.output
    passed = [ln for ln in ok.output.splitlines() if ln.startswith("gate ")]  # issue 38: a passing gate says so
    assert len(passed) == 1 and passed[0].startswith(f"gate {gate} passed: run {TASK}"), ok.output
    bad = invoke("--ref", str(ref), str(run), gate, failing)
    assert bad.exit_code == 1
    failed = [ln for ln in bad.output.splitlines() if ln.startswith("gate ")]
    assert len(failed) == 1 and failed[0].startswith(f"gate {gate} failed: run {TASK}"), bad.output


def test_max_kl_without_a_loglikelihood_task_is_a_user_error(tmp_path):
    gen = [{"doc_id": i, "doc": {}, "target": "4", "arguments": [["2+2=", {"until": ["\n"]}]],
            "resps": [["4"]], "filtered_resps": ["4"], "filter": "none", "metrics": ["exact_match"],
            "exact_match": 1.0, "doc_hash": f"d{i}", "prompt_hash": "p"} for i in range(3)]
    ref = write_ortevals_run(tmp_path / "ref", gen, task="arith")
    run = write_ortevals_run(tmp_path / "run", gen, task="arith")
    assert invoke("--ref", str(ref), str(run)).exit_code == 0
    assert_one_line_error(invoke("--ref", str(ref), str(run), "--max-kl", "1"), "--max-kl")


def test_report_is_self_contained_with_six_plots(tmp_path):
    ref, run = hand_runs(tmp_path)
    run2 = write_ortevals_run(tmp_path / "run2", [record(i, loglik(a, 0.3), category=c) for i, (a, c) in
                                                  enumerate(zip(REF_ANSWERS, CATS))])
    out = tmp_path / "report"
    result = invoke("--ref", str(ref), str(run), str(run2), "--report", str(out))
    assert result.exit_code == 0, result.output
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| run | task |" in md and "math" in md
    images = re.findall(r"<img[^>]*src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 6 and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    for alt in ("delta_by_category", "flips_by_margin", "kl_distribution", "agreement", "reliability",
                "risk_coverage"):
        assert f"alt='{alt}'" in page
    assert not re.search(r"(src|href)\s*=\s*['\"](?!data:)", page)  # nothing fetched from elsewhere
    assert "<link" not in page and "<script" not in page


def test_import_ortevals_stays_free_of_scipy_and_matplotlib():
    import subprocess
    import sys

    code = ("import sys, ortevals, ortevals.report; "
            "print([m for m in ('scipy', 'matplotlib', 'torch', 'onnxruntime') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def hf_and_ort_runs(tiny, tmp_path_factory):
    """lm-eval hf on the tiny model, written by lm-eval's own EvaluationTracker; ortevals on its package."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from ortevals.presets import PRESETS, resolve_data, task_specs

    hf_dir, pkg_dir = tiny
    base = tmp_path_factory.mktemp("real")
    preset = PRESETS["mmlu-pro"]
    tracker = EvaluationTracker(output_path=str(base / "hf"))
    # the tiny model's context is 1024 tokens and a 5-shot prompt is longer: both sides keep the last 1024
    # (lm-eval hf and ortevals truncate on the left the same way), so max_length=1024 on both
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float32,max_length=1024",
                                  tasks=task_specs(preset, resolve_data(preset, "bundled")), limit=3,
                                  log_samples=True, evaluation_tracker=tracker, device="cpu", batch_size=1)
    samples = res.pop("samples")
    tracker.save_results_aggregated(results=res, samples=samples)
    for task, rows in samples.items():
        tracker.save_results_samples(task_name=task, samples=rows)
    ort = base / "ort"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(pkg_dir), "--data", "bundled", "--limit", "3",
                                      "--max-length", "1024", "--truncate", "left", "--output", str(ort),
                                      "--no-resume"])
    assert result.exit_code == 0, result.output
    return base / "hf", ort


def test_real_lm_eval_hf_samples_file_against_ortevals(hf_and_ort_runs, tmp_path):
    hf, ort = hf_and_ort_runs
    written = list(hf.rglob("samples_*.jsonl"))
    assert len(written) == 1 and re.fullmatch(rf"samples_{TASK}_\d{{4}}-.*\.jsonl", written[0].name)
    assert isinstance(json.loads(written[0].read_text().splitlines()[0])["arguments"], dict)  # tracker layout
    (rec,) = compare_json(tmp_path, hf, ort)
    assert rec["n"] == 3 and rec["task"] == TASK
    assert rec["answer_changes"] == 0 and rec["correct_to_wrong"] == rec["wrong_to_correct"] == 0
    assert rec["kl_mean"] < 1e-8 and rec["kl_reverse"]["mean"] < 1e-8
    assert rec["delta"] == 0 and rec["mcnemar_p"] == 1.0


def test_mmlu_pro_compare_to(hf_and_ort_runs, tiny_pkg):
    hf, _ = hf_and_ort_runs
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "3",
                                      "--max-length", "1024", "--truncate", "left", "--compare-to", str(hf)])
    assert result.exit_code == 0, result.output
    assert "vs org__model" not in result.output and "answer changes 0" in result.output
    assert re.search(r"KL\(ref\|\|run\) mean \S+ ± ", result.output)


def test_olive_reference_adds_flip_rate_and_kl_mean(hf_and_ort_runs, tiny_pkg):
    pytest.importorskip("olive")
    from types import SimpleNamespace

    from ortevals.integrations.olive import OrtEvalsEvaluator

    hf, _ = hf_and_ort_runs
    evaluator = OrtEvalsEvaluator(tasks=["mmlu-pro"], limit=3, data="bundled", max_length=1024, truncate="left",
                                  reference=str(hf))
    metrics = evaluator.evaluate(SimpleNamespace(model_path=str(tiny_pkg / "model.onnx")), [])
    flip, kl = metrics.root[f"{TASK}-flip_rate"], metrics.root[f"{TASK}-kl_mean"]
    assert flip.value == 0.0 and 0 <= kl.value < 1e-8
    assert not flip.higher_is_better and not kl.higher_is_better
    assert f"{TASK}-acc" in metrics.root


def test_generation_task_text_and_answer_agreement(tmp_path):
    def gen(i: int, text: str, extracted: str, score: float) -> dict:
        return {"doc_id": i, "doc": {"category": "x"}, "target": "A", "arguments": [["Q?", {"until": ["\n"]}]],
                "resps": [[text]], "filtered_resps": [extracted], "filter": "custom-extract",
                "metrics": ["exact_match"], "exact_match": score, "doc_hash": f"d{i}", "prompt_hash": "p"}

    ref = write_ortevals_run(tmp_path / "ref", [gen(0, "The answer is (A)", "A", 1),
                                                gen(1, "The answer is (B)", "B", 0),
                                                gen(2, "xyz", "[invalid]", 0)], task="cot")
    run = write_ortevals_run(tmp_path / "run", [gen(0, "The answer is (A)", "A", 1),
                                                gen(1, "The answer is (C)", "C", 0),
                                                gen(2, "xyw", "[invalid]", 0)], task="cot")
    (rec,) = compare_json(tmp_path, ref, run)
    assert rec["kind"] == "generation" and "kl_mean" not in rec
    assert rec["text_agreement"] == pytest.approx(1 / 3) and rec["agreement"] == pytest.approx(2 / 3)
    assert rec["answer_changes"] == 1 and rec["flip_rate"] == 0.0
    # outputs 1 and 2 first differ at character 15 ("(B" vs "(C") and 2 ("z" vs "w")
    assert rec["first_divergence_char"]["p50"] == pytest.approx((15 + 2) / 2)


def test_a_question_without_score_is_a_user_error(tmp_path):
    ref, _ = hand_runs(tmp_path)
    recs = [record(i, loglik(a), category=c) for i, (a, c) in enumerate(zip(RUN_ANSWERS, CATS))]
    del recs[3]["acc"]  # never counted as wrong
    run = write_ortevals_run(tmp_path / "noscore", recs)
    assert_one_line_error(invoke("--ref", str(ref), str(run)), "no 0/1 score", "doc_id 3")


def test_stringified_index_target_is_resolved_by_the_stored_score():
    """lm-eval's tracker writes an int target 2 as "2"; with choices "1","2","3" that string is also a label."""
    from ortevals.report.runs import parse_task

    def rec(doc_id: int, target, lls: list[float], acc: float) -> dict:
        return {"doc_id": doc_id, "target": target, "arguments": [["Q", f" {c}"] for c in "123"],
                "filtered_resps": [[str(v), "False"] for v in lls], "acc": acc}

    run = parse_task("t", [rec(0, "2", [-3, -2, -1], 1.0),  # picks index 2 ("3"), right: gold is index 2
                           rec(1, "2", [-3, -1, -2], 1.0),  # picks index 1 ("2"), right: gold is label "2"
                           rec(2, 2, [-1, -2, -3], 0.0),  # ortevals keeps the int: an index
                           rec(3, "2", [-1, -2, -3], 0.0)], "mem")["t"]  # wrong either way: unknown
    assert run.gold.tolist() == [2, 1, 2, -1]


def test_clustered_interval_is_cr1_with_t_on_g_minus_1_df():
    """One convention in compare and fidelity: CR1 variance G/(G-1)·Σ_g(Σ resid)²/N² and t(G-1)."""
    from ortevals.fidelity import stats as fidelity_stats
    from ortevals.report.stats import clustered_interval, paired_delta

    x = np.array([1, 0, 1, 0, 0, 1, 1, 1, 0], dtype=float)
    groups = np.array(["a", "a", "a", "b", "b", "c", "c", "c", "c"])
    got = clustered_interval(x, groups)
    # mean 5/9; cluster residual sums 3/9, -10/9, 7/9 -> Σ² = 158/81; var = 3/2 · 158/81 / 81
    se = math.sqrt(1.5 * 158 / 81) / 9
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(2) quantile in closed form: (2p-1)/sqrt(2p(1-p)) = 4.303
    assert got.estimate == pytest.approx(5 / 9) and got.se == pytest.approx(se, rel=1e-12)
    assert (got.low, got.high) == pytest.approx((5 / 9 - t2 * se, 5 / 9 + t2 * se), rel=1e-9)
    # every question its own cluster: the textbook std(ddof=1)/sqrt(N) with t(N-1)
    plain = clustered_interval(x)
    from scipy.stats import t

    assert plain.se == pytest.approx(x.std(ddof=1) / 3, rel=1e-12)
    assert plain.high - plain.estimate == pytest.approx(t.ppf(0.975, 8) * x.std(ddof=1) / 3, rel=1e-12)
    assert paired_delta(np.zeros(9), x, groups) == got  # Δ accuracy is the same interval on run − ref
    assert fidelity_stats.clustered_mean(x, groups) == pytest.approx((got.estimate, got.se))  # fidelity shares it


def test_clustered_interval_equals_statsmodels_cluster_robust_ols():
    """statsmodels' OLS on a constant with cov_type="cluster" (CR1, use_t: t with G-1 df), 14 clusters as in
    MMLU-Pro. statsmodels is a dev dependency only (CI installs it: tests/test_pins.py); skipped where it is missing."""
    sm = pytest.importorskip("statsmodels.api")
    from ortevals.report.stats import clustered_interval

    rng = np.random.default_rng(3)
    groups = rng.integers(0, 14, 300)
    d = (rng.random(300) < 0.3 + 0.02 * groups).astype(float) - (rng.random(300) < 0.4).astype(float)
    fit = sm.OLS(d, np.ones((300, 1))).fit(cov_type="cluster", cov_kwds={"groups": groups}, use_t=True)
    got = clustered_interval(d, groups)
    assert got.se == pytest.approx(float(fit.bse[0]), rel=1e-10)
    assert (got.low, got.high) == pytest.approx(tuple(fit.conf_int(alpha=0.05)[0]), rel=1e-10)


def test_kl_from_log_probabilities_below_exp_underflow():
    """Issue 49 item 3: log-probabilities below −745 underflow in exp; KL from the probabilities became inf where
    the true value is ~1e-304·100. Against scipy's rel_entr on random distributions (where nothing underflows),
    and the edge cases of its definition (0 where p has no mass, inf where only q has none)."""
    from scipy.special import rel_entr, softmax

    from ortevals.report.stats import kl

    lp = np.array([[np.log1p(-1e-304), -700.0], [0.0, -np.inf], [np.log(0.5), np.log(0.5)]])
    lq = np.array([[np.log1p(-1e-300), -800.0], [0.0, -np.inf], [0.0, -np.inf]])
    got = kl(lp, lq)
    assert np.isfinite(got[0]) and got[0] < 1e-290
    assert got[1] == 0.0 and got[2] == np.inf
    rng = np.random.default_rng(0)
    p, q = softmax(rng.normal(size=(50, 10)) * 3, axis=1), softmax(rng.normal(size=(50, 10)) * 3, axis=1)
    np.testing.assert_allclose(kl(np.log(p), np.log(q)), rel_entr(p, q).sum(axis=1), rtol=1e-12, atol=1e-15)
