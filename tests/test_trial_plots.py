"""Issue 22, trial item 14: every plot the project draws is readable. The real matplotlib figures are
inspected (text colour against its cell, bin widths, tick values, where points sit), not pixels."""

import numpy as np
import pytest

from ortevals.report import html, plots
from ortevals.report.compare import compare
from ortevals.report.runs import load_run
from tests.test_compare import record, write_ortevals_run


def contrast(a, b) -> float:
    """WCAG 2 contrast ratio of two RGB colours (0..1)."""
    def lum(c):
        c = np.asarray(c[:3], float)
        c = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.fixture()
def figures(monkeypatch):
    """The report's figures as matplotlib objects: plots.png keeps the figure instead of closing it."""
    kept = []
    monkeypatch.setattr(plots, "png", lambda plt, fig, dpi=110: kept.append(fig) or b"")
    return kept


def comparison(tmp_path, n, cats, noise):
    rng = np.random.default_rng(0)
    base = rng.normal(0, 1, (n, 3))
    folders = []
    for name, sd in noise:
        lls = base + (rng.normal(0, sd, base.shape) if sd else 0)
        folders.append(write_ortevals_run(tmp_path / name, [record(i, list(lls[i]), category=cats[i % len(cats)])
                                                             for i in range(n)]))
    return compare(load_run(folders[0]), [load_run(f) for f in folders[1:]])


THREE = [("ref", 0), ("fp32", 1e-6), ("int8", 0.03), ("int4", 1.0)]


def test_agreement_labels_are_readable_on_their_cells(tmp_path, figures):
    cmp = comparison(tmp_path, 120, ["business"], THREE)
    html.plot_agreement(cmp)
    ax = figures[0].axes[0]
    image = ax.images[0]
    assert len(ax.texts) == 16
    for t in ax.texts:
        j, i = (round(v) for v in t.get_position())
        cell = image.cmap(image.norm(cmp.agreement[i, j]))
        import matplotlib.colors as mc

        assert contrast(mc.to_rgb(t.get_color()), cell) >= 4.5, (t.get_text(), t.get_color())  # WCAG AA


def test_kl_histogram_bars_are_wide_and_counts_whole(tmp_path, figures):
    cmp = comparison(tmp_path, 120, ["business"], THREE)
    few = comparison(tmp_path / "few", 12, ["math", "law"], [("ref", 0), ("int4", 0.5)])
    for c in (cmp, few):
        html.plot_kl(c)
    for fig in figures:
        ax = fig.axes[0]
        span = np.diff(ax.get_xlim())[0]
        widths = [p.get_width() for p in ax.patches]
        assert min(widths) >= span / 60, (min(widths), span)  # was one 40th of each run's own range
        assert len({round(w, 9) for w in widths}) == 1  # every run on the same bins
        ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        assert all(float(t).is_integer() for t in ticks), ticks  # question counts, never 0.25


def test_delta_with_one_category_keeps_runs_off_the_edges(tmp_path, figures):
    html.plot_delta(comparison(tmp_path, 120, ["business"], THREE))
    ax = figures[0].axes[0]
    low, high = sorted(ax.get_ylim())
    ys = [y for line in ax.lines if line.get_marker() == "o" for y in np.atleast_1d(line.get_ydata())]
    assert ys and all(low + 0.15 <= y <= high - 0.15 for y in ys), (ys, low, high)


def test_scaling_curve_axes(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ortevals.report.scaling import CurvePoint, curve_plot

    kept = []
    real_close = plt.close
    plt.close = lambda fig=None: kept.append(fig)
    try:
        zero = [CurvePoint(e, k, 0.0, 0.0, 0.0, 0.0, 6.0 * k) for e in ("maj", "pass", "best") for k in (1, 2, 4)]
        curve_plot(zero, tmp_path / "c.png")
    finally:
        plt.close = real_close
    ax = kept[0].axes[0]
    low, high = ax.get_ylim()
    assert -0.02 * high - 1e-12 <= low <= 0 and high <= 1  # an accuracy axis, not -0.04 … 0.04
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    assert len({line.get_linestyle() for line in ax.lines}) == 3  # equal curves stay visible
    real_close(kept[0])
