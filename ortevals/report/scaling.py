"""Inference-time scaling estimators over K samples per question: maj@k, pass@k, best-of-k.

Owns the statistics of ``--samples K`` (docs/decoding.md) for each k in 1, 2, 4, …, K, under two
conventions, each under its own name (:data:`DEFINITIONS`):

The standard ones, equal to the definition their name has elsewhere: the *first* k samples.

- ``maj@k``: lm-eval's (its ``take_first_k`` then ``majority_vote`` filters): the most frequent
  extracted answer among the first k samples, a sample with none (lm-eval's ``[invalid]``) voting
  like any answer, a tie going to the answer seen first (``Counter.most_common``).
- ``pass@k``: at least one of k samples is correct, the unbiased estimator over all K:
  ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021; lm-eval's and search-and-learn's).
- ``best@k``: the sample with the highest score (the model's own confidence) among the first k, a
  tie to the first; the score is the log-prob of the whole sequence, the EOS that ended it
  included, per scored token (generated tokens + that EOS; report/samples.py ``best_of_k_score``),
  so a sample that ends at once scores log p(EOS) rather than 0.

ortevals' own, named ``_avg``: the expected value over every size-k subset of the K samples
(exact, never one random draw), smoother than one draw of k.

- ``maj_avg@k`` (self-consistency, Wang et al. 2023): samples with no extracted answer (None) do
  not vote; a subset with no vote is wrong. Ties among the most frequent answers are broken
  uniformly at random, so a subset where the right answer ties with t others counts 1/(t + 1).
  Exact combinatorics (a DP over answer classes), no enumeration.
- ``best_avg@k``: best@k's score over every subset; equal scores ranked by sample index. Sample r
  in the descending order is chosen in C(K - 1 - r, k - 1) of the C(K, k) subsets.

Per-question values are averaged over questions; the interval is a percentile bootstrap over
questions (report/stats.py ``bootstrap_interval``), the stderr the clustered one (questions are the
clusters: std of the per-question values / sqrt(n)). :func:`classes` groups a question's samples by
answer for every vote here and in report/selection.py. Pure numpy/scipy; :func:`curve_plot` imports
matplotlib.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from math import comb
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.files import atomic_write_bytes
from ortevals.report import plots
from ortevals.report.stats import bootstrap_interval

ESTIMATORS = ("maj", "pass", "best", "maj_avg", "best_avg")
DEFINITIONS = {  # each estimator in one line: the console's legend and results.json's ``scaling.estimators``
    "maj": "lm-eval's maj@k: majority vote of the first k samples, no answer ([invalid]) a vote, ties to the first "
           "seen",
    "pass": "pass@k, the unbiased estimator over all K samples (Chen et al. 2021)",
    "best": "the highest mean log-prob (EOS included) among the first k samples, ties to the first",
    "maj_avg": "ortevals' maj@k: expected majority vote over every k-subset of the K samples, samples with no "
               "answer do not vote, ties at random",
    "best_avg": "ortevals' best@k: expected over every k-subset of the K samples",
}


@dataclass(frozen=True)
class QuestionSamples:
    """The K samples of one question."""

    answers: tuple[Hashable | None, ...]  # [K] the task's extracted answer (None: nothing extracted)
    correct: tuple[bool, ...]  # [K] the task's metric on each sample
    mean_logprob: tuple[float, ...] | None = None  # [K] log-prob per scored token, EOS included (best-of-k)
    tokens: tuple[int, ...] | None = None  # [K] generated tokens per sample


@dataclass(frozen=True)
class CurvePoint:
    estimator: str  # maj | pass | best | maj_avg | best_avg, or a selector of report/selection.py
    k: int
    value: float  # mean over questions
    stderr: float  # clustered by question
    low: float  # 95% percentile-bootstrap interval over questions
    high: float
    tokens: float  # expected generated tokens per question for k samples (k × mean per sample)


def ks_for(k_max: int) -> list[int]:
    """1, 2, 4, … up to K, and K itself."""
    ks = [1 << i for i in range(k_max.bit_length()) if 1 << i <= k_max]
    return ks + ([k_max] if ks[-1] != k_max else [])


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def best_avg_at_k(correct: Sequence[bool], score: Sequence[float], k: int) -> float:
    """P(the highest-scoring of a random k-subset is correct); ties ranked by sample index."""
    n = len(correct)
    order = sorted(range(n), key=lambda i: (-score[i], i))
    return sum(comb(n - 1 - r, k - 1) for r, i in enumerate(order) if correct[i]) / comb(n, k)


def best_at_k(correct: Sequence[bool], score: Sequence[float], k: int) -> float:
    """1.0 when the highest-scoring of the first k samples (a tie to the first) is correct, else 0.0
    (search-and-learn's ``pred_naive``: a stable sort by score, descending)."""
    first = sorted(range(k), key=lambda i: -score[i])[0]
    return float(bool(correct[first]))


def classes(answers: Sequence[Hashable | None], correct: Sequence[bool],
            none_votes: bool = False) -> list[tuple[list[int], bool]]:
    """Each distinct answer's sample indices (ascending) and whether it is right, in order of first sight;
    samples with no answer (None) form a class of their own where ``none_votes`` (lm-eval's ``[invalid]``,
    search-and-learn's empty extraction), else none. An answer scored both right and wrong is an error."""
    idx: dict[Hashable, list[int]] = {}
    right: dict[Hashable, bool] = {}
    for i, (a, c) in enumerate(zip(answers, correct, strict=True)):
        if a is None and not none_votes:
            continue
        idx.setdefault(a, []).append(i)
        if right.setdefault(a, bool(c)) != bool(c):
            raise OrtEvalsError(f"answer {a!r} is scored both right and wrong among one question's samples")
    return [(idx[a], right[a]) for a in idx]


def first_k_vote(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int,
                 weights: Sequence[float] | None = None) -> float:
    """1.0 when the vote of the first k samples elects a right answer, else 0.0: each answer (None too) scores
    its samples' count, or the sum of their ``weights`` added in sample order; the highest wins, a tie going to
    the answer seen first (lm-eval's ``majority_vote``, search-and-learn's ``find_answer_with_largest_sum``)."""
    votes = classes(answers[:k], correct[:k], none_votes=True)
    tally = [float(len(members)) if weights is None else _ordered_sum(weights, members) for members, _ in votes]
    return float(votes[int(np.argmax(tally))][1])  # argmax: the first of the largest


def _ordered_sum(weights: Sequence[float], members: Sequence[int]) -> float:
    total = 0.0
    for i in members:
        total += float(weights[i])
    return total


def _ways_others(counts: Sequence[int], abstain: int, k: int, m: int) -> np.ndarray:
    """``[k+1, T+1]``: ways to take j samples from the other classes (each at most m) and the
    non-voters, by j and by the number t of other classes taken exactly m times."""
    ways = np.zeros((k + 1, len(counts) + 1))
    ways[:, 0] = [comb(abstain, j) for j in range(k + 1)]
    for n_o in counts:
        nxt = np.zeros_like(ways)
        for j in range(min(n_o, m) + 1):
            shifted = np.zeros_like(ways)
            shifted[j:] = ways[:k + 1 - j]
            if j == m:
                shifted = np.roll(shifted, 1, axis=1)  # t + 1 (the last column is always empty)
            nxt += comb(n_o, j) * shifted
        ways = nxt
    return ways


def maj_at_k(q: QuestionSamples, k: int) -> float:
    """lm-eval's maj@k of one question: 1.0 when the majority of its first k samples is right (module doc)."""
    return first_k_vote(q.answers, q.correct, k)


def maj_avg_at_k(q: QuestionSamples, k: int) -> float:
    """P(majority vote of a random k-subset is right), ties broken uniformly (see the module doc)."""
    found = classes(q.answers, q.correct)
    counts, right, abstain = [len(m) for m, _ in found], [r for _, r in found], q.answers.count(None)
    total = 0.0
    for c, (n_c, ok) in enumerate(zip(counts, right, strict=True)):
        if not ok:
            continue
        others = counts[:c] + counts[c + 1:]
        for m in range(1, min(n_c, k) + 1):
            ways = _ways_others(others, abstain, k, m)[k - m]
            total += comb(n_c, m) * float(np.sum(ways / np.arange(1, len(others) + 2)))
    return total / comb(len(q.answers), k)


def per_question(questions: Sequence[QuestionSamples], estimator: str, k: int) -> np.ndarray:
    """``[Q]`` the expected value of one estimator at k for each question."""
    if estimator == "pass":
        return np.array([pass_at_k(len(q.correct), sum(map(bool, q.correct)), k) for q in questions])
    if estimator in ("maj", "maj_avg"):
        return np.array([(maj_at_k if estimator == "maj" else maj_avg_at_k)(q, k) for q in questions])
    if estimator in ("best", "best_avg"):
        if any(q.mean_logprob is None for q in questions):
            raise OrtEvalsError("best-of-k needs each sample's mean log-prob")
        pick = best_at_k if estimator == "best" else best_avg_at_k
        return np.array([pick(q.correct, q.mean_logprob, k) for q in questions])
    raise OrtEvalsError(f"unknown estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")


def interval(values: np.ndarray) -> tuple[float, float, float]:
    """(stderr, low, high) of the mean over questions: clustered SE and a 95% percentile bootstrap."""
    if len(values) < 2:
        return float("nan"), float("nan"), float("nan")
    se = float(np.std(values, ddof=1) / np.sqrt(len(values)))
    if np.ptp(values) == 0:
        return se, float(values[0]), float(values[0])
    found = bootstrap_interval((values,), np.mean)
    return se, found.low, found.high


def scaling_curves(questions: Sequence[QuestionSamples],
                   estimators: Sequence[str] = ESTIMATORS) -> list[CurvePoint]:
    """Every estimator at k = 1, 2, 4, …, K (K: the samples per question, the same for all)."""
    sizes = {len(q.answers) for q in questions}
    if len(sizes) != 1 or any(len(q.correct) != len(q.answers) for q in questions):
        raise OrtEvalsError(f"every question needs the same number of samples; got {sorted(sizes)}")
    k_max = sizes.pop()
    per_sample = float(np.mean([np.mean(q.tokens) for q in questions])) if all(q.tokens for q in questions) \
        else float("nan")
    points = []
    for est in estimators:
        if est.startswith("best") and any(q.mean_logprob is None for q in questions):
            continue
        for k in ks_for(k_max):
            v = per_question(questions, est, k)
            points.append(CurvePoint(est, k, float(v.mean()), *interval(v), tokens=k * per_sample))
    return points


def lm_eval_metrics(points: Sequence[CurvePoint], filter_name: str | None = None) -> dict[str, float]:
    """lm-eval's results layout: one metric per k, ``maj@4`` and ``maj@4_stderr`` (``,filter`` appended)."""
    tail = f",{filter_name}" if filter_name else ""
    out: dict[str, float] = {}
    for p in points:
        out[f"{p.estimator}@{p.k}{tail}"] = p.value
        out[f"{p.estimator}@{p.k}_stderr{tail}"] = p.stderr
    return out


def curve_plot(points: Sequence[CurvePoint], path: str | Path, title: str = "") -> Path:
    """Accuracy against k (log2 axis) and against generated tokens per question; 95% intervals as bands."""
    plt, fig, axes = plots.figure(10, 4, cols=2, sharey=True)
    styles = {"maj": ("o", "-"), "pass": ("s", "--"), "best": ("^", ":"),  # curves that coincide stay visible
              "maj_avg": ("o", "-."), "best_avg": ("^", (0, (1, 3)))}
    for est in ESTIMATORS:
        pts = [p for p in points if p.estimator == est]
        if not pts:
            continue
        marker, line = styles[est]
        for ax, xs in ((axes[0], [p.k for p in pts]), (axes[1], [p.tokens for p in pts])):
            ax.plot(xs, [p.value for p in pts], marker=marker, linestyle=line, markerfacecolor="none",
                    label=f"{est}@k")
            ax.fill_between(xs, [p.low for p in pts], [p.high for p in pts], alpha=0.15)
    axes[0].set_xscale("log", base=2)
    ks = sorted({p.k for p in points})
    axes[0].set_xticks(ks, [str(k) for k in ks])  # 1, 2, 4, … rather than 2^0, 2^1, …
    axes[0].minorticks_off()
    top = max([p.high for p in points if np.isfinite(p.high)] + [p.value for p in points], default=1.0)
    upper = min(1.0, max(0.05, 1.1 * top))
    axes[0].set_ylim(-0.02 * upper, upper)  # accuracies: 0 to 1 at most (a sliver below 0 keeps 0 visible)
    axes[0].set_xlabel("k (samples)")
    axes[1].set_xlabel("generated tokens per question")
    axes[0].set_ylabel("accuracy")
    axes[0].legend()
    if title:
        fig.suptitle(title)
    path = Path(path)
    atomic_write_bytes(path, plots.png(plt, fig, dpi=120))
    return path
