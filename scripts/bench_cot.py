#!/usr/bin/env python
"""Side-by-side chain-of-thought MMLU-Pro (lm-eval ``mmlu_pro``, generate_until) benchmark.

Every backend generates greedily for the same questions (``--limit`` per
subject, 14 subjects) with a reduced ``--max-gen-toks``, each in its own
subprocess. Generated tokens/s counts the tokens of the text each backend
returns (cut at the stop sequence), re-tokenized with the package tokenizer, so
a backend that generates past a stop sequence gets no credit for it.

    python scripts/bench_cot.py --limit 3 --max-gen-toks 64 --backends ortevals,ortevals-batch4,hf,onnxruntime-genai \
        --ortevals-args '{"ortevals-batch4": "gen_batch_size=4"}' --out docs/bench-cot
    python scripts/bench_cot.py --limit 1 --max-gen-toks 64 --out docs/bench-cot-1

Writes the summary to ``--out`` (results.json: each backend's figures and its agreement with hf; table.md:
docs/benchmarks.md section 3) and every generated text to ``--raw`` (default ``bench-data/<the --out
folder's name>/texts.json``, not tracked).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def worker(args) -> None:
    import lm_eval
    from bench_mmlu_pro import build_lm, time_method

    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer
    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro-cot"]
    lm = build_lm(args.backend, args)
    timing = time_method(lm, "generate_until")
    res = lm_eval.simple_evaluate(model=lm, tasks=task_specs(preset, resolve_data(preset, args.data)),
                                  limit=args.limit, log_samples=True, gen_kwargs={"max_gen_toks": args.max_gen_toks})
    tok = Tokenizer.load(ModelPackage.load(args.pkg))
    texts = {f"{t}/{s['doc_id']}": s["resps"][0][0] for t, ss in res["samples"].items() for s in ss}
    scores = [float(s["exact_match"]) for ss in res["samples"].values() for s in ss]
    out = {"backend": args.backend, "questions": len(texts), "seconds": timing["seconds"],
           "gen_tokens": sum(len(tok.encode(t, add_special_tokens=False)) for t in texts.values()),
           "exact_match": sum(scores) / len(scores), "texts": texts,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print("BENCH " + json.dumps(out))


def run_backend(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--limit", str(args.limit), "--pkg", args.pkg,
           "--hf", args.hf, "--data", args.data, "--ep", args.ep, "--max-gen-toks", str(args.max_gen_toks),
           "--ortevals-args", json.dumps(args.ortevals_args)]
    print(f"running {name} …", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"  failed: {tail[0]}")
        return {"backend": name, "failed": tail[0]}
    out = json.loads(line[6:])
    print(f"  {out['gen_tokens']} tokens in {out['seconds']:.1f} s ({out['gen_tokens'] / out['seconds']:.1f} tok/s)")
    return out


def same_as_hf(results: list[dict]) -> dict[str, str]:
    """backend -> "k/n": how many of hf's texts it returned word for word."""
    ref = next((r for r in results if r["backend"] == "hf" and "failed" not in r), None)
    return {r["backend"]: f"{sum(r['texts'].get(k) == v for k, v in ref['texts'].items())}/{len(ref['texts'])}"
            for r in results if ref is not None and r is not ref and "failed" not in r}


def table(results: list[dict], max_gen_toks: int) -> str:
    ref = next((r for r in results if r["backend"] == "hf" and "failed" not in r), None)
    rows = ["| backend | questions | generated tokens (kept) | seconds | tokens/s | × hf | same text as hf "
            "| exact_match | peak RSS (MB) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "failed" in r:
            rows.append(f"| {r['backend']} | failed: {r['failed'][:80]} | | | | | | | |")
            continue
        rate = r["gen_tokens"] / r["seconds"]
        ratio = f"{rate / (ref['gen_tokens'] / ref['seconds']):.2f}" if ref else "—"
        same = r.get("same_text_as_hf", "—")
        rows.append(f"| {r['backend']} | {r['questions']} | {r['gen_tokens']} | {r['seconds']:.1f} | {rate:.1f} | "
                    f"{ratio} | {same} | {r['exact_match']:.3f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(rows) + f"\n\nmax_gen_toks = {max_gen_toks} (the task's default is 2048)"


def slim(results: list[dict]) -> list[dict]:
    """Each backend's figures without its texts, with how many equal hf's."""
    same = same_as_hf(results)
    return [{**{k: v for k, v in r.items() if k != "texts"}, **({"same_text_as_hf": same[r["backend"]]}
                                                               if r["backend"] in same else {})} for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pkg", default=None)
    p.add_argument("--hf", default=None)
    p.add_argument("--data", default="bundled")
    p.add_argument("--ep", default="cpu")
    p.add_argument("--limit", type=int, default=1, help="questions per subject (14 subjects)")
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument("--backends", default="ortevals,hf,onnxruntime-genai")
    p.add_argument("--ortevals-args", default="{}",
                   help='JSON: model_args per ortevals variant, e.g. {"ortevals-batch4": "gen_batch_size=4"}')
    p.add_argument("--out", default=str(HERE.parent / "docs" / "bench-cot"))
    p.add_argument("--raw", default=None, help="folder for the generated texts (default: bench-data/<--out's name>)")
    args = p.parse_args()
    args.ortevals_args = json.loads(args.ortevals_args)
    if args.pkg is None or args.hf is None:
        from ortevals.package.examples import smollm2_hf_dir, smollm2_package

        args.pkg, args.hf = args.pkg or str(smollm2_package("fp32")), args.hf or str(smollm2_hf_dir())
    if args.worker:
        args.backend = args.worker
        return worker(args)
    results = [run_backend(b, args) for b in args.backends.split(",")]
    out, raw = Path(args.out), Path(args.raw or HERE.parent / "bench-data" / Path(args.out).name)
    out.mkdir(parents=True, exist_ok=True)
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "texts.json").write_text(json.dumps({r["backend"]: r.get("texts") for r in results}, indent=1))
    results = slim(results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    md = table(results, args.max_gen_toks)
    (out / "table.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
