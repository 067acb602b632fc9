#!/usr/bin/env python
"""Side-by-side MMLU-Pro benchmark: ortevals against the peers, in one run.

Every backend runs lm-eval's ``leaderboard_mmlu_pro`` (5-shot, log-likelihood)
on the same package/weights and the same questions, each in its own
subprocess so peak RSS and threads are its own. Scoring time is the time spent
inside the backend's ``loglikelihood`` (data loading excluded, the same for all).

    python scripts/bench_mmlu_pro.py --limit 100 --slow-limit 20 --out docs/bench
    python scripts/bench_mmlu_pro.py --backends ortevals,ortevals-incremental,hf,onnxruntime-genai --limit 50 \
        --slow-limit 10 --slow onnxruntime-genai --ortevals-args '{"ortevals-incremental": "path=incremental"}' \
        --out docs/bench-incremental

Writes the summary to ``--out`` (results.json with each backend's figures and the ratios, table.md,
throughput.png: docs/benchmarks.md sections 1 and 2) and every question's answers, log-probs and
prompt ids to ``--raw`` (default ``bench-data/<the --out folder's name>/requests.json``, not tracked).

Backends: ortevals (prefill path; variants via --ortevals-args), lm-eval ``hf``
(PyTorch on the HF folder), lm-eval's built-in ``onnxruntime-genai`` and
``onnxruntime``. With --ep cuda it runs the ONNX backends on CUDA and hf on
cuda:0 (on a GPU machine with ortevals[cuda] and torch+CUDA installed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_lm(name: str, args) -> object:
    if name.startswith("ortevals"):
        from ortevals.integrations.lm import OrtLM

        extra = dict(kv.split("=", 1) for kv in args.ortevals_args.get(name, "").split(",") if kv)
        return OrtLM.create_from_arg_obj({"pkg": args.pkg, "ep": args.ep, "store": "none", **extra})  # timed: no resume
    from lm_eval.api.registry import get_model

    if name == "hf":
        device = "cuda:0" if args.ep == "cuda" else "cpu"
        return get_model("hf")(pretrained=args.hf, device=device, dtype="float32", batch_size=1)
    return get_model(name)(pretrained=args.pkg, execution_provider=args.ep)


def time_method(lm, name: str) -> dict:
    """Wrap ``lm.<name>`` so the seconds spent in it and the requests it served are counted."""
    timing = {"seconds": 0.0, "requests": 0}
    inner = getattr(lm, name)

    def timed(requests, *a, **k):
        start = time.perf_counter()
        out = inner(requests, *a, **k)
        timing["seconds"] += time.perf_counter() - start
        timing["requests"] += len(requests)
        return out

    setattr(lm, name, timed)
    return timing


def score_mmlu_pro(lm, limit: int, data: str) -> tuple[dict, list[dict]]:
    """Run ``leaderboard_mmlu_pro`` on ``lm``: (its figures, lm-eval's samples). Seconds are those spent
    inside ``lm.loglikelihood``; answers and log-probs are keyed by doc_id."""
    import lm_eval

    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro"]
    tasks = task_specs(preset, resolve_data(preset, data))
    timing = time_method(lm, "loglikelihood")
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True)
    samples = res["samples"]["leaderboard_mmlu_pro"]
    answers = {s["doc_id"]: int(max(range(len(s["resps"])), key=lambda i: float(s["resps"][i][0][0])))
               for s in samples}
    logprobs = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    out = {"questions": len(samples), "requests": timing["requests"], "seconds": timing["seconds"],
           "accuracy": res["results"]["leaderboard_mmlu_pro"]["acc,none"], "answers": answers, "logprobs": logprobs}
    return out, samples


def worker(args) -> None:
    """Run one backend; print a JSON line with its figures."""
    lm = build_lm(args.backend, args)
    scores, samples = score_mmlu_pro(lm, args.limit, args.data)
    engine = getattr(lm, "engine", None)
    out = {
        "backend": args.backend, **scores,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_run": getattr(engine, "tokens_run", None),
        "prompts": prompt_tokens(samples, args),
    }
    print("BENCH " + json.dumps(out))


def prompt_tokens(samples, args) -> list[list[int]]:
    """Each question's model input (context + answer letter, minus its last token), package tokenizer."""
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer

    tok = Tokenizer.load(ModelPackage.load(args.pkg))
    return [tok.encode(s["arguments"][0][0] + s["arguments"][0][1])[:-1] for s in samples]


def run_backend(name: str, limit: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--limit", str(limit), "--pkg", args.pkg, "--hf", args.hf,
           "--data", args.data, "--ep", args.ep, "--ortevals-args", json.dumps(args.ortevals_args)]
    print(f"running {name} on {limit} questions …", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                                                     "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
        print(f"  {name} failed:\n{tail}")
        return {"backend": name, "failed": tail.splitlines()[-1] if tail else "no output"}
    out = json.loads(line[6:])
    print(f"  {out['requests']} requests in {out['seconds']:.1f} s ({out['requests'] / out['seconds']:.2f} req/s), "
          f"acc {out['accuracy']:.4f}, wall {time.time() - start:.0f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pkg", default=None, help="GenAI package (default: the SmolLM2 example, fp32)")
    p.add_argument("--hf", default=None, help="HF folder with the same weights (default: the example's)")
    p.add_argument("--data", default="bundled")
    p.add_argument("--ep", default="cpu")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--slow-limit", type=int, default=20, help="questions for peers slower than 1 req/s")
    p.add_argument("--backends", default="ortevals,hf,onnxruntime-genai,onnxruntime")
    p.add_argument("--slow", default="onnxruntime-genai,onnxruntime", help="backends timed on --slow-limit")
    p.add_argument("--ortevals-args", type=json.loads, default={},
                   help='JSON: extra model_args per ortevals variant, e.g. {"ortevals-nocache": "prefix_cache=0"}')
    p.add_argument("--out", default=str(REPO / "docs" / "bench"), help="folder for results.json and the plot")
    p.add_argument("--raw", default=None, help="folder for the per-question data (default: bench-data/<--out's name>)")
    args = p.parse_args()
    args.raw = args.raw or str(REPO / "bench-data" / Path(args.out).name)
    if args.pkg is None or args.hf is None:
        from ortevals.package.examples import smollm2_hf_dir, smollm2_package

        args.pkg = args.pkg or str(smollm2_package("fp32"))
        args.hf = args.hf or str(smollm2_hf_dir())
    if args.worker:
        args.backend = args.worker
        return worker(args)
    from bench_flops import matmul_peak
    from bench_report import write_report

    args.peak_gflops = matmul_peak()
    print(f"onnxruntime fp32 MatMul peak on this machine: {args.peak_gflops:.1f} GFLOP/s", flush=True)
    slow = set(args.slow.split(","))
    results = [run_backend(b, args.slow_limit if b in slow else args.limit, args) for b in args.backends.split(",")]
    write_report(results, args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
