"""Shared-prefix planning: which token prefixes to compute once and reuse as past KV.

Pure Python over token ids, no runtime. The inputs are sorted; the longest
common prefixes of neighbours define the internal nodes of a radix tree (the
LCP-interval tree). A node is kept when reusing it saves at least
``min_saving`` token computations, and each kept node is computed from its
nearest kept ancestor, so every shared token is run through the model once.
Prefixes are found by exact token-id match, never by string assumptions.

The engine walks the plan depth-first, holding only the KV of the kept nodes
on the current path (bounded by a memory budget): leaving a subtree evicts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ortevals.package.reuse import MIN_PASS_TOKENS
from ortevals.tokens import common_prefix


@dataclass(frozen=True)
class PrefixNode:
    """A prefix worth caching: ``depth`` tokens of ``source`` input, computed on top of ``parent``."""

    depth: int
    parent: int | None  # index into PrefixPlan.nodes, or None for an empty past
    members: int  # how many inputs start with it


@dataclass(frozen=True)
class PrefixPlan:
    """Execution order (indices into the inputs) and each input's cached ancestor."""

    order: tuple[int, ...]  # inputs in depth-first (lexicographic) order
    nodes: tuple[PrefixNode, ...]
    ancestor: tuple[int | None, ...]  # per input: deepest kept node, or None
    paths: tuple[tuple[int, ...], ...]  # per input: kept nodes from the root down

    def top_level(self) -> PrefixPlan:
        """The plan with only its outermost nodes (those without a kept parent): every input continues from its
        top-level prefix. Node indices are kept (the others are simply never on a path)."""
        paths = tuple(tuple(k for k in p if self.nodes[k].parent is None) for p in self.paths)
        return PrefixPlan(self.order, self.nodes, tuple(p[-1] if p else None for p in paths), paths)


def _intervals(seqs: list[Sequence[int]], order: list[int]) -> list[tuple[int, int, int]]:
    """LCP intervals ``(depth, first, last)`` over ``order`` (positions, inclusive), depth > 0."""
    out: list[tuple[int, int, int]] = []
    stack: list[tuple[int, int]] = [(0, 0)]  # (depth, first position)
    for pos in range(1, len(order) + 1):
        lcp = common_prefix(seqs[order[pos - 1]], seqs[order[pos]]) if pos < len(order) else 0
        first = pos - 1
        while lcp < stack[-1][0]:
            depth, first = stack.pop()
            out.append((depth, first, pos - 1))
        if lcp > stack[-1][0]:
            stack.append((lcp, first))
    return out


def plan_prefixes(inputs: Sequence[Sequence[int]], reserved: Sequence[int], min_saving: int = 64,
                  min_depth: int = 16, min_step: int = MIN_PASS_TOKENS) -> PrefixPlan:
    """Plan prefix reuse for ``inputs``.

    reserved[i]: how many trailing tokens of input i must be computed in its own
    pass (its scored rows), so a prefix never covers them. A kept node extends its
    parent by at least ``min_step`` tokens: a one-token pass can take another kernel
    path than a longer one (MatMulNBits accuracy_level=4, the builder's int4/int8: up
    to 0.59 nats on SmolLM2), so no KV is ever computed by one.
    """
    order = sorted(range(len(inputs)), key=lambda i: tuple(inputs[i]))
    seqs = [tuple(s) for s in inputs]
    limit = [len(s) - r for s, r in zip(seqs, reserved)]
    # outermost first, so a node's kept ancestor is decided before the node itself
    intervals = sorted(_intervals(seqs, order), key=lambda t: (t[1], -(t[2] - t[1]), t[0]))
    nodes: list[PrefixNode] = []
    spans: list[tuple[int, int]] = []
    for depth, first, last in intervals:
        depth = min(depth, *(limit[order[p]] for p in range(first, last + 1)))
        parent = _enclosing(spans, nodes, first, last)
        base = nodes[parent].depth if parent is not None else 0
        count = last - first + 1
        if depth >= min_depth and (count - 1) * (depth - base) >= min_saving and depth - base >= min_step:
            nodes.append(PrefixNode(depth, parent, count))
            spans.append((first, last))
    paths = [[] for _ in inputs]
    for k, (first, last) in enumerate(spans):
        for p in range(first, last + 1):
            paths[order[p]].append(k)
    for p in paths:
        p.sort(key=lambda k: nodes[k].depth)
    ancestor = tuple(p[-1] if p else None for p in paths)
    return PrefixPlan(tuple(order), tuple(nodes), ancestor, tuple(tuple(p) for p in paths))


def _enclosing(spans: list[tuple[int, int]], nodes: list[PrefixNode], first: int, last: int) -> int | None:
    """The deepest kept node whose span contains [first, last]."""
    best = None
    for k, (a, b) in enumerate(spans):
        if a <= first and last <= b and (best is None or nodes[k].depth > nodes[best].depth):
            best = k
    return best
