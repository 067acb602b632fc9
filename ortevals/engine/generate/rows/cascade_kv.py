"""Decode rows that share one copy of their prompt's KV (model arg ``cascade=auto|on|off``).

Owns :class:`CascadeKV`, a KV holder for the sampler (the interface of engine/generate/rows/kv.py:
``empty``/``prefix``, ``run``, ``repeat``, ``keep``, ``peak``, ``held_bytes``) over an in-place
holder (:class:`~ortevals.engine.generate.rows.kv.InplaceKV` on the host, ``DeviceKV`` where the session
runs). Prompt passes are the in-place holder's. Decode rows (``repeat`` with more than one row, or
:meth:`CascadeKV.share` / :meth:`CascadeKV.join` of several prompts' rows) become :class:`SharedRows`:
each prompt's valid tokens once, contiguous ``[1,H,P,D]`` per layer, bound as they are by every pass of
the cascade decode graph (runtime/cascade.py), and each row's own tokens after its prompt in the
in-place holder's arenas (``[rows,H,max_gen_toks+1,D]``, written in place by GroupQueryAttention). A
decode pass then reads its weights, each prompt once and the rows' suffixes, instead of a prompt per
row; rows leave by the in-place holder's ``keep``. Up to GROUPS prompts' rows share a pass, each group
holding its own number of tokens, so a prompt can join a batch that is already decoding (the sampler's
streams: engine/generate/rows/sampler.py).

The cascade graph is opened on the first batch of several rows (a greedy run never pays for it)
and trusted only after :func:`~ortevals.engine.generate.rows.kv.same_as_plain` (a prompt, a prefix cut, rows
replicated, decode steps, a row dropped, on NaN-filled buffers) agrees with the plain pass; where
the graph is refused (runtime/cascade.py says why), the check fails or the session cannot open,
``auto`` logs why once and keeps each row's own copy of the prompt, ``on`` is a one-line error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.rows.kv import DeviceKV, InplaceKV, same_as_plain
from ortevals.errors import OrtEvalsError
from ortevals.runtime.cascade import GROUPS

log = logging.getLogger(__name__)
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SharedRows:
    """A decode batch's KV: each group's prompt once (``prompts``: one-row KVCaches) with its row count
    (``counts``: the first ``counts[0]`` rows read ``prompts[0]``, the next ``counts[1]`` the second, ...) and
    the tokens each of its rows holds after the prompt (``lengths``; a group's rows started together), and the
    rows' own tokens (``rows``: ``[B,H,room,D]`` per layer, ``rows.length`` the longest) in arenas holding
    ``reserve`` rows (a group joins while the rows fit)."""

    prompts: tuple  # runtime.buffers.KVCache each
    counts: tuple[int, ...]
    lengths: tuple[int, ...]
    rows: object
    reserve: int

    @property
    def groups(self) -> tuple:
        """``((prompt, rows, length), ...)``: what the cascade graph binds (runtime/cascade.PromptBinding)."""
        return tuple(zip(self.prompts, self.counts, self.lengths, strict=True))

    def kept(self, rows, kv) -> SharedRows:
        """These groups after ``rows`` (batch indices, groups in order) stayed, a group left with none dropped; ``kv``
        the rows' KV moved forward."""
        edges = np.cumsum(self.counts)
        counts = np.bincount(np.searchsorted(edges, np.asarray(rows, dtype=np.int64), side="right"),
                             minlength=len(self.counts))
        stay = [g for g, c in enumerate(counts) if c]
        return SharedRows(tuple(self.prompts[g] for g in stay), tuple(int(counts[g]) for g in stay),
                          tuple(self.lengths[g] for g in stay), kv, self.reserve)


@dataclass(frozen=True)
class Cascade:
    """The ``cascade`` model arg and how to open the cascade decode graph's runner (raises where it cannot).

    ``cost``: bytes a second session of the decoder takes (its weights: :func:`decoder_bytes`); ``free``:
    bytes free where it would hold them. ``auto`` declines when the second session would take more than
    half of what is free (on a GPU that memory is the decode KV's budget); ``on`` opens it anyway."""

    mode: str
    open: Callable[[], object]
    cost: int = 0
    free: Callable[[], int | None] | None = None

    def too_big(self) -> str | None:
        free = self.free() if self.free is not None and self.mode == "auto" else None
        if free is None or 2 * self.cost <= free:
            return None
        return (f"a second session of the decoder ({self.cost / 2**20:.1f} MiB of weights) would take more than "
                f"half of the {free / 2**20:.1f} MiB free")


def decoder_bytes(package) -> int:
    """The decoder's graph and external data files, in bytes: what a second session of it loads."""
    from ortevals.package.graph import external_data_files

    path = package.decoder.path
    return sum(p.stat().st_size for p in (path, *external_data_files(path)) if p.is_file())


class CascadeKV:
    """Decode rows on one shared prompt KV (see the module docstring); everything else is ``base``'s."""

    def __init__(self, base, plain, cascade: Cascade) -> None:
        self.base, self.plain, self.cascade = base, plain, cascade
        self.runner = None  # the cascade graph's DecoderRunner, once opened and checked
        self.refused: str | None = None if isinstance(base, InplaceKV) else base.why

    @property
    def name(self) -> str:
        if self.runner is not None:
            return f"{self.base.name}, decode rows on one shared prompt KV (cascade)"
        return self.base.name + (f" (cascade off: {self.refused})" if self.refused else "")

    @property
    def poison(self) -> bool:
        return self.base.poison

    @poison.setter
    def poison(self, value: bool) -> None:  # same_as_plain fills new buffers with NaN while it checks
        self.base.poison = value

    def empty(self, rows: int, capacity: int):
        return self.base.empty(rows, capacity)

    def prefix(self, held, length: int, capacity: int):
        return self.base.prefix(held, length, capacity)

    def run(self, ids: np.ndarray, past, last: bool = False):
        """ids ``[B,1]`` after ``past`` → (logits ``[B,V]``, the grown KV); prompt passes go to ``base``."""
        if not isinstance(past, SharedRows):
            return self.base.run(ids, past, last)
        from ortevals.runtime.buffers import KVCache

        rows, room = past.rows, _shape(past.rows.layers[0][0])[2]
        if rows.length + ids.shape[1] > room:
            raise ValueError(f"KV rows of {room} tokens cannot take {rows.length} + {ids.shape[1]}")
        logits = self.runner.forward_inplace(ids, rows, prompts=past.groups)
        grown = tuple(n + ids.shape[1] for n in past.lengths)
        return logits[:, -1, :], SharedRows(past.prompts, past.counts, grown, KVCache(rows.layers, max(grown)),
                                            past.reserve)

    def repeat(self, past, rows: int):
        """The one-row prompt KV as ``rows`` decode rows: :meth:`share` once the cascade graph is ready and
        there are several rows (one row reads its prompt once anyway), else ``base``'s copies."""
        if rows == 1 or not self.ready():
            return self.base.repeat(past, rows)
        return self.share(past, rows)

    def share(self, past, rows: int, *more, reserve: int = 0, room: int | None = None) -> SharedRows:
        """The one-row prompt KV as ``rows`` decode rows on the cascade graph: its valid tokens once, contiguous,
        and ``rows`` empty rows with ``room`` tokens each (default: the prompt buffer's capacity past its tokens,
        max_gen_toks + 1 as the sampler allocates it). ``more``: further prompts' KV and row counts, each a group
        after it (default room: the largest). ``reserve``: rows the arenas hold, for groups that :meth:`join`
        later."""
        if not self.ready():
            raise ValueError(f"the cascade decode graph is not in use: {self.refused}")
        pasts, counts = (past, *more[0::2]), (rows, *more[1::2])
        if len(pasts) > GROUPS:
            raise ValueError(f"the cascade graph takes {GROUPS} prompts at once, not {len(pasts)}")
        room = room or max(_shape(p.layers[0][0])[2] - p.length for p in pasts)
        first = self._grow(None, past, max(reserve, sum(counts)), room)
        out = SharedRows((), (), (), first.rows, first.reserve)
        for p, n in zip(pasts, counts, strict=True):
            out = self.join(out, p, n)
        return out

    def join(self, past: SharedRows, prompt, rows: int) -> SharedRows:
        """``past`` with a new last group: ``prompt`` (a one-row prompt KV) read by ``rows`` new rows holding no
        token of their own yet. Raises where the arenas cannot hold them or the graph takes no more prompts."""
        from ortevals.runtime.buffers import KVCache

        have = sum(past.counts)
        if len(past.counts) >= GROUPS or have + rows > past.reserve:
            raise ValueError(f"cannot add {rows} rows of a prompt to {have} rows of {len(past.counts)} prompts "
                             f"(at most {GROUPS} prompts, {past.reserve} rows)")
        valid = KVCache(tuple(tuple(self._valid(t, prompt.length) for t in pair) for pair in prompt.layers),
                        prompt.length)
        grown = self._grow(past, prompt, have + rows, _shape(past.rows.layers[0][0])[2])
        return SharedRows((*past.prompts, valid), (*past.counts, rows), (*past.lengths, 0), grown.rows, past.reserve)

    def _grow(self, past: SharedRows | None, like, rows: int, room: int) -> SharedRows:
        """The arenas' leading ``rows`` rows of ``room`` tokens (the rows already there kept: the same buffers,
        the same row stride); on the first call they are sized for ``rows`` rows (the reserve)."""
        from ortevals.runtime.buffers import KVCache

        layers = tuple(tuple(self._arena(2 * li + j, t, rows, room) for j, t in enumerate(pair))
                       for li, pair in enumerate(like.layers))
        if past is None:
            return SharedRows((), (), (), KVCache(layers, 0), rows)
        return SharedRows(past.prompts, past.counts, past.lengths, KVCache(layers, past.rows.length), past.reserve)

    def keep(self, past, rows):
        if not isinstance(past, SharedRows):
            return self.base.keep(past, rows)
        return past.kept(rows, self.base.keep(past.rows, rows))

    def peak(self, tokens: int):
        """``base``'s peak: every row counted at prompt + max_gen_toks (an upper bound: a row holds only its
        own tokens, the prompt is held once)."""
        return self.base.peak(tokens)

    def held_bytes(self) -> int:
        return self.base.held_bytes()

    def ready(self) -> bool:
        """Whether decode rows share the prompt: the cascade graph opened and checked once (see the module
        docstring); ``off``, a refusal or a failed check: False from then on."""
        if self.runner is not None or self.refused is not None:
            if self.runner is None and self.cascade.mode == "on" and self.refused != "cascade=off":
                raise OrtEvalsError(f"cascade=on is impossible for this package: {self.refused}")
            return self.runner is not None
        if self.cascade.mode == "off":
            self.refused = "cascade=off"
            return False
        try:
            if self.cascade.too_big():
                raise MemoryError(self.cascade.too_big())
            self.runner = self.cascade.open()
            diff = max(same_as_plain(self.plain, self), two_prompts_as_plain(self.plain, self))
            if not diff <= 1e-4:  # NaN too: a poisoned value was read
                raise ValueError(f"it differs from the plain pass (rel. {diff:.2g})")
        except Exception as e:  # noqa: BLE001 - any refusal means: not this graph
            self.runner, self.refused = None, str(e)
            if self.cascade.mode == "on":
                raise OrtEvalsError(f"cascade=on is impossible for this package: {e}") from None
            (log.warning if isinstance(self.base, DeviceKV) else log.info)(
                "cascade: %s; each decode row keeps its own copy of the prompt KV", e)
            return False
        log.info("raw path: decode rows attend to one shared prompt KV (cascade decode graph)")
        return True

    def _valid(self, t, length: int):
        """The first ``length`` tokens of a one-row buffer, contiguous ``[1,H,length,D]``: bound as they are. A
        buffer of exactly ``length`` tokens is its own (the sampler's streams allocate their prompts so: a copy
        of ~64 MB a 1,400-token prompt of SmolLM2-135M, most of it page faults, ~0.7 s a 14-prompt run)."""
        if _shape(t)[2] == length:
            return t
        if isinstance(t, np.ndarray):
            return np.ascontiguousarray(t[:, :, :length])
        out = self.base._new((1, t.shape[1], length, t.shape[3]), t.elem_type)
        self.base.copies.fit(t, length, into=out)
        return out

    def _arena(self, index: int, like, rows: int, room: int):
        shape = (rows, _shape(like)[1], room, _shape(like)[3])
        return self.base._arena(index, shape, like if isinstance(self.base, DeviceKV) else like.dtype)


def two_prompts_as_plain(plain, kv: CascadeKV) -> float:
    """Largest relative logit difference between the rows of two prompts decoded together on the cascade
    graph and each row on the plain path: prompts of 3 and 5 tokens with 2 and 1 rows, a step, the first
    prompt's second row dropped, another step (NaN-filled new buffers, as :func:`same_as_plain`)."""
    kv.poison = True
    try:
        prompts = [np.asarray([[1, 2, 3]], dtype=np.int64), np.asarray([[4, 5, 6, 7, 8]], dtype=np.int64)]
        rows = [plain.run(p, None)[1] for p in prompts]
        rows = [plain.repeat(rows[0], 2), rows[1]]
        shared = kv.share(*(x for p, n in zip(prompts, (2, 1), strict=True)
                            for x in (kv.run(p, kv.empty(1, p.shape[1] + 3))[1], n)))
        pairs = []
        for step, kept in ((np.asarray([[9], [10], [11]]), [0, 1, 2]), (np.asarray([[12], [14]]), [0, 2])):
            if len(kept) < shared.rows.layers[0][0].shape[0]:
                shared, rows = kv.keep(shared, kept), [plain.keep(rows[0], [0]), rows[1]]
            got, shared = kv.run(step, shared)
            want = [plain.run(step[:len(kept) - 1], rows[0]), plain.run(step[len(kept) - 1:], rows[1])]
            rows = [w[1] for w in want]
            pairs.append((got, np.concatenate([w[0] for w in want])))
        scale = max(1.0, max(float(np.abs(w).max()) for _, w in pairs))
        return float(np.max([np.abs(g - w).max() for g, w in pairs])) / scale
    finally:
        kv.poison = False


def _shape(t) -> tuple:
    return tuple(t.shape)
