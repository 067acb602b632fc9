"""Issue 38 item 18: what compare and the plots show. compute.png's FLOPs labels ran into each other; compare
reported no P(True) drift between two --self-eval runs."""

import pytest

from ortevals.report import plots
from ortevals.report.compute import ComputePoint, compute_plot


def _overlaps(fig) -> list[str]:
    """Pairs of visible x tick labels whose boxes overlap, per axis, once the figure is laid out."""
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        labels = sorted((t for t in ax.get_xticklabels(which="both") if t.get_visible() and t.get_text()),
                        key=lambda t: t.get_window_extent(renderer).x0)
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
        found += [f"{a} / {b}" for (a, x), (b, y) in zip(boxes, boxes[1:]) if x.x1 > y.x0]
        assert len(labels) >= 2, f"{ax.get_xlabel()}: fewer than two labelled ticks"
    return found


def overlaps_as_drawn(monkeypatch, module) -> list[list[str]]:
    """``module.png`` replaced: each figure it would save is checked as drawn (:func:`_overlaps`) and closed; the
    returned list gains each figure's overlapping labels."""
    seen: list[list[str]] = []

    def check(plt, fig, dpi=110):
        seen.append(_overlaps(fig))
        plt.close(fig)
        return b""

    monkeypatch.setattr(module, "png", check)
    return seen


@pytest.mark.parametrize("flops", [(6.75e10, 8.6e11), (8.2e10, 8.9e10), (3e9, 3e13), (1.2e14, 1.9e14)],
                         ids=["one-decade", "narrow", "four-decades", "narrow-high"])
def test_compute_plot_labels_never_overlap(tmp_path, monkeypatch, flops):
    """The figure is checked as drawn (text extents by matplotlib's renderer), before it becomes a PNG."""
    seen = overlaps_as_drawn(monkeypatch, plots)
    lo, hi = flops
    points = [ComputePoint(m, k, 0.4, 0.05, 0.3, 0.5, 200.0 * k, lo * (hi / lo) ** ((k - 1) / 7) * scale)
              for m, scale in (("maj", 1.0), ("bon", 1.02)) for k in range(1, 9)]
    compute_plot(points, tmp_path / "compute.png", "t")
    assert seen == [[]]


def test_compare_reports_p_true_drift(tmp_path):
    """Two --self-eval runs (each sample's p_true per choice): mean P(True) of the chosen answer, its AUROC
    against each run's own correctness (sklearn) and its equal-width ECE, and the mean |change| per question,
    all by hand; Δ = run − ref with a paired interval around it. Was: nothing about P(True) at all."""
    import json

    import numpy as np
    from sklearn.metrics import roc_auc_score

    from tests.test_compare import CATS, LABELS, REF_ANSWERS, RUN_ANSWERS, compare_json, invoke, loglik, record

    ref_p = [0.92, 0.85, 0.77, 0.64, 0.35, 0.55, 0.88, 0.15]  # of the chosen answer; values away from bin edges
    run_p = [0.45, 0.82, 0.33, 0.71, 0.66, 0.52, 0.38, 0.26]

    def write(name, answers, chosen):
        folder = tmp_path / name
        folder.mkdir()
        rows = []
        for i, (a, c, p) in enumerate(zip(answers, CATS, chosen)):
            rec = record(i, loglik(a), category=c)
            rec["p_true"] = [p if lab == a else 0.01 for lab in LABELS]  # the others are never read
            rows.append(json.dumps(rec))
        (folder / "results.json").write_text("{}")
        (folder / "samples_leaderboard_mmlu_pro.jsonl").write_text("\n".join(rows) + "\n")
        return folder

    ref, run = write("ref", REF_ANSWERS, ref_p), write("run", RUN_ANSWERS, run_p)
    [rec] = compare_json(tmp_path, ref, run)
    rk = np.array([a == "A" for a in REF_ANSWERS], float)
    k = np.array([a == "A" for a in RUN_ANSWERS], float)
    rp, p = np.array(ref_p), np.array(run_p)

    def ece(conf, correct):  # 10 equal-width bins: Σ_b |Σ_{i∈b} (correct_i − conf_i)| / N
        bins = np.minimum((conf * 10).astype(int), 9)
        return sum(abs((correct - conf)[bins == b].sum()) for b in range(10)) / len(conf)

    want = {"ptrue_mean": (p.mean(), rp.mean()), "ptrue_auroc": (roc_auc_score(k, p), roc_auc_score(rk, rp)),
            "ptrue_ece": (ece(p, k), ece(rp, rk))}
    assert rec["ptrue_n"] == 8
    for name, (run_value, ref_value) in want.items():
        assert rec[name] == pytest.approx(run_value) and rec[f"ref_{name}"] == pytest.approx(ref_value)
        assert rec[f"delta_{name}"] == pytest.approx(run_value - ref_value)
        low, high = rec[f"delta_{name}_ci"]
        if name != "ptrue_auroc":  # 8 questions: some resamples have no wrong answer, so no AUROC (null)
            assert low <= rec[f"delta_{name}"] <= high
    assert rec["ptrue_change"] == pytest.approx(np.abs(p - rp).mean())
    text = invoke("--ref", str(ref), str(run)).output
    assert (f"P(True) on 8 questions: mean {p.mean():.4f} (ref {rp.mean():.4f}, delta {p.mean() - rp.mean():+.4f}"
            in text)
    report = tmp_path / "report"
    assert invoke("--ref", str(ref), str(run), "--report", str(report)).exit_code == 0
    assert "## P(True) drift (--self-eval, paired 95% intervals)" in (report / "report.md").read_text()
