"""Stepping on raw onnxruntime sessions: the incremental path's cursor over a :class:`DecoderRunner`.

Owns scoring a decoder whose passes return only the last position's logits (the builder's
``prune_lm_head=true``, static-shape and NPU exports), whatever shape its graph declares for them, on the raw
sessions: :class:`RawSteps` hands :class:`~ortevals.engine.score.incremental.IncrementalEngine` the same
:class:`~ortevals.runtime.genai.Cursor` onnxruntime-genai's path uses, over :class:`RawGenerator`, which holds
one sequence's present KV and does what the cursor asks of an ``og.Generator`` (``append_tokens``,
``get_logits``, ``get_output``, ``rewind_to``: the past cut by ``DecoderRunner.narrow_past``). So every pass
follows the package's reuse rules as on onnxruntime-genai (package/reuse.py: two new tokens at least on a kept
past, never KV of another length class), and a continuation of k tokens is scored in k passes, each ending
at the position it predicts from.
"""

from __future__ import annotations

import numpy as np

from ortevals.package.reuse import reuse_policy
from ortevals.runtime.genai import Cursor


class RawGenerator:
    """One sequence's KV on a :class:`~ortevals.runtime.sessions.DecoderRunner`, driven like an og Generator."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.past = None  # KVCache of the tokens held
        self.logits: np.ndarray | None = None  # the last pass's logits [1, rows, V]

    def append_tokens(self, ids) -> None:
        """Run ``ids [1,n]`` on the held past and hold the present KV."""
        ids = np.asarray(ids, dtype=np.int64)
        held = self.past.length if self.past is not None else 0
        mask = np.ones((1, held + ids.shape[1]), np.int64)
        self.logits, self.past = self.runner.forward(ids, mask, self.past, want_present=True)

    def get_logits(self) -> np.ndarray:
        """``[1, 1, V]``: the last row of the last pass (the next token's)."""
        return self.logits[:, -1:]

    def get_output(self, name: str) -> np.ndarray:
        return self.logits

    def rewind_to(self, length: int) -> None:
        self.past = self.runner.narrow_past(self.past, length) if length else None


class RawSteps:
    """The runner :class:`~ortevals.engine.score.incremental.IncrementalEngine` takes (``cursor``), over raw
    sessions. A kept past is cut to a shorter prefix only where that is exact: never on a windowed sliding
    cache or a recurrent state (each input then starts from an empty past)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.package = runner.package
        self.reuse = reuse_policy(runner.package)
        self.rewind_ok = not (runner.package.windowed or runner.package.recurrent)
        self.snapshots = False

    def cursor(self, max_length: int) -> Cursor:
        return Cursor(self, max_length)

    def _generator(self, max_length: int) -> RawGenerator:
        return RawGenerator(self.runner)
