#!/usr/bin/env python
"""Where an ``ortevals mmlu-pro`` run's time goes: cProfile plus onnxruntime's profiler, in one process.

    python scripts/profile_split.py --pkg PKG --limit 30 --out bench-data/profile/smollm2
    python scripts/profile_split.py --example --limit 30 --out bench-data/profile/smollm2 -- --no-resume

Runs the ``ortevals`` command in this process (a fresh ``$ORTEVALS_CACHE`` under ``--out`` unless
``--cache`` names one: no stored answers) with onnxruntime's profiler on every session it opens
(scripts/gpu/ortprofile.py) and cProfile around it, then splits the time:

* the process: start-up, inside ``session.run``, the rest (Python, numpy, tokenizing, lm-eval);
* inside onnxruntime, by kind of node: the body's MatMul / MatMulNBits (with their FLOPs from the traced
  shapes and the GFLOP/s they reached), the LM head (its GFLOP too: the derived graph applies it only at the
  scored positions), attention (GroupQueryAttention), norms, the rest by op;
* the machine's fp32 MatMul peak measured in the same process (one MatMul [256, hidden] x [hidden, 4 hidden])
  and, for MatMulNBits, an int4 MatMulNBits peak of the same shape and accuracy level.

With ``--threads 1`` (the default) every figure is also in CPU seconds: onnxruntime then computes on the
calling thread, so each node kind's share of the profiled node time times that thread's CPU seconds inside
``session.run`` is its CPU time, and the peaks are measured the same way: a shared machine's other processes
stretch the wall clock, not these. ``--threads 2`` gives the wall-clock split (on a quiet machine).

Writes ``split.json`` and ``split.md`` under ``--out`` (and the raw traces, ``cprofile.prof``). The first
pass of each shape class is included: profile more questions to dilute it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts"), str(REPO / "scripts" / "gpu")]

KINDS = (("lm_head", ("/lm_head/",)), ("attention", ("GroupQueryAttention", "MultiHeadAttention", "Attention")),
         ("norms", ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
                    "SkipLayerNormalization", "RMSNormalization")),
         ("matmul", ("MatMul", "MatMulNBits", "Gemm", "FusedMatMul")))


def kind_of(name: str, op: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys if k.startswith("/")) or op in keys:
            return kind
    return "other:" + op


def _dims(shapes: list) -> list[list[int]]:
    """onnxruntime's ``input_type_shape`` / ``output_type_shape``: [{"float": [1, 3, 64]}, …] → [[1, 3, 64], …]."""
    return [next(iter(s.values())) if s else [] for s in shapes]


def matmul_flops(op: str, args: dict) -> float:
    """2·M·K·N of a MatMul-like node from its traced shapes (the output gives N, the first input K)."""
    ins, outs = _dims(args.get("input_type_shape", [])), _dims(args.get("output_type_shape", []))
    if not ins or not outs or not ins[0] or not outs[0]:
        return 0.0
    a, y = ins[0], outs[0]
    m = 1
    for d in y[:-1]:
        m *= d
    return 2.0 * m * a[-1] * y[-1]


def attention_flops(args: dict) -> float:
    """QKᵀ and softmax·V of a GroupQueryAttention node from its traced shapes: each of the S new tokens of the
    B rows attends (causally) to the P past tokens and the new ones up to itself, in every head:
    4·B·S·(H·D)·(P + (S+1)/2), H·D the output's width, P the past key's length."""
    ins, outs = _dims(args.get("input_type_shape", [])), _dims(args.get("output_type_shape", []))
    past = next((d for d in ins if len(d) == 4), None)  # the trace leaves out absent optional inputs
    if past is None or not outs or len(outs[0]) != 3:
        return 0.0
    b, s, width = outs[0]
    return 4.0 * b * s * width * (past[2] + (s + 1) / 2)


def split_traces(files: list[Path]) -> dict:
    """Node seconds by kind and op, MatMul FLOPs, session runs, from onnxruntime's JSON traces."""
    runs = run_us = 0
    by_kind: Counter = Counter()
    by_op: Counter = Counter()
    flops: Counter = Counter()
    per_kind_ops: dict[str, Counter] = defaultdict(Counter)
    for f in files:
        for e in json.loads(Path(f).read_text()):
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                runs += 1
                run_us += e["dur"]
            elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                args = e.get("args", {})
                op, name = args.get("op_name", "?"), e["name"][: -len("_kernel_time")]
                kind = kind_of(name, op)
                by_kind[kind] += e["dur"]
                by_op[op] += e["dur"]
                per_kind_ops[kind][op] += e["dur"]
                if kind in ("matmul", "lm_head"):
                    flops[kind] += matmul_flops(op, args)
                elif op == "GroupQueryAttention":
                    flops[kind] += attention_flops(args)
    s = 1e-6
    nodes = sum(by_kind.values())
    return {"session_runs": runs, "inside_run_s": run_us * s, "nodes_s": nodes * s,
            "by_kind_s": {k: v * s for k, v in by_kind.most_common()},
            "by_op_s": {k: v * s for k, v in by_op.most_common(15)},
            "gflop": {k: v / 1e9 for k, v in flops.items()},
            "gflops_rate": {k: flops[k] / 1e9 / (by_kind[k] * s) for k in flops if by_kind[k]},
            "ops_in_kind": {k: dict(c) for k, c in per_kind_ops.items()}}


def fp32_session(m: int, k: int, n: int, threads: int):
    """An onnxruntime session of one fp32 MatMul [m,k]x[k,n] (random weights)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w])
    return _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), threads)


def nbits_session(k: int, n: int, m: int, threads: int, accuracy_level: int = 4, block: int = 32):
    """One int4 MatMulNBits [m,k]x[k,n] (random packed weights), as the builder writes it for CPU."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    blocks = (k + block - 1) // block
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.integers(0, 255, (n, blocks, block // 2), dtype=np.uint8), "w")
    sc = numpy_helper.from_array(rng.uniform(0.001, 0.01, (n * blocks,)).astype(np.float32), "s")
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "nb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w, sc])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return _session(helper.make_model(graph, opset_imports=opsets, ir_version=8), threads)


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def cpu_peak(make, m: int, k: int, n: int, threads: int, seconds: float = 3.0) -> float:
    """GFLOP/s of ``make()``'s one-node session on [m,k] inputs: by the calling thread's CPU seconds with one
    thread (what other processes do not inflate), else by wall seconds."""
    import numpy as np

    sess = make()
    x = {"x": np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)}
    for _ in range(3):
        sess.run(None, x)
    clock = time.thread_time if threads == 1 else time.perf_counter
    runs, start, wall = 0, clock(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        sess.run(None, x)
        runs += 1
    return 2.0 * m * k * n * runs / (clock() - start) / 1e9


def stub_engine() -> None:
    """PrefillEngine.score plans as score_batched does (groups, shared prefixes), then reports made-up scores."""
    from ortevals.engine.score import prefill
    from ortevals.engine.score.scoring import Score

    def score(self, requests, on_done=None):
        groups = prefill.plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        prefill.plan_prefixes([g.tokens for g in groups], [2] * len(groups), self.settings.prefix_min_saving)
        out = []
        for i, r in enumerate(requests):
            out.append(Score(-1.0 - (hash(r.continuation) % 97) / 10, False))
            if on_done is not None:
                on_done(i, out[-1])
        return out

    prefill.PrefillEngine.score = score


def count_runs() -> dict:
    """Wrap ``InferenceSession.run`` / ``run_with_iobinding`` (after ortprofile.enable): calls, wall seconds, and
    CPU seconds of the calling thread (all of onnxruntime's work with one intra-op thread) and of the process."""
    import onnxruntime as ort

    totals = {"calls": 0, "wall_s": 0.0, "thread_cpu_s": 0.0, "process_cpu_s": 0.0}
    cls = ort.InferenceSession
    for name in ("run", "run_with_iobinding"):
        inner = getattr(cls, name)

        def timed(self, *a, _inner=inner, **k):
            w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
            try:
                return _inner(self, *a, **k)
            finally:
                totals["calls"] += 1
                totals["wall_s"] += time.perf_counter() - w
                totals["thread_cpu_s"] += time.thread_time() - t
                totals["process_cpu_s"] += time.process_time() - p

        setattr(cls, name, timed)
    return totals


def cprofile_split(prof: Path) -> dict:
    """Seconds in session.run (cProfile's view) and the heaviest Python functions outside it."""
    st = pstats.Stats(str(prof))
    total = max(v[3] for v in st.stats.values())
    runs = [(k, v) for k, v in st.stats.items() if "run_with_iobinding" in k[2] or
            k[2].endswith("onnxruntime_pybind11_state.run>")]
    run = sum(v[3] for _, v in runs)
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in st.stats.items()
                  if "onnxruntime_pybind11_state" not in k[2]), reverse=True)[:12]
    return {"process_s": total, "session_run_s": run, "outside_run_s": total - run,
            "top_self_s": {name: t for t, name in top}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pkg")
    p.add_argument("--example", action="store_true")
    p.add_argument("--limit", type=int, default=30, help="the first N test questions (0: all)")
    p.add_argument("--data", default="bundled")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1: each node's share times the calling thread's CPU seconds is its CPU "
                        "time, which other processes on a shared machine do not inflate)")
    p.add_argument("--stub-scores", action="store_true",
                   help="no model passes: the engine plans its groups and shared prefixes as it would, then reports "
                        "made-up scores; what is left is everything else a run does at this scale (lm-eval, "
                        "tokenizing, the plan, the store, metrics, samples, the report)")
    p.add_argument("--cache", default=None, help="ORTEVALS_CACHE to use (default: a fresh one under --out)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("extra", nargs="*", help="more ortevals mmlu-pro arguments (after --)")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    traces = out / "traces"
    traces.mkdir(exist_ok=True)
    for old in traces.glob("*.json"):
        old.unlink()
    cache = Path(args.cache) if args.cache else out / "cache"
    if args.example and not args.cache:  # the example package from the usual cache, linked into the fresh one
        from ortevals.package.examples import smollm2_package

        source = smollm2_package("fp32")
        (cache / "examples").mkdir(parents=True, exist_ok=True)
        link = cache / "examples" / source.name
        if not link.exists():
            link.symlink_to(source)
    os.environ.update(ORTEVALS_CACHE=str(cache), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    from ortprofile import enable

    sessions = enable(traces)
    runs = count_runs()
    if args.stub_scores:
        stub_engine()
    from ortevals.cli import cli

    target = ["--example"] if args.example else ["--pkg", args.pkg]
    argv = ["mmlu-pro", *target, *(["--limit", str(args.limit)] if args.limit > 0 else []), "--data", args.data,
            "--output", str(out / "run"),
            "--threads", str(args.threads), *args.extra]
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    try:
        cli.main(argv, prog_name="ortevals", standalone_mode=False)
    finally:
        prof.disable()
    wall = time.perf_counter() - start
    for sess in sessions:
        sess.end_profiling()
    prof.dump_stats(str(out / "cprofile.prof"))
    report = finish(out, traces, wall, args, runs)
    (out / "split.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "split.md").write_text(table(report) + "\n")
    print(table(report))


def finish(out: Path, traces: Path, wall: float, args, runs: dict) -> dict:
    report = {"wall_s": wall, "limit": args.limit, "threads": args.threads, "runs": runs,
              "cprofile": cprofile_split(out / "cprofile.prof"), "ort": split_traces(sorted(traces.glob("*.json")))}
    cfg = json.loads((Path(args.pkg or cache_pkg(out)) / "genai_config.json").read_text())["model"]
    hidden = cfg["decoder"]["hidden_size"]
    quantized = "MatMulNBits" in report["ort"]["ops_in_kind"].get("matmul", {})
    report["peak_fp32_gflops"] = cpu_peak(lambda: fp32_session(256, hidden, 4 * hidden, args.threads),
                                          256, hidden, 4 * hidden, args.threads)
    if quantized:
        report["peak_int4_gflops"] = cpu_peak(lambda: nbits_session(hidden, 4 * hidden, 256, threads=args.threads),
                                              256, hidden, 4 * hidden, args.threads)
    o, cpu = report["ort"], runs["thread_cpu_s"] if args.threads == 1 else None
    if cpu:  # CPU seconds per kind: its share of the node time times the thread's CPU seconds in session.run
        o["cpu_s"] = {k: v / o["nodes_s"] * cpu for k, v in o["by_kind_s"].items()}
        o["cpu_gflops"] = {k: o["gflop"][k] / o["cpu_s"][k] for k in o["gflop"] if o["cpu_s"].get(k)}
    return report


def cache_pkg(out: Path) -> Path:
    return next((out / "cache" / "examples").iterdir())


def table(r: dict) -> str:
    o, c = r["ort"], r["cprofile"]
    u = r["runs"]
    clock = "CPU" if r["threads"] == 1 else "wall"
    lines = [f"process {r['wall_s']:.1f} s (cProfile {c['process_s']:.1f} s): session.run {u['wall_s']:.1f} s wall "
             f"({u['calls']} calls, {u['thread_cpu_s']:.1f} s CPU on the calling thread, {u['process_cpu_s']:.1f} s "
             f"process CPU), outside {c['outside_run_s']:.1f} s; {r['threads']} intra-op thread(s)",
             f"fp32 MatMul peak {r['peak_fp32_gflops']:.1f} GFLOP/s ({clock})"
             + (f", int4 MatMulNBits peak {r['peak_int4_gflops']:.1f} GFLOP/s" if "peak_int4_gflops" in r else ""),
             "", f"| node kind | share of node time | {clock} s | GFLOP | GFLOP/s ({clock}) |",
             "|---|---:|---:|---:|---:|"]
    for kind, s in o["by_kind_s"].items():
        if s / o["nodes_s"] < 0.001:
            continue
        secs = o["cpu_s"][kind] if "cpu_s" in o else s
        g = o["gflop"].get(kind)
        rate = o["cpu_gflops"].get(kind) if "cpu_gflops" in o else o["gflops_rate"].get(kind)
        lines.append(f"| {kind} | {s / o['nodes_s']:.1%} | {secs:.2f} | {g:.1f} | {rate:.1f} |" if g else
                     f"| {kind} | {s / o['nodes_s']:.1%} | {secs:.2f} | | |")
    lines += ["", "heaviest Python (self seconds, outside onnxruntime):"]
    lines += [f"  {t:7.2f}  {name}" for name, t in list(c["top_self_s"].items())[:8]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
