#!/usr/bin/env python
"""Real sizes, every backend side by side: ortevals against lm-eval ``hf``, ``onnxruntime`` and
``onnxruntime-genai`` on random-weight models with the real configurations, whole process each.

    python scripts/bench_real.py --build                       # the models under bench-data/models (~32 GB)
    python scripts/bench_real.py --limit 20 --out bench-data/real
    python scripts/bench_real.py --report bench-data/real --docs docs/bench-real

Models (``MODELS``; built by scripts/gpu/make_model.py, the same code the GPU kit uses): Qwen3-0.6B (hidden
1024, 28 layers, 16/8 heads, head 128, vocabulary 151,936, tied embeddings), Llama-3.2-1B (hidden 2048, 16
layers, 32/8 heads, vocabulary 128,256) and Gemma-3-1B (hidden 1152, 26 layers, 4/1 heads, head 256,
vocabulary 262,144, five 512-token sliding-window layers to one global), random weights (seed 0) in
float32 for transformers, and the onnxruntime-genai builder's fp32 and int4 CPU packages of the same
weights. The tokenizer is SmolLM2's (the example package's, 49,152 tokens: the bundled data must tokenize
offline), the models' vocabularies the real sizes: the LM head and embedding have the real shapes, only the
ids the tokenizer emits are below 49,152. ``smollm2-135m`` (the example package) is the small end.

Every backend runs lm-eval's ``leaderboard_mmlu_pro`` (5-shot, log-likelihood) on the first ``--limit``
test questions of the bundled data, as its own process, timed from launch to exit, its tree's RSS sampled
(scripts/procwatch.py): ortevals as the ``ortevals mmlu-pro`` command on an empty cache; lm-eval's
``hf`` (PyTorch float32 on the transformers folder, at the largest batch whose logits and log-softmax fit
in half the free memory: ``hf_batch``), ``onnxruntime`` and ``onnxruntime-genai`` through
``lm_eval.simple_evaluate`` in a child process of this script. A backend that fails is recorded with its
message. Answers and per-choice log-likelihoods are compared with hf's (fp32) and with onnxruntime-genai's
on the same package. Raw per-run files go under ``--out`` (git-ignored ``bench-data/``); ``--report``
writes ``table.md``, ``results.json`` (no per-question data) and ``throughput.png`` under ``--docs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from procwatch import Watched

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TASK = "leaderboard_mmlu_pro"
MODELS = {  # name: make_model.py arch, --params (gives the real layer count), the packages built
    "qwen3-0.6b": ("qwen3-0.6b", 5.96e8, ("fp32", "int4")),
    "llama-3.2-1b": ("llama", 1.236e9, ("fp32", "int4")),
    "gemma-3-1b": ("gemma3", 1.0e9, ("fp32",)),
    "smollm2-135m": (None, 1.35e8, ("fp32",)),  # the example package and its transformers folder
}
BACKENDS = ("ortevals", "hf", "onnxruntime", "onnxruntime-genai")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def tokenizer_dir() -> Path:
    from ortevals.package.examples import smollm2_hf_dir

    return smollm2_hf_dir()


def paths(models: Path, name: str, precision: str) -> tuple[Path, Path]:
    """(transformers folder, package folder) of a model."""
    if MODELS[name][0] is None:
        from ortevals.package.examples import smollm2_package

        return tokenizer_dir(), smollm2_package(precision)
    return models / name / "hf", models / name / f"{precision}-cpu"


def build(models: Path, names: list[str]) -> None:
    """make_model.py for each model and precision (a folder already built from the same spec is kept)."""
    for name in names:
        arch, params, precisions = MODELS[name]
        if arch is None:
            paths(models, name, "fp32")
            continue
        for precision in precisions:
            cmd = [sys.executable, str(REPO / "scripts/gpu/make_model.py"), str(models / name), "--arch", arch,
                   "--params", str(params), "--precision", precision, "--ep", "cpu", "--tokenizer",
                   str(tokenizer_dir()), "--init-device", "cpu"]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)


def hf_batch(hf: Path, tokens: int = 1100, share: float = 0.5) -> int:
    """lm-eval hf's largest batch here: each row holds [tokens, V] float32 logits twice (the model's output and
    lm-eval's log-softmax of it) plus its activations; the weights once; within ``share`` of MemAvailable."""
    import psutil

    cfg = json.loads((hf / "config.json").read_text())
    weights = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    per_row = tokens * (2 * cfg["vocab_size"] + 16 * cfg["hidden_size"]) * 4
    return max(1, min(32, int((share * psutil.virtual_memory().available - weights) // per_row)))


def worker(backend: str, target: str, limit: int, dump: Path, batch: int) -> None:
    """One lm-eval backend on the bundled questions, in this process; per-question log-likelihoods to ``dump``."""
    import lm_eval
    from lm_eval.api.registry import get_model

    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro"]
    if backend == "hf":
        lm = get_model("hf")(pretrained=target, device="cpu", dtype="float32", batch_size=batch)
    else:
        lm = get_model(backend)(pretrained=target, execution_provider="cpu")
    res = lm_eval.simple_evaluate(model=lm, tasks=task_specs(preset, resolve_data(preset, "bundled")), limit=limit,
                                  log_samples=True)
    samples = res["samples"][TASK]
    dump.write_text(json.dumps({"accuracy": res["results"][TASK]["acc,none"],
                                "logprobs": {str(s["doc_id"]): [float(r[0][0]) for r in s["resps"]]
                                             for s in samples}}))


def ortevals_logprobs(folder: Path) -> dict:
    """Per-question log-likelihoods, accuracy and prefilled tokens from an ``ortevals --output`` folder."""
    res = json.loads((folder / "results.json").read_text())
    lines = (folder / f"samples_{TASK}.jsonl").read_text().splitlines()
    logprobs = {str(s["doc_id"]): [float(r[0][0]) for r in s["resps"]] for s in map(json.loads, lines)}
    eff = res["efficiency"]["overall"]
    return {"accuracy": res["results"][TASK]["acc,none"], "logprobs": logprobs,
            "prefill_tokens": eff["prefill_tokens"], "prefill_passes": eff["prefill_passes"]}


def run_one(backend: str, name: str, precision: str, args) -> dict:
    """One backend on one model, whole process; its figures (or its failure)."""
    hf, pkg = paths(args.models, name, precision)
    run_dir = args.out / f"{name}-{precision}-{backend}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    batch = hf_batch(hf) if backend == "hf" else 1
    if backend == "ortevals":
        cache = run_dir / "cache"  # empty: no store, no canary verdict, no derived graph
        cache.mkdir()
        env.update(ORTEVALS_CACHE=str(cache), PYTHONPATH=str(args.ortevals_src.resolve()))
        cmd = [sys.executable, "-m", "ortevals.cli", "mmlu-pro", "--pkg", str(pkg), "--data", "bundled",
               "--limit", str(args.limit), "--output", str(run_dir / "output"), *args.ortevals_args.split()]
    else:
        cmd = [sys.executable, __file__, "--worker", backend, "--target", str(hf if backend == "hf" else pkg),
               "--limit", str(args.limit), "--dump", str(run_dir / "logprobs.json"), "--batch", str(batch)]
    print(f"{name} {precision} {backend}: {' '.join(cmd)}", flush=True)
    w = Watched(cmd, env, args.every)
    out = {"model": name, "precision": precision, "backend": backend, "wall_s": w.wall, "exit": w.code,
           "peak_rss_mib": w.peak_mib, "limit": args.limit, "batch": batch if backend == "hf" else None}
    (run_dir / "stdout.txt").write_text(w.out)
    (run_dir / "stderr_tail.txt").write_text("\n".join(w.tail) + "\n")
    try:
        got = ortevals_logprobs(run_dir / "output") if backend == "ortevals" else \
            json.loads((run_dir / "logprobs.json").read_text())
    except (OSError, KeyError, ValueError):
        out["failed"] = w.failure()
        print(f"  failed (exit {w.code}, {w.wall:.0f} s): {out['failed']}", flush=True)
        return out
    out.update(got, questions=len(got["logprobs"]), requests=sum(len(v) for v in got["logprobs"].values()))
    out["requests_per_s"] = out["requests"] / w.wall
    print(f"  {out['requests']} requests in {w.wall:.1f} s ({out['requests_per_s']:.2f} req/s), peak RSS "
          f"{w.peak_mib:.0f} MiB, acc {got['accuracy']:.3f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=REPO / "bench-data" / "models")
    p.add_argument("--only", default=",".join(MODELS), help="models, comma-separated (MODELS' names)")
    p.add_argument("--precisions", default="fp32,int4")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--every", type=float, default=0.5, help="seconds between RSS samples")
    p.add_argument("--ortevals-args", default="", help="more `ortevals mmlu-pro` flags, space-separated")
    p.add_argument("--ortevals-src", type=Path, default=REPO,
                   help="the ortevals checkout the ortevals backend runs from (default: this one)")
    p.add_argument("--out", type=Path, default=REPO / "bench-data" / "real")
    p.add_argument("--build", action="store_true", help="build the models (make_model.py), then stop")
    p.add_argument("--report", type=Path, default=None, help="a finished --out folder: write the table and plot")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "bench-real")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in MODELS] + [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"error: unknown model or backend: {', '.join(unknown)} (models: {', '.join(MODELS)}; "
                         f"backends: {', '.join(BACKENDS)})")
    if args.worker:
        return worker(args.worker, args.target, args.limit, args.dump, args.batch)
    if args.build:
        return build(args.models, names)
    if args.report:
        from bench_real_report import report

        return report(args.report, args.docs)
    run_all(args, names)


def run_all(args, names: list[str]) -> None:
    """Every asked backend on every asked model and precision; each run's ``run.json`` (with its per-question
    log-likelihoods) under ``--out``, the invocation's settings in each. Comparisons are the report's."""
    from bench_flops import matmul_peak

    args.out.mkdir(parents=True, exist_ok=True)
    src = args.ortevals_src.resolve()
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    meta = {"limit": args.limit, "cores": os.cpu_count(), "peak_fp32_gflops": matmul_peak(),
            "ortevals_args": args.ortevals_args, "ortevals_src": str(src), "ortevals_commit": commit.stdout.strip()}
    print(f"onnxruntime fp32 MatMul peak: {meta['peak_fp32_gflops']:.1f} GFLOP/s", flush=True)
    for name in names:
        precisions = [q for q in MODELS[name][2] if q in args.precisions.split(",")]
        for precision in precisions:
            for backend in args.backends.split(","):
                if backend == "hf" and precision != precisions[0]:
                    continue  # hf runs the float32 weights once per model
                r = {**run_one(backend, name, precision, args), "invocation": meta}
                (args.out / f"{name}-{precision}-{backend}" / "run.json").write_text(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
