"""Issue 26: efficiency reported like accuracy, and start-up that does only what the run needs.

The pass meter counts the tokens of passes whose shapes the test chooses on the tiny package; the
arithmetic is checked against hand-computed values; results.json's layout on a real CLI run; lm-eval's
torch seed and environment report without importing torch; the derived graph keeps its weights in place.
"""

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.package.loader import ModelPackage
from ortevals.report.efficiency import efficiency, since, timeline, timeline_text
from ortevals.runtime.derive import derived_decoder
from ortevals.runtime.meter import PassCounts, process_started
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runner(tiny_pkg, tmp_path_factory):
    package = ModelPackage.load(tiny_pkg)
    provider = from_package(package.decoder.session_options, "cpu", {}, 1)
    return DecoderRunner.open(package, provider, tmp_path_factory.mktemp("cache"))


def test_meter_counts_the_tokens_of_each_pass_and_not_the_probe(runner):
    runner.meter.reset()
    assert runner.meter.counts() == PassCounts()
    ids = np.arange(3, 3 + 2 * 5, dtype=np.int64).reshape(2, 5)
    _, present = runner.forward(ids, np.ones((2, 5), np.int64), want_present=True)  # prefill: 2 rows x 5
    runner.forward(ids[:, :1], np.ones((2, 6), np.int64), present)  # decode: 2 rows x 1 on a 5-token past
    runner.forward(ids[:1, :3], np.ones((1, 3), np.int64))  # prefill: 1 row x 3
    c = runner.meter.counts()
    assert (c.prefill_passes, c.prefill_tokens, c.prefill_rows) == (2, 13, 3)
    assert (c.decode_passes, c.decode_tokens) == (1, 2)
    assert c.prefill_seconds > 0 and c.decode_seconds > 0
    assert c.decode_row_seconds == pytest.approx(2 * c.decode_seconds)  # one decode pass of 2 rows
    assert c.first_pass_at is not None and c.first_pass_at >= process_started()


def test_efficiency_arithmetic_by_hand():
    c = PassCounts(prefill_passes=2, prefill_tokens=13, prefill_seconds=0.5, prefill_rows=3,
                   prefill_row_seconds=2 * 0.3 + 1 * 0.2, decode_passes=4, decode_tokens=10, decode_seconds=2.0,
                   decode_row_seconds=3 * 0.5 + 3 * 0.5 + 2 * 0.5 + 2 * 0.5, first_pass_at=12.0)
    clock = {"startup_s": 1.5, "scoring_s": 2.0, "after_s": 0.5, "total_s": 4.0}
    e = efficiency(c, requests=7, reused=1, output_tokens=10, clock=clock, peak_rss_mib=100.0)
    assert e["prefill_tokens_per_s"] == pytest.approx(26.0)  # 13 tokens / 0.5 s
    assert e["decode_tokens_per_s"] == pytest.approx(5.0)  # 10 tokens / 2 s
    assert e["ttft_s"] == pytest.approx(0.8 / 3)  # rows wait for their pass: (0.3+0.3+0.2)/3
    assert e["tpot_s"] == pytest.approx(0.5)  # every decode pass took 0.5 s: each row's token took 0.5 s
    assert e["peak_device_mib"] is None and {k: e[k] for k in clock} == clock
    none = efficiency(PassCounts(), 0, 5, 0, timeline(None, None, 3.0, 3.5), 1.0)
    assert none["prefill_tokens_per_s"] is None and none["ttft_s"] is None and none["tpot_s"] is None
    later = PassCounts(prefill_passes=3, prefill_tokens=20, prefill_seconds=0.7, prefill_rows=4,
                       prefill_row_seconds=1.0, decode_passes=4, decode_tokens=10, decode_seconds=2.0,
                       decode_row_seconds=c.decode_row_seconds, first_pass_at=12.0)
    span = since(later, c)
    assert (span.prefill_passes, span.prefill_tokens, span.prefill_rows, span.decode_passes) == (1, 7, 1, 0)
    assert span.prefill_seconds == pytest.approx(0.2) and span.first_pass_at == 12.0
    assert since(c, c).first_pass_at is None  # nothing ran in the span


def test_the_run_clock_parts_add_up_by_hand():
    """Launch at 10.0 s, first pass at 11.25, lm-eval done at 14.9, the record at 15.3 (one clock)."""
    t = timeline(10.0, 11.25, 14.9, 15.3)
    assert t == pytest.approx({"startup_s": 1.25, "scoring_s": 3.65, "after_s": 0.4, "total_s": 5.3})
    # printed: each part the difference of the rounded times since launch (1.2, 4.9, 5.3), so the line adds up
    assert timeline_text(t) == "start-up 1.2 s + scoring 3.7 s + after 0.4 s = 5.3 s since launch"
    none_ran = timeline(10.0, None, 12.0, 12.5)  # every answer reused: start-up lasts to lm-eval's end
    assert none_ran == pytest.approx({"startup_s": 2.0, "scoring_s": 0.0, "after_s": 0.5, "total_s": 2.5})
    unknown = timeline(None, 11.0, 12.0, 12.5)  # no process start (not Linux): no start-up, no total
    assert unknown == pytest.approx({"startup_s": None, "scoring_s": 1.0, "after_s": 0.5, "total_s": None})
    assert timeline_text(unknown) is None


def test_results_json_and_summary_carry_the_efficiency(tiny_pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2",
                                      "--output", str(out), "--truncate", "left"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    body = json.loads((out / "results.json").read_text())
    eff = body["efficiency"]
    overall = eff["overall"]
    assert eff["by_task"] == {"leaderboard_mmlu_pro": overall}  # one task: its figures are the run's
    assert overall["requests"] == body["ortevals"]["requests"] > 0
    assert overall["prefill_passes"] > 0 and overall["prefill_tokens"] >= overall["prefill_passes"] * 2
    assert overall["prefill_tokens_per_s"] == pytest.approx(overall["prefill_tokens"] / overall["prefill_s"])
    assert overall["decode_tokens"] == 0 and overall["decode_tokens_per_s"] is None and overall["tpot_s"] is None
    assert 0 < overall["ttft_s"] <= overall["prefill_s"] and 0 < overall["startup_s"]
    assert overall["peak_rss_mib"] == pytest.approx(body["ortevals"]["peak_rss_mb"], rel=0.05)
    parts = [overall[k] for k in ("startup_s", "scoring_s", "after_s")]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(overall["total_s"])
    assert overall["scoring_s"] >= overall["prefill_s"]  # the passes ran inside the scoring span
    assert overall["total_s"] <= time.clock_gettime(time.CLOCK_BOOTTIME) - process_started()
    line = next(ln for ln in result.output.splitlines() if ln.startswith("questions "))
    shown = re.search(r"start-up ([\d.]+) s \+ scoring ([\d.]+) s \+ after ([\d.]+) s = ([\d.]+) s since launch",
                      line)
    assert shown, line
    assert sum(float(x) for x in shown.groups()[:3]) == pytest.approx(float(shown[4]), abs=1e-9)
    assert float(shown[4]) == pytest.approx(overall["total_s"], abs=0.051)
    assert "efficiency: prefill " in result.output and "TTFT" in result.output
    again = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2",
                                     "--truncate", "left"], catch_exceptions=False)
    assert "efficiency: no pass run (all requests reused)" in again.output, again.output


def test_generation_meters_decode_tokens(tiny_pkg, tmp_path, monkeypatch):
    """--cot on the raw sampler: every generated token after the first comes from a one-token decode pass."""
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--cot",
                                      "--max-gen-toks", "4", "--output", str(out), "--truncate", "left",
                                      "--no-resume"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    overall = json.loads((out / "results.json").read_text())["efficiency"]["overall"]
    assert overall["output_tokens"] > 0 and overall["decode_tokens"] > 0
    assert overall["decode_tokens_per_s"] == pytest.approx(overall["decode_tokens"] / overall["decode_s"])
    assert overall["tpot_s"] > 0 and "TPOT" in result.output


def test_an_ortevals_run_imports_no_torch_and_keeps_lm_evals_seed(tiny_pkg, tmp_path):
    """lm-eval seeds torch whenever it is installed (importing it, ~3 s); ortevals never uses torch."""
    code = ("import sys, json; from ortevals.cli import main; sys.argv[0] = 'ortevals'\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, "mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled",
                           "--limit", "1", "--no-resume", "--truncate", "left", "--output", str(out)],
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                               "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                                               "ORTEVALS_CACHE": str(tmp_path / "cache")})
    assert "TORCH False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    config = json.loads((out / "results.json").read_text())
    assert config["config"]["torch_seed"] == 1234 and "not collected" in config["pretty_env_info"]
    assert config["transformers_version"] not in ("", None)


def test_the_deferred_torch_seed_gives_torch_lm_evals_state():
    code = ("import sys, lm_eval.evaluator as e\nfrom ortevals.evaluate import deferred_torch_seed\n"
            "with deferred_torch_seed():\n    e.set_torch_seed(1234)\n    assert 'torch' not in sys.modules\n"
            "    import torch\n    a = torch.rand(4)\n"
            "torch.manual_seed(1234)\nb = torch.rand(4)\nprint('SAME', bool((a == b).all()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "SAME True" in proc.stdout, proc.stderr[-2000:]


def test_the_derived_graph_leaves_the_weights_in_the_package(tiny_pkg, tmp_path):
    package = ModelPackage.load(tiny_pkg)
    derived = derived_decoder(package, tmp_path)
    files = list(derived.parent.iterdir())
    assert {f.name for f in files} == {derived.name, "scope.json"}  # no copy of the data file
    data = sum(f.stat().st_size for f in package.decoder.path.parent.iterdir() if f.suffix == ".data")
    assert data > 0 and derived.stat().st_size < data / 10
    model = onnx.load(str(derived), load_external_data=False)
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    locations = {e.value for i in external for e in i.external_data if e.key == "location"}
    assert external and all((package.decoder.path.parent / loc).is_file() for loc in locations)
    assert sum(math.prod(i.dims) for i in external) * 4 >= data * 0.9  # the weights are all referenced there


def test_sessions_open_on_a_thread_and_errors_come_at_first_use(tiny_pkg, monkeypatch):
    import threading

    from lm_eval.api.instance import Instance

    from ortevals.errors import PackageError
    from ortevals.integrations.lm import OrtLM
    from ortevals.options import ModelArgs

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)))
    assert lm.backends.prefill.runner.meter is lm.backends.meter  # the opened engine feeds the run's meter
    where = []

    def refuse(*a, **k):
        where.append(threading.current_thread().name)
        raise PackageError("decoder.onnx: refused")

    monkeypatch.setattr(DecoderRunner, "open", refuse)
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)), open_soon=True)  # returns: it opens on its thread
    with pytest.raises(PackageError, match="refused"):  # the first request meets the error, before its checks
        lm.loglikelihood([Instance("loglikelihood", {}, ("The city", " of"), 0)], disable_tqdm=True)
    assert where == ["ortevals-open"]
    with pytest.raises(PackageError, match="refused"):  # a library caller: at once, as before
        OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)))
    assert where == ["ortevals-open", "MainThread"]


def test_requests_are_tokenized_while_the_sessions_open(tiny_pkg, monkeypatch):
    """The first log-likelihood call tokenizes its requests before it waits for the opening thread; an
    opening error still comes before the requests' own checks (here: one longer than max_length)."""
    import threading

    from lm_eval.api.instance import Instance

    from ortevals.errors import PackageError
    from ortevals.integrations.lm import OrtLM
    from ortevals.options import ModelArgs

    tokenized, open_real = threading.Event(), DecoderRunner.open
    seen = []

    def open_after_tokenizing(*a, **k):
        seen.append(tokenized.wait(timeout=10))  # False: the caller waited for this thread before tokenizing
        return open_real(*a, **k)

    monkeypatch.setattr(DecoderRunner, "open", open_after_tokenizing)
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)), open_soon=True)
    encode, encode_many = lm.run.tokenizer.encode, lm.run.tokenizer.encode_many
    monkeypatch.setattr(lm.run.tokenizer, "encode", lambda *a: (tokenized.set(), encode(*a))[1])
    monkeypatch.setattr(lm.run.tokenizer, "encode_many", lambda *a: (tokenized.set(), encode_many(*a))[1])
    lm.loglikelihood([Instance("loglikelihood", {}, ("The city", " of"), 0)], disable_tqdm=True)
    assert seen == [True]

    def refuse(*a, **k):
        raise PackageError("decoder.onnx: refused")

    monkeypatch.setattr(DecoderRunner, "open", refuse)
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=8), open_soon=True)
    with pytest.raises(PackageError, match="refused"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("The city " * 20, " of"), 0)], disable_tqdm=True)


def test_cli_opens_the_sessions_before_lm_eval_loads_its_tasks(tiny_pkg, tmp_path, monkeypatch):
    """``ortevals mmlu-pro``: the sessions start opening (on their thread) before lm-eval's task index is
    imported and the task configs are built, so the two overlap."""
    import ortevals.presets
    from ortevals.engine.backends import Backends

    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    order, open_soon, task_specs = [], Backends.open_soon, ortevals.presets.task_specs
    monkeypatch.setattr(Backends, "open_soon", lambda self: (order.append("open"), open_soon(self))[1])
    monkeypatch.setattr(ortevals.presets, "task_specs", lambda *a: (order.append("tasks"), task_specs(*a))[1])
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2",
                                      "--truncate", "left"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert order == ["open", "tasks"]


def test_no_resume_reuses_the_canary_verdict_but_no_answer(tiny_pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    args = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2", "--truncate", "left"]

    def run(*extra):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        result = CliRunner().invoke(cli, [*args, *extra, "--output", str(out)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output, json.loads((out / "results.json").read_text())

    first, body1 = run("--no-resume")
    second, body2 = run("--no-resume")
    assert "canary passed" in first and "stored verdict reused" not in first
    assert "stored verdict reused" in second  # the canary's passes are not run again
    assert body2["efficiency"]["overall"]["prefill_passes"] < body1["efficiency"]["overall"]["prefill_passes"]
    assert body2["ortevals"]["reused"] == 0  # every answer scored again
    third, body3 = run()  # resume: --no-resume wrote no answer, so nothing to reuse
    assert body3["ortevals"]["reused"] == 0 and body3["ortevals"]["requests"] == body1["ortevals"]["requests"]
    assert [s["resps"] for s in body3.get("samples", [])] == [s["resps"] for s in body1.get("samples", [])]


def test_start_up_counts_from_ortevals_own_start(tiny_pkg, tmp_path):
    """Issue 38 item 11: a shell that waits, then execs ortevals in the same process (`sleep 3 && exec
    ortevals …`, or pip before it): the process started before the wait, ortevals' code after it. The
    run's total (start-up from ortevals' start) is at most the command's wall time less the wait; it was
    the process's age (the wait counted as start-up: 22.3 s after `sleep 20`)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    command = (f"sleep 3 && exec {sys.executable} -m ortevals.cli mmlu-pro --pkg {tiny_pkg} --data bundled "
               f"--limit 1 --truncate left --no-resume --output {out}")
    began = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ORTEVALS_CACHE": str(tmp_path / "cache")})
    wall = time.perf_counter() - began
    assert proc.returncode == 0, proc.stderr[-2000:]
    overall = json.loads((out / "results.json").read_text())["efficiency"]["overall"]
    assert overall["total_s"] <= wall - 3.0, (overall, wall)
    assert 0 < overall["startup_s"] < overall["total_s"]


@pytest.mark.parametrize("args", [["--cot", "--max-gen-toks", "8", "--model-args", "gen_path=og"],
                                  ["--model-args", "path=incremental"]], ids=["og-generation", "og-loglikelihood"])
def test_onnxruntime_genai_paths_book_their_work_as_scoring(tiny_pkg, tmp_path, monkeypatch, args):
    """Issue 38 item 11: onnxruntime-genai's passes are not metered, so start-up lasted to the end of the
    evaluation (`start-up 28.3 s + scoring 0.0 s`); now the scoring span holds the engine's time."""
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2",
                                      "--truncate", "left", "--no-resume", "--output", str(out), *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    body = json.loads((out / "results.json").read_text())
    overall, engine = body["efficiency"]["overall"], body["ortevals"]["model_seconds"]
    assert engine > 0 and overall["scoring_s"] >= engine, (overall, engine)
    assert overall["startup_s"] + overall["scoring_s"] + overall["after_s"] == pytest.approx(overall["total_s"])


def test_busy_seconds_count_a_long_pass_recorded_after_short_ones_once():
    """Issue 49 item 4 (`--passes auto`): one thread runs a 10 s pass while another runs 2000 passes of 2.5 ms with
    2.5 ms gaps inside it, recorded first. Busy time is the union: 10 s (the meter kept only intervals within
    twice the longest pass so far, 5 ms, so the long pass was counted again over the short ones' time: 15 s).
    Afterwards, with nothing running, the kept intervals shrink to the last one."""
    import threading

    from ortevals.runtime.meter import PassMeter

    meter = PassMeter()
    begun, short_done = threading.Event(), threading.Event()

    def long_pass():
        started = meter.start(0.0)
        begun.set()
        short_done.wait()
        meter.record(1, 64, False, started, 10.0)

    worker = threading.Thread(target=long_pass)
    worker.start()
    begun.wait()
    for i in range(2000):
        meter.record(1, 64, False, meter.start(i * 0.005), 0.0025)
    short_done.set()
    worker.join()
    counts = meter.counts()
    assert counts.prefill_passes == 2001
    assert counts.prefill_seconds == pytest.approx(10.0, abs=1e-9)
    assert counts.prefill_row_seconds == pytest.approx(10.0 + 2000 * 0.0025)
    meter.record(1, 1, True, meter.start(20.0), 1.0)  # another kind, apart
    meter.record(1, 1, True, meter.start(20.5), 1.0)  # overlapping: 0.5 s more
    assert meter.counts().decode_seconds == pytest.approx(1.5)
    assert all(len(starts) == 1 for starts, _ in meter._spans.values())  # nothing runs: the last interval kept
