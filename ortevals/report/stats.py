"""Pure statistics on per-question arrays: intervals, paired differences, flips, KL.

Every function takes numpy arrays of per-question values (N questions, C
choices) and returns numbers or frozen dataclasses; nothing here reads files.
scipy provides the exact binomial (McNemar, Wilson), the t quantiles, KL
(``scipy.special.rel_entr``) and the bootstrap.

The bootstrap, ONE convention for every interval ortevals draws by resampling
(``compare``'s Δ check, calibration, the ``--samples`` curves): :func:`bootstrap`,
scipy's ``stats.bootstrap`` over questions, percentile, 95%, ``RESAMPLES``
resamples drawn by ``np.random.default_rng(SEED)`` (scipy's ``rng=``).

Clustered intervals, ONE convention for ``ortevals compare`` and ``ortevals
fidelity`` (docs/compare.md): the cluster-robust (CR1) variance of a mean over G
clusters, ``G/(G−1) · Σ_g (Σ_{i∈g} (x_i − x̄))² / N²`` (Miller 2024, "Adding Error
Bars to Evals", eq. 4, with the small-sample factor G/(G−1) that Stata and
statsmodels apply), and a two-sided interval from Student's t with G−1 degrees of
freedom. With every question its own cluster (G = N) this is the textbook
``std(x, ddof=1)/√N`` with t(N−1). 14 MMLU-Pro categories give t(13): 2.16 in place
of 1.96, and the factor 14/13 on the variance.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95%
Z80 = 0.8416212335729143  # one-sided 80% power
FEW_QUESTIONS = 300  # under this, the power line warns
MARGIN_BINS = (0.0, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 1.0)  # edges on the reference's top-1 margin
RESAMPLES = 2000  # every bootstrap's resamples
SEED = 0  # and its generator's seed


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    se: float = float("nan")


@dataclass(frozen=True)
class Flips:
    correct_to_wrong: int
    wrong_to_correct: int
    answer_changes: int  # any different answer, wrong -> other wrong included
    agreement: float  # share of questions with the same answer


@dataclass(frozen=True)
class Distribution:
    """Mean ± SE (questions independent) and percentiles of a per-question quantity."""

    mean: float
    se: float
    p50: float
    p90: float
    p99: float
    max: float
    rms: float


@dataclass(frozen=True)
class MarginBin:
    low: float
    high: float
    n: int
    answer_changes: int
    flips: int  # correctness changed

    @property
    def change_rate(self) -> float:
        return self.answer_changes / self.n if self.n else float("nan")


def wilson(k: int, n: int) -> Interval:
    """Accuracy k/n with its 95% Wilson score interval (scipy's binomtest)."""
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=0.95, method="wilson")
    return Interval(k / n, float(ci.low), float(ci.high))


def _cluster_index(clusters: np.ndarray | None, n: int) -> tuple[np.ndarray, int]:
    """([N] cluster index, G); None: every observation its own cluster."""
    if clusters is None:
        return np.arange(n), n
    labels = np.asarray(clusters)
    if labels.dtype.kind not in "biuf":  # category names, maybe mixed with None: compare as text
        labels = labels.astype(object).astype(str)
    _, inverse = np.unique(labels, return_inverse=True)
    return inverse.reshape(-1), int(inverse.max()) + 1 if n else 0


def clustered_cov(x: np.ndarray, y: np.ndarray, clusters: np.ndarray | None = None) -> float:
    """CR1 covariance of the means of ``x`` and ``y`` ``[N]`` with cluster labels ``[N]`` (None: one
    cluster per observation); nan with fewer than 2 clusters."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    index, g = _cluster_index(clusters, len(x))
    if g < 2:
        return float("nan")
    sx = np.bincount(index, weights=x - x.mean(), minlength=g)
    sy = np.bincount(index, weights=y - y.mean(), minlength=g)
    return float(g / (g - 1) * (sx * sy).sum() / len(x) ** 2)


def clustered_mean(x: np.ndarray, clusters: np.ndarray | None = None) -> tuple[float, float]:
    """Mean of ``x`` ``[N]`` and its CR1 standard error (nan with fewer than 2 clusters)."""
    return float(np.mean(x)), float(np.sqrt(clustered_cov(x, x, clusters)))


def t_critical(clusters: int, level: float = 0.95) -> float:
    """The two-sided ``level`` quantile of Student's t with G−1 degrees of freedom (nan for G < 2)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, clusters - 1)) if clusters >= 2 else float("nan")


def n_clusters(clusters: np.ndarray | None, n: int) -> int:
    return _cluster_index(clusters, n)[1]


def clustered_interval(x: np.ndarray, clusters: np.ndarray | None = None, level: float = 0.95) -> Interval:
    """Mean of ``x`` ``[N]`` with its CR1 standard error and t(G−1) interval (module docstring)."""
    mean, se = clustered_mean(x, clusters)
    half = t_critical(n_clusters(clusters, len(x)), level) * se
    return Interval(mean, mean - half, mean + half, se)


def paired_delta(ref: np.ndarray, run: np.ndarray, clusters: np.ndarray | None = None) -> Interval:
    """Δ accuracy (run − ref) with a 95% cluster-robust interval (CR1, t with G−1 df).

    ref, run: [N] 0/1 scores of the same questions; clusters: [N] labels (categories), or None for
    one cluster per question.
    """
    d = np.asarray(run, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    return clustered_interval(d, clusters)


def bootstrap(data: tuple[np.ndarray, ...], statistic: Callable, resamples: int = RESAMPLES, seed: int = SEED,
              **options):
    """scipy's ``stats.bootstrap`` of ``statistic`` over ``data`` (questions along the last axis): percentile, 95%,
    ``resamples`` drawn by ``np.random.default_rng(seed)``; ``options``: ``paired``, ``vectorized``, ``batch``.
    A statistic that is constant over resamples (ECE of identical runs) is fine: scipy's warning is dropped."""
    from scipy.stats import DegenerateDataWarning
    from scipy.stats import bootstrap as scipy_bootstrap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateDataWarning)
        return scipy_bootstrap(data, statistic, n_resamples=resamples, confidence_level=0.95, method="percentile",
                               rng=np.random.default_rng(seed), **options)


def bootstrap_interval(data: tuple[np.ndarray, ...], statistic: Callable, **options) -> Interval:
    """One scalar statistic's :func:`bootstrap`: (NaN, low, high, standard error)."""
    res = bootstrap(data, statistic, **options)
    ci = res.confidence_interval
    return Interval(float("nan"), float(ci.low), float(ci.high), float(res.standard_error))


def bootstrap_delta(ref: np.ndarray, run: np.ndarray) -> Interval:
    """Δ accuracy with the paired percentile :func:`bootstrap`: a check on the analytic interval."""
    d = np.asarray(run, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    if len(d) < 2 or np.all(d == d[0]):  # no spread: the bootstrap distribution is a point
        return Interval(float(d.mean()), float(d.mean()), float(d.mean()), 0.0)
    found = bootstrap_interval((np.asarray(ref, float), np.asarray(run, float)),
                               lambda a, b, axis=-1: np.mean(b - a, axis=axis), paired=True, vectorized=True)
    return Interval(float(d.mean()), found.low, found.high, found.se)


def mcnemar_p(correct_to_wrong: int, wrong_to_correct: int) -> float:
    """McNemar's exact two-sided p: the discordant pairs against Binomial(b + c, 1/2)."""
    from scipy.stats import binomtest

    b, c = int(correct_to_wrong), int(wrong_to_correct)
    if b + c == 0:
        return 1.0
    return float(min(1.0, binomtest(min(b, c), b + c, 0.5).pvalue))


def flips(ref_correct: np.ndarray, run_correct: np.ndarray, ref_answer, run_answer) -> Flips:
    """Counts over [N] questions: correctness flips both ways, answer changes and agreement."""
    rc, uc = np.asarray(ref_correct) == 1, np.asarray(run_correct) == 1
    same = np.array([a == b for a, b in zip(ref_answer, run_answer)], dtype=bool)
    return Flips(int(np.sum(rc & ~uc)), int(np.sum(~rc & uc)), int(np.sum(~same)),
                 float(same.mean()) if len(same) else float("nan"))


def kl(logp: np.ndarray, logq: np.ndarray, axis: int = -1) -> np.ndarray:
    """KL(p‖q) in nats along ``axis`` from log-probabilities (``-inf`` where a distribution has no mass):
    Σ p·(log p − log q), each term as ``scipy.special.rel_entr`` defines it (0 where p is 0, inf where q is 0
    and p is not) but computed from the log-probabilities, so a log q below −745 (exp underflows to 0) is a
    tiny term, not inf; never below 0 (a negative sum is rounding: KL ≥ 0); [N, C] -> [N] for ``compare``'s
    choice distributions, [n, k+1] -> [n] for ``fidelity``'s top-k with its tail."""
    logp, logq = np.asarray(logp, dtype=np.float64), np.asarray(logq, dtype=np.float64)
    some = logp > -np.inf  # p has mass here (however little)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.where(some, np.exp(logp) * (logp - logq), 0.0)
    terms = np.where(some & (logq == -np.inf), np.inf, terms)  # mass where q has none
    return np.maximum(np.sum(terms, axis=axis), 0.0)


def distribution(x: np.ndarray) -> Distribution:
    """Mean ± SE and percentiles of [N] per-question values."""
    x = np.asarray(x, dtype=np.float64)
    se = float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")
    p50, p90, p99 = (float(v) for v in np.percentile(x, [50, 90, 99]))
    return Distribution(float(x.mean()), se, p50, p90, p99, float(x.max()), float(np.sqrt(np.mean(x**2))))


def top1_margin(logp: np.ndarray) -> np.ndarray:
    """[N, C] log-probabilities -> [N] probability of the top choice minus the runner-up's."""
    p = np.sort(np.exp(logp), axis=1)
    return p[:, -1] - (p[:, -2] if p.shape[1] > 1 else 0.0)


def margin_bins(margin: np.ndarray, changed: np.ndarray, flipped: np.ndarray,
                edges: tuple[float, ...] = MARGIN_BINS) -> tuple[MarginBin, ...]:
    """Answer changes and correctness flips per bin of the reference's margin ([N] each)."""
    idx = np.clip(np.searchsorted(edges, margin, side="right") - 1, 0, len(edges) - 2)
    return tuple(MarginBin(edges[b], edges[b + 1], int(np.sum(idx == b)), int(np.sum(changed[idx == b])),
                           int(np.sum(flipped[idx == b]))) for b in range(len(edges) - 1))


def min_detectable(ref: np.ndarray, run: np.ndarray) -> float:
    """Smallest |Δ accuracy| a paired test on these N questions detects at 5% (two-sided) with 80% power.

    Uses the observed spread of the paired differences; with no discordant pair at all, the
    unpaired bound 2·p(1−p) of the reference accuracy p stands in (it is the larger one).
    """
    d = np.asarray(run, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    var = float(np.var(d))
    if var == 0.0:
        p = float(np.mean(ref))
        var = 2 * p * (1 - p) or 0.5  # accuracy 0 or 1: the worst case p = 1/2
    return (Z95 + Z80) * float(np.sqrt(var / len(d)))


def power_line(n: int, mde: float) -> str:
    size = f"{mde:.1%}" if mde < 1 else "more than 100% (none)"
    line = f"{n} questions detect a difference of {size} (5% two-sided, 80% power)"
    if n < FEW_QUESTIONS:
        line += f"; warning: under {FEW_QUESTIONS} questions, only large differences are visible"
    return line


def holm(pvalues: list[float] | np.ndarray) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values, in the input order."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = len(p)
    order = np.argsort(p)
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out
