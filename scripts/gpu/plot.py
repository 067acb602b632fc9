#!/usr/bin/env python
"""The GPU benchmark's plot: requests/s per backend and model, from ``scripts/bench_gpu.py``'s results.json.

    python scripts/gpu/plot.py docs/bench-gpu/results.json docs/bench-gpu/requests.png \
        --console docs/bench-gpu/console.txt

A backend whose child was cut short (time-out) is drawn hatched at the rate its last progress bar shows
(``partial`` in its row, or read from ``--console``, the run's printed output, by bench_gpu's own
:func:`progress_before_cut`): questions done over the bar's seconds, times the requests a question took in
the same model's finished rows. A backend that failed outright is named under the axis with its reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import progress_before_cut  # noqa: E402

BLOCK = re.compile(r"^== ll (\S+) (\S+) …\n(.*?)(?=^== |\Z)", re.S | re.M)


def partials(console: str) -> dict[tuple[str, str], dict]:
    """(model, backend) -> the ``partial`` progress of each child the printed output shows cut short."""
    return {(model, backend): got["partial"] for backend, model, body in BLOCK.findall(console)
            if (got := progress_before_cut(body))}


def rates(results: dict, cut: dict) -> list[tuple[str, str, float | None, str]]:
    """(model, backend, requests/s or None, note) for every row."""
    rows = []
    for name, m in results["models"].items():
        done = [r for r in m.get("backends", {}).values() if "failed" not in r and r.get("questions")]
        per_q = sum(r["requests"] for r in done) / sum(r["questions"] for r in done) if done else None
        for backend, r in m.get("backends", {}).items():
            if "failed" not in r:
                rows.append((name, backend, r["requests_per_s"], ""))
                continue
            part = r.get("partial") or cut.get((name, backend))
            if part and part["unit"] == "questions" and per_q and part["seconds"]:
                rate = part["done"] * per_q / part["seconds"]
                rows.append((name, backend, rate, f"cut at {part['done']}/{part['of']} questions"))
            else:
                rows.append((name, backend, None, r["failed"].rsplit("Status Message: ", 1)[-1][:90]))
    return rows


def plot(results: dict, cut: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rates(results, cut)
    drawn = [r for r in rows if r[2]]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(drawn) + 2.2))
    labels = [f"{m}\n{b}" for m, b, _, _ in drawn]
    bars = ax.barh(labels, [r[2] for r in drawn], color="tab:blue")
    for bar, (_, _, rate, note) in zip(bars, drawn, strict=True):
        if note:
            bar.set_hatch("//")
            bar.set_facecolor("white")
            bar.set_edgecolor("tab:blue")
        ax.text(rate * 1.05, bar.get_y() + bar.get_height() / 2, f"{rate:.2f}" + (f" ({note})" if note else ""),
                va="center", fontsize=8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("requests/s (log scale)")
    failed = [textwrap.fill(f"{m} {b} fails: {note}", 95) for m, b, rate, note in rows if rate is None]
    device = results.get("device", {}).get("name") or "CPU"
    ax.set_title(f"leaderboard_mmlu_pro log-likelihood on {device}" + ("\n" + "\n".join(failed) if failed else ""),
                 fontsize=9)
    ax.set_xlim(right=max(r[2] for r in drawn) * 20)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--console", type=Path, help="the run's printed output, for children cut short")
    args = ap.parse_args(argv)
    results = json.loads(args.results.read_text())
    plot(results, partials(args.console.read_text()) if args.console else {}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
