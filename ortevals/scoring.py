"""Scoring math: pure functions on numpy arrays, no runtime.

Owns log-softmax, the log-probability of a continuation and lm-eval's greedy
flag, computed only on the rows that are needed (one per continuation token),
and the finite-ness check that turns an fp16 overflow into an error instead of
a silently wrong average.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortevals.errors import OrtEvalsError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in float32 (``[..., V]`` -> ``[..., V]``)."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def continuation_logprob(rows: np.ndarray, targets: Sequence[int]) -> tuple[float, bool]:
    """Score a continuation from the logits rows that predict it.

    rows: ``[L, V]`` logits, where row j predicts ``targets[j]`` (row i of a
    forward pass predicts token i+1, so these are the L rows ending one before
    the last input position + 1). targets: L token ids.
    Returns (sum of log-probabilities, whether every target is the argmax).
    """
    rows = np.asarray(rows)
    tgt = np.asarray(targets, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[0] != tgt.shape[0]:
        raise ValueError(f"rows {rows.shape} do not match {tgt.shape[0]} targets")
    lp = log_softmax(rows)
    picked = lp[np.arange(tgt.shape[0]), tgt]
    greedy = bool((rows.argmax(axis=-1) == tgt).all())
    return float(picked.sum(dtype=np.float64)), greedy


def check_finite(value: float, what: str) -> float:
    """Refuse NaN/inf scores (e.g. fp16 overflow) with the request named."""
    if not np.isfinite(value):
        raise OrtEvalsError(
            f"non-finite log-likelihood ({value}) for {what}; the model overflowed "
            "(fp16?). No score was recorded for it"
        )
    return value


def input_window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[int, ...]:
    """The tokens fed to the model, as lm-eval's hf backend builds them.

    ``(context + continuation)[-(max_length + 1):][:-1]``: left-truncated so
    that the last continuation token is predicted, never fed.
    """
    if not continuation:
        raise ValueError("continuation is empty")
    if len(continuation) > max_length:
        raise OrtEvalsError(f"continuation of {len(continuation)} tokens exceeds max_length {max_length}")
    return tuple((list(context) + list(continuation))[-(max_length + 1):][:-1])
