"""The reference-guided order of a decided comparison: questions the reference barely decided are drawn first.

Where the reference run is complete, its choice margin on each question (the top log-likelihood minus the second,
:func:`choice_margins`) says where a candidate is likely to flip: a question the reference answered by a hair flips
under a small perturbation of the model, a confident one rarely does. :func:`guided_weights` turns the margins
into sampling weights that grow as the margin shrinks (by rank: the q-th smallest margin of N weighs
((q - 1/2) / N) ** -POWER, so the weights' spread is the same for every benchmark and every scale of
log-likelihood, and the lightest question still weighs 1, a share of the set about 1 - POWER of the average);
:func:`guided_order` draws the questions one at a time, each with probability proportional to its weight among
those not drawn yet (successive sampling, drawn in one go by the Gumbel-top-k trick). The weights depend on the
reference alone, never on the candidate's answers, so the order can be fixed before anything is scored.

The estimator and the confidence sequence for this order are report/decide.py's weighted
:class:`~ortevals.report.decide.ConfidenceSequence` (Des Raj's unbiased increments, bet on as in Waudby-Smith &
Ramdas; its docstring says why it stays valid). Pure numpy.
"""

from __future__ import annotations

import numpy as np

from ortevals.errors import OrtEvalsError

POWER = 0.3  # the weight's power of the margin's rank: 0 is a uniform order


def choice_margins(loglik) -> np.ndarray:
    """The top choice's log-likelihood minus the second's, per question ([N, C] -> [N]); NaN where a question has
    fewer than two finite choices."""
    ll = np.asarray(loglik, dtype=np.float64)
    if ll.ndim != 2:
        raise OrtEvalsError("choice margins need per-choice log-likelihoods [questions, choices]")
    ll = np.where(np.isfinite(ll), ll, -np.inf)
    top = -np.sort(-ll, axis=1)[:, :2] if ll.shape[1] >= 2 else np.full((len(ll), 2), -np.inf)
    finite = np.isfinite(top).all(axis=1)
    return np.where(finite, np.where(finite[:, None], top, 0.0) @ np.array([1.0, -1.0]), np.nan)


def guided_weights(margins, power: float = POWER) -> np.ndarray:
    """Sampling weights [N] >= 1 from the reference's margins [N]: ``u ** -power`` with u = (rank + 1/2) / N, the
    smallest margin ranked 0. A question without a margin (NaN: not a choice question) takes the middle rank."""
    m = np.asarray(margins, dtype=np.float64)
    if m.ndim != 1 or m.size == 0 or not np.isfinite(m).any() or not 0 <= power < 1:
        raise OrtEvalsError("a reference-guided order needs the reference's choice margin on at least one question "
                            "(per-choice log-likelihoods) and a power in [0, 1)")
    rank = np.empty(m.size)
    known = np.isfinite(m)
    rank[np.flatnonzero(known)[np.argsort(m[known], kind="stable")]] = np.arange(known.sum())
    rank = np.where(known, rank * (m.size - 1) / max(known.sum() - 1, 1), (m.size - 1) / 2)
    return ((rank + 0.5) / m.size) ** -power / (1 - 0.5 / m.size) ** -power


def guided_order(weights, rng: np.random.Generator) -> np.ndarray:
    """A permutation [N] drawing each next question with probability proportional to its weight among those left
    (successive sampling without replacement): the Gumbel-top-k trick, keys log(w) + Gumbel noise sorted."""
    w = np.asarray(weights, dtype=np.float64)
    return np.argsort(-(np.log(w) + rng.gumbel(size=w.size)), kind="stable")
