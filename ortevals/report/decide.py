"""Deciding a comparison with the fewest questions: an anytime-valid confidence sequence for the whole-set accuracy
difference, the stopping rule with a margin, and its replay over random orders of two complete runs.

Pure numpy. The setting: a test set of N questions, each with a paired outcome d_i = candidate_i - reference_i in
{-1, 0, 1}; the target is the whole-set difference Δ = mean(d). Questions are scored in a uniformly random order,
without replacement, and looked at after every part.

The sequence (:class:`ConfidenceSequence`) is Waudby-Smith & Ramdas's hedged betting confidence sequence for
sampling without replacement ("Confidence sequences for sampling without replacement", NeurIPS 2020: their hedged
capital process with predictable plug-in bets). On x = (d + 1) / 2 in [0, 1] with mean m:

* under uniform sampling without replacement, the t-th question's expected x given the first t-1 is
  mu_t(m) = (N m - sum_{i<t} x_i) / (N - t + 1);
* for each candidate m, K+_t(m) = prod_i (1 + l+_i (x_i - mu_i(m))) and K-_t(m) = prod_i (1 - l-_i (x_i - mu_i(m)))
  with bets l±_i chosen from the first i-1 outcomes only (predictable) and kept in [0, c / mu_i] and
  [0, c / (1 - mu_i)] (c = 3/4), so every factor is positive: each is a nonnegative martingale with mean 1 at the
  true m, and so is the hedge K = (K+ + K-) / 2;
* Ville's inequality: P(sup_t K_t(m_true) >= 1/alpha) <= alpha, so the set of m never rejected,
  C_t = {m : K_s(m) < 1/alpha for every s <= t}, holds the true m at every t at once with probability >= 1 - alpha:
  an interval read at a time chosen by looking at the data (a stopping time) still covers with 1 - alpha.

Δ takes only the values k/N (k = -N..N), so the candidates are exactly those 2N+1 values (no grid rounding); a
candidate is dropped once its capital reaches 1/alpha or the outcomes seen rule it out (the rest of the set cannot
make up the difference). Looking only at the end of each part (not after every question) is fewer looks, so the
guarantee is unchanged. If the true value was dropped (an event of probability at most alpha) and every other
candidate is dropped later too, the set keeps the possible value nearest it rather than going empty. The interval
reported is the smallest and largest candidate left: the sequence's hull, never narrower than the set.
The bets are WSR's plug-in l_t = sqrt(2 log(2/alpha) / (s2_{t-1} t log(t+1))),
s2 the running variance of x with a prior of 1/4: it adapts to the flip rate, so a pair of runs that rarely
disagree (mostly x = 1/2) narrows fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.errors import OrtEvalsError

C_BET = 0.75  # the bets' cap, as a share of the largest bet that keeps a factor positive (WSR's c)
DECISIONS = ("equivalent", "worse", "better", "cap")


class ConfidenceSequence:
    """The hedged without-replacement betting sequence for the mean paired difference of a set of ``population``
    questions (module docstring). :meth:`update` takes the next outcomes in order; :attr:`low`/:attr:`high` bound Δ
    at level 1 - ``alpha``, valid at every time at once."""

    def __init__(self, population: int, alpha: float = 0.05) -> None:
        if population < 1 or not 0 < alpha < 1:
            raise OrtEvalsError(f"a confidence sequence needs a set of >= 1 question and 0 < alpha < 1, got "
                                f"{population} and {alpha}")
        self.n, self.alpha, self.t = population, alpha, 0
        self.k = np.arange(-population, population + 1)  # candidates: Δ = k / N; their N*m in x units: (k+N)/2
        self.log_plus = np.zeros(len(self.k))
        self.log_minus = np.zeros(len(self.k))
        self.sum_x = 0.0  # x seen so far
        self.sum_dev = 0.0  # sum of (x_i - running mean before i)^2: the plug-in variance
        self.sum_d = 0

    @property
    def low(self) -> float:
        return float(self.k[0]) / self.n

    @property
    def high(self) -> float:
        return float(self.k[-1]) / self.n

    @property
    def estimate(self) -> float:
        """The mean difference of the questions seen (unbiased for Δ under a uniformly random order)."""
        return self.sum_d / self.t if self.t else 0.0

    def update(self, d) -> None:
        """The next outcomes ``d`` [b] in {-1, 0, 1}, in the order drawn."""
        d = np.asarray(d)
        if d.size == 0:
            return
        if self.t + d.size > self.n or d.dtype.kind not in "iub" or np.abs(d).max() > 1:
            raise OrtEvalsError(f"a paired difference is -1, 0 or 1, and at most {self.n} of them")
        x = (d.astype(np.float64) + 1) / 2
        i = self.t + np.arange(d.size)  # 0-based draw index: draw i+1 of N
        before = self.sum_x + np.cumsum(x) - x  # sum of x before each draw
        mean_before = (0.5 + before) / (i + 1)
        dev = (x - mean_before) ** 2
        var_before = (0.25 + self.sum_dev + np.cumsum(dev) - dev) / (i + 1)
        bet = np.sqrt(2 * np.log(2 / self.alpha) / (var_before * (i + 1) * np.log(i + 2)))
        mu = ((self.k[None, :] + self.n) / 2 - before[:, None]) / (self.n - i)[:, None]
        mu = np.clip(mu, 1e-12, 1 - 1e-12)  # ruled-out candidates only (dropped below)
        step = x[:, None] - mu
        plus = self.log_plus + np.log1p(np.minimum(bet[:, None], C_BET / mu) * step).sum(axis=0)
        minus = self.log_minus + np.log1p(-np.minimum(bet[:, None], C_BET / (1 - mu)) * step).sum(axis=0)
        hedge = np.logaddexp(plus, minus) - np.log(2)  # read at the end of the part only: fewer looks, still valid
        self.t += d.size
        self.sum_x += float(x.sum())
        self.sum_dev += float(dev.sum())
        self.sum_d += int(d.sum())
        rest = self.n - self.t  # the questions not seen can move the total sum of d by at most rest either way
        possible = np.abs(self.k - self.sum_d) <= rest
        keep = possible & (hedge < np.log(1 / self.alpha))
        if keep.any():
            self.k, self.log_plus, self.log_minus = self.k[keep], plus[keep], minus[keep]
        else:  # the truth was dropped at an earlier look (probability <= alpha): the possible value nearest the set
            nearest = int(np.clip(self.k[np.argmin(hedge)], self.sum_d - rest, self.sum_d + rest))
            self.k, self.log_plus, self.log_minus = np.array([nearest]), plus[:1] * 0, minus[:1] * 0


@dataclass(frozen=True)
class Decision:
    """Where the stopping rule stopped: ``decision`` one of :data:`DECISIONS`, after ``used`` questions."""

    decision: str
    used: int
    population: int
    low: float  # the sequence's interval for Δ (fractions, not points)
    high: float
    estimate: float  # the mean difference of the questions used
    flips: int  # questions used where the two runs disagree (d != 0)
    margin: float
    alpha: float


def verdict(low: float, high: float, margin: float) -> str | None:
    """equivalent (the interval inside ±margin), worse (wholly below -margin), better (wholly above +margin), or
    None: not decided."""
    if -margin <= low and high <= margin:
        return "equivalent"
    if high < -margin:
        return "worse"
    if low > margin:
        return "better"
    return None


def run_rule(d, population: int, margin: float, alpha: float = 0.05, part: int = 50,
             cap: int | None = None) -> Decision:
    """The stopping rule over ``d`` [n <= population] (the paired differences in the order scored): update the
    sequence a ``part`` at a time and stop at the first part after which :func:`verdict` decides, or at ``cap``
    questions (default: all of ``d``), then ``cap``. ``margin`` is a fraction (0.01 = one point)."""
    d = np.asarray(d)
    if margin <= 0 or part < 1:
        raise OrtEvalsError(f"the decision needs a margin > 0 and parts of >= 1 question, got {margin} and {part}")
    cs = ConfidenceSequence(population, alpha)
    limit = len(d) if cap is None else min(cap, len(d))
    decided = None
    while cs.t < limit and decided is None:
        cs.update(d[cs.t:min(cs.t + part, limit)])
        decided = verdict(cs.low, cs.high, margin)
    return Decision(decided or "cap", cs.t, population, cs.low, cs.high, cs.estimate,
                    int(np.count_nonzero(d[:cs.t])), margin, alpha)


@dataclass(frozen=True)
class Replay:
    """The stopping rule replayed over ``orders`` random orders of two complete runs (:func:`replay`)."""

    population: int
    full: float  # the whole-set difference (candidate - reference), a fraction
    flips: int  # questions where the two runs disagree, over the whole set
    margin: float
    alpha: float
    part: int
    seed: int
    used: np.ndarray  # [orders] questions used by each order
    low: np.ndarray  # [orders] the final interval of each order
    high: np.ndarray
    decisions: tuple[str, ...]  # [orders]

    @property
    def misses(self) -> int:
        """Orders whose final interval does not hold the whole-set difference."""
        return int(np.count_nonzero((self.low > self.full) | (self.high < self.full)))

    @property
    def miss_rate(self) -> float:
        return self.misses / len(self.used)


def paired(candidate, reference) -> np.ndarray:
    """The paired differences [N] in {-1, 0, 1} of two runs' 0/1 correctness [N] on the same questions."""
    c, r = np.asarray(candidate, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if c.shape != r.shape or c.ndim != 1 or not np.isin(c, (0, 1)).all() or not np.isin(r, (0, 1)).all():
        raise OrtEvalsError("a paired comparison needs two runs' 0/1 scores on the same questions")
    return (c - r).astype(np.int64)


def replay(candidate, reference, margin: float, alpha: float = 0.05, orders: int = 200, part: int = 50,
           cap: int | None = None, seed: int = 0) -> Replay:
    """The stopping rule (:func:`run_rule`) over ``orders`` uniformly random orders (numpy PCG64 from ``seed``) of
    two complete runs' 0/1 correctness ([N] each, the same questions): how often the final interval misses the
    whole-set difference (at most ``alpha`` for a valid sequence, up to Monte Carlo error) and how many questions
    each order used."""
    d = paired(candidate, reference)
    rng = np.random.default_rng(seed)
    done = [run_rule(d[rng.permutation(len(d))], len(d), margin, alpha, part, cap) for _ in range(orders)]
    return Replay(len(d), float(d.mean()), int(np.count_nonzero(d)), margin, alpha, part, seed,
                  np.array([x.used for x in done]), np.array([x.low for x in done]),
                  np.array([x.high for x in done]), tuple(x.decision for x in done))


def replay_lines(r: Replay) -> list[str]:
    """What ``ortevals compare --replay-decide`` prints."""
    counts = ", ".join(f"{name} {r.decisions.count(name)}" for name in DECISIONS if name in r.decisions)
    median, p90 = np.median(r.used), np.percentile(r.used, 90)
    return [f"replay of the decision at ±{100 * r.margin:g} points, alpha {r.alpha:g}, over {len(r.used)} random "
            f"orders (seed {r.seed}, parts of {r.part}) of {r.population} questions:",
            f"  whole-set difference {100 * r.full:+.2f} points, {r.flips} flips ({r.flips / r.population:.1%})",
            f"  decisions: {counts}",
            f"  questions used: median {median:.0f} ({median / r.population:.0%}), p90 {p90:.0f} "
            f"({p90 / r.population:.0%})",
            f"  final interval missed the whole-set difference in {r.misses} of {len(r.used)} orders "
            f"({r.miss_rate:.1%}; a valid sequence misses at most {r.alpha:.0%}, up to Monte Carlo error)"]
