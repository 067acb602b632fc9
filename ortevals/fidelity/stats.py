"""Pure statistics of ``ortevals fidelity``: numpy arrays in, numbers out.

Owns the per-window reductions (a window's log-probs ``[n,V]`` → per-token
statistics, so nothing of size V outlives its window), the top-k KL with a
tail bucket, and the summaries with standard errors clustered by window.

KL with a top-k reference. The reference keeps, per scored token, its top-k
log-probs ``r_i`` (ids ``T``) and its tail mass ``r_tail = 1 − Σ_T p_ref``.
The candidate's mass is grouped the same way: ``q_i`` on ``T`` and
``q_tail = 1 − Σ_T p_cand``. Then

    KL_k = Σ_{i∈T} p_ref_i (log p_ref_i − log q_i) + r_tail (log r_tail − log q_tail)

is the KL divergence between the two distributions coarsened to k+1 outcomes.
By the log-sum inequality, merging outcomes never increases KL, so
``KL_k ≤ KL(ref‖cand)`` (a lower bound), with equality when k = V (the tail is
empty and its term is 0·log 0 = 0) or when the two tails are proportional.

Standard errors are clustered: tokens of one window share their context and
are correlated, so the cluster-robust (CR1) variance of a mean is used,
``G/(G−1) · Σ_g (Σ_{i∈g} (x_i − x̄))² / N²`` over G windows, and the
cross-covariance of two means likewise (for the paired PPL ratio); intervals
use Student's t with G−1 degrees of freedom. The functions are
:mod:`ortevals.report.stats`' own, so ``compare`` and ``fidelity`` share one
convention (docs/compare.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ortevals.report.stats import clustered_cov, clustered_mean, n_clusters, t_critical
from ortevals.report.stats import kl as kl_divergence

PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)


def topk(logp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of ``[n,V]``, sorted by descending value: ids ``[n,k]`` int32, values ``[n,k]``."""
    k = min(k, logp.shape[-1])
    part = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logp, part, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1).astype(np.int32), np.take_along_axis(vals, order, axis=-1)


def tail_logmass(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log of each row's mass outside ``ids``: ``[n,V]``, ``[n,k]`` → ``[n]`` (−inf when k = V).

    A log-sum-exp over the complement, not ``log(1 − Σ top-k)``: the latter
    cancels catastrophically when the top-k hold nearly all the mass.
    """
    rest = np.array(logp, dtype=np.float64, copy=True)
    np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=-1)
    m = rest.max(axis=-1)
    finite = np.isfinite(m)
    safe = np.where(finite, m, 0.0)
    with np.errstate(divide="ignore"):
        out = safe + np.log(np.exp(rest - safe[:, None]).sum(axis=-1))
    return np.where(finite, out, -np.inf)


@dataclass(frozen=True)
class RefTokens:
    """The reference side of n scored tokens (what a reference file stores).

    topk_ids ``[n,k]`` int32 (sorted, most likely first), topk_logp ``[n,k]``,
    tail_logp ``[n]`` (log of 1 − top-k mass), actual_logp ``[n]`` (log-prob of the real next token).
    """

    topk_ids: np.ndarray
    topk_logp: np.ndarray
    tail_logp: np.ndarray
    actual_logp: np.ndarray

    FIELDS = ("topk_ids", "topk_logp", "tail_logp", "actual_logp")

    def __len__(self) -> int:
        return int(self.actual_logp.shape[0])

    def rows(self, rows: slice) -> RefTokens:
        """The tokens ``rows`` of these."""
        return RefTokens(*(getattr(self, f)[rows] for f in self.FIELDS))


@dataclass(frozen=True)
class TokenStats:
    """Per scored token, reference vs candidate; every field ``[n]``."""

    kl: np.ndarray  # KL_k(ref‖cand), nats
    same_top1: np.ndarray  # bool
    overlap: np.ndarray  # |topk_ref ∩ topk_cand| / k
    lp_ref: np.ndarray  # log-prob of the actual next token
    lp_cand: np.ndarray


def reduce_reference(logp: np.ndarray, targets: np.ndarray, k: int) -> RefTokens:
    """A window's reference log-probs ``[n,V]`` and next tokens ``[n]`` → :class:`RefTokens`."""
    ids, vals = topk(logp, k)
    actual = np.take_along_axis(logp, targets[:, None].astype(np.int64), axis=-1)[:, 0]
    return RefTokens(ids, vals, tail_logmass(logp, ids), actual)


def kl_topk(ref_logp: np.ndarray, ref_tail: np.ndarray, cand_logp: np.ndarray, cand_tail: np.ndarray) -> np.ndarray:
    """KL_k per row: ``[n,k]`` log-probs of both on the reference's top-k, ``[n]`` log tail masses → ``[n]``."""
    ref_logp = np.asarray(ref_logp, np.float64)
    ref_tail = np.asarray(ref_tail, np.float64)
    # renormalize the reference's k+1 outcomes: a float32 file rounds each log-prob by up to |log p|·2⁻²⁴,
    # and an unnormalized P leaves that rounding in KL at first order (±1e-7 per token); normalized, it is
    # second order (~1e-13). On float64 log-probs the shift is ~1e-16.
    z = np.logaddexp(np.logaddexp.reduce(ref_logp, axis=-1), ref_tail)
    ref = np.concatenate([ref_logp - z[:, None], (ref_tail - z)[:, None]], axis=-1)
    cand = np.concatenate([np.asarray(cand_logp, np.float64), np.asarray(cand_tail, np.float64)[:, None]], axis=-1)
    return kl_divergence(ref, cand)  # report/stats.py: rel_entr over the k+1 outcomes (an empty tail adds 0·log 0 = 0)


def compare_window(ref: RefTokens, cand_logp: np.ndarray, targets: np.ndarray) -> TokenStats:
    """The candidate's log-probs ``[n,V]`` of one window against the reference's top-k → :class:`TokenStats`."""
    ids = ref.topk_ids.astype(np.int64)
    k = ids.shape[1]
    at_ref = np.take_along_axis(cand_logp, ids, axis=-1)
    kl = kl_topk(ref.topk_logp, ref.tail_logp, at_ref, tail_logmass(cand_logp, ids))
    cand_ids, _ = topk(cand_logp, k)
    in_ref = np.zeros(cand_logp.shape, dtype=bool)
    np.put_along_axis(in_ref, ids, True, axis=-1)
    overlap = np.take_along_axis(in_ref, cand_ids.astype(np.int64), axis=-1).sum(axis=-1) / k
    same = cand_logp.argmax(axis=-1) == ids[:, 0]
    lp_cand = np.take_along_axis(cand_logp, targets[:, None].astype(np.int64), axis=-1)[:, 0]
    return TokenStats(kl, same, overlap, np.asarray(ref.actual_logp, np.float64), lp_cand)


def concat_stats(parts: list[TokenStats]) -> TokenStats:
    return TokenStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                        ("kl", "same_top1", "overlap", "lp_ref", "lp_cand")))


def percentiles(x: np.ndarray) -> dict[str, float]:
    """min, the :data:`PERCENTILES` (numpy's linear interpolation) and max of ``x``."""
    vals = np.percentile(np.asarray(x, np.float64), PERCENTILES)
    out = {"min": float(np.min(x))}
    out.update({f"p{p:g}": float(v) for p, v in zip(PERCENTILES, vals)})
    out["max"] = float(np.max(x))
    return out


def ppl_ratio(lp_ref: np.ndarray, lp_cand: np.ndarray, clusters: np.ndarray) -> dict[str, float]:
    """PPL_cand / PPL_ref from the actual tokens' log-probs ``[N]``, with a paired clustered interval.

    ln ratio = mean(nll_cand − nll_ref): its SE comes from the per-token
    differences (so the covariance of the two NLLs is accounted for), the
    ratio's SE by the delta method (ratio · SE), and the 95% interval is the
    exponential of the log-ratio interval (t with G−1 degrees of freedom, G windows).
    """
    z = t_critical(n_clusters(clusters, len(lp_ref)))
    nll_ref, nll_cand = -np.asarray(lp_ref, np.float64), -np.asarray(lp_cand, np.float64)
    log_ratio, se = clustered_mean(nll_cand - nll_ref, clusters)
    m_ref, se_ref = clustered_mean(nll_ref, clusters)
    m_cand, se_cand = clustered_mean(nll_cand, clusters)
    cov = clustered_cov(nll_ref, nll_cand, clusters)
    ratio = math.exp(log_ratio)
    return {"ppl_ref": math.exp(m_ref), "ppl_ref_se": math.exp(m_ref) * se_ref,
            "ppl_cand": math.exp(m_cand), "ppl_cand_se": math.exp(m_cand) * se_cand,
            "cor_ln_ppl": cov / (se_ref * se_cand) if se_ref > 0 and se_cand > 0 else math.nan,
            "log_ratio": log_ratio, "log_ratio_se": se, "ratio": ratio, "ratio_se": ratio * se,
            "ratio_ci95": [math.exp(log_ratio - z * se), math.exp(log_ratio + z * se)]}


def summarize(t: TokenStats, clusters: np.ndarray) -> dict:
    """Every printed statistic of :class:`TokenStats` over N tokens in windows ``clusters`` ``[N]``."""
    dp = np.exp(t.lp_cand) - np.exp(t.lp_ref)
    kl_mean, kl_se = clustered_mean(t.kl, clusters)
    top1, top1_se = clustered_mean(t.same_top1.astype(np.float64), clusters)
    ov, ov_se = clustered_mean(t.overlap, clusters)
    dp_mean, dp_se = clustered_mean(dp, clusters)
    sq_mean, sq_se = clustered_mean(dp**2, clusters)
    rms = math.sqrt(sq_mean)
    return {
        "tokens": int(len(t.kl)), "windows": int(len(np.unique(clusters))),
        "kl": {"mean": kl_mean, "se": kl_se, **percentiles(t.kl)},
        "same_top1": {"mean": top1, "se": top1_se},
        "topk_overlap": {"mean": ov, "se": ov_se},
        "delta_p": {"mean": dp_mean, "se": dp_se, "rms": rms, "rms_se": sq_se / (2 * rms) if rms > 0 else 0.0,
                    **percentiles(dp)},
        "ppl": ppl_ratio(t.lp_ref, t.lp_cand, clusters),
    }
