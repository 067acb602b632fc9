"""P(True) of two ``--self-eval`` runs on the same questions: how the model's judgement of its own answers drifted.

Owns the paired comparison ``ortevals compare`` prints when both runs logged each question's P(True) (the
``p_true`` of the proposed answer: the chosen choice, or the generated answer): mean P(True), its AUROC
against each run's own correctness (sklearn's ``roc_auc_score``) and equal-width ECE, each with Δ = run − ref
on a paired bootstrap (one resample of the questions weights both runs alike), and the mean absolute change
of a question's P(True), which shows drift that leaves the mean where it was. Pure numpy over per-question
arrays; the statistics are :mod:`ortevals.report.calibration`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.report import calibration as cal
from ortevals.report import calibration_boot as boot
from ortevals.report.stats import Interval


@dataclass(frozen=True)
class PTrueDelta:
    """Run against reference on the N questions where both have a P(True) and a 0/1 outcome; Δ = run − ref."""

    n: int
    ref_mean: float
    mean: float
    delta_mean: Interval
    ref_auroc: float  # NaN where one run's answers are all right or all wrong
    auroc: float
    delta_auroc: Interval
    ref_ece: float
    ece: float
    delta_ece: Interval
    change: Interval  # mean |P(True)_run − P(True)_ref| per question


def ptrue_delta(ref_p: np.ndarray, ref_correct: np.ndarray, run_p: np.ndarray, run_correct: np.ndarray,
                resamples: int = cal.RESAMPLES) -> PTrueDelta | None:
    """[N] P(True) and 0/1 outcomes of both runs (NaN: none); None under two questions with all four."""
    arrays = [np.asarray(x, np.float64) for x in (ref_p, ref_correct, run_p, run_correct)]
    keep = np.all([np.isfinite(x) for x in arrays], axis=0)
    if keep.sum() < 2:
        return None
    rp, rk, p, k = (x[keep] for x in arrays)
    ref_ece, run_ece = cal.ece_statistic(rp, rk), cal.ece_statistic(p, k)
    ref_auc, run_auc = boot.auroc(rp, rk), boot.auroc(p, k)
    found = boot.intervals({"mean": boot.mean(p - rp), "auroc": lambda w: run_auc(w) - ref_auc(w),
                            "ece": lambda w: run_ece(w) - ref_ece(w), "change": boot.mean(np.abs(p - rp))},
                           len(p), resamples)
    aucs = [float(cal.auroc(x, y)) for x, y in ((rp, rk), (p, k))]
    eces = [float(cal.ece(x, y)) for x, y in ((rp, rk), (p, k))]

    def around(estimate: float, key: str) -> Interval:
        return Interval(estimate, found[key].low, found[key].high, found[key].se)

    return PTrueDelta(len(p), float(rp.mean()), float(p.mean()), around(float(p.mean() - rp.mean()), "mean"),
                      aucs[0], aucs[1], around(aucs[1] - aucs[0], "auroc"), eces[0], eces[1],
                      around(eces[1] - eces[0], "ece"), around(float(np.abs(p - rp).mean()), "change"))
