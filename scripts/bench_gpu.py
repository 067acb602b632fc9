#!/usr/bin/env python
"""The GPU benchmark: models of real architectures built where they run, then ``ortevals bench`` on each.

For each model (``--models ARCH:PARAMS:PRECISION,…``) scripts/gpu/make_model.py writes a transformers
checkpoint with random weights and the onnxruntime-genai builder's package of the same weights (nothing
large travels). Then, through ``ortevals.bench.run`` (docs/bench.md: every row its own process, timed from
launch to exit, peak device memory from NVML), each in its own folder under ``--out``:

* ``NAME/``: MMLU-Pro 5-shot log-likelihood: ortevals (one row a ``--row``), lm-eval ``hf`` in the package's
  precision (``batch_size=auto`` on CUDA) as the reference, lm-eval ``onnxruntime-genai`` and ``onnxruntime``
  on ``--peer-limit`` questions; MFU against the device's fp16 peak;
* ``NAME-generator/`` (``--generator N``): ortevals against onnxruntime-genai's own Generator on the same
  package and device (ortevals' ``path=incremental``, the reference): same answers, max |Δ log-likelihood|;
* ``NAME-cot/`` (``--cot K``): chain-of-thought MMLU-Pro, K samples a question, generated tokens/s;
* ``NAME-profile/`` (``--profile N``): onnxruntime's profiler on ortevals (scripts/gpu/ortprofile.py).

``OUT/results.md`` gathers the tables under the device and the versions; it is rewritten after each step,
so a run cut short keeps what finished.

    python scripts/bench_gpu.py --models qwen3:1.5e9:fp16,qwen3:1.5e9:int4 --limit 500 --generator 50
    python scripts/bench_gpu.py --models qwen3:1.5e9:fp16 --row batched=shared_prefix_batch=on \\
        --row batch1=shared_prefix_batch=off --limit 1000
    python scripts/bench_gpu.py --models qwen3:1.5e9:fp16 --limit 0 --cot 16 --cot-questions 8
    python scripts/bench_gpu.py --ep cpu --limit 5 --generator 5 --out /tmp/gpu-bench      # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ortevals.bench import BenchOptions, run  # noqa: E402
from ortevals.bench.devmem import device_info  # noqa: E402
from ortevals.errors import OrtEvalsError  # noqa: E402

PYTHON = [sys.executable, *(["-S"] if sys.flags.no_site else [])]  # children see what this process sees
PEAK_FP16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense fp16/bf16


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def parse_models(text: str) -> list[dict]:
    models = []
    for item in filter(None, text.split(",")):
        try:
            arch, params, precision = item.split(":")
            models.append({"arch": arch, "params": float(params), "precision": precision,
                           "name": f"{arch}-{params}-{precision}"})
        except ValueError:
            fail(f"--models: expected ARCH:PARAMS:PRECISION (e.g. qwen3:1.5e9:fp16), got {item!r}")
    return models


def package_ep(precision: str, ep: str) -> str:
    """The builder's ``-e`` for a package run on ``ep``: fp32 is always built for the CPU (the builder's fp32
    CUDA package is invalid, scripts/gpu/make_model.py FP32_CUDA); ortevals runs it on CUDA only if every
    node has a CUDA kernel there (runtime/placement.py), else its row says which do not."""
    return "cpu" if precision == "fp32" else ep


def hf_dtype(precision: str, ep: str) -> str:
    """hf in the package's precision (the CUDA int4 package computes in float16); float32 on CPU."""
    if ep == "cpu":
        return "float32"
    return {"fp32": "float32", "bf16": "bfloat16"}.get(precision, "float16")


def make_model(m: dict, args) -> dict:
    """Build (or reuse) the model with scripts/gpu/make_model.py: its report, with the folders."""
    out = args.models_dir / f"{m['arch']}-{m['params']:g}"
    cmd = [*PYTHON, str(REPO / "scripts/gpu/make_model.py"), str(out), "--arch", m["arch"], "--params",
           str(m["params"]), "--precision", m["precision"], "--ep", package_ep(m["precision"], args.ep)]
    cmd += ["--hf-only"] if args.build_only == "hf" else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        fail(f"make_model {m['name']} failed: {tail[0]}", 1)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**report, "hf": str(out / "hf"), "pkg": report.get("package")}


def benches(m: dict, built: dict, args) -> dict[str, BenchOptions]:
    """The benchmarks of one model, by folder name."""
    pkg, name = built["pkg"], m["name"]
    rows = tuple(f"{label}={pkg}" + (f":{margs}" if margs else "") for label, margs in args.rows)
    hf_args = f"dtype={hf_dtype(m['precision'], args.ep)},batch_size={'auto' if args.ep == 'cuda' else 8}"
    base = BenchOptions(ep=args.ep, timeout=args.timeout, peak_tflops=args.peak_tflops)
    out = {}
    if args.limit:
        out[name] = replace(base, pkgs=rows, hf=f"hf={built['hf']}:{hf_args}", backends=args.backends,
                            limit=args.limit, peer_limit=args.peer_limit)
    if args.generator:
        out[f"{name}-generator"] = replace(base, pkgs=(rows[0], f"generator={pkg}:path=incremental"),
                                          ref="generator", limit=args.generator)
    if args.cot:
        out[f"{name}-cot"] = replace(base, pkgs=rows[:1], hf=f"hf={built['hf']}:{hf_args}", backends=args.backends,
                                     cot=True, samples=args.cot, max_gen_toks=args.cot_max_gen_toks,
                                     limit=args.cot_questions, peer_limit=args.cot_peer_questions)
    return out


def profile(m: dict, built: dict, args) -> str:
    """onnxruntime's profiler on one ortevals run (scripts/gpu/ortprofile.py): its summary, as Markdown."""
    out = args.out / f"{m['name']}-profile"
    cmd = [*PYTHON, str(REPO / "scripts/gpu/ortprofile.py"), str(out), "--", "mmlu-pro", "--pkg", built["pkg"],
           "--data", "bundled", "--limit", str(args.profile), "--ep", args.ep, "--output", str(out / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
        return f"failed: {tail[0]}"
    return "```\n" + (out / "profile.json").read_text() + "```"


def write(out: Path, sections: list[str], machine: dict) -> None:
    device = machine.get("device", {}).get("name") or "no GPU seen by NVML"
    head = [f"# GPU benchmark: {device}\n", f"Versions: `{json.dumps(machine.get('versions', {}))}`\n"]
    (out / "results.md").write_text("\n".join(head + sections) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    built = {m["name"]: make_model(m, args) for m in args.models}
    if args.build_only:
        return print(json.dumps({n: {k: b.get(k) for k in ("hf", "pkg")} for n, b in built.items()}))
    sections, machine, t0 = [], {"device": device_info()}, time.perf_counter()
    for m in args.models:
        for folder, options in benches(m, built[m["name"]], args).items():
            try:
                result = run(replace(options, output=args.out / folder), progress=print)
            except OrtEvalsError as e:
                sections.append(f"## {folder}\n\nnot run: {e}\n")
                continue
            machine = result.meta["machine"]
            sections.append(f"## {folder}\n\n" + (args.out / folder / "bench.md").read_text())
            write(args.out, sections, machine)
        if args.profile:
            sections.append(f"## {m['name']}: onnxruntime's profiler, {args.profile} questions\n\n"
                            + profile(m, built[m["name"]], args))
    sections.append(f"Whole benchmark: {time.perf_counter() - t0:.0f} s.")
    write(args.out, sections, machine)
    print((args.out / "results.md").read_text())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", default=None, help="ARCH:PARAMS:PRECISION,… (default cuda: qwen3:1.5e9:fp16; "
                                                     "cpu: a tiny llama:1e6:fp32)")
    ap.add_argument("--models-dir", type=Path, default=None, help="where models are built (default: the cache)")
    ap.add_argument("--row", action="append", default=[], metavar="LABEL=K=V,…",
                    help="an ortevals row with these model args (repeatable; default: one row, the defaults)")
    ap.add_argument("--backends", default="ortevals,hf,onnxruntime-genai,onnxruntime",
                    help="ortevals bench's --backends for the MMLU-Pro and CoT benchmarks")
    ap.add_argument("--limit", type=int, default=500, help="MMLU-Pro questions (0: no log-likelihood bench)")
    ap.add_argument("--peer-limit", type=int, default=None, help="questions for lm-eval's ONNX backends "
                                                                  "(default: min(limit, 100))")
    ap.add_argument("--generator", type=int, default=0, metavar="N",
                    help="questions scored against onnxruntime-genai's Generator (0: off)")
    ap.add_argument("--cot", type=int, default=0, metavar="K", help="chain-of-thought samples a question (0: off)")
    ap.add_argument("--cot-questions", type=int, default=4)
    ap.add_argument("--cot-peer-questions", type=int, default=1, help="questions for the ONNX peers in the CoT run")
    ap.add_argument("--cot-max-gen-toks", type=int, default=256)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="onnxruntime's profiler on ortevals, N questions (0: off)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense fp16 peak (default: "
                                                                     "known for H100, H200, A100, L40S)")
    ap.add_argument("--build-only", choices=["hf", "all"], help="only build the models (hf: the checkpoints, "
                                                                 "e.g. in the background before the kit is in)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before a row's run is cut off")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-gpu")
    args = ap.parse_args(argv)
    args.backends = tuple(b for b in args.backends.split(",") if b)
    args.rows = [(label, margs) for label, _, margs in (r.partition("=") for r in args.row)] or [("ortevals", "")]
    if bad := [label for label, _ in args.rows if not label.isidentifier()]:
        ap.error(f"--row: expected LABEL=K=V,… with a name for LABEL, got {bad[0]!r}")
    args.models = parse_models(args.models or ("qwen3:1.5e9:fp16" if args.ep == "cuda" else "llama:1e6:fp32"))
    args.peer_limit = args.peer_limit if args.peer_limit is not None else max(1, min(args.limit, 100))
    if args.peak_tflops is None and args.ep == "cuda":
        name = device_info().get("name") or ""
        args.peak_tflops = next((v for k, v in PEAK_FP16_TFLOPS.items() if k in name), None)
    if args.models_dir is None:
        cache = Path(os.environ.get("ORTEVALS_CACHE") or Path.home() / ".cache" / "ortevals")
        args.models_dir = cache / "gpu-models"
    return args


if __name__ == "__main__":
    main()
