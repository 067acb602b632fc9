#!/usr/bin/env python
"""ortevals fidelity on the SmolLM2-135M fp32, int8 and int4 packages against the PyTorch checkpoint.

One child process per run, so each reports its own time and peak RSS:
1. fp32 package vs the transformers checkpoint, saving the reference (``--save-ref``);
2. int8 and int4 packages vs that reference file (no reference model loaded);
3. fp32 vs the file again (the saved path must give the fp32 numbers of run 1).

Acceptance (issue 12): fp32 mean KL < 1e-6 nats and same top-1 >= 99.9%.
The default text is the bundled MMLU-Pro questions with worked answers.

    python scripts/bench_fidelity.py --tokens 100000 --out docs/bench-fidelity.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(args) -> None:
    """Child: one fidelity run; prints its summary plus seconds and peak RSS as JSON."""
    import logging

    from ortevals.fidelity.run import FidelityOptions, format_report, run_fidelity

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # window progress on stderr
    start = time.perf_counter()
    report = run_fidelity(FidelityOptions(pkg=Path(args.pkg), ref=args.ref, tokens=args.tokens,
                                          save_ref=Path(args.save_ref) if args.save_ref else None))
    s = dict(report.summary)
    s["seconds"] = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    s["peak_rss_mib"] = usage.ru_maxrss / 1024
    s["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # wall time depends on what else the machine runs
    print(format_report(report.summary), file=sys.stderr)
    print(json.dumps(s))


def child(pkg: Path, ref: str, tokens: int | None, save_ref: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--one", "--pkg", str(pkg), "--ref", ref]
    if tokens is not None:
        cmd += ["--tokens", str(tokens)]
    if save_ref is not None:
        cmd += ["--save-ref", str(save_ref)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pkg")
    ap.add_argument("--ref")
    ap.add_argument("--save-ref")
    ap.add_argument("--tokens", type=int, default=None, help="scored tokens (default 100000)")
    ap.add_argument("--root", type=Path, default=None,
                    help="examples root (holds examples/smollm2-135m-instruct-{hf,fp32,int8,int4}); default: the cache")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-fidelity"))
    ap.add_argument("--out", type=Path, default=None, help="JSON file for every run's summary")
    ap.add_argument("--compare-tokens", type=int, default=None,
                    help="score only the first N tokens of the saved reference in the runs against it")
    ap.add_argument("--reuse", action="store_true", help="reuse the reference file and first run from --out")
    args = ap.parse_args()
    if args.one:
        return one(args)
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    tokens = args.tokens or 100000
    hf = smollm2_hf_dir(args.root)
    pkgs = {p: smollm2_package(p, args.root) for p in ("fp32", "int8", "int4")}
    args.work.mkdir(parents=True, exist_ok=True)
    ref_file = args.work / f"smollm2-ref-{tokens}.npz"
    first = "fp32 vs pytorch (saving the reference)"
    if args.reuse and ref_file.is_file() and args.out is not None and args.out.is_file():
        runs = {first: json.loads(args.out.read_text())[first]}  # the saved reference of an earlier run
    else:
        runs = {first: child(pkgs["fp32"], str(hf), tokens, ref_file)}
    for p in ("int8", "int4", "fp32"):
        if args.out is not None:  # partial results survive an interrupted run
            args.out.write_text(json.dumps(runs, indent=2) + "\n")
        runs[f"{p} vs reference file"] = child(pkgs[p], str(ref_file), args.compare_tokens)
    print(f"{'run':<40} {'tokens':>7} {'mean KL':>11} {'± SE':>9} {'p99 KL':>9} {'top-1 %':>8} "
          f"{'PPL ratio':>10} {'seconds':>8} {'CPU s':>8} {'peak MiB':>9}")
    for name, s in runs.items():
        print(f"{name:<40} {s['tokens']:>7} {s['kl']['mean']:>11.3g} {s['kl']['se']:>9.2g} {s['kl']['p99']:>9.3g} "
              f"{100 * s['same_top1']['mean']:>8.3f} {s['ppl']['ratio']:>10.5f} {s['seconds']:>8.0f} "
              f"{s.get('cpu_seconds', float('nan')):>8.0f} {s['peak_rss_mib']:>9.0f}")
    f = runs["fp32 vs pytorch (saving the reference)"]
    print(f"reference file: {f['reference_file']['bytes_per_token']:.0f} bytes per token; llama.cpp "
          f"{f['reference_file']['llama_cpp_bytes_per_token']}")
    ok = f["kl"]["mean"] < 1e-6 and f["same_top1"]["mean"] >= 0.999
    print(f"acceptance (fp32 mean KL < 1e-6, same top-1 >= 99.9%): {'PASS' if ok else 'FAIL'}")
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
