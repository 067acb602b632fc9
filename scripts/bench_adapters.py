#!/usr/bin/env python
"""docs/adapters.md's figure: several LoRA adapters in one ``ortevals mmlu-pro`` against one invocation per adapter.

    python scripts/bench_adapters.py --pkg PKG --adapter a.onnx_adapter=A --adapter b.onnx_adapter=B --limit 20

Both ways run as the user runs them, each invocation its own process timed from launch to exit, each with an empty
``$ORTEVALS_CACHE`` (nothing reused from an earlier run; the derived scoring graph is built in each): ``together`` is
one invocation with every ``--adapter``; ``apart`` is one invocation per adapter, their times summed. ``--repeat N``
alternates the two ways N times and reports the medians and their ratio. Without ``--pkg``, the tests' tiny Llama
with two LoRA adapters (tests/fixtures/lora.py, built once into .fixture-cache/). Extra ``mmlu-pro`` flags follow
``--``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def tiny_lora() -> tuple[Path, list[str], list[str]]:
    """The tests' LoRA fixture: its package, its two adapters (built once, about 45 s) and ``--truncate left`` (its
    context is 1024 tokens, shorter than some 5-shot prompts)."""
    from tests.fixtures.lora import build_lora

    lora = build_lora(REPO / ".fixture-cache")
    return lora.pkg, [f"{lora.adapters[0]}=A", f"{lora.adapters[1]}=B"], ["--truncate", "left"]


def timed(args: list[str]) -> float:
    """Seconds from launch to exit of ``ortevals ARGS`` with an empty cache (an error stops the script)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, ORTEVALS_CACHE=cache)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "ortevals.cli", *args, "--output", out], env=env,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"ortevals {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pkg", type=Path, default=None)
    ap.add_argument("--adapter", action="append", default=[], metavar="FILE=NAME")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="more mmlu-pro flags (after --)")
    o = ap.parse_args()
    pkg, adapters, fit = (o.pkg, o.adapter, []) if o.pkg else tiny_lora()
    if len(adapters) < 2:
        sys.exit("give --adapter at least twice (FILE=NAME)")
    base = ["mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", str(o.limit), *fit, *o.extra]
    together, apart = [], []
    for i in range(o.repeat):
        together.append(timed(base + [w for a in adapters for w in ("--adapter", a)]))
        apart.append(sum(timed(base + ["--adapter", a]) for a in adapters))
        print(f"round {i + 1}: together {together[-1]:.1f} s, apart {apart[-1]:.1f} s", file=sys.stderr)
    t, a = statistics.median(together), statistics.median(apart)
    print(f"{len(adapters)} adapters, {o.limit} questions each, {pkg}")
    print(f"one invocation:        {t:.1f} s (median of {o.repeat})")
    print(f"one run per adapter:   {a:.1f} s (their sum; median of {o.repeat})")
    print(f"ratio together/apart:  {t / a:.2f}  ({a - t:.1f} s saved)")


if __name__ == "__main__":
    main()
