"""Selection among K samples by a verifier or by self-certainty: bon@k, weighted_maj@k and variants.

Owns the selection estimators over the K samples of each question, under the two conventions of
report/scaling.py, with its intervals (clustered SE by question, percentile bootstrap over questions)
and points (:class:`~ortevals.report.scaling.CurvePoint`):

search-and-learn's (``src/sal/utils/math.py``), on the *first* k samples, a sample with no
extracted answer voting like any answer (its ``extract_answer`` always returns a string):

- ``bon`` (best-of-N, its ``pred_naive``): the sample of highest verifier score among the first k,
  a tie to the first (a stable sort, descending).
- ``weighted_maj`` (its ``pred_weighted``): each distinct answer among the first k scores the sum of
  its samples' verifier scores, summed in sample order; the highest wins, a tie going to the answer
  seen first.
- ``bon_prm_<agg>``, ``weighted_maj_prm_<agg>``: the same with a PRM's step scores folded by
  ``last``, ``min`` or ``prod`` (engine/generate/search/steps.py :func:`aggregate`, its
  ``aggregate_scores``) as each sample's score.
- ``bon_certainty`` (Kang et al. 2025): the sample of highest self-certainty
  (engine/generate/choice/certainty.py) among the first k.

ortevals' own, each named ``<selector>_avg``: the exact mean over every size-k subset of the K
samples (never one random draw), samples with no extracted answer not voting in the weighted ones (a
subset where none votes is wrong). weighted_maj_avg: for each subset T of a right answer's samples, the
other answers' subsets that lose to T are counted by size (each class's subset sums enumerated once,
``MAX_SUBSETS`` at most) and combined by polynomial products over the classes.

The weighted selectors sum scores and a PRM's ``prod`` multiplies them, as search-and-learn does with
probabilities: a score outside [0, 1] there is a one-line error (every verifier scores a probability:
runtime/reward.py, P(True)). Pure numpy/scipy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import comb

import numpy as np

from ortevals.engine.generate.search.steps import AGGREGATIONS, aggregate
from ortevals.errors import OrtEvalsError
from ortevals.report.scaling import (
    CurvePoint,
    QuestionSamples,
    best_at_k,
    best_avg_at_k,
    classes,
    first_k_vote,
    interval,
    ks_for,
)

MAX_SUBSETS = 2**21  # subsets of one answer's samples weighted_maj_avg@k enumerates (sizes 1..k)
_STANDARD: dict[str, tuple[str, str]] = {  # name → (how it selects, which score)
    "bon": ("best", "verifier"),
    "weighted_maj": ("weighted", "verifier"),
    **{f"bon_prm_{a}": ("best", f"prm_{a}") for a in AGGREGATIONS},
    **{f"weighted_maj_prm_{a}": ("weighted", f"prm_{a}") for a in AGGREGATIONS},
    "bon_certainty": ("best", "certainty"),
}
SELECTORS: dict[str, tuple[str, str]] = {**_STANDARD, **{f"{n}_avg": (f"{how}_avg", src)
                                                         for n, (how, src) in _STANDARD.items()}}
_SCORES = {"verifier": "verifier score", "certainty": "self-certainty",
           **{f"prm_{a}": f"PRM step scores folded by {a}" for a in AGGREGATIONS}}
_HOW = {"best": "the highest {} among the first k samples, ties to the first (search-and-learn's pred_naive)",
        "weighted": "the answer with the largest sum of {} among the first k samples, no answer a vote, ties to the "
                    "first seen (search-and-learn's pred_weighted)",
        "best_avg": "ortevals': the highest {}, expected over every k-subset of the K samples",
        "weighted_avg": "ortevals': the largest sum of {}, expected over every k-subset of the K samples, samples "
                        "with no answer do not vote"}
DEFINITIONS = {n: _HOW[how].format(_SCORES[src]) for n, (how, src) in SELECTORS.items()}  # the console's legend


@dataclass(frozen=True)
class ScoredQuestion:
    """The K samples of one question and what judged them (each in sample order)."""

    samples: QuestionSamples  # answers, correctness, log-probs, tokens (report/scaling.py)
    verifier: tuple[float, ...] | None = None  # [K] an outcome verifier's score (ORM, P(True))
    steps: tuple[tuple[float, ...], ...] | None = None  # [K][steps of sample k] a PRM's step scores
    certainty: tuple[float, ...] | None = None  # [K] self-certainty


def sample_scores(q: ScoredQuestion, source: str) -> np.ndarray | None:
    """``[K]`` each sample's score from ``source`` (verifier | certainty | prm_last | prm_min |
    prm_prod); None when the question has no such score."""
    if source.startswith("prm_"):
        return None if q.steps is None else np.array([aggregate(s, source[4:]) for s in q.steps])
    values = {"verifier": q.verifier, "certainty": q.certainty}[source]
    return None if values is None else np.asarray(values, dtype=np.float64)


def _subsets(members: list[int], weights: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """For sizes j = 0..k: (sums ``[C(n, j)]`` added in sample order, first sample ``[C(n, j)]``)."""
    n = len(members)
    total = sum(comb(n, j) for j in range(1, min(n, k) + 1))
    if total > MAX_SUBSETS:
        raise OrtEvalsError(f"weighted_maj_avg@{k}: one answer has {n} samples ({total} subsets to enumerate, "
                            f"at most {MAX_SUBSETS}); use a smaller k")
    out = [(np.zeros(1), np.full(1, len(weights)))]  # the empty subset: sum 0, never first
    for j in range(1, min(n, k) + 1):
        picks = np.array(list(combinations(members, j)), dtype=np.int64)
        sums = weights[picks[:, 0]]
        for col in range(1, j):  # left to right, as a running sum over the subset would
            sums = sums + weights[picks[:, col]]
        out.append((sums, picks[:, 0]))
    return out


def _losers(table, s: np.ndarray, f: np.ndarray, k: int) -> np.ndarray:
    """``[len(s), k + 1]``: per subset T (sum s, first sample f) of the answer that should win, the
    subsets of another answer by size that lose to it: sum below s, or equal with a later first
    sample (the empty subset always)."""
    out = np.zeros((len(s), k + 1))
    out[:, 0] = 1.0
    for j in range(1, min(len(table) - 1, k) + 1):
        sums, first = table[j]
        order = np.lexsort((-first, sums))  # by sum, then later first sample first
        ss, ff = sums[order], first[order]
        lo, hi = np.searchsorted(ss, s, "left"), np.searchsorted(ss, s, "right")
        out[:, j] = lo
        for t in np.flatnonzero(hi > lo):  # exact ties: only those starting after f lose
            out[t, j] += np.count_nonzero(ff[lo[t]:hi[t]] > f[t])
    return out


def weighted_maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], weights: Sequence[float],
                      k: int) -> float:
    """search-and-learn's weighted vote of the first k samples: 1.0 when it elects a right answer, else 0.0."""
    return first_k_vote(answers, correct, k, weights)


def weighted_maj_avg_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], weights: Sequence[float],
                          k: int) -> float:
    """P(the weighted-majority answer of a random k-subset is right) (see the module docstring)."""
    w = np.asarray(weights, dtype=np.float64)
    found = classes(answers, correct)
    tables = [_subsets(members, w, k) for members, _ in found]
    abstain = sum(a is None for a in answers)
    base = np.array([float(comb(abstain, j)) for j in range(k + 1)])
    total = 0.0
    for c, (members, right) in enumerate(found):
        if not right:
            continue
        for t in range(1, min(len(members), k) + 1):
            s, f = tables[c][t]
            ways = np.broadcast_to(base[:k - t + 1], (len(s), k - t + 1)).copy()
            for o, other in enumerate(tables):
                if o != c:
                    lose = _losers(other, s, f, k - t)
                    ways = np.stack([(ways[:, :j + 1] * lose[:, j::-1]).sum(axis=1)
                                     for j in range(k - t + 1)], axis=1)  # truncated polynomial product
            total += float(ways[:, k - t].sum())
    return total / comb(len(answers), k)


def per_question(questions: Sequence[ScoredQuestion], name: str, k: int) -> np.ndarray:
    """``[Q]`` the expected value of selector ``name`` at k for each question."""
    if name not in SELECTORS:
        raise OrtEvalsError(f"unknown selector {name!r}; expected one of {', '.join(SELECTORS)}")
    how, source = SELECTORS[name]
    pick = {"best": best_at_k, "best_avg": best_avg_at_k}.get(how)
    vote = {"weighted": weighted_maj_at_k, "weighted_avg": weighted_maj_avg_at_k}.get(how)
    out = []
    for q in questions:
        scores = sample_scores(q, source)
        if scores is None or len(scores) != len(q.samples.answers) or not np.all(np.isfinite(scores)):
            raise OrtEvalsError(f"{name}@k needs one finite {source} score per sample; got "
                                f"{None if scores is None else scores.tolist()}")
        if vote is not None and not np.all((scores >= 0) & (scores <= 1)):
            raise OrtEvalsError(f"{name}@k sums {source} scores as probabilities, as search-and-learn does; got "
                                f"{scores.tolist()}, outside [0, 1] (a classifier's logits? runtime/reward.py maps "
                                "them to probabilities)")
        s = q.samples
        out.append(pick(s.correct, scores.tolist(), k) if pick is not None else vote(s.answers, s.correct, scores, k))
    return np.array(out)


def available(questions: Sequence[ScoredQuestion]) -> list[str]:
    """The selectors every question has scores for, in SELECTORS order."""
    return [n for n, (_, src) in SELECTORS.items() if all(sample_scores(q, src) is not None for q in questions)]


def selection_curves(questions: Sequence[ScoredQuestion], names: Sequence[str] | None = None) -> list[CurvePoint]:
    """Every selector (default: those with scores) at k = 1, 2, 4, …, K, with intervals and tokens."""
    sizes = {len(q.samples.answers) for q in questions}
    if len(sizes) != 1:
        raise OrtEvalsError(f"every question needs the same number of samples; got {sorted(sizes)}")
    k_max = sizes.pop()
    toks = [q.samples.tokens for q in questions]
    per_sample = float(np.mean([np.mean(t) for t in toks])) if all(toks) else float("nan")
    points = []
    for name in (available(questions) if names is None else names):
        for k in ks_for(k_max):
            v = per_question(questions, name, k)
            points.append(CurvePoint(name, k, float(v.mean()), *interval(v), tokens=k * per_sample))
    return points
