"""Bootstrap intervals for the calibration statistics, without re-sorting per resample (issue 24).

Owns :func:`interval` (report/stats.py's ``bootstrap`` over question indices: the one
convention, percentile 95% and standard error) and each statistic of :mod:`ortevals.report.calibration`
rewritten as a function of the resample's *counts* ``w [..., N]`` (how often each
question was drawn; all ones is the data itself). The questions are sorted
once; a resample is then a weighting of that fixed order, so ECE (equal-width
and equal-mass), AURC, accuracy at a coverage and AUROC cost O(N) per resample
instead of a sort. ``tests/test_calibration.py`` checks every one against the
plain definition on the expanded resample (each question repeated w times).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ortevals.report.stats import RESAMPLES, SEED, Interval, bootstrap

Statistic = Callable[[np.ndarray], np.ndarray]  # counts [..., N] -> value [...]
BATCH_CELLS = 2_000_000  # resamples × questions held at once


def counts(idx: np.ndarray, n: int) -> np.ndarray:
    """Resampled question indices ``[..., N]`` -> how often each question was drawn, ``[..., n]`` float."""
    idx = np.asarray(idx).astype(np.int64)
    lead = idx.shape[:-1]
    rows = int(np.prod(lead))
    flat = (idx.reshape(rows, -1) + n * np.arange(rows)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * n).reshape(*lead, n).astype(np.float64)


def intervals(statistics: Mapping[str, Statistic], n: int, resamples: int = RESAMPLES,
              seed: int = SEED) -> dict[str, Interval]:
    """Each statistic at all-ones counts, with the percentile bootstrap over the n questions (report/stats.py): one
    set of resamples for all of them (so differences between them are paired). NaN intervals under 2 questions."""
    names = list(statistics)
    estimates = [float(statistics[k](np.ones(n))) for k in names]
    if n < 2:
        return {k: Interval(e, float("nan"), float("nan"), float("nan")) for k, e in zip(names, estimates)}

    def stat(i: np.ndarray, axis: int = -1) -> np.ndarray:
        w = counts(i, n)
        return np.stack([statistics[k](w) for k in names], axis=0)

    res = bootstrap((np.arange(n, dtype=np.float64),), stat, resamples, seed, vectorized=True,
                    batch=max(1, BATCH_CELLS // n))
    low, high = np.atleast_1d(res.confidence_interval.low), np.atleast_1d(res.confidence_interval.high)
    se = np.atleast_1d(res.standard_error)
    return {k: Interval(e, float(lo), float(hi), float(s)) for k, e, lo, hi, s in zip(names, estimates, low, high, se)}


def interval(statistic: Statistic, n: int, resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """One statistic's :func:`intervals`."""
    return intervals({"x": statistic}, n, resamples, seed)["x"]


def mean(values: np.ndarray) -> Statistic:
    """The mean of per-question ``values [N]``."""
    values = np.asarray(values, np.float64)
    return lambda w: (w @ values) / w.sum(axis=-1)


def ece_fixed(conf: np.ndarray, correct: np.ndarray, ids: np.ndarray, n_bins: int) -> Statistic:
    """ECE on fixed bins (equal-width); ``ids [N]``: each question's bin.

    Σ_b |Σ_{i∈b} w_i (correct_i − conf_i)| / Σ w."""
    gap = np.zeros((len(ids), n_bins))
    gap[np.arange(len(ids)), ids] = np.asarray(correct, np.float64) - np.asarray(conf, np.float64)
    return lambda w: np.abs(w @ gap).sum(axis=-1) / w.sum(axis=-1)


def ece_mass(conf: np.ndarray, correct: np.ndarray, n_bins: int) -> Statistic:
    """Equal-mass ECE: edges are np.percentile (linear) of the resample, bins as in ``bin_ids``."""
    order = np.argsort(conf, kind="stable")
    xs = np.asarray(conf, np.float64)[order]
    gap = (np.asarray(correct, np.float64) - conf)[order]
    q = np.linspace(0, 100, n_bins + 1) / 100  # as np.percentile turns its q into quantiles

    def stat(w: np.ndarray) -> np.ndarray:
        ws = np.atleast_2d(w)[:, order]
        total = ws.sum(axis=1, keepdims=True)
        edges = _lerp_at(xs, np.cumsum(ws, axis=1), (total - 1) * q)  # [R, B+1]
        # bin k holds e_k < x <= e_{k+1}: the questions before searchsorted(xs, e, 'right')
        cut = np.searchsorted(xs, edges[:, 1:-1], side="right")
        bounds = np.concatenate([np.zeros_like(cut[:, :1]), cut, np.full_like(cut[:, :1], len(xs))], axis=1)
        cum = np.concatenate([np.zeros((len(ws), 1)), np.cumsum(ws * gap, axis=1)], axis=1)
        sums = np.diff(np.take_along_axis(cum, bounds, axis=1), axis=1)
        return (np.abs(sums).sum(axis=1) / total[:, 0]).reshape(np.shape(w)[:-1])

    return stat


def _lerp_at(xs: np.ndarray, cum: np.ndarray, virtual: np.ndarray) -> np.ndarray:
    """np.percentile's linear interpolation on the expanded data: xs repeated by counts whose running
    sums are ``cum [R, N]``; ``virtual [R, Q]`` 0-based positions in the expanded sorted list."""
    rows, n = cum.shape
    last = cum[:, -1:] - 1
    lo = np.floor(virtual)
    hi = np.minimum(lo + 1, last)
    t = virtual - lo

    def value(pos: np.ndarray) -> np.ndarray:  # the expanded list's element at pos: #(cum <= pos) per row
        offset = (cum[:, -1:] + 1) * np.arange(rows)[:, None]  # rows laid end to end stay sorted
        flat = np.searchsorted((cum + offset).ravel(), (pos + offset).ravel(), side="right").reshape(pos.shape)
        return xs[flat - n * np.arange(rows)[:, None]]

    a, b = value(lo), value(hi)
    return np.where(t >= 0.5, b - (b - a) * (1 - t), a + (b - a) * t)  # numpy's _lerp, both branches


def _blocks(score: np.ndarray, descending: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sort order of ``score`` and the start of each run of equal values in it (ties)."""
    order = np.argsort(-score if descending else score, kind="stable")
    s = score[order]
    return order, np.flatnonzero(np.r_[True, s[1:] != s[:-1]])


def risk(conf: np.ndarray, correct: np.ndarray) -> tuple[Statistic, Callable[[float], Statistic]]:
    """(AURC, coverage -> accuracy at that coverage) under the tie convention of ``risk_curve``.

    With counts, tie block j of the descending order holds W_j draws with E_j errors and covers
    positions K0+1…K; there the expected errors are E0 + (k − K0)·E_j/W_j, so Σ_k E(k)/k over the block
    is E0·ΔH + rate·(W_j − K0·ΔH), ΔH = H(K) − H(K0) with H the harmonic numbers.
    """
    conf = np.asarray(conf, np.float64)
    order, starts = _blocks(conf, descending=True)
    err = 1.0 - np.asarray(correct, np.float64)[order]
    harmonic = np.r_[0.0, np.cumsum(1.0 / np.arange(1, len(conf) + 1))]

    last: list = [None, None]  # (counts, parts): AURC and the accuracy at a coverage share one resample's sums

    def parts(w: np.ndarray):
        if last[0] is w:  # the same array object (held here, so its id cannot be reused)
            return last[1]
        last[:] = [w, _parts(w)]
        return last[1]

    def _parts(w: np.ndarray):
        ws = np.atleast_2d(w)[:, order]
        big_w = np.add.reduceat(ws, starts, axis=1)
        big_e = np.add.reduceat(ws * err, starts, axis=1)
        k = np.cumsum(big_w, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(big_w > 0, big_e / big_w, 0.0)
        return big_w, k - big_w, np.cumsum(big_e, axis=1) - big_e, rate, k

    def area(w: np.ndarray) -> np.ndarray:
        big_w, k0, e0, rate, k = parts(w)
        dh = harmonic[k.astype(np.int64)] - harmonic[k0.astype(np.int64)]
        return ((e0 * dh + rate * (big_w - k0 * dh)).sum(axis=1) / k[:, -1]).reshape(np.shape(w)[:-1])

    def accuracy_at(coverage: float) -> Statistic:
        def stat(w: np.ndarray) -> np.ndarray:
            big_w, k0, e0, rate, k = parts(w)
            top = np.maximum(1.0, np.ceil(coverage * k[:, -1:]))
            inside = (k0 < top) & (top <= k)
            errors = np.sum(np.where(inside, e0 + (top - k0) * rate, 0.0), axis=1)
            return (1.0 - errors / top[:, 0]).reshape(np.shape(w)[:-1])
        return stat

    return area, accuracy_at


def auroc(score: np.ndarray, correct: np.ndarray) -> Statistic:
    """AUROC with counts: Σ_blocks pos·(negatives below) + ½·pos·neg, over n_pos·n_neg (ties count ½)."""
    score = np.asarray(score, np.float64)
    order, starts = _blocks(score, descending=False)
    right = np.asarray(correct, np.float64)[order]

    def stat(w: np.ndarray) -> np.ndarray:
        ws = np.atleast_2d(w)[:, order]
        pos = np.add.reduceat(ws * right, starts, axis=1)
        neg = np.add.reduceat(ws * (1.0 - right), starts, axis=1)
        below = np.cumsum(neg, axis=1) - neg
        with np.errstate(invalid="ignore", divide="ignore"):
            out = (pos * below + 0.5 * pos * neg).sum(axis=1) / (pos.sum(axis=1) * neg.sum(axis=1))
        return out.reshape(np.shape(w)[:-1])

    return stat
