"""Figures for the report layer: matplotlib opened on its Agg backend when a plot is drawn, PNG bytes out.

Owns :func:`figure` (``plt.subplots`` with the project's defaults, matplotlib imported only
here and only when called: it is an optional heavy dependency) and :func:`png` (a finished
figure as PNG bytes, closed). The plots themselves live with what they show
(report/html.py, report/calibration_plots.py, report/scaling.py).
"""

from __future__ import annotations

import io


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
