"""Calibration plots as PNG bytes (issue 24): reliability diagram and risk-coverage curve.

The only matplotlib import for calibration (Agg backend, imported when a plot is
drawn). Each function takes already computed per-bin or per-question arrays
from :mod:`ortevals.report.calibration`, one series per run or per score
(choice confidence, P(True)), and returns the PNG; callers write it to
``--output`` / ``--report`` or embed it in report.html.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortevals.report import plots
from ortevals.report.calibration import Reliability


def _figure(width: float, height: float, rows: int = 1, ratios: tuple[int, ...] | None = None):
    return plots.figure(width, height, rows=rows, sharex=True,
                        gridspec_kw={"height_ratios": ratios} if ratios else None)


def reliability_png(series: Sequence[tuple[str, Reliability]], title: str) -> bytes:
    """Accuracy against mean confidence per bin (one line per series, empty bins skipped), the diagonal of
    perfect calibration, and below it each bin's share of the questions."""
    plt, fig, (top, bottom) = _figure(6.4, 6.2, rows=2, ratios=(3, 1))
    top.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="perfect calibration")
    width = 0.8 / max(len(series), 1)
    for j, (label, rel) in enumerate(series):
        live = rel.count > 0
        line, = top.plot(rel.confidence[live], rel.accuracy[live], marker="o", ms=4, label=label)
        centres = (rel.edges[:-1] + rel.edges[1:]) / 2
        widths = np.diff(rel.edges)
        offset = (j - (len(series) - 1) / 2) * width * widths
        bottom.bar(centres + offset, rel.count / max(rel.count.sum(), 1), width=widths * width,
                   color=line.get_color(), alpha=0.8)
    top.set_xlim(0, 1)
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("accuracy in bin")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, loc="upper left")
    bottom.set_xlabel("confidence (mean of the bin)")
    bottom.set_ylabel("share of questions")
    return plots.png(plt, fig)


def risk_coverage_png(series: Sequence[tuple[str, np.ndarray]], title: str) -> bytes:
    """Risk (error rate) of the k most confident questions against coverage k/N: one ``[N]`` risk curve
    (:func:`~ortevals.report.calibration.risk_curve`) per series."""
    plt, fig, ax = _figure(6.4, 4.2)
    for label, risk in series:
        n = len(risk)
        ax.plot(np.arange(1, n + 1) / n, risk, lw=1.4, label=label)
    ax.axvline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.02, 1.02)  # a curve at 0 or 1 stays visible
    ax.set_xlabel("coverage (share of questions answered, most confident first)")
    ax.set_ylabel("risk (error rate among those answered)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return plots.png(plt, fig)
