#!/usr/bin/env python
"""GPU benchmark: ortevals, lm-eval ``hf``, ``onnxruntime-genai`` and ``onnxruntime`` side by side, one run.

For each model (``--models arch:params:precision,…``, built where it runs by scripts/gpu/make_model.py:
random weights, a transformers checkpoint for hf and the onnxruntime-genai builder's package of the same
weights) each backend scores ``leaderboard_mmlu_pro`` on the bundled data in its own child process
(scripts/bench_mmlu_pro.score_mmlu_pro): questions, requests/s and model calls/s (seconds inside
``loglikelihood``), peak device memory (NVML, sampled from this parent: nothing is added to the measured
process), peak host RSS, and against hf: same answers and max |Δ log-likelihood|. hf runs in the
package's precision (float32 for fp32, else float16; float32 on CPU) at ``--hf-batch`` (auto on CUDA).

    python scripts/bench_gpu.py --models smollm2:1.35e8:fp32,qwen3:1.5e9:fp16,qwen3:1.5e9:int4 --limit 500
    python scripts/bench_gpu.py --cot-samples 16 --cot-questions 4 --models qwen3:1.5e9:fp16 --backends ortevals
    python scripts/bench_gpu.py --profile --models qwen3:1.5e9:fp16 --limit 0      # profile only
    python scripts/bench_gpu.py --ep cpu --limit 5 --out /tmp/gpu-bench            # the CPU rehearsal (tiny)

``--cot-samples K``: chain-of-thought MMLU-Pro, K samples a question (scripts/bench_samples.py), generated
tokens/s of each backend. ``--profile``: onnxruntime's profiler on ortevals for ``--profile-limit``
questions (scripts/gpu/ortprofile.py): time inside onnxruntime against the host's. Writes ``OUT/results.json``
(after every step, so a run cut short keeps what finished), ``OUT/results.md`` and ``OUT/answers.json.gz``.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts"), str(REPO / "scripts" / "gpu")]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BACKENDS = ("ortevals", "hf", "og", "ort")  # og, ort: lm-eval's onnxruntime-genai and onnxruntime backends
SLOW = ("og", "ort")  # batch 1, a pass per request: run on --og-limit questions
PYTHON = [sys.executable, *(["-S"] if sys.flags.no_site else [])]  # children see what this process sees


# ---- the parent: models, children, comparisons, files ---------------------------------------------------
def run_child(kind: str, spec: dict, timeout: float | None = None) -> dict:
    """One worker in a child process, its peak device memory sampled from here; {"failed": …} on error."""
    from ortevals.bench.devmem import PeakSampler

    cmd = [*PYTHON, __file__, "--worker", kind, "--spec", json.dumps(spec)]
    print(f"== {kind} {spec.get('backend')} {spec.get('model', '')} …", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakSampler(proc.pid) as sampler:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\ntimed out after {timeout:.0f} s"
    line = next((ln for ln in stdout.splitlines() if ln.startswith("BENCH ")), None)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or line is None:
        tail = [ln for ln in (stderr or stdout).splitlines() if ln.strip()][-12:]
        print("  failed:\n    " + "\n    ".join(tail), flush=True)
        return {"failed": tail[-1] if tail else f"exit {proc.returncode}", "child_wall_s": wall,
                **progress_before_cut(stderr or "")}
    return {**json.loads(line[6:]), **sampler.result(), "child_wall_s": wall}


PROGRESS = re.compile(r"(\d+)/(\d+) (questions|requests)? ?\[(?:(\d+):)?(\d+):(\d+)")


def progress_before_cut(stderr: str) -> dict:
    """A child cut short (time-out, crash): how far its last progress bar got, ``{"partial": {"done", "of",
    "unit", "seconds"}}`` (tqdm's elapsed time since the bar started: after loading), or nothing."""
    found = PROGRESS.findall(stderr.replace("\r", "\n"))
    if not found:
        return {}
    done, total, unit, h, m, sec = found[-1]
    return {"partial": {"done": int(done), "of": int(total), "unit": unit or "items",
                        "seconds": int(h or 0) * 3600 + int(m) * 60 + int(sec)}}


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
    """Build (or reuse) the model with scripts/gpu/make_model.py; its report plus the paths."""
    out = args.models_dir / f"{m['arch']}-{m['params']:g}"
    cmd = [*PYTHON, str(REPO / "scripts/gpu/make_model.py"), str(out), "--arch", m["arch"], "--params",
           str(m["params"]), "--precision", m["precision"], "--ep", package_ep(m["precision"], args.ep)]
    cmd += ["--hf-only"] if args.build_only == "hf" else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        fail(f"make_model {m['name']} failed: {tail[0]}", 1)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**report, "make_model_s": time.perf_counter() - t0, "hf": str(out / "hf"), "pkg": report.get("package")}


def compare(r: dict, ref: dict | None) -> dict:
    """Same answers and max |Δ log-likelihood| against hf on the questions both scored; the goal is the
    same answer on at least 99% of them (every flip listed, up to 200)."""
    if ref is None or "answers" not in ref or "answers" not in r:
        return {}
    common = sorted(set(r["answers"]) & set(ref["answers"]))
    delta = max((abs(a - b) for q in common for a, b in zip(r["logprobs"][q], ref["logprobs"][q])), default=None)
    flips = [q for q in common if r["answers"][q] != ref["answers"][q]]
    return {"compared_with_hf": len(common), "same_answers_as_hf": len(common) - len(flips),
            "same_answers_goal_met": bool(common) and len(common) - len(flips) >= 0.99 * len(common),
            "flipped_doc_ids": [int(q) for q in flips][:200], "max_abs_dlogprob_vs_hf": delta}


def rates(r: dict) -> dict:
    s = r.get("seconds") or 0
    return {"requests_per_s": r["requests"] / s if s else None,
            "model_calls_per_s": r["model_calls"] / s if s and r.get("model_calls") is not None else None}


def run_ll(m: dict, built: dict, args, hf_cache: dict) -> dict:
    dtype = hf_dtype(m["precision"], args.ep)
    base = {"model": m["name"], "pkg": built["pkg"], "hf": built["hf"], "ep": args.ep, "hf_dtype": dtype,
            "hf_batch": args.hf_batch, "threads": args.threads, "ortevals_args": args.ortevals_args}
    capture = Path(tempfile.gettempdir()) / f"ortevals-oracle-{os.getpid()}-{m['name']}.json"  # not in --out
    out = {}
    for backend in args.backends:
        limit = args.og_limit if backend in SLOW else args.limit
        key = (built["hf"], dtype, limit)
        if backend == "hf" and key in hf_cache:  # fp16 and int4 of one model share the fp16 hf run
            out[backend] = {**hf_cache[key], "reused_from": hf_cache[key]["model"]}
            continue
        first = next(b for b in args.backends if is_ortevals(b)) if any(map(is_ortevals, args.backends)) else None
        extra = {"capture": str(capture), "capture_limit": args.oracle_requests} \
            if backend == first and args.oracle_requests else {}
        if is_ortevals(backend):  # a mode's model args after the global ones
            mode = args.mode_args.get(backend.partition(":")[2], "")
            extra["ortevals_args"] = ",".join(filter(None, (args.ortevals_args, mode)))
        r = run_child("ll", {**base, "backend": "ortevals" if is_ortevals(backend) else backend, "row": backend,
                             "limit": limit, **extra}, args.child_timeout)
        r.update(model=m["name"], hf_dtype=dtype if backend == "hf" else None)
        if "failed" not in r:
            r.update(rates(r))
        out[backend] = r
        if backend == "hf" and "failed" not in r:
            hf_cache[key] = r
    for name, r in out.items():
        if name != "hf" and "failed" not in r:
            r.update(compare(r, out.get("hf")))
    ratios = {f"{v}/{n}": out[v]["requests_per_s"] / r["requests_per_s"] for v in out if is_ortevals(v)
              for n, r in out.items()
              if not is_ortevals(n) and out[v].get("requests_per_s") and r.get("requests_per_s")}
    for name, r in out.items():
        if is_ortevals(name) and "failed" not in r:
            r.update(mfu(r, args))
    result = {"backends": out, "ratios": ratios}
    first = next((n for n in out if is_ortevals(n)), "ortevals")
    if capture.is_file() and "failed" not in out.get(first, {"failed": 1}):
        result["oracle"] = run_oracle_child(m, built, args, capture)
        capture.unlink()
    return result


PEAK_FP16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense fp16/bf16 FLOP/s


def mfu(r: dict, args) -> dict:
    """The scoring passes' share of the device's fp16 peak: 2 x the matrix weights x the tokens run over the
    seconds in the engine (the embedding table, gathered, not counted; the attention's and the LM head's FLOPs at
    the scored positions not counted either: a few percent more)."""
    from ortevals.bench.devmem import device_info

    name = device_info().get("name") or ""
    peak = next((v for k, v in PEAK_FP16.items() if k in name), None)
    if not (peak and r.get("parameters") and r.get("tokens_run") and r.get("seconds")):
        return {"mfu": None}
    return {"mfu": 2 * r["parameters"] * r["tokens_run"] / r["seconds"] / peak, "peak_flops": peak}


def run_oracle_child(m: dict, built: dict, args, capture: Path) -> dict:
    """ortevals against onnxruntime-genai's Generator, request by request (scripts/gpu/oracle.py)."""
    from oracle import compare as against_oracle

    r = run_child("oracle", {"backend": "og-generator", "model": m["name"], "pkg": built["pkg"], "ep": args.ep,
                             "capture": str(capture)}, args.child_timeout)
    if "failed" in r:
        return r
    from ortevals.package.loader import ModelPackage

    activations = ModelPackage.load(built["pkg"]).kv[0].dtype  # fp16 for the CUDA int4 package, fp32 on CPU
    return {**against_oracle(r.pop("requests"), activations), "seconds": r["seconds"],
            "peak_device_mib": r.get("peak_device_mib")}


def table(results: dict) -> str:
    head = ("| model | backend | questions | req/s | model calls/s | × hf (ortevals rows) | peak device MiB "
            "| peak RSS MiB | accuracy | same answers as hf | max abs Δ log-lik vs hf |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["models"].items():
        for b, r in m.get("backends", {}).items():
            if "failed" in r:
                part = r.get("partial")
                got = f" ({part['done']}/{part['of']} {part['unit']} in {part['seconds']} s)" if part else ""
                lines.append(f"| {name} | {b} | failed: {r['failed'][-240:]}{got} |" + " |" * 8)
                continue
            ratio = m["ratios"].get(f"{b}/hf") if is_ortevals(b) else m["ratios"].get(f"ortevals/{b}")
            same = f"{r['same_answers_as_hf']}/{r['compared_with_hf']}" if "compared_with_hf" in r else "—"
            delta = r.get("max_abs_dlogprob_vs_hf")

            def f(v, fmt):
                return format(v, fmt) if v is not None else "—"
            lines.append(f"| {name} | {b} | {r['questions']} | {f(r['requests_per_s'], '.2f')} | "
                         f"{f(r['model_calls_per_s'], '.2f')} | {f(ratio, '.2f')} | {f(r['peak_device_mib'], '.0f')} | "
                         f"{r['peak_host_rss_mib']:.0f} | {r['accuracy']:.4f} | {same} | {f(delta, '.1e')} |")
    oracle = {n: m["oracle"] for n, m in results["models"].items() if "oracle" in m}
    if oracle:
        lines += ["", "ortevals against onnxruntime-genai's Generator on the same package and device, per request "
                  f"({results['config']['oracle_tolerance']}):", "",
                  "| model | requests | within tolerance | max abs Δ | max Δ / tolerance |",
                  "|---|---:|---:|---:|---:|"]
        for n, o in oracle.items():
            if "failed" in o:
                lines.append(f"| {n} | failed: {o['failed'][-240:]} | | | |")
            elif o["requests"]:
                lines.append(f"| {n} | {o['requests']} | {o['within_tolerance']} | {o['max_abs_delta']:.2e} | "
                             f"{o['max_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    """results.json without the per-question arrays (they go to answers.json.gz), and results.md."""
    answers = {}
    slim = json.loads(json.dumps(results))
    for name, m in slim["models"].items():
        for b, r in m.get("backends", {}).items():
            answers[f"{name}/{b}"] = {k: r.pop(k) for k in ("answers", "logprobs") if k in r}
    (out / "results.json").write_text(json.dumps(slim, indent=1) + "\n")
    with gzip.open(out / "answers.json.gz", "wt") as f:
        json.dump(answers, f)
    md = [f"# GPU benchmark: {slim['device'].get('name') or 'no GPU'} ({slim['config']['ep']})\n", table(slim)]
    if slim.get("cot"):
        import bench_samples

        cot = {**slim["cot"], "backends": {b: r for b, r in slim["cot"]["backends"].items() if "failed" not in r}}
        md += [f"\n## Chain of thought: {cot['samples']} samples a question, {cot['max_gen_toks']} tokens\n",
               bench_samples.table(cot) if cot["backends"] else "every backend failed"]
    if slim.get("profile"):
        p = {k: v for k, v in slim["profile"].items() if not isinstance(v, dict)}
        md += ["\n## Profile (ortevals, one batch)\n", "```", json.dumps(p, indent=1), "```"]
    (out / "results.md").write_text("\n".join(md) + "\n")


def run_cot(built: dict, m: dict, args) -> dict:
    import bench_samples

    spec = {"model": m["name"], "pkg": built["pkg"], "hf": built["hf"], "ep": args.ep, "samples": args.cot_samples,
            "max_gen_toks": args.cot_max_gen_toks, "threads": args.threads,
            "hf_dtype": "float32" if m["precision"] == "fp32" or args.ep == "cpu" else "float16"}
    out = {"model": m["name"], "questions": args.cot_questions, "samples": args.cot_samples,
           "max_gen_toks": args.cot_max_gen_toks, "backends": {}}
    for backend in args.backends:
        questions = args.cot_questions if backend == "ortevals" else min(args.cot_questions, args.cot_peer_questions)
        r = run_child("cot", {**spec, "backend": backend, "questions": questions}, args.child_timeout)
        out["backends"][backend] = r
    done = {b: r for b, r in out["backends"].items() if "failed" not in r}
    out["ratios"] = bench_samples.ratios(done) if "ortevals" in done else {}
    return out


def header(args) -> dict:
    from importlib import metadata

    from oracle import TOLERANCE

    from ortevals.bench.devmem import device_info

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    names = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-genai", "onnxruntime-genai-cuda", "torch",
             "transformers", "lm_eval", "numpy")
    return {"device": {**device_info(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "versions": {"ortevals": commit.stdout.strip() or None, "python": platform.python_version(),
                         **{n: version(n) for n in names}},
            "config": {"ep": args.ep, "task": "leaderboard_mmlu_pro (bundled data)", "limit": args.limit,
                       "og_limit": args.og_limit, "hf_batch": args.hf_batch, "threads": args.threads,
                       "backends": args.backends, "ortevals_args": args.ortevals_args,
                       "oracle_requests": args.oracle_requests, "oracle_tolerance": TOLERANCE,
                       "hf_goal": "same answer as hf in the package's precision on >= 99% of the questions",
                       "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
            "models": {}}


def parse_modes(text: str, ap) -> dict[str, str]:
    """``NAME=k=v,k=v;NAME=…`` → {NAME: "k=v,k=v"} (the ortevals model args of each row)."""
    modes = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, margs = item.partition("=")
        if not sep or not name.isidentifier():
            ap.error(f"--modes: expected NAME=k=v,… separated by ';', got {item!r}")
        modes[name] = margs
    return modes


def is_ortevals(backend: str) -> bool:
    return backend == "ortevals" or backend.startswith("ortevals:")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["ll", "cot", "profile", "oracle"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", default=None, help="ARCH:PARAMS:PRECISION,… (cuda: qwen3:1.5e9:fp16; cpu: a tiny "
                                                     "llama:1e6:fp32)")
    ap.add_argument("--models-dir", type=Path, default=None, help="where models are built (default: the cache)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="ortevals,hf,og,ort (lm-eval's onnxruntime-genai "
                    "and onnxruntime backends)")
    ap.add_argument("--limit", type=int, default=500, help="MMLU-Pro questions (0: skip the log-likelihood runs)")
    ap.add_argument("--og-limit", type=int, default=None, help="questions for og and ort (default: min(limit, 100))")
    ap.add_argument("--hf-batch", default=None, help="hf batch size (default: auto on cuda, 8 on cpu)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: 2 on cpu, the libraries' own on cuda)")
    ap.add_argument("--ortevals-args", default="", help="extra ortevals model args, k=v,… (every ortevals row)")
    ap.add_argument("--modes", default="", help="ortevals rows side by side, NAME=k=v,k=v;NAME=…: each replaces the "
                    "ortevals backend by a row 'ortevals:NAME' with those model args (e.g. "
                    "batched=shared_prefix_batch=on;batch1=shared_prefix_batch=off;"
                    "sdpa0=shared_prefix_batch=off,provider_options=sdpa_kernel=0)")
    ap.add_argument("--oracle-requests", type=int, default=200,
                    help="requests checked against onnxruntime-genai's Generator, same package and device (0: off)")
    ap.add_argument("--cot-samples", type=int, default=0, help="chain-of-thought samples a question (0: off)")
    ap.add_argument("--cot-questions", type=int, default=4)
    ap.add_argument("--cot-peer-questions", type=int, default=1, help="questions for hf and og in the CoT run")
    ap.add_argument("--cot-max-gen-toks", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="onnxruntime's profiler on ortevals, first model")
    ap.add_argument("--profile-limit", type=int, default=2)
    ap.add_argument("--build-only", choices=["hf", "all"], help="only build the models (hf: the checkpoints, "
                                                                 "e.g. in the background before the kit is in)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds before a backend's run is cut off")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-gpu")
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if unknown := set(args.backends) - set(BACKENDS):
        ap.error(f"--backends: unknown {', '.join(sorted(unknown))} (expected {', '.join(BACKENDS)})")
    args.mode_args = parse_modes(args.modes, ap)
    if args.mode_args and "ortevals" in args.backends:  # the ortevals row becomes one row a mode, in place
        at = args.backends.index("ortevals")
        args.backends[at:at + 1] = [f"ortevals:{name}" for name in args.mode_args]
    args.models = parse_models(args.models or ("qwen3:1.5e9:fp16" if args.ep == "cuda" else "llama:1e6:fp32"))
    args.og_limit = args.og_limit if args.og_limit is not None else min(args.limit, 100)
    args.hf_batch = args.hf_batch or ("auto" if args.ep == "cuda" else "8")
    args.threads = args.threads if args.threads is not None else (2 if args.ep == "cpu" else None)
    if args.models_dir is None:
        cache = Path(os.environ.get("ORTEVALS_CACHE") or Path.home() / ".cache" / "ortevals")
        args.models_dir = cache / "gpu-models"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        from workers import worker_main

        return worker_main(args.worker, json.loads(args.spec))
    args.out.mkdir(parents=True, exist_ok=True)
    results, hf_cache, t0 = header(args), {}, time.perf_counter()
    built = {}
    for m in args.models:
        built[m["name"]] = make_model(m, args)
        results["models"][m["name"]] = {"spec": m, "build": {k: v for k, v in built[m["name"]].items()}}
        write(results, args.out)
    if args.build_only:
        return print(json.dumps({n: {k: b.get(k) for k in ("hf", "pkg", "make_model_s")} for n, b in built.items()}))
    if args.limit > 0:
        for m in args.models:
            results["models"][m["name"]].update(run_ll(m, built[m["name"]], args, hf_cache))
            write(results, args.out)
    if args.cot_samples:
        m = next((m for m in args.models if m["precision"] != "fp32"), args.models[0])
        results["cot"] = run_cot(built[m["name"]], m, args)
        write(results, args.out)
    if args.profile:
        m, b = args.models[0], built[args.models[0]["name"]]
        spec = {"backend": "ortevals", "model": m["name"], "pkg": b["pkg"], "hf": b["hf"], "ep": args.ep,
                "limit": args.profile_limit, "threads": args.threads, "ortevals_args": args.ortevals_args}
        results["profile"] = {"model": m["name"], **run_child("profile", spec, args.child_timeout)}
    results["config"]["wall_s"] = time.perf_counter() - t0
    write(results, args.out)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
