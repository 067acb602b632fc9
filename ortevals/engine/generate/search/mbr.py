"""Minimum Bayes Risk selection among K sampled candidates (``mbr_samples``, ``mbr_metric``).

Owns the choice, not the sampling: given K candidate texts, return the one with the highest
expected utility against the others, the others standing in for samples of the model's
distribution (Kumar & Byrne 2004; Eikema & Aziz 2020): ``E[i] = mean_{j != i} u(c_i, c_j)``.
Utilities come from the libraries, never hand-written: ``chrf`` sacrebleu's sentence chrF
(``CHRF().sentence_score(hyp, [ref])``, 0–100 scaled to 0–1), ``rouge`` rouge_score's rougeL F1,
``exact`` string equality. Ties go to the lowest index (the earliest sample). Pure; the metric
libraries are imported only when used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.errors import OrtEvalsError


@dataclass(frozen=True)
class MbrChoice:
    index: int  # the chosen candidate
    expected: tuple[float, ...]  # [K] expected utility of each candidate against the others


def utility(metric: str) -> Callable[[str, str], float]:
    """u(hypothesis, reference) in [0, 1] for ``metric`` (exact | chrf | rouge)."""
    if metric == "exact":
        return lambda hyp, ref: float(hyp == ref)
    if metric == "chrf":
        from sacrebleu.metrics import CHRF

        chrf = CHRF()
        return lambda hyp, ref: chrf.sentence_score(hyp, [ref]).score / 100.0
    if metric == "rouge":
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rougeL"])
        return lambda hyp, ref: scorer.score(ref, hyp)["rougeL"].fmeasure  # score(target, prediction)
    raise OrtEvalsError(f"mbr_metric={metric!r}: expected exact, chrf or rouge")


def utility_matrix(candidates: Sequence[str], metric: str) -> np.ndarray:
    """``[K, K]``: entry (i, j) = u(candidate i as hypothesis, candidate j as reference); diagonal 0."""
    u = utility(metric)
    k = len(candidates)
    out = np.zeros((k, k))
    for i in range(k):
        for j in range(k):
            if i != j:
                out[i, j] = u(candidates[i], candidates[j])
    return out


def mbr_select(candidates: Sequence[str], metric: str = "chrf") -> MbrChoice:
    """The candidate with the highest expected utility against the others (ties: lowest index)."""
    if not candidates:
        raise OrtEvalsError("MBR needs at least one candidate (mbr_samples >= 1)")
    if len(candidates) == 1:
        return MbrChoice(0, (0.0,))
    m = utility_matrix(candidates, metric)
    expected = m.sum(axis=1) / (len(candidates) - 1)
    return MbrChoice(int(np.argmax(expected)), tuple(float(e) for e in expected))  # argmax: first maximum
