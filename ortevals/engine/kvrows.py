"""How the sampler keeps the KV of its rows: in place (host buffers) or one new cache per pass.

Owns two ways of holding a decode batch's KV behind one interface (``empty``/``prefix``,
``run``, ``repeat``, ``keep``):

* :class:`InplaceKV` (host numpy KV): buffers ``[rows, H, capacity, D]`` sized for the prompt
  plus max_gen_toks, bound as both past input and present output, so GroupQueryAttention
  writes each new token in place (onnxruntime-genai's ``past_present_share_buffer``). A
  decode pass then costs its attention reads, not a copy of the whole cache. Decode rows live
  in reusable arenas: replicating a prompt copies its valid tokens only, and a finished row
  leaves by moving the rows after it forward in place.
* :class:`CopyKV`: the plain way, present = a new cache every pass (device KV, or a graph
  whose attention cannot share the buffer); row ops run where the KV lives.

:func:`choose_kv` picks InplaceKV only after checking it once against the plain way on a
few tokens (no graph is trusted to share the buffer unchecked).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def _last(logits: np.ndarray) -> np.ndarray:
    return logits[:, -1, :]


def _positions(runner, ids: np.ndarray, last: bool):
    """A derived graph's LM head at each row's last position only (prompt passes)."""
    if last and getattr(runner, "gathers_positions", False):
        return np.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=np.int64)
    return None


class CopyKV:
    """A new present cache per pass (``DecoderRunner.forward``); capacity is ignored."""

    name = "copy"

    def __init__(self, runner) -> None:
        self.runner = runner

    def empty(self, rows: int, capacity: int):
        return None

    def prefix(self, held, length: int, capacity: int):
        return self.runner.narrow_past(held, length)

    def run(self, ids: np.ndarray, past, last: bool = False):
        """ids ``[B,S]`` after ``past`` → (logits ``[B,V]`` at the last position, the new cache)."""
        length = past.length if past is not None else 0
        mask = np.ones((ids.shape[0], length + ids.shape[1]), np.int64)
        positions = _positions(self.runner, ids, last)
        if positions is None:
            logits, kv = self.runner.forward(ids, mask, past, want_present=True)
        else:
            logits, kv = self.runner.forward(ids, mask, past, want_present=True, positions=positions)
        return _last(logits), kv

    def repeat(self, past, rows: int):
        return self.runner.repeat_past(past, rows)

    def keep(self, past, rows):
        return self.runner.keep_rows(past, rows)


class InplaceKV:
    """Host buffers ``[B,H,capacity,D]`` written in place by each pass (see the module docstring)."""

    name = "in-place"

    def __init__(self, runner) -> None:
        from ortevals.runtime.buffers import KVCache

        self.runner = runner
        self.KVCache = KVCache
        self.specs = runner.package.kv
        self._arenas: dict[int, np.ndarray] = {}  # decode rows' KV, reused from batch to batch

    def empty(self, rows: int, capacity: int):
        return self.KVCache(tuple(tuple(np.zeros((rows, s.kv_heads, capacity, s.head_size), dtype=s.dtype)
                                        for _ in range(2)) for s in self.specs), 0)

    def prefix(self, held, length: int, capacity: int):
        """Fresh buffers holding the first ``length`` tokens of ``held`` (one row)."""
        kv = self.empty(1, capacity)
        for (k, v), (hk, hv) in zip(kv.layers, held.layers, strict=True):
            k[:, :, :length] = hk[:, :, :length]
            v[:, :, :length] = hv[:, :, :length]
        return self.KVCache(kv.layers, length)

    def run(self, ids: np.ndarray, past, last: bool = False):
        capacity = past.layers[0][0].shape[2]
        if past.length + ids.shape[1] > capacity:  # GQA would write past the buffer's end
            raise ValueError(f"KV buffer of {capacity} tokens cannot take {past.length} + {ids.shape[1]}")
        logits = self.runner.forward_inplace(ids, past, _positions(self.runner, ids, last))
        return _last(logits), self.KVCache(past.layers, past.length + ids.shape[1])

    def repeat(self, past, rows: int):
        """The one-row prompt KV copied into ``rows`` rows of the arena (its valid tokens only)."""
        layers = []
        for li, pair in enumerate(past.layers):
            out = []
            for j, t in enumerate(pair):
                buf = self._arena(2 * li + j, (rows, *t.shape[1:]), t.dtype)
                buf[:, :, :past.length] = t[:, :, :past.length]  # broadcast over rows
                out.append(buf)
            layers.append(tuple(out))
        return self.KVCache(tuple(layers), past.length)

    def keep(self, past, rows):
        """Rows ``rows`` (ascending batch indices) moved to the front in place, order kept; the
        leading rows are a contiguous view. Only valid tokens move (no allocation, no full copy)."""
        rows = [int(r) for r in rows]
        for pair in past.layers:
            for t in pair:
                for slot, src in enumerate(rows):
                    if src != slot:  # src > slot: a source is never a slot already written
                        t[slot, :, :past.length] = t[src, :, :past.length]
        return self.KVCache(tuple(tuple(t[:len(rows)] for t in pair) for pair in past.layers), past.length)

    def _arena(self, index: int, shape: tuple, dtype) -> np.ndarray:
        """A contiguous ``shape`` view of reusable flat buffer ``index`` (grown when too small): decode
        batches after the first write to memory already mapped, and GQA binds the view as is."""
        size = int(np.prod(shape))
        flat = self._arenas.get(index)
        if flat is None or flat.size < size or flat.dtype != dtype:
            # 25% headroom: a slightly longer prompt later does not map (and fault in) the arena again
            flat = self._arenas[index] = np.empty(size + size // 4, dtype=dtype)
        return flat[:size].reshape(shape)


def choose_kv(runner, vocab_tokens: int = 3):
    """InplaceKV where the runner keeps host numpy KV and the graph writes a shared buffer exactly as
    the plain way computes it (checked on a 3-token prompt and one decode step); else CopyKV."""
    plain = CopyKV(runner)
    if getattr(runner, "bind_device", None) is not None or not hasattr(runner, "forward_inplace"):
        return plain
    inplace = InplaceKV(runner)
    ids = np.arange(1, vocab_tokens + 1, dtype=np.int64)[None, :]
    try:
        a, kv_a = plain.run(ids, None)
        b, kv_b = inplace.run(ids, inplace.empty(1, vocab_tokens + 2))
        a2, _ = plain.run(ids[:, :1], kv_a)
        b2, _ = inplace.run(ids[:, :1], kv_b)
    except Exception as e:  # noqa: BLE001 - any refusal means: not this graph
        log.info("KV: shared past/present buffer refused (%s); a new cache per pass", e)
        return plain
    scale = max(1.0, float(np.abs(a).max()))
    diff = max(float(np.abs(a - b).max()), float(np.abs(a2 - b2).max())) / scale
    if not diff <= 1e-4:
        log.info("KV: the shared buffer differs from the plain pass (rel. %.2g); a new cache per pass", diff)
        return plain
    return inplace
