"""Calibration of two runs on the same questions: paired differences (issue 24, ``ortevals compare``).

Owns Δ ECE, Δ Brier and Δ over-confidence (run − reference) with paired bootstrap
intervals (one resample of the questions weights both runs alike), and the
temperature each run needs, so "int4 kept its accuracy but became over-confident
by X" is one line. Pure numpy over per-question arrays; the statistics are those of
:mod:`ortevals.report.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ortevals.engine.score.scoring import log_softmax
from ortevals.report import calibration as cal
from ortevals.report import calibration_boot as boot
from ortevals.report.stats import Interval


@dataclass(frozen=True)
class CalibrationDelta:
    """Run against reference on the same N questions (those with a known gold); Δ = run − ref."""

    n: int
    ref_ece: float
    ece: float
    delta_ece: Interval  # equal-width ECE, paired bootstrap
    ref_brier: float
    brier: float
    delta_brier: Interval  # multi-class Brier, paired bootstrap
    ref_overconfidence: float  # mean confidence − accuracy (> 0: over-confident)
    overconfidence: float
    delta_overconfidence: Interval
    ref_temperature: Interval  # the T each run needs (fitted on all its questions), one-step bootstrap
    temperature: Interval
    ref_reliability: cal.Reliability = field(repr=False, compare=False)  # for the report's plots
    reliability: cal.Reliability = field(repr=False, compare=False)
    ref_risk: np.ndarray = field(repr=False, compare=False)  # [N] risk curves
    risk: np.ndarray = field(repr=False, compare=False)


def calibration_delta(ref_loglik: np.ndarray, run_loglik: np.ndarray, gold: np.ndarray,
                      resamples: int = cal.RESAMPLES) -> CalibrationDelta:
    """[N, C] log-likelihoods of both runs and their shared [N] gold (−1: unknown, left out)."""
    keep = np.asarray(gold) >= 0
    ref_ll, g = cal.known(ref_loglik, gold)
    run_ll = np.asarray(run_loglik, np.float64)[keep]
    (ref_c, ref_k), (run_c, run_k) = cal.confidence(ref_ll, g), cal.confidence(run_ll, g)
    ref_ece, run_ece = cal.ece_statistic(ref_c, ref_k), cal.ece_statistic(run_c, run_k)
    ref_b = cal.brier_values(log_softmax(ref_ll, np.float64), g)
    run_b = cal.brier_values(log_softmax(run_ll, np.float64), g)
    ref_gap, run_gap = ref_c - ref_k, run_c - run_k
    found = boot.intervals({"ece": lambda w: run_ece(w) - ref_ece(w), "brier": boot.mean(run_b - ref_b),
                            "gap": boot.mean(run_gap - ref_gap)}, len(g), resamples)
    e_ref, e_run = float(cal.ece(ref_c, ref_k)), float(cal.ece(run_c, run_k))

    def around(estimate: float, key: str) -> Interval:
        return Interval(estimate, found[key].low, found[key].high, found[key].se)

    return CalibrationDelta(
        len(g), e_ref, e_run, around(e_run - e_ref, "ece"), float(ref_b.mean()), float(run_b.mean()),
        around(float(run_b.mean() - ref_b.mean()), "brier"), float(ref_gap.mean()), float(run_gap.mean()),
        around(float(run_gap.mean() - ref_gap.mean()), "gap"), needed(ref_ll, g, resamples),
        needed(run_ll, g, resamples), cal.reliability(ref_c, ref_k), cal.reliability(run_c, run_k),
        cal.risk_curve(ref_c, ref_k), cal.risk_curve(run_c, run_k))


def needed(loglik: np.ndarray, gold: np.ndarray, resamples: int = cal.RESAMPLES) -> Interval:
    """The NLL-minimising temperature of one run on all its questions; NaN under 2 questions."""
    if len(gold) < 2:
        return Interval(float("nan"), float("nan"), float("nan"))
    return cal.temperature_interval(loglik, gold, cal.fit_temperature(loglik, gold), resamples)
