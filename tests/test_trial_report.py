"""Issue 22: what a run prints and writes. Per filter as lm-eval's table (numbered item 7), what was scored
(trial item 1), --samples' headline and strict JSON (item 11), the scoring mode of a resumed run, stale
samples files and Ray workers (item 12). Values are worked out by hand in each test."""

import json
import math

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.report.results import format_table, summarize, write_outputs


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, as strict parsers (JavaScript's JSON.parse, jq) do."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def sample(doc_id, filt, value, doc=None):
    return {"doc_id": doc_id, "doc": doc or {}, "filter": filt, "exact_match": value}


def gsm_like_results():
    """gsm8k-style: 4 questions under two filters, plus a one-filter task of 2 questions."""
    strict, flexible = [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]
    samples = [sample(i, "strict-match", v) for i, v in enumerate(strict)]
    samples += [sample(i, "flexible-extract", v) for i, v in enumerate(flexible)]
    arc = [{"doc_id": i, "doc": {}, "filter": "none", "acc": v} for i, v in enumerate([1.0, 0.0])]
    results = {"gsm": {"alias": "gsm", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.25,
                       "exact_match,flexible-extract": 0.75, "exact_match_stderr,flexible-extract": 0.25},
               "arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": 0.5}}
    return {"results": results, "samples": {"gsm": samples, "arc": arc}}


def test_summary_reports_each_filter_and_counts_a_question_once():
    s = summarize(gsm_like_results(), requests=6, seconds=1.0, model_seconds=0.5)
    assert s.questions == 6  # 4 gsm questions + 2 arc questions, not 4 x 2 filters + 2
    overall = {o.filter: (o.value, o.questions) for o in s.overall}
    # by hand: strict 1/4, flexible 3/4, none 1/2 (before: one figure, (1 + 3 + 1) / 10 = 0.5)
    assert overall == {"strict-match": (0.25, 4), "flexible-extract": (0.75, 4), "none": (0.5, 2)}
    text = format_table(s)
    assert "gsm   strict-match      exact_match  0.2500  0.2500" in text
    assert "gsm   flexible-extract  exact_match  0.7500  0.2500" in text
    assert "overall, filter strict-match: 0.2500 over 4 questions" in text
    assert "overall, filter flexible-extract: 0.7500 over 4 questions" in text


def samples_results():
    """--samples 4: one question per task; lm-eval's stderr of one question is NaN; pooled pass@1 = 0.375."""
    points = [{"estimator": e, "k": k, "value": v, "stderr": math.nan, "low": lo, "high": hi, "tokens": 10.0 * k}
              for e, k, v, lo, hi in [("pass", 1, 0.375, 0.25, 0.5), ("pass", 4, 0.5, 0.0, 1.0),
                                      ("maj", 1, 0.375, 0.25, 0.5), ("maj", 4, 0.5, math.nan, math.nan),
                                      ("best", 1, 0.375, 0.25, 0.5), ("best", 4, 0.0, 0.0, 0.0)]]
    task = {"exact_match,custom-extract": 1.0, "exact_match_stderr,custom-extract": math.nan,
            **{f"{p['estimator']}@{p['k']},custom-extract": p["value"] for p in points},
            **{f"{p['estimator']}@{p['k']}_stderr,custom-extract": math.nan for p in points}}
    return {"results": {"t": task}, "samples": {"t": [sample(0, "custom-extract", 1.0, {"category": "math"})]},
            "scaling": {"questions": 2, "samples": 4, "points": points}}


def test_samples_headline_is_the_k1_estimate_with_its_interval(tmp_path):
    s = summarize(samples_results(), requests=8, seconds=1.0, model_seconds=0.5)
    text = format_table(s)
    # the first sample's exact_match (1.0) is not the headline; pass@1 over every sample is, with its interval
    assert "overall (k=1 estimate, all 4 samples of each question): 0.3750 [0.2500, 0.5000]" in text
    assert "nan" not in text.lower() and "n/a" in text
    assert "1  0.3750 [0.2500, 0.5000]" in text and "0.5000 [n/a]" in text  # maj@4 has no interval
    write_outputs(tmp_path, samples_results(), s)
    body = strict_json((tmp_path / "results.json").read_text())
    assert body["results"]["t"]["exact_match_stderr,custom-extract"] is None
    assert body["ortevals"]["overall"][0]["value"] == 0.375


def test_cli_samples_run_writes_strict_json_and_no_nan(tiny_pkg, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit",
                                      "1", "--max-gen-toks", "4", "--samples", "2", "--no-resume", "--truncate",
                                      "left", "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output and "overall (k=1 estimate, all 2 samples" in result.output
    strict_json((out / "results.json").read_text())
    for f in out.glob("samples_*.jsonl"):
        for line in f.read_text().splitlines():
            strict_json(line)


def test_results_say_what_was_scored_and_compare_says_which_is_which(tiny_pkg, tmp_path):
    from ortevals.package.loader import ModelPackage

    base = ["mmlu-pro", "--data", "bundled", "--limit", "2", "--no-resume", "--truncate", "left"]
    for name in ("a", "b"):
        result = CliRunner().invoke(cli, [*base, "--pkg", str(tiny_pkg), "--output", str(tmp_path / name)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
    config = strict_json((tmp_path / "a" / "results.json").read_text())["config"]
    assert config["model"] == "ortevals" and config["model_path"] == str(tiny_pkg.resolve())
    assert config["model_fingerprint"] == ModelPackage.load(tiny_pkg).fingerprint()
    assert config["model_dtype"] == "float32" and config["execution_provider"] == "CPUExecutionProvider"
    args = dict(kv.split("=", 1) for kv in config["model_args"].split(","))
    assert args["pkg"] == str(tiny_pkg.resolve()) and args["ep"] == "cpu" and args["truncate"] == "left"
    result = CliRunner().invoke(cli, ["compare", "--ref", str(tmp_path / "a"), str(tmp_path / "b")])
    line = (f"ortevals {tiny_pkg.resolve()} (llama, float32, CPUExecutionProvider, "
            f"fingerprint {config['model_fingerprint']})")
    assert f"  a: {line}" in result.output and f"  b: {line}" in result.output


def test_precision_from_the_graph(tmp_path, fixture_cache, tiny_pkg):
    """float32 (initializers), int8 dynamic (quantize_dynamic), int4 (a MatMulNBits node with bits=4)."""
    import onnx
    from onnx import TensorProto, helper

    from ortevals.package.graph import graph_facts
    from tests.fixtures.dynquant import build_dynquant

    assert graph_facts(tiny_pkg / "model.onnx").precision == "float32"
    assert graph_facts(build_dynquant(tiny_pkg, fixture_cache) / "model.onnx").precision.startswith("int8 (dynamic")
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=16, N=8, bits=4,
                            block_size=16)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor("w", TensorProto.UINT8, [8, 1, 8], bytes(64), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, [8], [1.0] * 8)])
    onnx.save(helper.make_model(graph), tmp_path / "q.onnx")
    assert graph_facts(tmp_path / "q.onnx").precision == "int4 (MatMulNBits)"


def test_resumed_run_says_so_and_stale_samples_go(tiny_pkg, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"ortevals": {}, "configs": {"old_task": {}}}))
    (out / "samples_old_task.jsonl").write_text("{}\n")
    (out / "samples_mine.jsonl").write_text("{}\n")  # not named by the earlier results.json: kept
    args = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
            "--output", str(out)]
    env = {"ORTEVALS_CACHE": str(tmp_path / "cache")}
    first = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
    assert first.exit_code == 0 and "scoring mode: batched" in first.output, first.output
    assert not (out / "samples_old_task.jsonl").exists() and (out / "samples_mine.jsonl").exists()
    second = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
    assert "scoring mode: all 9 requests reused from the result store" in second.output, second.output
    assert strict_json((out / "results.json").read_text())["ortevals"]["mode"].startswith("all 9 requests reused")


def test_workers_line():
    from ortevals.evaluate import workers_text

    class Pool:
        workers = 2

    class Args:
        ray_address = None

    class Lm:
        pool, args = Pool(), Args()

    assert workers_text(Lm()) == "2 Ray workers on a local cluster"
    Lm.pool = None
    assert workers_text(Lm()) == ""


def test_a_real_run_outside_git_prints_no_git_noise_no_filter_bars_and_a_plain_resume_notice(tiny_pkg, tmp_path):
    """A process as a user starts it, in a folder outside any git repository (lm-eval's git hash lookup)."""
    import os
    import subprocess
    import sys

    assert subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode != 0  # not a repo
    env = {**os.environ, "ORTEVALS_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "ortevals.cli", "mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot",
            "--limit", "2", "--max-gen-toks", "2", "--truncate", "left", "--output", str(tmp_path / "out")]
    runs = [subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600) for _ in "12"]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert "fatal:" not in r.stderr and "Filter:" not in r.stderr, r.stderr
    notice = [ln for ln in runs[1].stderr.splitlines() if "resuming:" in ln]
    assert notice and all(ln.startswith("resuming: ") for ln in notice), runs[1].stderr
    assert "scoring mode: all 2 requests reused" in runs[1].stdout


# --- item 13: fidelity --------------------------------------------------------------------------------------
def test_ppl_difference_equals_llama_cpp_published_output():
    """llama.cpp's perplexity README (--kl-divergence): Mean PPL(Q) 18.274923 ± 0.147295, Mean PPL(base)
    19.087688 ± 0.155066, Cor 97.75%, Mean PPL(Q)-PPL(base) -0.812765 ± 0.032991 (cor printed to 4 digits)."""
    from ortevals.fidelity.run import ppl_difference

    diff, se = ppl_difference({"ppl_cand": 18.274923, "ppl_cand_se": 0.147295, "ppl_ref": 19.087688,
                               "ppl_ref_se": 0.155066, "cor_ln_ppl": 0.9775})
    assert diff == pytest.approx(-0.812765, abs=1e-6) and se == pytest.approx(0.032991, abs=5e-5)


def test_fidelity_with_one_window_says_there_is_no_interval(tiny_pkg, tmp_path):
    out = tmp_path / "s.json"
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny_pkg), "--ref", str(tiny_pkg), "--tokens", "255",
                                      "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "1 windows of 512" in result.output and "nan" not in result.output.lower()
    assert "one window gives no standard error or interval" in result.output
    assert "Mean PPL(cand)-PPL(ref)       :   0.000000 ±        n/a" in result.output
    s = strict_json(out.read_text())
    assert s["ppl"]["ppl_cand_se"] is None and s["ppl"]["diff"] == 0.0 and s["ppl"]["diff_se"] is None


def test_fidelity_prints_the_ppl_difference_with_its_error(tiny_pkg, tmp_path):
    """Several windows: the line equals the formula on the printed values (package against itself: 0 ± 0)."""
    out = tmp_path / "s.json"
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny_pkg), "--ref", str(tiny_pkg), "--ctx", "64",
                                      "--tokens", "300", "--json", str(out)], catch_exceptions=False)
    s = strict_json(out.read_text())["ppl"]
    assert s["diff"] == pytest.approx(s["ppl_cand"] - s["ppl_ref"], abs=1e-12)
    assert "Mean PPL(cand)-PPL(ref)       :" in result.output and "one window" not in result.output
