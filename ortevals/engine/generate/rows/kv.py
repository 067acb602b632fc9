"""How the sampler keeps the KV of its rows (in place, on the host or the device, or one new cache
per pass) and what a decode batch of them costs at its peak.

Owns three ways of holding a decode batch's KV behind one interface (``empty``/``prefix``,
``run``, ``repeat``, ``keep``, ``peak``, ``held_bytes``):

* :class:`InplaceKV` (host numpy KV): buffers ``[rows, H, capacity, D]`` sized for the prompt
  plus max_gen_toks, bound as both past input and present output, so GroupQueryAttention
  writes each new token in place (onnxruntime-genai's ``past_present_share_buffer``). A
  decode pass then costs its attention reads, not a copy of the whole cache. Decode rows live
  in reusable arenas: replicating a prompt copies its valid tokens only, and a finished row
  leaves by moving the rows after it forward in place.
* :class:`DeviceKV`: the same on the session's device (IOBinding with OrtValues there): the
  arenas are device buffers whose leading rows are bound by pointer as past and present
  (:class:`~ortevals.runtime.buffers.KVView`), and replicating, moving a row and cutting a
  prefix run as one-node graphs on the device writing into buffers already held
  (runtime/replicate.py). A decode pass allocates no KV and moves none through the host.
* :class:`CopyKV`: the plain way, present = a new cache every pass (a graph whose attention
  cannot share the buffer, or a decoder with recurrent state: every pass returns a new state, so a
  state kept for a later prompt is never written over); row ops run where the KV lives.

:func:`choose_kv` picks an in-place kind only after checking it once against the plain way (a
prompt, a prefix cut, rows replicated, a row dropped, decode steps): no graph is trusted to share
the buffer unchecked; a refusal on a device is logged once. :class:`KVPeak` is the memory a batch
needs at its peak, from the KV spec (prompt + max_gen_toks per row, all layers, the element
type's size, the arena headroom or the present buffers, the logits row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)
ARENA_HEADROOM = 4  # arenas get n + n // 4 elements: a slightly longer prompt later reuses them


@dataclass(frozen=True)
class KVPeak:
    """Bytes a decode batch of ``rows`` rows holds at its peak: ``fixed + rows * per_row``."""

    fixed: int  # the prompt's one-row KV (kept for the next prompt's shared prefix)
    per_row: int  # a row's KV (with the arena headroom, or past + present), and its logits row

    def total(self, rows: int) -> int:
        return self.fixed + rows * self.per_row

    def rows_within(self, budget: int, most: int) -> int:
        """The most rows (1 at least, ``most`` at most) whose peak fits ``budget`` bytes."""
        return max(1, min(most, (budget - self.fixed) // max(self.per_row, 1)))


def kv_peak(bytes_per_token: int, tokens: int, logits_row: int, in_place: bool) -> KVPeak:
    """The peak of a batch whose rows hold up to ``tokens`` tokens (prompt + max_gen_toks + 1, the
    capacity the sampler sizes buffers for) at ``bytes_per_token`` (K and V, all layers).

    In place: a row's KV in the arena, allocated with 1/ARENA_HEADROOM room. A new cache per pass:
    the past and the present of a pass are alive together, twice a row's KV. Either way each row
    has a logits row of ``logits_row`` bytes, and the prompt's one-row KV stays held.
    """
    row_kv = tokens * bytes_per_token
    per_row = row_kv + row_kv // ARENA_HEADROOM if in_place else 2 * row_kv
    return KVPeak(row_kv, per_row + logits_row)


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
    why = "the shared past/present buffer was refused"  # why not in place (the cascade graph says it)

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

    def peak(self, tokens: int) -> KVPeak:
        return _peak(self.runner, tokens, in_place=False)

    def held_bytes(self) -> int:
        """Bytes this holder keeps between batches (none: every cache is new)."""
        return 0


class InplaceKV:
    """Host buffers ``[B,H,capacity,D]`` written in place by each pass (see the module docstring)."""

    name = "in-place"
    poison = False  # the check (same_as_plain) fills new buffers with NaN: a stale copy cannot pass it

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
        """Fresh buffers holding the first ``length`` tokens of ``held`` (its rows)."""
        kv = self.empty(held.layers[0][0].shape[0], capacity)
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
        """Rows ``rows`` (batch indices, each at or after the slot it takes: rows/batch.py placed) moved to the front
        in place, in that order; the leading rows are a contiguous view. Only valid tokens move (no allocation,
        no full copy)."""
        rows = _forward(rows)
        for pair in past.layers:
            for t in pair:
                for slot, src in enumerate(rows):
                    if src != slot:  # src > slot: a source is never a slot already written
                        t[slot, :, :past.length] = t[src, :, :past.length]
        return self.KVCache(tuple(tuple(t[:len(rows)] for t in pair) for pair in past.layers), past.length)

    def peak(self, tokens: int) -> KVPeak:
        return _peak(self.runner, tokens, in_place=True)

    def held_bytes(self) -> int:
        """Bytes of the decode arenas kept for the next batch (it reuses them)."""
        return sum(int(a.nbytes) for a in self._arenas.values())

    def _arena(self, index: int, shape: tuple, dtype) -> np.ndarray:
        """A contiguous ``shape`` view of reusable flat buffer ``index`` (grown when too small): decode
        batches after the first write to memory already mapped, and GQA binds the view as is."""
        size = int(np.prod(shape))
        flat = self._arenas.get(index)
        if flat is None or flat.size < size or flat.dtype != dtype:
            # headroom: a slightly longer prompt later does not map (and fault in) the arena again
            flat = self._arenas[index] = np.empty(size + size // ARENA_HEADROOM, dtype=dtype)
            if self.poison:
                flat.fill(np.nan)
        return flat[:size].reshape(shape)


class DeviceKV(InplaceKV):
    """:class:`InplaceKV` on the session's device: OrtValue arenas bound by pointer (see the module
    docstring); every row op is a one-node graph on the device writing into a buffer already held."""

    name = "in-place (device)"

    def __init__(self, runner) -> None:
        from ortevals.runtime import buffers
        from ortevals.runtime.providers import ProviderConfig
        from ortevals.runtime.replicate import Replicator

        super().__init__(runner)
        self.buffers = buffers
        self.device, self.device_id = runner.bind_device, runner.device_id
        self.copies = getattr(runner, "replicator", None) or Replicator(ProviderConfig("cpu"), self.device,
                                                                        self.device_id)
        self._arenas: dict[int, object] = {}  # index → KVView of a whole device buffer

    def _fresh(self, rows: int, capacity: int, spec):
        shape = (rows, spec.kv_heads, capacity, spec.head_size)
        return self._new(shape, self.buffers.ONNX_TYPES[spec.dtype])

    def _new(self, shape: tuple, elem_type: int):
        view = self.buffers.device_buffer(shape, elem_type, self.device, self.device_id)
        # NaN while same_as_plain checks (a read of memory never written shows); else zeros, as onnxruntime-genai
        # zeroes its KV: the positions past a row's length are never written, and an attention kernel handed
        # the buffer's whole width (onnxruntime's cuDNN SDPA path) may multiply stale NaN bits there by 0.
        # The zeros are written on the device: from the host they would be a capacity-sized copy per prompt
        (self.buffers.fill_nan if self.poison else self.copies.zero)(view)
        return view

    def empty(self, rows: int, capacity: int):
        return self.KVCache(tuple(tuple(self._fresh(rows, capacity, s) for _ in range(2)) for s in self.specs), 0)

    def prefix(self, held, length: int, capacity: int):
        """Fresh device buffers holding the first ``length`` tokens of ``held`` (its rows)."""
        first = held.layers[0][0]
        kv = self.empty(int(first.shape[0] if isinstance(first.shape, tuple) else first.shape()[0]), capacity)
        for pair, held_pair in zip(kv.layers, held.layers, strict=True):
            for t, h in zip(pair, held_pair, strict=True):
                self.copies.fit(h, length, into=t)
        return self.KVCache(kv.layers, length)

    def repeat(self, past, rows: int):
        """The one-row prompt buffer expanded into ``rows`` leading rows of the arenas."""
        layers = []
        for li, pair in enumerate(past.layers):
            layers.append(tuple(self.copies.expand(t, rows, into=self._arena(2 * li + j, (rows, *t.shape[1:]), t))
                                for j, t in enumerate(pair)))
        return self.KVCache(tuple(layers), past.length)

    def keep(self, past, rows):
        """Rows ``rows`` (each at or after the slot it takes) moved forward one whole row at a time on the device, in
        that order."""
        rows = _forward(rows)
        for pair in past.layers:
            for t in pair:
                for slot, src in enumerate(rows):
                    if src != slot:  # src > slot: distinct rows, and a source is never a slot already written
                        self.copies.copy(t.rows(src, src + 1), into=t.rows(slot, slot + 1))
        return self.KVCache(tuple(tuple(t.rows(0, len(rows)) for t in pair) for pair in past.layers), past.length)

    def held_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values())

    def _arena(self, index: int, shape: tuple, like):
        """A ``shape`` view at the start of device buffer ``index`` (grown, with headroom, when too small)."""
        size = int(np.prod(shape))
        arena = self._arenas.get(index)
        if arena is None or arena.shape[0] < size or arena.elem_type != like.elem_type:
            arena = self._arenas[index] = self._new((size + size // ARENA_HEADROOM,), like.elem_type)
        return self.buffers.KVView(arena.owner, tuple(shape), like.elem_type, self.device, self.device_id)


def _forward(rows) -> list[int]:
    """``rows`` as ints, each at or after its slot (moved in slot order, a row is then read before its own slot
    is written); raises otherwise (a row would be read after another was written over it)."""
    rows = [int(r) for r in rows]
    if any(src < slot for slot, src in enumerate(rows)):
        raise ValueError(f"rows {rows}: a row cannot move to a slot after its own in place")
    return rows


def _peak(runner, tokens: int, in_place: bool) -> KVPeak:
    from ortevals.runtime.buffers import ITEMSIZE, specs_bytes_per_token

    package = runner.package
    out = package.decoder.output(package.logits_name)
    logits_row = package.vocab_size * ITEMSIZE[out.dtype if out is not None else "float32"]
    return kv_peak(specs_bytes_per_token(package.kv), tokens, logits_row, in_place)


def choose_kv(runner):
    """An in-place kind where the graph writes a shared buffer exactly as the plain way computes it
    (:class:`InplaceKV` for host numpy KV, :class:`DeviceKV` for KV bound where the session runs,
    checked by :func:`same_as_plain`); else :class:`CopyKV`."""
    plain = CopyKV(runner)
    if not hasattr(runner, "forward_inplace"):
        return plain
    if getattr(runner.package, "recurrent", False):
        plain.why = "the decoder carries recurrent state: each row keeps its own, made new by every pass"
        log.info("KV: %s; a new cache per pass", plain.why)
        return plain
    from ortevals.runtime.buffers import POINTER_DEVICES

    on_device = getattr(runner, "bind_device", None) is not None
    if on_device and runner.bind_device not in POINTER_DEVICES:
        log.warning("KV: %s buffers cannot be bound from an offset; a new cache per pass", runner.bind_device)
        return plain
    inplace = DeviceKV(runner) if on_device else InplaceKV(runner)
    report = log.warning if on_device else log.info  # once per model: the copy path costs O(T) per step there
    try:
        diff = same_as_plain(plain, inplace)
    except Exception as e:  # noqa: BLE001 - any refusal means: not this graph
        report("KV: shared past/present buffer refused (%s); a new cache per pass", e)
        return plain
    if not diff <= 1e-4:
        report("KV: the shared buffer differs from the plain pass (rel. %.2g); a new cache per pass", diff)
        return plain
    return inplace


def same_as_plain(plain: CopyKV, inplace: InplaceKV) -> float:
    """Largest relative logit difference between ``inplace`` and ``plain`` over every operation the
    sampler uses: a 3-token prompt, a 2-token prefix cut and its third token, the prompt replicated
    over 3 rows, a decode step, row 1 dropped, another step."""
    inplace.poison = True  # every new buffer NaN until written: memory that happens to hold the right
    try:  # values (an allocator handing back the block just freed) cannot pass for a copy
        return _compare(plain, inplace)
    finally:
        inplace.poison = False


def _compare(plain: CopyKV, inplace: InplaceKV) -> float:
    ids = np.asarray([[1, 2, 3]], dtype=np.int64)
    a, kv_a = plain.run(ids, None)
    b, kv_b = inplace.run(ids, inplace.empty(1, 8))
    pairs = [(a, b)]
    pairs.append((plain.run(ids[:, 2:], plain.prefix(kv_a, 2, 8))[0],
                  inplace.run(ids[:, 2:], inplace.prefix(kv_b, 2, 8))[0]))
    rows_a, rows_b = plain.repeat(kv_a, 3), inplace.repeat(kv_b, 3)
    step = np.asarray([[4], [5], [6]], dtype=np.int64)
    la, rows_a = plain.run(step, rows_a)
    lb, rows_b = inplace.run(step, rows_b)
    pairs.append((la, lb))
    rows_a, rows_b = plain.keep(rows_a, [0, 2]), inplace.keep(rows_b, [0, 2])
    pairs.append((plain.run(step[[0, 2]], rows_a)[0], inplace.run(step[[0, 2]], rows_b)[0]))
    scale = max(1.0, float(np.abs(a).max()))
    return float(np.max([np.abs(x - y).max() for x, y in pairs])) / scale  # NaN if a poisoned value was read
