"""The plot of ``ortevals fidelity --by-position --plot FILE``: the loss by context length.

Owns one figure drawn from fidelity summaries' ``by_position`` (:mod:`ortevals.fidelity.positions`):
per context-length bucket, the mean KL (the verdict's threshold as a line), the same-top-1 share and
the mean Δ log-prob of the actual token, each with its 95% interval clustered by window. Several
summaries (one comparison each: int4 against fp32, a quantized KV cache against its float twin) share
the axes; the KL's on a log scale where they differ by more than 20 times. matplotlib through
:mod:`ortevals.report.plots`.
"""

from __future__ import annotations

from pathlib import Path

from ortevals.files import atomic_write_bytes
from ortevals.report import plots

PANELS = (("kl", "KL(ref‖cand), nats", 1.0), ("same_top1", "same top-1 token, %", 100.0),
          ("delta_logp", "Δ log p(actual token), nats", 1.0))


def positions_png(series: list[tuple[str, dict]]) -> bytes:
    """PNG bytes of ``[(label, fidelity summary)]`` (each with ``by_position``) on shared axes."""
    plt, fig, axes = plots.figure(7.5, 8.5, rows=3)
    labels = _bucket_labels(series)
    for i, (label, s) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * 0.12
        buckets = {(b["low"], b["high"]): b for b in s["by_position"]["buckets"]}
        for ax, (key, _, scale) in zip(axes, PANELS):
            rows = [(j, buckets[k][key]) for j, k in enumerate(labels) if k in buckets]
            x = [j + offset for j, _ in rows]
            y = [scale * v["mean"] for _, v in rows]
            err = [[scale * (v["mean"] - v["ci95"][0]) for _, v in rows],
                   [scale * (v["ci95"][1] - v["mean"]) for _, v in rows]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=4, lw=1.3, capsize=3, label=label)
    for s in (s for _, s in series if (s["by_position"].get("verdict") or {}).get("threshold") is not None):
        axes[0].axhline(s["by_position"]["verdict"]["threshold"], color="grey", lw=0.8, ls="--",
                        label=f"threshold {s['by_position']['verdict']['threshold']:g}")
        break
    kls = [b["kl"]["mean"] for _, s in series for b in s["by_position"]["buckets"]]
    if min(kls) > 0 and max(kls) / min(kls) > 20:  # comparisons of other sizes: each readable on a log axis
        axes[0].set_yscale("log")
    axes[2].axhline(0, color="grey", lw=0.6)
    for ax, (_, title, _) in zip(axes, PANELS):
        ax.set_ylabel(title, fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([f"{lo}-{hi - 1}" for lo, hi in labels], fontsize=7)
    axes[0].set_title("by context length (tokens before the predicted token); 95% intervals clustered by window",
                      fontsize=9)
    axes[0].legend(fontsize=7)
    axes[2].set_xlabel("context length bucket (tokens)")
    return plots.png(plt, fig)


def _bucket_labels(series: list[tuple[str, dict]]) -> list[tuple[int, int]]:
    return sorted({(b["low"], b["high"]) for _, s in series for b in s["by_position"]["buckets"]})


def plot_positions(summary: dict, path: Path, label: str = "candidate vs reference") -> None:
    """Write the figure of one summary to ``path``."""
    atomic_write_bytes(Path(path), positions_png([(label, summary)]))
