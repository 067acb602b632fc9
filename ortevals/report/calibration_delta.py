"""Calibration of two runs on the same questions: paired differences (issue 24, ``ortevals compare``).

Owns Δ ECE and Δ Brier (run − reference) with paired bootstrap intervals (one
resample of the questions weights both runs alike) and the temperature each run
needs, so "int4 kept its accuracy but became over-confident by X" is one line.
Pure numpy over per-question arrays; the statistics are those of
:mod:`ortevals.report.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.report import calibration as cal
from ortevals.report import calibration_boot as boot
from ortevals.report.stats import Interval, log_softmax


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
    ref_temperature: Interval  # the T each run needs (fitted on all its questions), one-step bootstrap
    temperature: Interval


def calibration_delta(ref_loglik: np.ndarray, run_loglik: np.ndarray, gold: np.ndarray,
                      resamples: int = cal.RESAMPLES) -> CalibrationDelta:
    """[N, C] log-likelihoods of both runs and their shared [N] gold (−1: unknown, left out)."""
    keep = np.asarray(gold) >= 0
    ref_ll, g = cal.known(ref_loglik, gold)
    run_ll = np.asarray(run_loglik, np.float64)[keep]
    (ref_c, ref_k), (run_c, run_k) = cal.confidence(ref_ll, g), cal.confidence(run_ll, g)
    edges = cal.bin_edges(ref_c)
    ref_ece = boot.ece_fixed(ref_c, ref_k, cal.bin_ids(ref_c, edges), cal.N_BINS)
    run_ece = boot.ece_fixed(run_c, run_k, cal.bin_ids(run_c, edges), cal.N_BINS)
    e_ref, e_run = float(cal.ece(ref_c, ref_k)), float(cal.ece(run_c, run_k))
    ref_b, run_b = cal.brier_values(log_softmax(ref_ll), g), cal.brier_values(log_softmax(run_ll), g)
    found = boot.intervals({"ece": lambda w: run_ece(w) - ref_ece(w), "brier": boot.mean(run_b - ref_b)}, len(g),
                           resamples)
    d_ece, d_brier = found["ece"], found["brier"]
    return CalibrationDelta(len(g), e_ref, e_run, Interval(e_run - e_ref, d_ece.low, d_ece.high, d_ece.se),
                            float(ref_b.mean()), float(run_b.mean()),
                            Interval(float(run_b.mean() - ref_b.mean()), d_brier.low, d_brier.high, d_brier.se),
                            needed(ref_ll, g, resamples), needed(run_ll, g, resamples))


def needed(loglik: np.ndarray, gold: np.ndarray, resamples: int = cal.RESAMPLES) -> Interval:
    """The NLL-minimising temperature of one run on all its questions; NaN under 2 questions."""
    if len(gold) < 2:
        return Interval(float("nan"), float("nan"), float("nan"))
    return cal.temperature_interval(loglik, gold, cal.fit_temperature(loglik, gold), resamples)
