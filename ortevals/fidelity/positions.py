"""Fidelity by context length (``ortevals fidelity --by-position``): pure numpy and scipy.

Owns the context-length buckets, each bucket's statistics with intervals, the growth from the first
bucket to the last, and the one-line verdict against the user's KL threshold.

Every window is scored at every position (:attr:`~ortevals.fidelity.windows.WindowPlan.every`), so a
token's *context length* ``c`` is the number of tokens before it in its window (BOS included): the
prediction of token ``j + 1`` from the logits at ``j`` has ``c = j + 1``. A bucket ``[lo, hi)`` holds
the predictions with ``lo ≤ c < hi``; every window contributes the same positions to it, so its
tokens are clustered by window as the overall numbers are (CR1, Student's t with G − 1 degrees of
freedom, :func:`ortevals.report.stats.clustered_interval`). Per bucket:

* ``kl``: mean KL_k(ref‖cand) in nats (the top-k + tail lower bound of :mod:`~ortevals.fidelity.stats`);
* ``same_top1``: the share of tokens where both models' most likely token is the same (its interval clipped
  to [0, 1]);
* ``delta_logp``: mean log p_cand − log p_ref of the actual next token (negative: the candidate gives
  the real text less probability; its mean is the bucket's log perplexity ratio, ln PPL_ref/PPL_cand).

**Growth** is the paired difference of the last bucket's KL and the first's: per window, the mean KL
of its tokens in the last bucket minus the mean in the first, then the mean of those G differences
with its t(G − 1) interval (a one-sample t interval over windows, scipy's ``ttest_1samp``), so each
window is compared with itself.

**Verdict** (``--kl-threshold X``): the first bucket, shortest context first, whose mean KL exceeds X,
with its interval and whether the whole interval lies above X; or the statement that no bucket does.
"""

from __future__ import annotations

import math

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.report.stats import Interval, clustered_interval

DEFAULT_EDGES = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
METRICS = ("kl", "same_top1", "delta_logp")


def bucket_edges(n_ctx: int, given: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The buckets' edges ``[1, …, n_ctx]``: the inner edges ``given`` (``--buckets``), else
    :data:`DEFAULT_EDGES` below ``n_ctx``. Context lengths run from 1 to ``n_ctx − 1``."""
    if given is None:
        inner = [e for e in DEFAULT_EDGES if 1 < e < n_ctx]
    else:
        inner = list(given)
        bad = [e for e in inner if not 1 < e < n_ctx]
        if bad or inner != sorted(set(inner)):
            raise OrtEvalsError(f"--buckets {','.join(map(str, given))}: expected increasing context lengths "
                                f"between 2 and {n_ctx - 1} (the window length --ctx {n_ctx} minus one)")
    return (1, *inner, n_ctx)


def parse_buckets(text: str | None) -> tuple[int, ...] | None:
    """``--buckets 512,2048`` → (512, 2048); a value that is not a comma-separated list of ints is one line."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise OrtEvalsError(f"--buckets {text}: expected comma-separated context lengths, e.g. 512,2048") from None


def _interval(x: np.ndarray, clusters: np.ndarray, share: bool = False) -> dict:
    """Mean, CR1 standard error and t interval; a ``share``'s interval clipped to [0, 1] (with few windows the t
    interval of a share near 1 passes it)."""
    iv = clustered_interval(x, clusters)
    low, high = (max(iv.low, 0.0), min(iv.high, 1.0)) if share else (iv.low, iv.high)
    return {"mean": iv.estimate, "se": iv.se, "ci95": [low, high]}


def by_position(kl: np.ndarray, same_top1: np.ndarray, delta_logp: np.ndarray, clusters: np.ndarray,
                positions: np.ndarray, edges: tuple[int, ...]) -> list[dict]:
    """Each non-empty bucket's statistics: per-token ``[N]`` KL, same-top-1, Δ log p, window and context length."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (positions >= lo) & (positions < hi)
        if not m.any():
            continue
        g = clusters[m]
        out.append({"low": int(lo), "high": int(hi), "tokens": int(m.sum()), "windows": int(len(np.unique(g))),
                    "kl": _interval(kl[m], g), "same_top1": _interval(same_top1[m].astype(np.float64), g, True),
                    "delta_logp": _interval(delta_logp[m], g)})
    return out


def growth(kl: np.ndarray, clusters: np.ndarray, positions: np.ndarray, buckets: list[dict]) -> dict | None:
    """The last bucket's KL minus the first's, paired by window (module docstring); None with one bucket or
    fewer than two windows in both."""
    if len(buckets) < 2:
        return None
    first, last = buckets[0], buckets[-1]
    diffs = []
    for w in np.unique(clusters):
        a = kl[(clusters == w) & (positions >= first["low"]) & (positions < first["high"])]
        b = kl[(clusters == w) & (positions >= last["low"]) & (positions < last["high"])]
        if len(a) and len(b):
            diffs.append(b.mean() - a.mean())
    if len(diffs) < 2:
        return None
    iv = t_interval(np.asarray(diffs))
    return {"from": [first["low"], first["high"]], "to": [last["low"], last["high"]], "windows": len(diffs),
            "mean": iv.estimate, "se": iv.se, "ci95": [iv.low, iv.high]}


def t_interval(d: np.ndarray) -> Interval:
    """Mean of ``d`` ``[G]`` with its 95% one-sample t interval (G − 1 degrees of freedom)."""
    from scipy.stats import t

    mean, se = float(np.mean(d)), float(np.std(d, ddof=1) / math.sqrt(len(d)))
    half = float(t.ppf(0.975, len(d) - 1)) * se
    return Interval(mean, mean - half, mean + half, se)


def verdict(buckets: list[dict], threshold: float, where: str = "context {} tokens") -> dict:
    """Where the mean KL first exceeds ``threshold`` nats (module docstring): ``line`` and the bucket or None;
    ``where`` names a bucket's span in the line."""
    for b in buckets:
        kl = b["kl"]
        if kl["mean"] > threshold:
            lo, hi = kl["ci95"]
            above = "the whole 95% interval above it" if lo > threshold else "its 95% interval reaches below it"
            line = (f"KL first exceeds {threshold:g} nats at {where.format(_span(b))}: {kl['mean']:.4g} "
                    f"[{lo:.4g}, {hi:.4g}] ({above})")
            return {"threshold": threshold, "bucket": [b["low"], b["high"]], "significant": bool(lo > threshold),
                    "line": line}
    worst = max(buckets, key=lambda b: b["kl"]["mean"])
    line = (f"KL stays at or under {threshold:g} nats up to {where.format(buckets[-1]['high'] - 1)} (highest: "
            f"{worst['kl']['mean']:.4g} at {_span(worst)})")
    return {"threshold": threshold, "bucket": None, "significant": False, "line": line}


def position_summary(t, clusters: np.ndarray, positions: np.ndarray, edges: tuple[int, ...],
                     threshold: float | None) -> dict:
    """The summary's ``by_position``: the buckets of :class:`~ortevals.fidelity.stats.TokenStats` ``t`` (window
    ``clusters`` and context ``positions`` ``[N]``), the growth and, with a threshold, the verdict."""
    buckets = by_position(t.kl, t.same_top1, t.lp_cand - t.lp_ref, clusters, positions, edges)
    return {"edges": list(edges), "buckets": buckets, "growth": growth(t.kl, clusters, positions, buckets),
            "verdict": verdict(buckets, threshold) if threshold is not None else None}


def _span(b: dict) -> str:
    return f"{b['low']}-{b['high'] - 1}"


def check_threshold(value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise OrtEvalsError(f"--kl-threshold {value:g}: expected a finite KL divergence >= 0 in nats")


def format_lines(s: dict, title: str = "By context length (tokens before the predicted token)",
                 column: str = "context") -> list[str]:
    """The printed table of a summary's ``by_position`` (and its growth and verdict lines)."""
    bp = s["by_position"]
    lines = ["", f"====== {title}; [95% interval, clustered by {'window' if column == 'context' else 'question'}]) "
                 "======", f"{column:>13} {'tokens':>7} {'KL (nats)':>28} {'same top-1':>26} {'Δ log p':>28}"]
    for b in bp["buckets"]:
        cells = [f"{_cell(b[m], 100 if m == 'same_top1' else 1)}" for m in METRICS]
        lines.append(f"{_span(b):>13} {b['tokens']:>7} {cells[0]:>28} {cells[1]:>26} {cells[2]:>28}")
    g = bp.get("growth")
    if g:
        unit = "windows" if column == "context" else "questions"
        lines.append(f"KL growth from {column} {g['from'][0]}-{g['from'][1] - 1} to {g['to'][0]}-{g['to'][1] - 1}: "
                     f"{g['mean']:+.4g} [{g['ci95'][0]:+.4g}, {g['ci95'][1]:+.4g}] nats (paired by {unit[:-1]}, "
                     f"{g['windows']} {unit})")
    if bp.get("verdict"):
        lines.append(bp["verdict"]["line"])
    return lines


def _cell(x: dict, scale: float) -> str:
    lo, hi = x["ci95"]
    if not math.isfinite(lo):
        return f"{scale * x['mean']:.4g} [n/a]"
    return f"{scale * x['mean']:.4g} [{scale * lo:.4g}, {scale * hi:.4g}]"
