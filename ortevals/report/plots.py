"""Figures for the report layer: matplotlib opened on its Agg backend when a plot is drawn, PNG bytes out.

Owns :func:`figure` (``plt.subplots`` with the project's defaults, matplotlib imported only
here and only when called: it is an optional heavy dependency), :func:`log_ticks` (a log axis
whose labels never crowd) and :func:`png` (a finished figure as PNG bytes, closed). The plots
themselves live with what they show (report/html.py, report/calibration_plots.py, report/scaling.py).
"""

from __future__ import annotations

import io
import math


def figure(width: float = 7.0, height: float = 4.0, rows: int = 1, cols: int = 1, **subplots):
    """``(plt, fig, axes)`` for a ``rows`` × ``cols`` grid of ``width`` × ``height`` inches."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width, height), **subplots)
    return plt, fig, axes


def png(plt, fig, dpi: int = 110) -> bytes:
    """The figure laid out tightly, as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def log_ticks(ax, values, most: int = 5) -> None:
    """``ax``'s x axis on a log scale with labels that never crowd (matplotlib labels every minor tick of a range
    under a decade or two: ``2×10^11 3×10^11 …`` ran into each other): at most ``most`` labelled ticks at 1-2-5
    steps, else at powers of ten (every n-th), else, over a range without two such values, its ends and middle to
    two significant digits; labels in engineering form (``200 G``, ``1.5 k``), minor ticks unlabelled."""
    from matplotlib.ticker import EngFormatter, NullFormatter

    ax.set_xscale("log")
    positive = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if positive:
        ax.set_xticks(log_tick_values(min(positive), max(positive), most))
    ax.xaxis.set_major_formatter(EngFormatter(sep=" "))
    ax.xaxis.set_minor_formatter(NullFormatter())


def log_tick_values(lo: float, hi: float, most: int = 5) -> list[float]:
    """Tick values in ``[lo, hi]`` for a log axis (see :func:`log_ticks`)."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for mantissas in ((1, 2, 5), (1,)):
        ticks = [m * 10.0**e for e in decades for m in mantissas if lo <= m * 10.0**e <= hi]
        if len(ticks) <= most:
            break
    else:
        ticks = ticks[::math.ceil(len(ticks) / most)]
    if len(ticks) < 2:
        middle = math.sqrt(lo * hi)
        ticks = sorted({float(f"{v:.2g}") for v in (lo, middle, hi)})
    return ticks
