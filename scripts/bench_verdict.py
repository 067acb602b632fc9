"""What a stored canary verdict saves (issue 22, item 9), whole processes, one invocation.

Three runs of the same 20 MMLU-Pro questions (leaderboard_mmlu_pro, 5-shot, bundled data; by
default questions 21-40) on one package, each a fresh Python process timed from start to exit:

* ``canary``: the invariance canary runs;
* ``stored verdict``: an earlier run on other questions (1-20) stored the verdict: same package and
  settings, no canary pass;
* ``no check``: ``check=false``, the floor.

Each has its own ortevals cache where an earlier run on questions 1-20 built the derived scoring
graph (with ``check=false`` except for ``stored verdict``), so only the canary differs.

Prints a markdown table (seconds and the ratio to ``no check``); the machine may be shared, so read
ratios, not seconds.

    python scripts/bench_verdict.py --pkg PATH [--first 20] [--count 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(pkg: str, start: int, count: int, check: bool) -> None:
    """One run: simple_evaluate on questions [start, start + count) through OrtLM with the package's store."""
    import lm_eval

    from ortevals.files import store_path
    from ortevals.integrations.lm import ModelArgs, OrtLM
    from ortevals.presets import PRESETS, resolve_data, task_specs
    from ortevals.tasks import task_manager

    lm = OrtLM.from_package(ModelArgs(pkg=pkg, check=check, truncate="left", store=str(store_path(pkg))))
    tasks = task_specs(PRESETS["mmlu-pro"], resolve_data(PRESETS["mmlu-pro"], "bundled"), None)
    lm_eval.simple_evaluate(model=lm, tasks=tasks, samples={"leaderboard_mmlu_pro": list(range(start, start + count))},
                            task_manager=task_manager(None, defaults=False), bootstrap_iters=0)
    engine = lm.engine
    print(json.dumps({"mode": lm.stats.get("mode"), "canary_passes": getattr(engine, "canary_passes", None),
                      "requests": lm.stats["requests"]}))


def timed(args: list[str], cache: Path) -> tuple[float, dict]:
    env = {**os.environ, "ORTEVALS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                         check=True)
    return time.perf_counter() - start, json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pkg", required=True)
    ap.add_argument("--first", type=int, default=20, help="questions run first to store a verdict")
    ap.add_argument("--count", type=int, default=20, help="questions timed")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.pkg, a.start, a.count, not a.no_check)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        timed_args = ["--pkg", a.pkg, "--start", str(a.first), "--count", str(a.count)]
        seed = ["--pkg", a.pkg, "--start", "0", "--count", str(a.first)]
        for name, seed_check, run_check in (("canary", False, True), ("stored verdict", True, True),
                                            ("no check", False, False)):
            cache = Path(tmp) / name.replace(" ", "-")
            timed(seed + ([] if seed_check else ["--no-check"]), cache)
            rows.append((name,) + timed(timed_args + ([] if run_check else ["--no-check"]), cache))
    floor = rows[-1][1]
    print(f"{a.count} questions (leaderboard_mmlu_pro {a.first + 1}-{a.first + a.count}), {a.pkg}\n")
    print("| run | seconds | / no check | canary passes | mode |\n|---|---|---|---|---|")
    for name, seconds, info in rows:
        mode = str(info["mode"]).replace("|", "\\|")
        print(f"| {name} | {seconds:.1f} | {seconds / floor:.2f} | {info['canary_passes']} | {mode} |")


if __name__ == "__main__":
    main()
