#!/usr/bin/env python
"""Whole-process wall time of ``ortevals mmlu-pro --limit N`` against ``lm-eval --model hf``, in one run.

What a new user waits for, start-up included: each command is its own process, timed from launch to exit.

* ortevals, fresh cache: a new ``$ORTEVALS_CACHE`` holding only the example package (no result store, no
  canary verdict, no derived graph): the first run on the package;
* ortevals, warm cache: the same command again (every answer from the result store);
* ortevals, warm cache, ``--no-resume``: everything scored again (the derived graph is reused);
* lm-eval ``hf`` (PyTorch, float32, batch 8) on the same package's PyTorch weights (the folder the example
  package was built from) and the same questions: ``leaderboard_mmlu_pro`` from the bundled data, its
  first N test questions (ortevals' ``--limit N`` on this one-task preset means the same documents).

    python scripts/bench_startup.py --limit 20 --out docs/bench-startup

Each timed command holds ``/work/bench.lock`` (flock) when that folder exists (machines shared between
benchmark runs); the clock starts once the lock is held. Writes results.json, table.md and startup.png under --out.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = Path("/work/bench.lock")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def hf_worker(limit: int, hf_dir: str, batch: int) -> None:
    """lm-eval's hf model on the bundled questions: what ``lm_eval --model hf`` does, in this process."""
    import lm_eval

    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro"]
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float32,device=cpu",
                                  tasks=task_specs(preset, resolve_data(preset, "bundled")), limit=limit,
                                  batch_size=batch)
    print("BENCH " + json.dumps({"accuracy": res["results"]["leaderboard_mmlu_pro"]["acc,none"]}))


def timed(name: str, cmd: list[str], env: dict) -> dict:
    """Launch to exit of ``cmd``, its summary lines. Under the shared lock where there is one, taken before the
    clock starts: waiting for another benchmark is not counted."""
    import fcntl

    print(f"{name}: {' '.join(cmd)}", flush=True)
    with open(LOCK, "a") if LOCK.parent.is_dir() else open(os.devnull) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
    if proc.returncode:
        print(proc.stderr[-3000:])
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    lines = [ln for ln in proc.stdout.splitlines()
             if ln.startswith(("questions ", "efficiency:", "scoring mode:", "BENCH ", "leaderboard_mmlu_pro"))]
    print(f"  {wall:.1f} s  " + " | ".join(lines[-3:]), flush=True)
    return {"run": name, "wall_s": wall, "lines": lines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="lm-eval hf batch size")
    p.add_argument("--out", default=str(REPO / "docs" / "bench-startup"))
    p.add_argument("--hf-worker", nargs=2, metavar=("LIMIT", "HF_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker(int(args.hf_worker[0]), args.hf_worker[1], args.batch)
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    package, hf_dir = smollm2_package("fp32"), smollm2_hf_dir()
    # ortevals' bytecode compiled first, as `pip install` leaves an installed package (with
    # PYTHONDONTWRITEBYTECODE set, as on this workplace's machines, an editable checkout would otherwise
    # compile every module it imports on every run)
    compileall.compile_dir(str(REPO / "ortevals"), quiet=1)
    fresh = Path(tempfile.mkdtemp(prefix="ortevals-bench-startup-"))
    (fresh / "examples").mkdir()
    (fresh / "examples" / package.name).symlink_to(package)  # the package only: no store, verdicts, derived
    env = {**os.environ, **OFFLINE, "ORTEVALS_CACHE": str(fresh), "PYTHONPATH": str(REPO)}
    ort = [sys.executable, "-m", "ortevals.cli", "mmlu-pro", "--example", "--limit", str(args.limit)]
    try:
        runs = [timed("ortevals, fresh cache", ort, env),
                timed("ortevals, warm cache", ort, env),
                timed("ortevals, warm cache, --no-resume", [*ort, "--no-resume"], env),
                timed(f"lm-eval hf, batch {args.batch}",
                      [sys.executable, __file__, "--batch", str(args.batch), "--hf-worker", str(args.limit),
                       str(hf_dir)], env)]
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    write_report(runs, args)


def _clock(lines: list[str]) -> str:
    """ortevals' ``start-up … + scoring … + after … = … since launch`` from its summary line ("" for hf)."""
    found = next((re.search(r"start-up .* since launch", ln) for ln in lines if ln.startswith("questions ")), None)
    return found[0] if found else ""


def write_report(runs: list[dict], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = runs[-1]["wall_s"]
    for r in runs:
        r["x_hf"] = hf / r["wall_s"]
    (out / "results.json").write_text(json.dumps({"limit": args.limit, "batch": args.batch, "cores": os.cpu_count(),
                                                  "runs": runs}, indent=1) + "\n")
    rows = [f"| {r['run']} | {r['wall_s']:.1f} s | {r['x_hf']:.1f}× | {_clock(r['lines'])} |" for r in runs]
    table = "\n".join(["| run (whole process) | wall | × lm-eval hf | its own clock (summary line) |",
                       "|---|---:|---:|---|", *rows])
    (out / "table.md").write_text(table + "\n")
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.barh([r["run"] for r in runs][::-1], [r["wall_s"] for r in runs][::-1], color="#4c72b0")
    for i, r in enumerate(runs[::-1]):
        ax.text(r["wall_s"], i, f" {r['wall_s']:.1f} s ({r['x_hf']:.1f}×)", va="center", fontsize=8)
    ax.set_xlabel(f"seconds, whole process, mmlu-pro --limit {args.limit} (lower is better)")
    ax.set_xlim(0, hf * 1.25)
    fig.tight_layout()
    fig.savefig(out / "startup.png", dpi=120)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
