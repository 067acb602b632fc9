"""Decode rows that share one copy of their prompt's KV (model arg ``cascade=auto|on|off``).

Owns :class:`CascadeKV`, a KV holder for the sampler (the interface of engine/kvrows.py:
``empty``/``prefix``, ``run``, ``repeat``, ``keep``, ``peak``, ``held_bytes``) over an in-place
holder (:class:`~ortevals.engine.generate.kvrows.InplaceKV` on the host, ``DeviceKV`` where the session
runs). Prompt passes are the in-place holder's. Decode rows (``repeat`` with more than one row)
become :class:`SharedRows`: the prompt's valid tokens once, contiguous ``[1,H,P,D]`` per layer,
bound as they are by every pass of the cascade decode graph (runtime/cascade.py), and each row's
own tokens after the prompt in the in-place holder's arenas (``[K,H,max_gen_toks+1,D]``, written
in place by GroupQueryAttention). A decode pass then reads its weights, the prompt once and the
rows' suffixes, instead of the prompt K times; rows leave by the in-place holder's ``keep``.

The cascade graph is opened on the first batch of several rows (a greedy run never pays for it)
and trusted only after :func:`~ortevals.engine.generate.kvrows.same_as_plain` (a prompt, a prefix cut, rows
replicated, decode steps, a row dropped, on NaN-filled buffers) agrees with the plain pass; where
the graph is refused (runtime/cascade.py says why), the check fails or the session cannot open,
``auto`` logs why once and keeps each row's own copy of the prompt, ``on`` is a one-line error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.kvrows import DeviceKV, InplaceKV, same_as_plain
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SharedRows:
    """A decode batch's KV: the prompt's once (``prompt``, one row of ``P`` tokens) and each row's tokens
    after it (``rows``: ``[B,H,capacity,D]`` per layer holding ``rows.length`` tokens)."""

    prompt: object  # runtime.buffers.KVCache
    rows: object


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
        self.refused: str | None = None if isinstance(base, InplaceKV) else "the shared past/present buffer was refused"

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

        rows = past.rows
        if rows.length + ids.shape[1] > _shape(rows.layers[0][0])[2]:
            raise ValueError(f"KV rows of {_shape(rows.layers[0][0])[2]} tokens cannot take {rows.length} + "
                             f"{ids.shape[1]}")
        logits = self.runner.forward_inplace(ids, rows, prompt=past.prompt)
        return logits[:, -1, :], SharedRows(past.prompt, KVCache(rows.layers, rows.length + ids.shape[1]))

    def repeat(self, past, rows: int):
        """The one-row prompt KV as ``rows`` decode rows: :meth:`share` once the cascade graph is ready and
        there are several rows (one row reads its prompt once anyway), else ``base``'s copies."""
        if rows == 1 or not self.ready():
            return self.base.repeat(past, rows)
        return self.share(past, rows)

    def share(self, past, rows: int) -> SharedRows:
        """The one-row prompt KV (capacity prompt + max_gen_toks + 1) as ``rows`` decode rows on the cascade
        graph: its valid tokens once, contiguous, and ``rows`` empty rows with room for the rest."""
        from ortevals.runtime.buffers import KVCache

        if not self.ready():
            raise ValueError(f"the cascade decode graph is not in use: {self.refused}")

        room = _shape(past.layers[0][0])[2] - past.length
        prompt = KVCache(tuple(tuple(self._valid(t, past.length) for t in pair) for pair in past.layers), past.length)
        layers = tuple(tuple(self._arena(2 * li + j, t, rows, room) for j, t in enumerate(pair))
                       for li, pair in enumerate(past.layers))
        return SharedRows(prompt, KVCache(layers, 0))

    def keep(self, past, rows):
        if not isinstance(past, SharedRows):
            return self.base.keep(past, rows)
        return SharedRows(past.prompt, self.base.keep(past.rows, rows))

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
            return self.runner is not None
        if self.cascade.mode == "off":
            self.refused = "cascade=off"
            return False
        try:
            if self.cascade.too_big():
                raise MemoryError(self.cascade.too_big())
            self.runner = self.cascade.open()
            diff = same_as_plain(self.plain, self)
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
        """The first ``length`` tokens of a one-row buffer, contiguous ``[1,H,length,D]``: bound as they are."""
        if isinstance(t, np.ndarray):
            return np.ascontiguousarray(t[:, :, :length])
        out = self.base._new((1, t.shape[1], length, t.shape[3]), t.elem_type)
        self.base.copies.fit(t, length, into=out)
        return out

    def _arena(self, index: int, like, rows: int, room: int):
        shape = (rows, _shape(like)[1], room, _shape(like)[3])
        return self.base._arena(index, shape, like if isinstance(self.base, DeviceKV) else like.dtype)


def _shape(t) -> tuple:
    return tuple(t.shape)
