"""Where one K-row decode pass spends its time, with and without cascade (issue 26).

Opens the package's decoder as the sampler does (``InplaceKV``: KV written in place), runs one
prompt of ``--prompt-len`` random tokens, then ``--steps`` decode passes of ``--rows`` rows two ways:
each row on its own copy of the prompt's KV (today's path, ``cascade=off``) and every row on one
shared copy (the cascade decode graph, ``cascade=on``), alternately twice. Prints the median
milliseconds a pass of each, and with ``--ort-profile`` onnxruntime's own per-node profile of both
sessions (kernel time per decode pass, grouped by node with the layer number removed).

    PYTHONPATH=. python scripts/profile_cascade.py --prompt-len 1024 --rows 16 --steps 24 --ort-profile

Run it alone on the machine (``flock`` with the other benchmarks on a shared one).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def open_kv(pkg: str, threads: int, profile_dir: Path | None):
    import ortevals.runtime.opening as opening
    from ortevals.engine.generate.rows.cascade_kv import Cascade, CascadeKV
    from ortevals.engine.generate.rows.kv import CopyKV, InplaceKV
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    if profile_dir is not None:  # onnxruntime's profiler is a SessionOptions switch: wrap the one builder
        build = opening.session_options

        def profiled(settings, model):
            so = build(settings, model)
            so.enable_profiling, so.profile_file_prefix = True, str(profile_dir / "ort")
            return so

        opening.session_options = profiled
    provider = ProviderConfig("cpu", intra_op_threads=threads)
    runner = DecoderRunner.open(ModelPackage.load(pkg), provider)
    cache = Path(tempfile.mkdtemp(prefix="cascade-graph-"))
    kv = CascadeKV(InplaceKV(runner), CopyKV(runner), Cascade("on", functools.partial(runner.cascade, provider, cache)))
    if not kv.ready():
        raise SystemExit(f"the cascade graph is not in use: {kv.refused}")
    return runner, kv


def pass_ms(kv, prompt: np.ndarray, tokens: np.ndarray, shared: bool, prompts: int = 1) -> float:
    """Median milliseconds of a decode pass of ``tokens [rows, steps]`` after ``prompt`` (first two apart);
    shared with ``prompts`` > 1: that many copies of the prompt, each its own group of rows."""
    base = kv.base
    _, past = base.run(prompt[None], base.empty(1, prompt.size + tokens.shape[1] + 1), last=True)
    if shared:
        rows = np.diff(np.linspace(0, tokens.shape[0], prompts + 1).astype(int))
        past = kv.share(past, int(rows[0]), *(x for n in rows[1:] for x in (past, int(n))))
    else:
        past = base.repeat(past, tokens.shape[0])
    holder, times = (kv if shared else base), []
    for s in range(tokens.shape[1]):
        t0 = time.perf_counter()
        _, past = holder.run(tokens[:, s:s + 1], past)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times[2:]))


def per_node(path: str) -> tuple[int, list[tuple[str, str, float]]]:
    """(decode passes, [(op, node with layer numbers removed, kernel ms per decode pass)]) from an onnxruntime
    profile. Decode passes: the session's runs within 0.5-5x of its median run (prompt passes and the
    once-only checks on a short prompt fall outside); only their nodes are counted."""
    events = json.loads(Path(path).read_text())
    runs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    mid = float(np.median([b - a for a, b in runs]))
    decode = [(a, b) for a, b in runs if 0.5 * mid <= b - a <= 5 * mid]
    total = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and any(a <= e["ts"] <= b for a, b in decode):
            name = re.sub(r"layers\.\d+", "layers.N", e["name"].removesuffix("_kernel_time"))
            total[(e["args"]["op_name"], re.sub(r"\d+$", "", name))] += e["dur"]
    return len(decode), [(op, name, us / 1000 / len(decode)) for (op, name), us in total.most_common()]


def main() -> None:
    from bench_samples import model_paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1, help="cascade=on: the rows split among this many prompts")
    ap.add_argument("--ort-profile", action="store_true", help="print onnxruntime's per-node profile of both")
    args = ap.parse_args()
    profile_dir = Path(tempfile.mkdtemp(prefix="cascade-prof-")) if args.ort_profile else None
    runner, kv = open_kv(model_paths(args)[0], args.threads, profile_dir)
    rng = np.random.default_rng(0)
    prompt, tokens = rng.integers(3, 49152, args.prompt_len), rng.integers(3, 49152, (args.rows, args.steps))
    got = {"off": [], "on": []}
    for _ in range(2):
        got["off"].append(pass_ms(kv, prompt, tokens, shared=False))
        got["on"].append(pass_ms(kv, prompt, tokens, shared=True, prompts=args.prompts))
    off, on = min(got["off"]), min(got["on"])
    print(f"prompt {args.prompt_len}, {args.rows} rows: a decode pass takes {off:.1f} ms with each row's own "
          f"prompt copy, {on:.1f} ms on one shared copy (x {off / on:.2f})")
    if profile_dir is not None:
        for label, session in (("cascade=off", runner.decoder), ("cascade=on", kv.runner.decoder)):
            passes, rows = per_node(session.end_profiling())
            print(f"\n{label}: kernel ms per decode pass ({passes} passes; {sum(r[2] for r in rows):.1f} ms in all)")
            for op, name, ms in rows[:20]:
                print(f"  {ms:7.2f}  {op:22s} {name[:90]}")


if __name__ == "__main__":
    main()
