"""Step-level search's decoder on raw onnxruntime: rows of one prompt that differ in length (issue 25).

Owns :class:`RawRowModel`, engine/generate/search/steps.py's ``RowModel`` on a
:class:`~ortevals.runtime.sessions.DecoderRunner`. Each row holds its own one-row KV, made new by
every pass (engine/generate/rows/kv.py's ``CopyKV``: a pass never writes a past it was given), so

* ``start`` prefills the prompt once; every row starts on that one KV (nothing copied);
* ``fork(parents)`` is a reference copy: row i takes row ``parents[i]``'s KV object, so a row
  duplicated, dropped or reordered costs nothing and the prompt is never run again;
* ``step(tokens, rows)`` runs only the asked rows, grouped by length: rows of one length (host
  arrays) are stacked into one pass with an all-ones mask (the runtime's per-row ``seqlens_k``
  contract holds: every row of the pass has the same valid length); rows on the device run one pass
  each. The passes and tokens run are counted (``stats``).

The in-place arenas of the sampler (ragged rows right-packed in one buffer, per-row masks and
positions) are not used here: per-length passes are exact by construction and need no check.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortevals.engine.generate.rows.kv import CopyKV
from ortevals.package.reuse import ReusePolicy
from ortevals.runtime.buffers import KVCache


class RawRowModel:
    """``RowModel`` on a DecoderRunner (see the module docstring); logits float32 ``[A, V]``. Rows whose step
    crosses a LongRoPE switch of ``reuse`` (package/reuse.py) run their whole sequence again, with no past."""

    def __init__(self, runner, reuse: ReusePolicy | None = None) -> None:
        self.kv = CopyKV(runner)
        self.rows: list[KVCache] = []
        self.reuse = reuse or ReusePolicy()
        self.seqs: list[tuple[int, ...]] = []  # each row's prompt and tokens
        self.stats = {"passes": 0, "prompt_tokens": 0, "tokens_run": 0}

    def start(self, prompt: Sequence[int], rows: int) -> np.ndarray:
        logits, kv = self.kv.run(np.asarray([list(prompt)], dtype=np.int64), None, last=True)
        self.rows = [kv] * rows
        self.seqs = [tuple(prompt)] * rows
        self.stats["passes"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        return np.repeat(logits, rows, axis=0)

    def fork(self, parents: np.ndarray) -> None:
        self.rows = [self.rows[int(p)] for p in parents]
        self.seqs = [self.seqs[int(p)] for p in parents]

    def step(self, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
        tokens, rows = np.asarray(tokens, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        out: np.ndarray | None = None
        for a, t in zip(rows, tokens, strict=True):
            self.seqs[int(a)] = (*self.seqs[int(a)], int(t))
        for members in self._groups(rows):
            past = self._stack([self.rows[int(rows[a])] for a in members])
            if self.reuse.same_class(past.length, past.length + 1):
                logits, kv = self.kv.run(tokens[members][:, None], past)
            else:  # past the switch: the rows' KV for the long class, as one pass over each would make it
                logits, kv = self.kv.run(np.asarray([self.seqs[int(rows[a])] for a in members], np.int64), None)
            for j, a in enumerate(members):
                self.rows[int(rows[a])] = _row(kv, j) if len(members) > 1 else kv
            if out is None:
                out = np.empty((len(rows), logits.shape[-1]), dtype=logits.dtype)
            out[members] = logits
            self.stats["passes"] += 1
            self.stats["tokens_run"] += len(members)
        return out if out is not None else np.zeros((0, 0), np.float32)

    def _groups(self, rows: np.ndarray) -> list[np.ndarray]:
        """Positions in ``rows`` grouped by their row's length; one position a group off the host."""
        host = all(isinstance(self.rows[int(r)].layers[0][0], np.ndarray) for r in rows)
        if not host:
            return [np.array([a]) for a in range(len(rows))]
        lengths = np.array([self.rows[int(r)].length for r in rows])
        return [np.flatnonzero(lengths == n) for n in np.unique(lengths)]

    @staticmethod
    def _stack(caches: list[KVCache]) -> KVCache:
        if len(caches) == 1:
            return caches[0]
        layers = tuple(tuple(np.concatenate([c.layers[i][j] for c in caches], axis=0) for j in range(2))
                       for i in range(len(caches[0].layers)))
        states = tuple(np.concatenate([c.states[i] for c in caches], axis=0) for i in range(len(caches[0].states)))
        return KVCache(layers, caches[0].length, states)


def _row(kv: KVCache, j: int) -> KVCache:
    """Row ``j`` of a host cache, KV and recurrent state (a view: caches are never written after their pass)."""
    return kv.rows(lambda t: t[j:j + 1])
