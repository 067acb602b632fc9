"""Scoring math: pure functions on numpy arrays, no runtime.

Owns log-softmax, the log-probability of a continuation and lm-eval's greedy
flag, computed only on the rows that are needed (one per continuation token),
turning a pass's rows into each request's :class:`Score` (:class:`ScoreSink`),
the finite-ness check that turns an fp16 overflow into an error instead of
a silently wrong average, and the context limit: a request longer than the
model's context is an error unless the user opted into left truncation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.errors import OrtEvalsError


def log_softmax(logits: np.ndarray, dtype) -> np.ndarray:
    """Log-softmax over the last axis (``[..., V]`` -> ``[..., V]``) in ``dtype``: ortevals' one log-softmax.

    float32 on the scoring hot path (the derived graph runs the same arithmetic, runtime/derive.py);
    float64 for token choice and search (engine/generate/), fidelity's token statistics and the
    choice distributions of compare and calibration (report/). ``x - max`` first, as scipy's
    ``special.log_softmax`` computes it (bit for bit on rows with a finite maximum)."""
    x = np.asarray(logits, dtype=dtype)
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
    lp = log_softmax(rows, np.float32)
    picked = lp[np.arange(tgt.shape[0]), tgt]
    greedy = bool((rows.argmax(axis=-1) == tgt).all())
    return float(picked.sum(dtype=np.float64)), greedy


@dataclass(frozen=True)
class Score:
    """lm-eval's answer to a log-likelihood request."""

    logprob: float
    greedy: bool


class NonFiniteScore(OrtEvalsError):
    """A NaN/inf log-likelihood; ``index`` is the request's position in the scored list, if known."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def check_finite(value: float, what: str, index: int | None = None) -> float:
    """Refuse NaN/inf scores (e.g. fp16 overflow) with the request named."""
    if not np.isfinite(value):
        raise NonFiniteScore(
            f"non-finite log-likelihood ({value}) for {what}; the model returned NaN/inf logits "
            "(an fp16 overflow?). No score was recorded for it", index)
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


TRUNCATE_MODES = ("error", "left")


@dataclass(frozen=True)
class ContextLimit:
    """The longest model input allowed, where that number came from, and what to do past it.

    source: how the user should read the limit (``max_length=64`` or
    ``model.context_length=1024 in …/genai_config.json``). truncate: ``error``
    (a request that does not fit is a one-line error) or ``left`` (lm-eval
    ``hf``'s left truncation, counted by the caller).
    """

    max_length: int
    source: str
    truncate: str = "error"


def fits(n_tokens: int, limit: ContextLimit, what: str) -> bool:
    """True when a model input of ``n_tokens`` fits; False when it will be left-truncated.

    Raises the one-line error under ``truncate=error``. ``what`` names the request.
    """
    if n_tokens <= limit.max_length:
        return True
    if limit.truncate != "left":
        raise OrtEvalsError(
            f"{what} needs {n_tokens} tokens but the context is {limit.source}; pass the model arg "
            "truncate=left to left-truncate it as lm-eval's hf backend does, or a larger max_length")
    return False


def describe_request(context: str, continuation: str = "") -> str:
    """A short, one-line name for a request in errors: the start of its text."""
    text = (context + continuation).replace("\n", " ")
    return repr(text[:40] + ("…" if len(text) > 40 else ""))


def effective_max_length(user_max_length: int | None, context_length: int, config: object, default: int) -> int:
    """The user's max_length, else the package's context_length, else ``default``. A max_length beyond the
    package's context is refused: its positions were never trained, and onnxruntime-genai refuses it too."""
    if user_max_length and context_length and user_max_length > context_length:
        raise OrtEvalsError(f"max_length={user_max_length} is beyond the package's context: "
                            f"model.context_length={context_length} in {config}; expected max_length <= "
                            f"{context_length} (onnxruntime-genai refuses a longer one as well)")
    return user_max_length or context_length or default


def context_limit(max_length: int, user_max_length: int | None, context_length: int, config: object,
                  truncate: str = "error") -> ContextLimit:
    """The limit in force and its origin: the user's max_length, else the package's context_length."""
    if truncate not in TRUNCATE_MODES:
        raise OrtEvalsError(f"truncate must be one of {', '.join(TRUNCATE_MODES)}, got {truncate!r}")
    if user_max_length:
        source = f"max_length={max_length}"
    elif context_length:
        source = f"model.context_length={max_length} in {config}"
    else:
        source = f"max_length={max_length} (ortevals' default: {config} has no model.context_length)"
    return ContextLimit(max_length, source, truncate)


class ScoreSink:
    """Turns logits rows into scores for a group's members and reports them."""

    def __init__(self, requests, results, on_done) -> None:
        self.requests, self.results, self.on_done = requests, results, on_done

    def group(self, logits: np.ndarray, group, end: int) -> None:
        """logits: ``[R, V]`` rows of one input whose scored tail ends at row ``end``; ``group``: the
        input's members, (request index, continuation length) pairs (engine/score/prefill.py's ``Group``)."""
        for index, n_cont in group.members:
            # row i predicts token i+1: the last n_cont input rows predict the continuation
            self._report(index, *continuation_logprob(logits[end - n_cont:end], self.requests[index].continuation))

    def targets(self, batch, k: int) -> np.ndarray:
        """``[B,K,M]`` int64 tokens for a graph that scores on the device (runtime/derive.py): member m of
        row b's group has its continuation at the last n of the K positions; other slots hold 0, never read."""
        out = np.zeros((len(batch), k, max(len(g.members) for g in batch)), dtype=np.int64)
        for b, group in enumerate(batch):
            for m, (index, n_cont) in enumerate(group.members):
                out[b, k - n_cont:, m] = self.requests[index].continuation
        return out

    def scores(self, logprobs: np.ndarray, greedy: np.ndarray, group, end: int) -> None:
        """The graph's float32 log-probabilities and argmax flags ``[K, M]`` of one input (slot m: member m,
        as laid out by :meth:`targets`), each member's continuation ending at position ``end``.
        Summed in float64, as :func:`continuation_logprob` sums its float32 rows."""
        for m, (index, n_cont) in enumerate(group.members):
            lp = float(logprobs[end - n_cont:end, m].sum(dtype=np.float64))
            self._report(index, lp, bool(greedy[end - n_cont:end, m].all()))

    def _report(self, index: int, logprob: float, greedy: bool) -> None:
        score = Score(check_finite(logprob, f"request {index}", index), greedy)
        self.results[index] = score
        if self.on_done is not None:
            self.on_done(index, score)
