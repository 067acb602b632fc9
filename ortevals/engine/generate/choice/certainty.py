"""Self-certainty of a sample (Kang et al. 2025, "Scalable Best-of-N Selection for Large Language
Models via Self-Certainty"): the mean over its tokens of KL(U || p_t), how far each next-token
distribution p_t is from uniform over the V tokens.

Owns the pure function on a sample's log-prob rows and the running form a sampler keeps per row
(two numbers a row, O(1) memory): per token ``KL(U || p) = -log V - mean_j log p_j``, which from
logits x is ``logsumexp(x) - mean_j x_j - log V`` (no softmax kept). The distribution is the
model's own (temperature 1, no filters), as best@k's log-prob: a filtered distribution gives
tokens probability 0 and an infinite KL. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def row_logsumexp(x: np.ndarray, out: np.ndarray | None = None, top: np.ndarray | None = None) -> np.ndarray:
    """``log sum_j exp(x[r, j])`` of float64 ``[R, V]`` → ``[R]``, shifted by each row's max; ``out``: a
    ``[R, V]`` float64 buffer for the shifted exponentials (else a new one); ``top [R]``: the rows' maxima where
    the caller has them (a float32 row's max, widened, is its float64 copy's max)."""
    top = x.max(axis=1) if top is None else top
    z = np.subtract(x, top[:, None], out=out)
    return top + np.log(np.exp(z, out=z).sum(axis=1))


def certainty_terms(logits: np.ndarray, lse: np.ndarray | None = None) -> np.ndarray:
    """KL(U || softmax(x)) of each row of logits ``[R, V]`` → ``[R]`` (float64). ``lse [R]``: the rows'
    :func:`row_logsumexp` when the caller has it already (the sampler's chosen-token log-probs need it too)."""
    x = np.asarray(logits, dtype=np.float64)
    if lse is None:
        lse = row_logsumexp(x)
    return lse - x.mean(axis=1) - np.log(x.shape[1])


def self_certainty(logprobs: np.ndarray) -> float:
    """A sample's self-certainty from its next-token log-probabilities ``[T, V]`` (row t: log p_t over
    the vocabulary): the mean over its T tokens of ``-log V - mean_j log p_tj``."""
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.ndim != 2 or lp.shape[0] == 0:
        raise ValueError(f"self-certainty needs log-prob rows [T, V] with T >= 1; got shape {lp.shape}")
    return float(np.mean(-np.log(lp.shape[1]) - lp.mean(axis=1)))


class RunningCertainty:
    """Self-certainty of ``rows`` samples accumulated one decode step at a time: a sum and a count a row."""

    def __init__(self, rows: int) -> None:
        self.sums = np.zeros(rows)
        self.counts = np.zeros(rows, dtype=np.int64)

    def add(self, logits: np.ndarray, rows: Sequence[int], lse: np.ndarray | None = None) -> None:
        """The next-token logits ``[A, V]`` of rows ``rows [A]`` at one step (each row's token counts once);
        ``lse [A]`` their log-sum-exp if already computed."""
        idx = np.asarray(rows, dtype=np.int64)
        np.add.at(self.sums, idx, certainty_terms(logits, lse))
        np.add.at(self.counts, idx, 1)

    def values(self) -> np.ndarray:
        """``[rows]`` each row's self-certainty so far (NaN for a row with no token)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.counts > 0, self.sums / np.maximum(self.counts, 1), np.nan)
