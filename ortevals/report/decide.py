"""Deciding a comparison with the fewest questions: an anytime-valid confidence sequence for the whole-set accuracy
difference, the stopping rule with a margin, and its replay over random orders of two complete runs.

Pure numpy. The setting: a test set of N questions, each with a paired outcome d_i = candidate_i - reference_i in
{-1, 0, 1}; the target is the whole-set difference Δ = mean(d) = D / N. Questions are scored one after another,
without replacement, and looked at after every part. The order is uniformly random, or reference-guided
(report/guided.py): each next question drawn with probability q_t(i) = w_i / sum of w over the questions left,
fixed weights w > 0 from the reference alone. A uniform order is the case w = 1.

The sequence (:class:`ConfidenceSequence`) is Waudby-Smith & Ramdas's hedged betting confidence sequence for
sampling without replacement ("Confidence sequences for sampling without replacement", NeurIPS 2020), on Des Raj's
increments for the weighted draw (as in Shekhar, Xu, Harchaoui & Ramdas 2023's audits by weighted sampling without
replacement). With R_t the questions left before draw t (|R_t| = N - t + 1) and S_{t-1} the sum of d drawn:

* the increment y_t = d_I / (q_t(I) |R_t|) has, given the draws so far, mean sum_{R_t} d / |R_t|, which under a
  candidate total D = k is mu_t(k) = (k - S_{t-1}) / |R_t|: y_t - mu_t(k_true) is a martingale difference. In a
  uniform order y_t = d_I and mu_t is WSR's remaining mean; |y_t| <= B_t = mean of w over R_t / min w;
* for each candidate k and each bet size, K+_t(k) = prod_i (1 + l_i (y_i - mu_i(k))) and
  K-_t(k) = prod_i (1 - l_i (y_i - mu_i(k))) with bets l_i chosen from the first i-1 draws only (predictable) and
  capped at c / (B_i + mu_i) and c / (B_i - mu_i) (c = 3/4), so every factor is positive: each is a nonnegative
  martingale with mean 1 at the true k, and so is their average K over both signs and every bet size (an
  average of test martingales is one);
* Ville's inequality: P(sup_t K_t(k_true) >= 1/alpha) <= alpha, so the set of k never rejected,
  C_t = {k : K_s(k) < 1/alpha for every s <= t}, holds the true D at every t at once with probability >= 1 - alpha:
  an interval read at a time chosen by looking at the data (a stopping time) still covers with 1 - alpha.

Nothing in this needs the weights to be good: any fixed positive weights (or none) give a valid sequence; weights
that draw the questions likely to flip first make the increments' variance smaller, and the sequence narrower.

Δ takes only the values k/N (k = -N..N), so the candidates are exactly those 2N+1 values (no grid rounding); a
candidate is dropped once its capital reaches 1/alpha or the outcomes seen rule it out (the rest of the set cannot
make up the difference). Looking only at the end of each part (not after every question) is fewer looks, so the
guarantee is unchanged. If the true value was dropped (an event of probability at most alpha) and every other
candidate is dropped later too, the set keeps the possible value nearest it rather than going empty. The interval
reported is the smallest and largest candidate left: the sequence's hull, never narrower than the set.
The bets are WSR's plug-in tuned for n questions, l_t = sqrt(2 log(2/alpha) / (s2_{t-1} n)), s2 the running
variance of y with a prior of 1 (the largest for d): it adapts to the flip rate, so a pair of runs that rarely
disagree narrows fast. One bet is tuned for each n in N, N/2, N/4, ... down to 64 questions (:func:`tuned_for`) and
their capitals are averaged: whichever number of questions the decision turns out to need, a bet tuned near it
carries the average, at the price of log(number of bets) in the threshold (on simulated sets of 3,000 questions
this needed 25-45% fewer questions than WSR's all-times plug-in sqrt(2 log(2/alpha) / (s2 t log(t+1)))).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.report.guided import guided_order, guided_weights

SHORTEST = 64  # the fewest questions a bet is tuned for (the bets: N, N/2, N/4, ... down to this)
C_BET = 0.75  # the bets' cap, as a share of the largest bet that keeps a factor positive (WSR's c)
DECISIONS = ("equivalent", "worse", "better", "cap")
ORDERS = ("uniform", "guided")


class ConfidenceSequence:
    """The hedged without-replacement betting sequence for the mean paired difference of a set of ``population``
    questions (module docstring). :meth:`update` takes the next outcomes in order; :attr:`low`/:attr:`high` bound Δ
    at level 1 - ``alpha``, valid at every time at once.

    ``weights`` [population] > 0: the questions are drawn one at a time with probability proportional to their
    weight among those not drawn yet (report/guided.py's reference-guided order), and :meth:`update` is told which
    were drawn; the sequence is then the weighted form in the module docstring (Des Raj's increments). None: a
    uniformly random order."""

    def __init__(self, population: int, alpha: float = 0.05, weights=None) -> None:
        if population < 1 or not 0 < alpha < 1:
            raise OrtEvalsError(f"a confidence sequence needs a set of >= 1 question and 0 < alpha < 1, got "
                                f"{population} and {alpha}")
        self.n, self.alpha, self.t = population, alpha, 0
        self.k = np.arange(-population, population + 1)  # candidates: Δ = k / N, k the whole-set sum of d
        self.targets = tuned_for(population)
        self.log_capital = np.zeros((2, len(self.targets), len(self.k)))  # [+/-, bets, candidates]
        self.sum_y = 0.0  # increments y seen so far (y = d in a uniform order)
        self.sum_dev = 0.0  # sum of (y_i - running mean before i)^2: the plug-in variance
        self.sum_d = 0
        self.sum_total = 0.0  # Des Raj's estimates of the whole-set sum of d, one per draw, added up
        self.weights = None if weights is None else _checked_weights(weights, population)
        if self.weights is not None:
            self.left = float(self.weights.sum())  # weight of the questions not drawn yet
            self.lightest = float(self.weights.min())
            self.drawn = np.zeros(population, dtype=bool)

    @property
    def low(self) -> float:
        return float(self.k[0]) / self.n

    @property
    def high(self) -> float:
        return float(self.k[-1]) / self.n

    @property
    def estimate(self) -> float:
        """Unbiased for Δ: the mean difference of the questions seen in a uniform order; in a weighted one, the mean
        of Des Raj's per-draw estimates (the difference itself once every question is seen)."""
        if not self.t:
            return 0.0
        if self.weights is None or self.t == self.n:
            return self.sum_d / self.t if self.weights is None else self.sum_d / self.n
        return self.sum_total / (self.t * self.n)

    def _scales(self, drawn, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Per draw: y / d (the remaining weight's mean over the drawn question's weight) and the bound on |y|."""
        if self.weights is None:
            return np.ones(size), np.ones(size)
        drawn = np.asarray(drawn) if drawn is not None else np.zeros(0, dtype=np.int64)
        if (drawn.shape != (size,) or drawn.dtype.kind not in "iu" or len(np.unique(drawn)) != size
                or drawn.min() < 0 or drawn.max() >= self.n or self.drawn[drawn].any()):
            raise OrtEvalsError(f"a weighted sequence needs the {size} drawn questions' positions, each once")
        w = self.weights[drawn]
        mean_left = (self.left - (np.cumsum(w) - w)) / (self.n - self.t - np.arange(size))
        self.drawn[drawn] = True
        self.left -= float(w.sum())
        return mean_left / w, mean_left / self.lightest

    def update(self, d, drawn=None) -> None:
        """The next outcomes ``d`` [b] in {-1, 0, 1}, in the order drawn; with ``weights``, ``drawn`` [b] the
        positions (in the set) of the questions they belong to."""
        d = np.asarray(d)
        if d.size == 0:
            return
        if self.t + d.size > self.n or d.dtype.kind not in "iub" or np.abs(d).max() > 1:
            raise OrtEvalsError(f"a paired difference is -1, 0 or 1, and at most {self.n} of them")
        ratio, bound = self._scales(drawn, d.size)
        y = d * ratio
        i = self.t + np.arange(d.size)  # 0-based draw index: draw i+1 of N
        sum_before = self.sum_d + np.cumsum(d) - d  # sum of d before each draw
        mean_before = (self.sum_y + np.cumsum(y) - y) / (i + 1)  # a prior of 0, as one draw
        dev = (y - mean_before) ** 2
        var_before = (1 + self.sum_dev + np.cumsum(dev) - dev) / (i + 1)  # a prior of 1, as one draw
        mu = (self.k[None, :] - sum_before[:, None]) / (self.n - i)[:, None]  # the rest's mean under each k
        mu = np.clip(mu, -1 + 1e-12, 1 - 1e-12)  # ruled-out candidates only (dropped below)
        step, bound = y[:, None] - mu, bound[:, None]
        capital = self.log_capital.copy()
        for j, bet in enumerate(self._bets(var_before, i)):
            capital[0, j] += np.log1p(np.minimum(bet[:, None], C_BET / (bound + mu)) * step).sum(axis=0)
            capital[1, j] += np.log1p(-np.minimum(bet[:, None], C_BET / (bound - mu)) * step).sum(axis=0)
        # the average of every capital, read at the end of the part only: fewer looks, still valid
        mixed = np.logaddexp.reduce(capital.reshape(-1, len(self.k)), axis=0) - np.log(capital[:, :, 0].size)
        self.t += d.size
        self.sum_y += float(y.sum())
        self.sum_dev += float(dev.sum())
        self.sum_total += float((sum_before + y * (self.n - i)).sum())
        self.sum_d += int(d.sum())
        self._drop(capital, mixed)

    def _bets(self, var_before, i) -> list[np.ndarray]:
        """Each bet's size per draw [b], before the caps: WSR's plug-in tuned for n questions,
        sqrt(2 log(2/alpha) / (s2 n)), for each n in :func:`tuned_for`."""
        return [np.sqrt(2 * np.log(2 / self.alpha) / (var_before * n)) for n in self.targets]

    def _drop(self, capital, mixed) -> None:
        rest = self.n - self.t  # the questions not seen can move the total sum of d by at most rest either way
        possible = np.abs(self.k - self.sum_d) <= rest
        keep = possible & (mixed < np.log(1 / self.alpha))
        if keep.any():
            self.k, self.log_capital = self.k[keep], capital[:, :, keep]
        else:  # the truth was dropped at an earlier look (probability <= alpha): the possible value nearest the set
            nearest = int(np.clip(self.k[np.argmin(mixed)], self.sum_d - rest, self.sum_d + rest))
            self.k, self.log_capital = np.array([nearest]), capital[:, :, :1] * 0


def tuned_for(population: int) -> tuple[float, ...]:
    """The numbers of questions the mixed bets are tuned for: N, N/2, N/4, ... while at least :data:`SHORTEST`."""
    out = [population / 2 ** j for j in range(64) if population / 2 ** j >= SHORTEST]
    return tuple(out) or (float(population),)


def _checked_weights(weights, population: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (population,) or not np.isfinite(w).all() or (w <= 0).any():
        raise OrtEvalsError(f"a weighted sequence needs {population} finite weights above 0")
    return w


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
             cap: int | None = None, weights=None, drawn=None) -> Decision:
    """The stopping rule over ``d`` [n <= population] (the paired differences in the order scored): update the
    sequence a ``part`` at a time and stop at the first part after which :func:`verdict` decides, or at ``cap``
    questions (default: all of ``d``), then ``cap``. ``margin`` is a fraction (0.01 = one point). A weighted
    (reference-guided) order passes the set's ``weights`` [population] and ``drawn`` [n], the positions of ``d``'s
    questions in the set (:class:`ConfidenceSequence`)."""
    d = np.asarray(d)
    if margin <= 0 or part < 1:
        raise OrtEvalsError(f"the decision needs a margin > 0 and parts of >= 1 question, got {margin} and {part}")
    cs = ConfidenceSequence(population, alpha, weights)
    limit = len(d) if cap is None else min(cap, len(d))
    decided = None
    while cs.t < limit and decided is None:
        end = min(cs.t + part, limit)
        cs.update(d[cs.t:end], None if drawn is None else np.asarray(drawn)[cs.t:end])
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
    order: str = "uniform"  # or "guided": drawn by the reference's choice margins (report/guided.py)

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
           cap: int | None = None, seed: int = 0, order: str = "uniform", reference_margin=None) -> Replay:
    """The stopping rule (:func:`run_rule`) over ``orders`` random orders (numpy PCG64 from ``seed``) of two complete
    runs' 0/1 correctness ([N] each, the same questions): how often the final interval misses the whole-set
    difference (at most ``alpha`` for a valid sequence, up to Monte Carlo error) and how many questions each order
    used. ``order`` "uniform": uniformly random orders; "guided": drawn by the reference's choice margins
    ``reference_margin`` [N] (report/guided.py's weights and order)."""
    d = paired(candidate, reference)
    if order not in ORDERS:
        raise OrtEvalsError(f"order {order!r}: expected one of {', '.join(ORDERS)}")
    if order == "guided" and (reference_margin is None or np.shape(reference_margin) != d.shape):
        raise OrtEvalsError(f"a guided order needs the reference's choice margin of each of the {len(d)} questions")
    weights = guided_weights(reference_margin) if order == "guided" else None
    rng = np.random.default_rng(seed)
    done = []
    for _ in range(orders):
        drawn = rng.permutation(len(d)) if weights is None else guided_order(weights, rng)
        done.append(run_rule(d[drawn], len(d), margin, alpha, part, cap, weights, drawn))
    return Replay(len(d), float(d.mean()), int(np.count_nonzero(d)), margin, alpha, part, seed,
                  np.array([x.used for x in done]), np.array([x.low for x in done]),
                  np.array([x.high for x in done]), tuple(x.decision for x in done), order)


def replay_lines(r: Replay) -> list[str]:
    """What ``ortevals compare --replay-decide`` prints."""
    counts = ", ".join(f"{name} {r.decisions.count(name)}" for name in DECISIONS if name in r.decisions)
    median, p90 = np.median(r.used), np.percentile(r.used, 90)
    return [f"replay of the decision at ±{100 * r.margin:g} points, alpha {r.alpha:g}, over {len(r.used)} {r.order} "
            f"random orders (seed {r.seed}, parts of {r.part}) of {r.population} questions:",
            f"  whole-set difference {100 * r.full:+.2f} points, {r.flips} flips ({r.flips / r.population:.1%})",
            f"  decisions: {counts}",
            f"  questions used: median {median:.0f} ({median / r.population:.0%}), p90 {p90:.0f} "
            f"({p90 / r.population:.0%})",
            f"  final interval missed the whole-set difference in {r.misses} of {len(r.used)} orders "
            f"({r.miss_rate:.1%}; a valid sequence misses at most {r.alpha:.0%}, up to Monte Carlo error)"]
