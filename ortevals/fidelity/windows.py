"""Windows over a token stream, streamed through a model one pass at a time.

Owns the window plan (llama.cpp's ``perplexity``: non-overlapping chunks of
``n_ctx`` tokens, each scored only in its second half so every scored token
sees at least ``n_ctx/2`` tokens of context) and the two streams that reduce
each window at once to per-token statistics: the reference's top-k
(:func:`reference_windows`) and the candidate against it
(:func:`compare_windows`). At most one window's logits ``[n_ctx,V]`` (and its
log-softmax) are alive at a time, however long the text.

BOS: when the package's tokenizer adds BOS, every window starts with it
(llama.cpp overwrites each chunk's first token with BOS; here BOS is put in
front and the window takes ``n_ctx − 1`` text tokens, so no text token is
lost). Window ``w`` at positions ``j ∈ [n_ctx/2, n_ctx − 1)`` scores the
prediction of token ``j+1`` from the logits at ``j``: ``n_ctx/2 − 1`` tokens
per window, as llama.cpp.

Every position (``--by-position``, :attr:`WindowPlan.every`): window ``w`` scores the predictions from
every position ``j ∈ [0, n_ctx − 1)``, so each token is also tagged with its context length ``j + 1``
(the tokens before it in the window, BOS included) for the breakdown by context length
(:mod:`~ortevals.fidelity.positions`). A window's log-probs are reduced :data:`CHUNK_ROWS` rows at a
time (row-wise operations: the numbers do not depend on the chunking), so a 4096-token window of a
49152-token vocabulary holds 0.4 GB of float64 log-probs at a time, not 1.6 GB.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.fidelity.stats import RefTokens, TokenStats, compare_window, concat_stats, reduce_reference

log = logging.getLogger(__name__)

# ids [S] int64 → logits [S,V]; one forward pass, batch 1
LogitSource = Callable[[np.ndarray], np.ndarray]
CHUNK_ROWS = 1024  # scored rows reduced at once


@dataclass(frozen=True)
class WindowPlan:
    """Where the windows fall: ``n_windows`` windows of ``n_ctx`` tokens, ``n_scored`` tokens scored in all."""

    n_ctx: int
    bos_id: int  # put at position 0 of every window; -1: none
    n_windows: int
    n_scored: int
    every: bool = False  # score every position (--by-position), not only the second half

    @property
    def first(self) -> int:
        return 0 if self.every else self.n_ctx // 2

    @property
    def text_per_window(self) -> int:
        return self.n_ctx - (1 if self.bos_id >= 0 else 0)

    @property
    def scored_per_window(self) -> int:
        return self.n_ctx - 1 - self.first

    def scored_in(self, w: int) -> int:
        """Tokens scored in window ``w`` (the last window may stop early at the cap)."""
        return min(self.scored_per_window, self.n_scored - w * self.scored_per_window)

    def window(self, text_ids: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``w``: its input ids ``[n_ctx]`` int64 and the scored next tokens ``[scored_in(w)]``."""
        start = w * self.text_per_window
        body = np.asarray(text_ids[start:start + self.text_per_window], dtype=np.int64)
        ids = np.concatenate([[self.bos_id], body]).astype(np.int64) if self.bos_id >= 0 else body
        n = self.scored_in(w)
        return ids, ids[self.first + 1:self.first + 1 + n]

    def clusters(self) -> np.ndarray:
        """The window index of every scored token ``[n_scored]`` int32."""
        return np.concatenate([np.full(self.scored_in(w), w, np.int32) for w in range(self.n_windows)])

    def positions(self) -> np.ndarray:
        """The context length of every scored prediction ``[n_scored]`` int64: the tokens before the predicted
        token in its window (BOS included), ``j + 1`` for the logits at position ``j``."""
        return np.concatenate([np.arange(self.scored_in(w), dtype=np.int64) + self.first + 1
                               for w in range(self.n_windows)])


def plan_windows(n_text: int, n_ctx: int, bos_id: int | None, max_scored: int | None,
                 every: bool = False) -> WindowPlan:
    """Plan over ``n_text`` text tokens; ``max_scored`` caps the scored tokens (None: the whole text); ``every``:
    every position of a window is scored."""
    if n_ctx < 4 or n_ctx % 2:
        raise OrtEvalsError(f"--ctx must be an even number >= 4, got {n_ctx}")
    if max_scored is not None and max_scored < 1:
        raise OrtEvalsError(f"--tokens must be >= 1, got {max_scored}")
    bos = -1 if bos_id is None else int(bos_id)
    probe = WindowPlan(n_ctx, bos, 0, 0, every)
    available = n_text // probe.text_per_window
    if available == 0:
        raise OrtEvalsError(f"the text has {n_text} tokens; one window of --ctx {n_ctx} needs "
                            f"{probe.text_per_window}: give a longer text or a smaller --ctx")
    n_windows = available
    if max_scored is not None:
        n_windows = min(available, math.ceil(max_scored / probe.scored_per_window))
    n_scored = n_windows * probe.scored_per_window
    if max_scored is not None:
        n_scored = min(n_scored, max_scored)
    return WindowPlan(n_ctx, bos, n_windows, n_scored, every)


def _scored_logp(source: LogitSource, plan: WindowPlan, text_ids: np.ndarray,
                 w: int) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """Window ``w``'s scored rows, :data:`CHUNK_ROWS` at a time: (rows of the window's scored tokens,
    float64 log-probs ``[r,V]``, next tokens ``[r]``)."""
    ids, targets = plan.window(text_ids, w)
    logits = source(ids)
    if logits.ndim != 2 or logits.shape[0] != len(ids):
        raise OrtEvalsError(f"a model returned logits of shape {tuple(logits.shape)} for {len(ids)} tokens; "
                            "expected [tokens, vocab]")
    for start in range(0, len(targets), CHUNK_ROWS):
        rows = slice(start, min(start + CHUNK_ROWS, len(targets)))
        # only the scored rows are converted: float64 log-softmax of [r, V]
        logp = log_softmax(logits[plan.first + rows.start:plan.first + rows.stop], np.float64)
        if not np.isfinite(logp).all():
            raise OrtEvalsError(f"a model returned non-finite logits in window {w}")
        yield rows, logp, targets[rows]


def reference_windows(source: LogitSource, text_ids: np.ndarray, plan: WindowPlan, k: int,
                      progress=None) -> Iterator[RefTokens]:
    """The reference model's top-k statistics, one :class:`RefTokens` per window."""
    for w in range(plan.n_windows):
        parts = [reduce_reference(logp, targets, k) for _, logp, targets in _scored_logp(source, plan, text_ids, w)]
        yield RefTokens(*(np.concatenate([getattr(p, f) for p in parts]) for f in RefTokens.FIELDS))
        if progress is not None:
            progress(w)


def compare_windows(source: LogitSource, text_ids: np.ndarray, plan: WindowPlan,
                    refs: Iterable[RefTokens], progress=None) -> Iterator[TokenStats]:
    """The candidate against each window's reference statistics, one :class:`TokenStats` per window."""
    for w, ref in zip(range(plan.n_windows), refs):
        if len(ref) != plan.scored_in(w):
            raise OrtEvalsError(f"window {w}: the reference has {len(ref)} scored tokens, the plan "
                                f"{plan.scored_in(w)}")
        parts = []
        for rows, logp, targets in _scored_logp(source, plan, text_ids, w):
            if logp.shape[1] <= int(ref.topk_ids.max()):
                raise OrtEvalsError(f"the candidate's vocabulary ({logp.shape[1]}) is smaller than the reference's "
                                    f"token ids (up to {int(ref.topk_ids.max())})")
            parts.append(compare_window(ref.rows(rows), logp, targets))
        yield concat_stats(parts)
        if progress is not None:
            progress(w)


class OrtSource:
    """A GenAI package as a :data:`LogitSource`: ortevals' raw-ORT prefill runner, LM head at every position."""

    def __init__(self, runner) -> None:
        if runner.gathers_positions:
            raise ValueError("fidelity needs the full-logit decoder, not the derived scoring graph")
        self.runner = runner

    @classmethod
    def open(cls, package, ep: str | None = None) -> OrtSource:
        from ortevals.runtime.providers import from_package
        from ortevals.runtime.sessions import DecoderRunner

        provider = from_package(package.decoder.session_options, ep)
        return cls(DecoderRunner.open(package, provider, cache=None))

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)[None]
        logits, _ = self.runner.forward(ids, np.ones_like(ids))
        return logits[0]
