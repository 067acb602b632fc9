"""Prefix-aware sharding of requests across data-parallel workers: pure planning and dispatch.

Owns how a request list is cut into chunks for workers (``ortevals.integrations.ray``) and
how the chunks are handed out and merged back:

* **units**: requests that must stay together (a question's choices: one context, several
  continuations; the repeats of one generation prompt). A unit is never split.
* **groups**: units that share an expensive prefix (a benchmark's few-shot header). The
  shared-prefix plan of :mod:`ortevals.engine.score.prefix` over the units' tokens gives each unit
  a path of kept prefix nodes; its group is the *heaviest* node on that path (most tokens
  over its parent), so a header of 1,500 tokens wins over the dozen tokens every prompt
  of a benchmark shares and over the few words some questions share.
* **chunks**: contiguous runs (in the plan's lexicographic order) of one group, cut to
  about ``total / (workers * chunks_per_worker)`` tokens, so the load balances; cuts go
  where the neighbours share nothing beyond the group's prefix where possible, so a deeper
  shared prefix stays inside one chunk.
* **dispatch** (:class:`Dispatcher`) pulls: a free worker takes the next chunk of the group
  it ran last (its prefix KV is warm), otherwise the largest chunk left. A chunk whose
  worker died goes back to the queue.
* **merge** (:func:`merge`): results carry their global index and are put back in order;
  a missing index is an error, a duplicate (a chunk run twice after a restart) is dropped.

Pure Python over token tuples; no runtime, no Ray.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from ortevals.engine.score.prefix import plan_prefixes
from ortevals.errors import OrtEvalsError
from ortevals.tokens import common_prefix

NO_GROUP = -1  # units that share no kept prefix with any other


@dataclass(frozen=True)
class Chunk:
    """A contiguous run of one group's units: what one worker call computes."""

    index: int  # position in ShardPlan.chunks
    group: int  # affinity: the group's prefix node, or NO_GROUP
    requests: tuple[int, ...]  # global request indices, unit by unit
    cost: float  # tokens computed beyond the group's prefix
    prefix: int  # tokens of the group's prefix (computed once per worker that runs the group)


@dataclass(frozen=True)
class ShardPlan:
    """Chunks in plan order, and the totals the simulator reports."""

    chunks: tuple[Chunk, ...]
    prefix: dict[int, int]  # group -> prefix tokens
    suffix_cost: float  # sum of chunk costs

    @property
    def groups(self) -> set[int]:
        return {c.group for c in self.chunks}


@dataclass(frozen=True)
class _Unit:
    tokens: tuple[int, ...]
    requests: tuple[int, ...]
    cost: float  # tokens of its members' inputs (distinct inputs once)


def _units(inputs: Sequence[Sequence[int]], units: Sequence[Hashable] | None) -> list[_Unit]:
    """Requests grouped by unit key in first-appearance order; a unit's tokens: its longest common prefix."""
    keys = units if units is not None else [tuple(t) for t in inputs]
    if len(keys) != len(inputs):
        raise OrtEvalsError(f"shard plan: {len(keys)} unit keys for {len(inputs)} requests")
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    out = []
    for idx in members.values():
        seqs = [tuple(inputs[i]) for i in idx]
        shared = min(common_prefix(seqs[0], s) for s in seqs)
        out.append(_Unit(seqs[0][:shared], tuple(idx), float(sum(len(s) for s in set(seqs)))))
    return out


def _groups(units: list[_Unit], min_saving: int) -> tuple[list[int], list[int], list[int]]:
    """Plan order of units, each unit's group (heaviest kept node) and that node's depth."""
    plan = plan_prefixes([u.tokens for u in units], [0] * len(units), min_saving)
    group, depth = [NO_GROUP] * len(units), [0] * len(units)
    for i, path in enumerate(plan.paths):
        best, gain = NO_GROUP, 0
        for k in path:  # root first: a tie keeps the shallower node (more members, same affinity)
            parent = plan.nodes[k].parent
            step = plan.nodes[k].depth - (plan.nodes[parent].depth if parent is not None else 0)
            if step > gain:
                best, gain = k, step
        if best != NO_GROUP:
            group[i], depth[i] = best, plan.nodes[best].depth
    return list(plan.order), group, depth


def plan_shards(inputs: Sequence[Sequence[int]], workers: int, units: Sequence[Hashable] | None = None,
                chunks_per_worker: int = 8, min_saving: int = 64) -> ShardPlan:
    """Cut requests into chunks for ``workers`` workers.

    inputs[i]: request i's model input (token ids; a prompt for generation).
    units[i]: requests with equal keys stay in one chunk (default: equal inputs).
    """
    if workers < 1:
        raise OrtEvalsError(f"workers must be > 0, got {workers}")
    us = _units(inputs, units)
    order, group, depth = _groups(us, min_saving)
    cost = [us[u].cost - depth[u] * len(set(tuple(inputs[r]) for r in us[u].requests)) for u in range(len(us))]
    target = max(1.0, sum(cost) / (workers * chunks_per_worker))
    chunks: list[Chunk] = []
    run: list[int] = []
    for pos, u in enumerate(order):
        run.append(u)
        nxt = order[pos + 1] if pos + 1 < len(order) else None
        if nxt is None or group[nxt] != group[u] or _cut_here(run, us, cost, depth, nxt, target):
            chunks.append(_chunk(len(chunks), run, us, group, depth, cost))
            run = []
    prefix = {c.group: c.prefix for c in chunks}
    return ShardPlan(tuple(chunks), prefix, float(sum(c.cost for c in chunks)))


def _cut_here(run: list[int], us: list[_Unit], cost: list[float], depth: list[int], nxt: int,
              target: float) -> bool:
    """Close the chunk before ``nxt``: the run is big enough and, until twice the target, the cut
    splits nothing deeper than the group's prefix."""
    acc = sum(cost[u] for u in run)
    if acc < target or len(run) < 2:
        return False
    return acc >= 2 * target or common_prefix(us[run[-1]].tokens, us[nxt].tokens) <= depth[nxt]


def _chunk(index: int, run: list[int], us: list[_Unit], group: list[int], depth: list[int],
           cost: list[float]) -> Chunk:
    requests = tuple(r for u in run for r in us[u].requests)
    return Chunk(index, group[run[0]], requests, float(sum(cost[u] for u in run)), depth[run[0]])


class Dispatcher:
    """Pull-based hand-out of a plan's chunks; see the module docstring."""

    def __init__(self, chunks: Iterable[Chunk]) -> None:
        self.left: dict[int, list[Chunk]] = {}  # group -> chunks not handed out, in plan order
        for c in chunks:
            self.left.setdefault(c.group, []).append(c)
        self.last: dict[Hashable, int] = {}  # worker -> group it ran last

    def __len__(self) -> int:
        return sum(len(v) for v in self.left.values())

    def next(self, worker: Hashable) -> Chunk | None:
        """The next chunk for ``worker``, or None when none is left."""
        group = self.last.get(worker)
        if group is not None and self.left.get(group):
            chunk = self.left[group].pop(0)
        else:
            pending = [c for cs in self.left.values() for c in cs]
            if not pending:
                return None
            work = {g: sum(c.cost for c in cs) for g, cs in self.left.items()}
            chunk = max(pending, key=lambda c: (c.cost, work[c.group], -c.index))
            self.left[chunk.group].remove(chunk)
        self.last[worker] = chunk.group
        return chunk

    def requeue(self, chunk: Chunk) -> None:
        """A chunk whose worker died: first in line again for its group."""
        self.left.setdefault(chunk.group, []).insert(0, chunk)


def merge(n: int, pieces: Iterable[tuple[int, object]]) -> list:
    """``(global index, result)`` pairs -> results in order; the first of duplicates wins."""
    out: list = [None] * n
    seen = [False] * n
    for index, value in pieces:
        if not seen[index]:
            out[index], seen[index] = value, True
    missing = [i for i, s in enumerate(seen) if not s]
    if missing:
        raise OrtEvalsError(f"sharded run lost {len(missing)} of {n} results (first: request {missing[0]})")
    return out
