"""Building small ONNX subgraphs by hand: named nodes and constants for one rewritten node.

Owns :class:`Nodes` (collects the nodes and initializers that replace one node of a graph, every
name prefixed so rewrites of several nodes never clash) and :func:`attrs` (a node's attributes as
Python values). Used by the cascade decode graph (runtime/cascade.py) and the test fixture that
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
