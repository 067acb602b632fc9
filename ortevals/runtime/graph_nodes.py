"""Building small ONNX subgraphs by hand: named nodes and constants for one rewritten node.

Owns :class:`Nodes` (collects the nodes and initializers that replace one node of a graph, every
name prefixed so rewrites of several nodes never clash), :func:`attrs` (a node's attributes as
Python values) and :func:`prune` (the nodes and initializers no graph output needs, removed). Used
by the cascade decode graph (runtime/cascade.py), the shared-prefix scoring graph
(runtime/prefix_graph.py), the swapped candidate (runtime/swap.py) and the test fixture that
rewrites GroupQueryAttention into plain ops (tests/fixtures/gqa_contract.py). Imports onnx only.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper


class Nodes:
    """Collects nodes and constants for one rewritten node (names prefixed)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes, self.inits, self.n = prefix, [], [], 0

    def const(self, value, dtype=np.int64) -> str:
        name = f"{self.prefix}/c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.n += 1
        out = f"{self.prefix}/{op_type}{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def ops(self, op_type: str, outputs: int, *inputs: str, **attrs) -> list[str]:
        """A node of several outputs (Split); their names."""
        self.n += 1
        name = f"{self.prefix}/{op_type}{self.n}"
        outs = [f"{name}/{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs


def attrs(node) -> dict:
    """A node's attributes, ``{name: value}``."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def prune(graph) -> None:
    """Drop the nodes no graph output needs, then the initializers no node reads."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output if o):
            keep.append(node)
            needed.update(reads(node))
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    kept = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def reads(node) -> set[str]:
    """The tensors a node reads, those its subgraphs (If, Loop) read from outside included."""
    names = {i for i in node.input if i}
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in sub.node:
                names |= reads(inner)
    return names
