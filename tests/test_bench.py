"""``ortevals bench`` (ortevals/bench/): the table's statistics against scipy, the one-line refusals before any
run, the candidate syntax, one process watched (time, memory, first result, time-out), and one benchmark end
to end on the tiny package (ortevals twice and lm-eval's onnxruntime-genai, each its own process)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from scipy.special import softmax
from scipy.stats import binomtest, entropy

from ortevals.bench import BenchOptions, parse_candidate
from ortevals.bench import plan as plan_module
from ortevals.bench.measure import RunRecord
from ortevals.bench.plan import plan
from ortevals.bench.rows import counts, paired, table_rows
from ortevals.bench.spec import Candidate
from ortevals.bench.watch import Watched, scoring_bar, watch
from ortevals.cli import cli
from ortevals.presets import BUNDLED
from ortevals.report.runs import load_run
from tests.test_cli import assert_one_line_error
from tests.test_compare import record, write_ortevals_run

# ---- the statistics against scipy, on hand-made runs --------------------------------------------------------------


def hand_made(tmp_path: Path, n_ref: int = 12, n_run: int = 9) -> tuple[Path, Path, list, list]:
    """A reference of ``n_ref`` questions (3 choices, but 2 in the last ones the row runs) and a row on its first
    ``n_run``, log-likelihoods drawn from a seeded generator, gold always A."""
    rng = np.random.default_rng(7)
    widths = [2 if i < n_run else 3 for i in range(n_ref)]  # the reference's widest questions are not the row's
    ref_ll = [list(rng.normal(-2, 1, w)) for w in widths]
    run_ll = [list(np.array(ll) + rng.normal(0, 0.8, len(ll))) for ll in ref_ll[:n_run]]
    ref = write_ortevals_run(tmp_path / "ref", [record(i, ll) for i, ll in enumerate(ref_ll)])
    run = write_ortevals_run(tmp_path / "run", [record(i, ll) for i, ll in enumerate(run_ll)])
    return ref, run, ref_ll, run_ll


def test_paired_statistics_against_scipy_on_the_questions_both_ran(tmp_path):
    ref, run, ref_ll, run_ll = hand_made(tmp_path)
    got = paired(load_run(ref), load_run(run))
    n = len(run_ll)
    ref_ok = np.array([int(np.argmax(x)) == 0 for x in ref_ll[:n]])
    run_ok = np.array([int(np.argmax(x)) == 0 for x in run_ll])
    b, c = int(np.sum(ref_ok & ~run_ok)), int(np.sum(~ref_ok & run_ok))
    assert got.n == n and (got.flips.correct_to_wrong, got.flips.wrong_to_correct) == (b, c) and b + c > 0
    assert got.mcnemar_p == pytest.approx(binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-12)
    kl = np.mean([entropy(softmax(p), softmax(q)) for p, q in zip(ref_ll[:n], run_ll)])  # KL(ref‖row), nats
    assert got.choice_kl == pytest.approx(kl, rel=1e-9)
    assert got.max_abs_dll == pytest.approx(max(abs(x - y) for p, q in zip(ref_ll, run_ll) for x, y in zip(p, q)))
    same = sum(int(np.argmax(p)) == int(np.argmax(q)) for p, q in zip(ref_ll, run_ll))
    assert got.n - got.flips.answer_changes == same


def watched(wall: float, first: float | None = 1.0, rss: float = 100.0) -> Watched:
    return Watched(0, wall, rss, first, False, "", ())


def test_table_rows_rate_ratio_medians_and_wilson_against_scipy(tmp_path):
    ref, run, ref_ll, run_ll = hand_made(tmp_path)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "genai_config.json").write_text("{}")
    (pkg / "model.onnx.data").write_bytes(b"\0" * 2**20)
    bench = plan_module.Plan((plan_module.RowSpec("a", "ortevals", str(pkg)),
                              plan_module.RowSpec("b", "onnxruntime-genai", str(pkg))), "a", "requests")
    records = {"a": [RunRecord("a", 1, ref, watched(10.0, 4.0, 300), None)],
               "b": [RunRecord("b", k, run, watched(w, 2.0 + k), None) for k, w in ((1, 30.0), (2, 20.0), (3, 50.0))]}
    a, b = table_rows(bench, records, "requests")
    req_a, req_b = sum(len(x) for x in ref_ll), sum(len(x) for x in run_ll)
    assert (a.requests, b.requests, b.runs, b.wall_s, b.wall_min_s, b.wall_max_s) == (req_a, req_b, 3, 30.0, 20.0, 50.0)
    assert a.rate == pytest.approx(req_a / 10.0) and b.rate == pytest.approx(req_b / 30.0)
    assert b.x_ref == pytest.approx((req_b / 30.0) / (req_a / 10.0)) and a.x_ref == pytest.approx(1.0)
    assert b.first_result_s == 4.0 and a.peak_rss_mib == 300 and a.size_mib == pytest.approx(1.0, abs=1e-3)
    k = sum(int(np.argmax(x)) == 0 for x in run_ll)
    ci = binomtest(k, len(run_ll)).proportion_ci(confidence_level=0.95, method="wilson")
    assert (b.accuracy.estimate, b.accuracy.low, b.accuracy.high) == pytest.approx((k / len(run_ll), ci.low, ci.high))
    assert a.paired is None and b.paired.n == len(run_ll) and b.repeat_same is True
    _, b = table_rows(bench, records, "requests", samples=True)  # --samples K: each backend's own draws
    assert b.paired is None and b.note.startswith("not compared with the reference: with --samples")


def test_counts_requests_once_per_filter_and_generated_tokens(tmp_path, tiny_pkg):
    from ortevals.bench.rows import _counter

    texts = [["The answer is (A).", "I think B"], ["C", ""]]
    recs = [{"doc_id": i, "filter": f, "resps": [t], "arguments": [["ctx", {}]], "filtered_resps": ["A"]}
            for f in ("strict", "flexible") for i, t in enumerate(texts)]
    (tmp_path / "samples_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer

    tok = Tokenizer.load(ModelPackage.load(tiny_pkg))
    assert counts(tmp_path, _counter(str(tiny_pkg))) == (4, sum(len(tok.encode(t, False)) for q in texts for t in q))
    assert counts(tmp_path) == (4, None)


def test_markdown_table_keeps_one_column_count():
    """The header's ``max |Δ ll|`` and a failed row's message hold pipes: escaped, every line has the columns."""
    from ortevals.bench.rows import Row
    from ortevals.bench.write import markdown_table

    base = dict(backend="ortevals", target="/p", args="", cache="warm", is_ref=False, runs=0)
    rows = [Row(label="a", status="failed", note="Error: x | y", **base),
            Row(label="b", status="not installed", note="not installed (pip install vllm)", **base)]
    table = markdown_table(rows, "requests").splitlines()
    assert len({len(re.findall(r"(?<!\\)\|", ln)) for ln in table}) == 1


# ---- the candidate syntax -----------------------------------------------------------------------------------------


def test_candidate_syntax(tmp_path):
    odd = tmp_path / "a:b=c"  # a path that exists as given is never split
    odd.mkdir()
    assert parse_candidate(str(odd)) == Candidate(str(odd))
    assert parse_candidate("/m/fp32") == Candidate("/m/fp32")
    assert parse_candidate("/m/fp32:prefix_cache=false,batch_size=2") == Candidate("/m/fp32",
                                                                                   "prefix_cache=false,batch_size=2")
    assert parse_candidate("nocache=/m/fp32:prefix_cache=false") == Candidate("/m/fp32", "prefix_cache=false",
                                                                              "nocache")


def fake_package(folder: Path, tokenizer: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "genai_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer or {"model": {"vocab": {"a": 0}}}))
    return folder


def test_rows_labels_reference_and_a_backend_not_installed(tmp_path, monkeypatch):
    pkg, hf = fake_package(tmp_path / "fp32"), tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    real = plan_module.util.find_spec
    monkeypatch.setattr(plan_module.util, "find_spec", lambda m: None if m == "vllm" else real(m))
    got = plan(BenchOptions(pkgs=(str(pkg), str(pkg), f"{pkg}:prefix_cache=false"), hf=str(hf),
                            backends=("ortevals", "hf", "onnxruntime-genai", "vllm"), limit=20))
    assert [(r.label, r.backend, r.limit, r.missing) for r in got.rows] == [
        ("ortevals fp32", "ortevals", 20, None), ("ortevals fp32 #2", "ortevals", 20, None),
        ("ortevals fp32 [prefix_cache=false]", "ortevals", 20, None), ("hf hf", "hf", 20, None),
        ("onnxruntime-genai fp32", "onnxruntime-genai", 3, None),
        ("vllm hf", "vllm", 20, "not installed (pip install vllm)")]
    assert got.ref == "hf hf" and got.rate == "requests"


# ---- one line and exit 2 for each bad input, before any run -------------------------------------------------------


@pytest.fixture
def no_run(monkeypatch):
    """Any run starting fails the test: every refusal comes first."""
    def refuse(*a, **k):
        raise AssertionError("a run started")
    monkeypatch.setattr("ortevals.bench.api.measure", refuse)


def bench(*args: str):
    return CliRunner().invoke(cli, ["bench", *args])


def test_refusals_before_any_run(tmp_path, monkeypatch, no_run):
    pkg, other = fake_package(tmp_path / "p"), fake_package(tmp_path / "q", {"model": {"vocab": {"b": 0}}})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cases = [
        (["--pkg", str(pkg), "--backends", "ortevals,hff"], "--backends hff: unknown backend (did you mean 'hf'?)"),
        (["--pkg", str(pkg), "--ref", "nosuch"], "--ref nosuch: not among the rows"),
        (["--pkg", str(pkg), "--pkg", str(other), "--cot"], "have different tokenizers"),
        (["--pkg", str(tmp_path / "none")], "not found; expected a GenAI package folder"),
        (["--pkg", str(pkg), "--hf", str(hf), "--backends", "ortevals"], "no backend runs it"),
        (["--pkg", str(pkg), "--backends", "ortevals,hf"], "--backends hf runs a transformers folder: give --hf"),
        (["--pkg", str(pkg), "--cache", "luke"], "--cache luke: unknown cache state"),
        (["--pkg", str(pkg), "--cold", "--cache", "warm"], "give one (--cold is --cache cold)"),
        (["--pkg", f"{pkg}:store=/tmp/x"], "store is set by the bench"),
        (["--pkg", f"{pkg}:prefix_cache=maybe"], "prefix_cache"),
        (["--pkg", str(pkg), "--samples", "4"], "--samples 4 needs generation"),
        (["--pkg", str(pkg), "--max-gen-toks", "64"], "--max-gen-toks 64 applies to generation"),
        (["--pkg", str(pkg), "--tasks", "arc_easy", "--cot"], "give --tasks or --cot, not both"),
        (["--pkg", str(pkg), "--backends", "ortevals,ortevals"], "a backend named twice"),
        (["--pkg", str(pkg), "--hf", str(tmp_path / "none")], "--hf"),
        (["--pkg", str(pkg), "--backends", "hf", "--hf", str(hf)], "no backend runs it"),
        (["--pkg", str(pkg), "--peak-tflops", "-3"], "--peak-tflops -3: expected the device's peak TFLOP/s > 0"),
        (["--pkg", str(pkg), "--ep", "cuda"], "execution provider 'cuda' (CUDAExecutionProvider) is not available"),
        (["--pkg", str(pkg), "--ep", "gpu"], "execution provider 'cuda' (CUDAExecutionProvider) is not available"),
        (["--pkg", str(pkg), "--ep", "webgpu"], "--ep webgpu: execution provider 'webgpu' (WebGpuExecutionProvider) is "
                                                "not available in this onnxruntime install"),
        (["--hf", str(hf), "--backends", "hf", "--ep", "cuda"], "--ep cuda: torch"),
        (["--hf", str(hf), "--backends", "hf", "--ep", "dml"], "--ep dml: lm-eval's hf row runs on the CPU or CUDA"),
        (["--hf", str(hf), "--backends", "hf", "--ep", "foo"], "--ep foo: unknown execution provider 'foo'"),
        (["--pkg", str(pkg), "--data", "bundeld"], "--data bundeld: data folder not found; expected a local copy of "
                                                   "TIGER-Lab/MMLU-Pro; or --data bundled"),
        (["--pkg", str(pkg), "--data", str(tmp_path)], f"--data {tmp_path}: no test split"),
        (["--pkg", str(pkg), "--tasks", "arc_easy", "--data", str(tmp_path / "none")],
         f"--data {tmp_path / 'none'}: data folder not found"),
        (["--pkg", str(pkg), "--rate", "tokens"], "--rate tokens counts generated tokens; MMLU-Pro without --cot"),
    ]
    for args, needle in cases:
        assert_one_line_error(bench(*args), needle)
    real = plan_module.util.find_spec
    monkeypatch.setattr(plan_module.util, "find_spec", lambda m: None if m == "torch" else real(m))
    assert_one_line_error(bench("--pkg", str(pkg), "--hf", str(hf)), "pip install 'ortevals[torch]'")


def test_rate_tokens_on_tasks_that_generate_nothing_is_refused_before_any_run(tmp_path, no_run):
    """lm-eval's own configs say what a task outputs: arc_easy is multiple_choice, nothing is generated to count."""
    pkg = fake_package(tmp_path / "p")
    assert_one_line_error(bench("--pkg", str(pkg), "--tasks", "arc_easy", "--rate", "tokens"),
                          "--rate tokens counts generated tokens; --tasks arc_easy score log-likelihoods")


def test_an_ep_spelling_reaches_every_backend_as_one_name(monkeypatch):
    """--ep gpu (or CUDA, CUDAExecutionProvider) is cuda for every row: hf ran on the CPU with --ep gpu before."""
    import lm_eval.api.registry

    from ortevals.bench.workload import Work, lm_eval_model

    seen = []
    model = type("Model", (), {"create_from_arg_obj": staticmethod(lambda args: seen.append(args))})
    monkeypatch.setattr(lm_eval.api.registry, "get_model", lambda name: model)
    for spelling in ("gpu", "CUDA", "CUDAExecutionProvider"):
        work = Work.of(BenchOptions(ep=spelling))
        lm_eval_model("hf", "/m", "", work.ep)
        assert work.ep == "cuda" and seen[-1]["device"] == "cuda:0"


def test_the_hf_row_runs_in_the_dtype_lm_eval_would_use(tiny, tmp_path):
    """lm-eval's hf default is dtype=auto, the checkpoint's own (here bfloat16): the row ran float32 whatever the
    checkpoint said, so an fp16 package was compared with fp32 PyTorch. A row's own dtype= still wins."""
    import shutil

    import torch
    from lm_eval.models.huggingface import HFLM

    from ortevals.bench.workload import lm_eval_model

    folder = tmp_path / "bf16"
    shutil.copytree(tiny[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    as_lm_eval = HFLM(pretrained=str(folder), device="cpu").model.dtype  # lm-eval's own defaults
    assert as_lm_eval == torch.bfloat16
    assert lm_eval_model("hf", str(folder), "", None).model.dtype == as_lm_eval
    assert lm_eval_model("hf", str(folder), "dtype=float32", None).model.dtype == torch.float32


def test_the_python_api_refuses_the_same_inputs_before_any_run(tmp_path, no_run):
    import ortevals.bench
    from ortevals.errors import OrtEvalsError

    pkg = fake_package(tmp_path / "p")
    with pytest.raises(OrtEvalsError, match="--ref nosuch: not among the rows"):
        ortevals.bench.run(pkgs=(str(pkg),), ref="nosuch")


# ---- one process, watched ------------------------------------------------------------------------------------------

CHILD = """
import sys, time
x = b"x" * (200 * 2**20)  # 200 MiB written: resident
print("Building contexts:  50%|#    | 1/2 [00:00<00:00]", file=sys.stderr, flush=True)
time.sleep(0.6)
print("Running loglikelihood requests:   0%|     | 0/4 [00:00<?]", end="\\r", file=sys.stderr, flush=True)
print("Running loglikelihood requests:  25%|#    | 1/4 [00:00<00:01]", end="\\r", file=sys.stderr, flush=True)
time.sleep(0.3)
print("done")
"""


def test_watch_times_launch_to_exit_peak_memory_and_the_first_result():
    w = watch([sys.executable, "-c", CHILD], {"PATH": "/usr/bin:/bin"})
    assert w.exit_code == 0 and w.stdout == "done\n" and not w.timed_out
    assert w.peak_rss_mib >= 200
    assert 0.6 <= w.first_result_s < w.wall_s and w.wall_s >= 0.9
    assert scoring_bar("ortevals:  70%|███████   | 12/20 questions [00:35<00:14]") == (12, 20)
    assert scoring_bar("Building contexts:  50%|#    | 1/2 [00:00<00:00]") is None


def test_watch_kills_a_run_at_its_timeout():
    w = watch([sys.executable, "-c", "import time; time.sleep(60)"], {"PATH": "/usr/bin:/bin"}, timeout=1.0)
    assert w.timed_out and w.wall_s < 20 and w.failure(1.0) == "timed out after 1 s"


CUT_SHORT = {  # real bars, drawn by the libraries that draw them in a row's process, then a hang
    "ortevals": "from ortevals.run.progress import Progress\n"
                "p = Progress([(1, 2, q) for q in range(200)], units=list(range(200)))\n"
                "for i in range(91): p.done(i)\n"
                "p.bar.refresh()\n",
    "lm-eval": "from tqdm import tqdm\n"
               "bar = tqdm(total=200, desc='Running loglikelihood requests', mininterval=0)\n"
               "bar.update(91)\n",
}


@pytest.mark.parametrize("bar", sorted(CUT_SHORT))
def test_a_run_cut_at_its_timeout_says_how_far_its_progress_bar_got(bar):
    """On the H200 a row cut at its time-out after 91 of 200 questions kept nothing but the time-out; its one
    line now says where its last scoring bar stood (ortevals' own bar, and a tqdm bar as lm-eval's backends draw)."""
    code = CUT_SHORT[bar] + "import sys, time\nsys.stderr.flush()\ntime.sleep(60)\n"
    w = watch([sys.executable, "-c", code], dict(os.environ), timeout=8.0)
    assert w.timed_out and w.last_bar == (91, 200)
    assert w.failure(8.0) == "timed out after 8 s, its progress bar at 91/200"


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, whatever this process inherited."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("to", ["process", "another thread"])
def test_ctrl_c_while_a_run_is_watched_ends_its_process(tmp_path, to, python_ctrl_c):
    """The child runs in a session of its own (so a time-out kills its whole group), which Ctrl-C at the terminal
    does not reach: watch ends it before the interrupt goes on (a bench interrupted left hf running before). The
    kernel may hand the signal to any thread of the process: a main thread blocked in wait4 then slept on to the
    child's end (60 s); here it is sent to another thread on purpose. Python's own Ctrl-C handler is installed for
    the test: a suite started in the background (``cmd &``) inherits SIGINT ignored."""
    import os
    import signal
    import threading

    pid_file = tmp_path / "pid"
    start = time.perf_counter()
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    if to == "process":
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:  # a thread of this process takes the signal: Python's handler still runs in the main thread
        other = threading.Thread(target=time.sleep, args=(3,), daemon=True)
        other.start()
        threading.Timer(1.0, lambda: signal.pthread_kill(other.ident, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        watch([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"})
    assert time.perf_counter() - start < 30
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


class FakeNvml:
    """pynvml as the parent sees it on a GPU: the device's used memory and the processes on it, each reading the
    next of ``used`` MiB (then the last); ``per_process``: False where NVML refuses per-process queries."""

    def __init__(self, used: list[int], per_process: bool = True, pid: int | None = None):
        self.used, self.per_process, self.pid, self.calls = used, per_process, pid, 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def _mib(self) -> int:
        value = self.used[min(self.calls, len(self.used) - 1)]
        return value * 2**20

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.calls += 1
        return type("Memory", (), {"used": self._mib(), "total": 80 * 2**30})()

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if not self.per_process:
            raise RuntimeError("not supported in this VM")
        child = os.listdir(f"/proc/{os.getpid()}/task")  # the watched process: this process's newest child
        pids = [int(c) for tid in child for c in Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text().split()]
        return [type("Proc", (), {"pid": max(pids), "usedGpuMemory": self._mib()})()] if pids else []


SLEEP = [sys.executable, "-c", "import time; time.sleep(0.8)"]


def test_watch_samples_the_childs_peak_device_memory_from_the_parent(monkeypatch):
    """NVML's count for the watched process, its peak over the run; the device's used memory less what was used at
    the start where per-process queries are refused; nothing (``n/a`` in the table) without NVML."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([100, 100, 700, 300]))
    w = watch(SLEEP, {"PATH": "/usr/bin:/bin"})
    assert (w.device_mib, w.device_source) == (700, "nvml-process")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([100, 100, 400, 250], per_process=False))
    w = watch(SLEEP, {"PATH": "/usr/bin:/bin"})
    assert (w.device_mib, w.device_source) == (400 - 100, "nvml-device-delta")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    w = watch(SLEEP, {"PATH": "/usr/bin:/bin"})
    assert (w.device_mib, w.device_source) == (None, None)


def test_a_rows_device_memory_is_the_median_of_its_runs_or_na(tmp_path):
    from ortevals.bench.write import cells

    ref, run, _, _ = hand_made(tmp_path)
    bench = plan_module.Plan((plan_module.RowSpec("a", "ortevals", str(run)),
                              plan_module.RowSpec("b", "onnxruntime-genai", str(run))), "a", "requests")
    sampled = [Watched(0, 5.0, 100.0, None, False, "", (), mib, "nvml-process") for mib in (900, 500, 700)]
    records = {"a": [RunRecord("a", k, ref, w, None) for k, w in enumerate(sampled, 1)],
               "b": [RunRecord("b", 1, run, watched(5.0), None)]}
    a, b = table_rows(bench, records, "requests")
    assert (a.device_mib, a.device_source) == (700, "nvml-process")
    assert (b.device_mib, b.device_source) == (None, None)
    assert cells(a)[8] == "700" and cells(b)[8] == "n/a"


def test_mfu_of_an_ortevals_row_from_its_engine_time_and_the_packages_weights(tmp_path, tiny_pkg):
    """--peak-tflops: 2 x the matrix weights (the decoder's initializers but its rotary caches, less the gathered
    embedding table) x the tokens run over the seconds in the engine, against the peak; rows without engine figures
    get none."""
    import onnx

    from ortevals.bench.rows import mfu

    (tmp_path / "results.json").write_text(json.dumps({"efficiency": {"overall": {
        "prefill_tokens": 3000, "prefill_s": 1.5, "decode_tokens": 200, "decode_s": 0.5}}}))
    config = json.loads((tiny_pkg / "genai_config.json").read_text())["model"]
    decoder = onnx.load(str(tiny_pkg / config["decoder"]["filename"]))
    rotary = {n.input[i] for n in decoder.graph.node if n.op_type == "GroupQueryAttention" for i in (7, 8)}
    assert rotary  # the cos/sin caches are tables, not weights
    weights = sum(int(np.prod(i.dims)) for i in decoder.graph.initializer if i.name not in rotary)
    matrix = weights - config["vocab_size"] * config["decoder"]["hidden_size"]
    assert mfu(str(tiny_pkg), tmp_path, 1e12) == pytest.approx(2 * matrix * 3200 / 2.0 / 1e12)
    (tmp_path / "results.json").write_text(json.dumps({"results": {}}))  # lm-eval's row: no engine time
    assert mfu(str(tiny_pkg), tmp_path, 1e12) is None
    from ortevals.errors import OrtEvalsError

    with pytest.raises(OrtEvalsError, match=r"^--peak-tflops 0: expected the device's peak TFLOP/s > 0"):
        plan(BenchOptions(pkgs=(str(tiny_pkg),), peak_tflops=0))


# ---- end to end on the tiny package ---------------------------------------------------------------------------------


def test_bench_end_to_end_on_the_tiny_package(tiny, tmp_path):
    """Four processes: ortevals twice (the second without prefix reuse), lm-eval hf (the reference: PyTorch on the
    same weights) and lm-eval onnxruntime-genai on its first 2 questions; every answer equal, log-likelihoods
    within float32 rounding of PyTorch's, requests counted from the data itself."""
    hf, pkg = tiny
    out = tmp_path / "bench"
    # the tiny model's context is 1024 tokens and a 5-shot prompt is longer: ortevals keeps the last 1024 as lm-eval
    # hf does (tests/test_compare.py); lm-eval's onnxruntime-genai cuts its own way, so only its counts are checked
    fit = "max_length=1024,truncate=left"
    args = ["--pkg", f"{pkg}:{fit}", "--pkg", f"plain={pkg}:{fit},prefix_cache=false", "--hf", f"{hf}:max_length=1024",
            "--backends", "ortevals,hf,onnxruntime-genai", "--limit", "3", "--peer-limit", "2", "--output", str(out),
            "--peak-tflops", "0.5"]
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 0, result.output
    body = json.loads((out / "bench.json").read_text())
    first, plain, ref, og = body["rows"]
    assert [r["label"] for r in body["rows"]] == [f"ortevals {pkg.name} [{fit}]", "plain",
                                                  f"hf {hf.name} [max_length=1024]", f"onnxruntime-genai {pkg.name}"]
    assert body["reference"] == ref["label"] and all(r["status"] == "ok" for r in body["rows"])
    options = pq.read_table(BUNDLED / "mmlu_pro" / "data" / "test-00000-of-00001.parquet").column("options")
    choices = [len(o) for o in options.to_pylist()]
    assert [(r["questions"], r["requests"]) for r in body["rows"]] == [(3, sum(choices[:3]))] * 3 + [
        (2, sum(choices[:2]))]
    for row in (first, plain):
        assert row["paired"]["n"] == 3 and row["paired"]["flips"]["answer_changes"] == 0
        assert row["paired"]["max_abs_dll"] < 1e-4 and row["paired"]["choice_kl"] < 1e-8
    assert og["paired"]["n"] == 2
    assert ref["paired"] is None and ref["x_ref"] == 1.0 and all(r["wall_s"] > 0 for r in body["rows"])
    assert first["mfu"] > 0 and plain["mfu"] > 0 and ref["mfu"] is None and og["mfu"] is None  # ortevals rows only
    assert "MFU (2 x the matrix weights" in result.output and "--peak-tflops 0.5" in body["command"]
    if importlib.util.find_spec("pynvml") is None:  # no NVML here: nothing measured device memory on the CPU
        assert all(r["device_mib"] is None and r["device_source"] is None for r in body["rows"])
        assert "device MiB n/a" in result.output
    md = (out / "bench.md").read_text()
    assert md.startswith("`ortevals bench --pkg") and (out / "bench.png").stat().st_size > 1000
    assert (out / "runs").is_dir() and not (out / "cache").exists()


# ---- bench.png ------------------------------------------------------------------------------------------------------


def ok_row(label: str, rate: float, backend: str = "ortevals"):
    from ortevals.bench.rows import Row
    from ortevals.report import stats

    return Row(label=label, backend=backend, target="/p", args="", cache=None, status="ok", note="", is_ref=False,
               runs=1, rate=rate, accuracy=stats.wilson(3, 10))


@pytest.mark.parametrize("rates", [(3.0, 6.0), (50.0, 120.0, 250.0), (4.53, 5.3), (0.108, 4.53, 0.591), (0.012, 3.1e3)],
                         ids=["twofold", "fivefold", "narrow", "docs-table", "five-decades"])
def test_bench_png_log_axis_labels_never_overlap(monkeypatch, rates):
    """bench.png's rate axis (log scale): matplotlib labelled every minor tick of a range under a decade or two, and
    the labels ran into one string; checked as drawn, by matplotlib's renderer, before it becomes a PNG."""
    from ortevals.bench import write
    from tests.test_trial3_report import overlaps_as_drawn

    seen = overlaps_as_drawn(monkeypatch, write)
    write.plot([ok_row(f"row {i}", r) for i, r in enumerate(rates)], "requests")
    assert seen == [[]]


# ---- the exit code: failed rows, Ctrl-C -----------------------------------------------------------------------------


def test_a_failed_or_cut_row_exits_1_with_the_table_written(tmp_path):
    """Every row failing (a folder with an empty genai_config.json: the row's own ortevals command refuses it), or
    cut at --timeout, exited 0 before; now 1, the table printed and written, the row saying why."""
    pkg = fake_package(tmp_path / "p")
    for extra, why in ((["--timeout", "120"], "genai_config.json"), (["--timeout", "0.2"], "timed out after 0.2 s")):
        out = tmp_path / f"out{len(why)}"
        result = CliRunner().invoke(cli, ["bench", "--pkg", str(pkg), "--cache", "cold", "--limit", "1",
                                          "--output", str(out), *extra])
        assert result.exit_code == 1, result.output
        body = json.loads((out / "bench.json").read_text())
        assert [r["status"] for r in body["rows"]] == ["failed"] and why in body["rows"][0]["note"]
        assert f"failed: {body['rows'][0]['note']}" in (out / "bench.md").read_text()
        assert "1 of 1 rows failed (ortevals p (cold)): the table says why" in result.output


def test_ctrl_c_keeps_the_rows_measured_and_exits_130(tmp_path, monkeypatch):
    """Ctrl-C during the second row's run: the first row's figures (from its finished run) are printed and written
    to bench.json and bench.md, marked interrupted; the second row says it has no run; exit 130 (was: nothing)."""
    from ortevals.bench import measure as measure_module

    ref, _, ref_ll, _ = hand_made(tmp_path)
    first, second = fake_package(tmp_path / "p"), fake_package(tmp_path / "q")

    def run(row, name, work, folder, n, timeout):
        if row.target == str(first):
            return RunRecord(row.label, n, ref, watched(8.0), None)
        raise KeyboardInterrupt  # watch() ends the run's process and lets it go on

    monkeypatch.setattr(measure_module, "_run", run)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["bench", "--pkg", str(first), "--pkg", str(second), "--cache", "cold",
                                      "--repeat", "2", "--output", str(out)])
    assert result.exit_code == 130, result.output
    body = json.loads((out / "bench.json").read_text())
    a, b = body["rows"]
    requests = sum(len(x) for x in ref_ll)  # one request per choice
    assert (a["status"], a["runs"], a["requests"]) == ("ok", 1, requests) and a["rate"] == pytest.approx(requests / 8)
    assert (b["status"], b["note"]) == ("interrupted", "no run finished before Ctrl-C")
    said = "Interrupted (Ctrl-C) after 1 of 4 runs: the rows hold the runs that finished"
    assert body["interrupted"].startswith(said) and said in (out / "bench.md").read_text()
    assert said in result.output and "interrupted: no run finished before Ctrl-C" in result.output


def test_lm_eval_onnxruntime_rows_failure_says_its_known_cause(tiny_pkg, tmp_path, capsys):
    """lm-eval's onnxruntime backend on a builder package (the head size a symbolic dim, kv_cache_dim, which it binds
    to 1): the row's process fails at its first request; its one line says the cause, onnxruntime's words after it
    (was: the raw INVALID_ARGUMENT line)."""
    import onnxruntime as ort

    from ortevals.bench.child import main

    config = json.loads((tiny_pkg / "genai_config.json").read_text())["model"]["decoder"]
    key = ort.InferenceSession(str(tiny_pkg / config["filename"])).get_inputs()[2]
    assert key.name.startswith("past_key_values") and key.shape[3] == "kv_cache_dim"  # the cause, in the graph
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"backend": "onnxruntime", "target": str(tiny_pkg), "limit": 1, "args": "",
                                "output": str(tmp_path / "out"), "work": {"tasks": []}}))
    assert main([str(spec)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("Error: lm-eval's onnxruntime backend binds graph dimensions it does not know (the "
                           "builder's kv_cache_dim: the past KV's head size) to 1")
    head = config["head_size"]
    assert line.endswith(f"(onnxruntime: Input 'past_key' dimension 3 should match the packed KV head dimension, "
                         f"got 1 expected {head})")
    assert Watched(1, 1.0, 1.0, None, False, "", (line,)).failure() == line  # the row's note is that line


def test_mfu_is_named_for_the_positions_it_counts_a_batchs_padding_included(tiny_pkg):
    """The engine feeds every pass an all-ones mask, so the pass meter (results.json's prefill tokens, the MFU's
    numerator) counts rows x width: two inputs of 3 and 7 tokens in one pass are 14 positions, 10 real tokens. The
    figure is named for that (was: 'the tokens the engine ran')."""
    from ortevals.bench.write import notes
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    runner = DecoderRunner.open(ModelPackage.load(tiny_pkg), ProviderConfig("cpu"))
    lengths, width = (3, 7), 7
    ids = np.full((2, width), 2, np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = np.arange(5, 5 + n)
    before = runner.meter.counts().prefill_tokens
    runner.forward(ids, np.ones_like(ids))  # as engine/score feeds a right-padded batch
    assert runner.meter.counts().prefill_tokens - before == len(lengths) * width == 14 != sum(lengths)
    row = replace(ok_row("a", 1.0), mfu=0.25)
    machine = {"cores": 2, "load_start": 1.0, "load_end": 1.0}
    said = next(n for n in notes([replace(row, is_ref=True, questions=10)], "requests", machine) if "MFU" in n)
    assert "the positions the engine's passes computed, padding included (a batch's" in said
    assert said.endswith("an upper bound): a 0.25.")
