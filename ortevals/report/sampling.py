"""``--sample N``: a random sample of a test set that stands for the whole set, and the whole-set estimate.

Pure numpy (scipy's normal quantile). Three steps:

* :func:`allocate`: N questions shared among the strata (MMLU-Pro's categories, or a group's tasks) in
  proportion to their sizes, by largest remainder, at least one each when N is at least the number of strata;
* :func:`draw`: that many questions of each stratum, without replacement, from a seeded generator;
* :func:`estimate`: the whole-set accuracy from the sample: each stratum's accuracy weighted by its real size
  (the stratified estimator, unbiased for the whole-set mean), its variance with the finite-population
  correction, and a 95% interval (``INTERVAL``: Wilson's score interval on the design's effective sample size).

Why that interval: the stratified normal interval (estimate ± 1.96 SE) is exact in the limit, but at small N
and accuracies near 0 or 1 its variance estimate is often near 0 (a stratum of 3 questions with none right has
a sample variance of 0) and it undercovers; Wilson's interval on the effective size n_eff = p(1-p)/Var (Kish's
design effect, finite-population correction included) keeps away from 0 and 1 and covers in simulation
(tests/test_sampling.py: 95% intervals on MMLU-Pro's real category sizes, N from 14 to 1000). A stratum
sampled once has no sample variance: it counts with the largest a 0/1 outcome can have (1/4), a conservative
choice. :func:`record` is what ``results.json`` keeps (``results["sample"]``) and :func:`lines` what a run prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import norm

from ortevals.errors import OrtEvalsError

LEVEL = 0.95
INTERVAL = ("Wilson score interval on the effective sample size of the stratified estimator (categories weighted "
            "by their real sizes, finite-population corrected)")


@dataclass(frozen=True)
class Estimate:
    """The whole-set accuracy from a stratified sample: ``value`` in [low, high] at ``level``."""

    value: float  # sum_h W_h * p_h, W_h = N_h / N
    se: float  # sqrt(sum_h W_h^2 (1 - n_h/N_h) s_h^2 / n_h)
    low: float
    high: float
    effective_n: float  # p(1-p) / se^2: the simple random sample this sample is worth (inf: the whole set)
    questions: int  # scored questions
    population: int  # questions in the whole set
    level: float = LEVEL


def allocate(sizes, n: int) -> np.ndarray:
    """``n`` questions shared among strata of ``sizes`` [K] (int): proportional, largest remainder (ties to the
    earlier stratum), then at least one per stratum when ``n >= K`` (taken from the stratum furthest above its
    quota). Returns [K] int64 counts, each at most its stratum's size, summing to ``n``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if not 0 < n <= total:
        raise OrtEvalsError(f"--sample {n}: expected 1 to {total} (the questions in the test set)")
    quota = n * sizes / total
    out = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - out), kind="stable")
    out[order[:n - int(out.sum())]] += 1
    if n >= len(sizes):
        for h in np.flatnonzero((out == 0) & (sizes > 0)):
            donor = int(np.argmax(np.where(out > 1, out - quota, -np.inf)))
            out[donor] -= 1
            out[h] += 1
    return out


def draw(strata, n: int, seed: int) -> np.ndarray:
    """A stratified sample of ``n`` positions of ``strata`` ([M] stratum codes 0..K-1 of the whole set's
    questions): :func:`allocate`'s count of each stratum drawn without replacement with ``numpy``'s PCG64 seeded
    by ``seed``. Returns [n] int64 positions, ascending."""
    strata = np.asarray(strata)
    codes = np.unique(strata)
    members = [np.flatnonzero(strata == c) for c in codes]
    counts = allocate([len(m) for m in members], n)
    rng = np.random.default_rng(seed)
    picked = [rng.choice(m, size=k, replace=False) for m, k in zip(members, counts)]
    return np.sort(np.concatenate(picked)).astype(np.int64)


def estimate(sizes, taken, right, level: float = LEVEL) -> Estimate:
    """The whole-set accuracy from a stratified sample. ``sizes`` [K]: each stratum's questions in the whole
    set; ``taken`` [K]: scored in the sample (>= 1 where the stratum has questions); ``right`` [K]: of those,
    correct. Returns :class:`Estimate` (the stratified estimator, its finite-population-corrected SE and
    ``INTERVAL``)."""
    sizes, taken, right = (np.asarray(a, dtype=np.float64) for a in (sizes, taken, right))
    if np.any((taken < 1) & (sizes > 0)) or np.any(taken > sizes) or np.any(right > taken) or np.any(right < 0):
        raise OrtEvalsError("a stratified estimate needs every stratum sampled, at most its size, right <= taken")
    weight = sizes / sizes.sum()
    p_h = right / taken
    s2 = np.where(taken > 1, p_h * (1 - p_h) * taken / np.maximum(taken - 1, 1), 0.25)
    var = float(np.sum(weight**2 * (1 - taken / sizes) * s2 / taken))
    p = float(np.sum(weight * p_h))
    n, population = int(taken.sum()), int(sizes.sum())
    if var <= 0:  # every stratum whole, or every stratum all right / all wrong: the design's size with its FPC
        n_eff = np.inf if n == population else n / (1 - n / population)
    else:
        n_eff = p * (1 - p) / var if 0 < p < 1 else n / (1 - n / population)
    low, high = wilson(p, n_eff, level)
    return Estimate(p, float(np.sqrt(var)), low, high, float(n_eff), n, population, level)


def wilson(p: float, n: float, level: float = LEVEL) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``p`` over ``n`` (real-valued: an effective size; inf: exact)."""
    if not np.isfinite(n):
        return p, p
    z = float(norm.ppf(0.5 + level / 2))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, float(centre - half)), min(1.0, float(centre + half))


def record(n: int, seed: int, strata_by: str, names, sizes, taken, right) -> dict:
    """``results["sample"]``: the draw (N, seed, what the strata are, each stratum's size, questions taken and
    right) and the whole-set :func:`estimate` with the interval's name."""
    est = estimate(sizes, taken, right)
    return {"n": n, "seed": seed, "strata_by": strata_by, "population": est.population,
            "strata": [{"name": str(a), "size": int(b), "taken": int(c), "right": int(d)}
                       for a, b, c, d in zip(names, sizes, taken, right)],
            "estimate": {**asdict(est), "interval": INTERVAL}}


def lines(sample: dict) -> list[str]:
    """What a run prints about its sample (under the table)."""
    e = sample["estimate"]
    return [f"--sample {sample['n']} (seed {sample['seed']}): {e['questions']} of the {e['population']} questions, "
            f"drawn at random within each {sample['strata_by']} ({len(sample['strata'])}) in proportion to its "
            f"size; whole-set accuracy estimate {e['value']:.4f}, {e['level']:.0%} interval "
            f"[{e['low']:.4f}, {e['high']:.4f}] (Wilson on the effective size, finite-population corrected)"]
