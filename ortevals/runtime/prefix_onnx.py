"""The standard ONNX ``Attention`` op (opsets 23/24) in the shared-prefix scoring graph: Mobius' ``--ep default``.

runtime/prefix_graph.py replaces every attention node by plain ops that read one prefix's KV for every row. For a
GroupQueryAttention node the op itself says everything (lengths, rotary, window); a standard ``Attention`` node
receives its queries and keys already rotated (``RotaryEmbedding`` nodes on ``position_ids``, which the shared
graph is fed as ``P + s``) and its mask as a tensor the package computes from ``attention_mask`` (a padding mask,
or Gemma 3's sliding windows and causality as an additive float bias). The rewrite keeps that computation: the
shared graph is fed ``attention_mask`` all ones over ``[B, P + S]`` (what one pass of a row sees: right padding
sits after its real tokens), and the mask ``[B, 1, S, P + S]`` the package computes from it is cut at ``P``, its
first ``P`` columns applied to the prefix part, the rest to the own part, as the op applies it (a boolean mask
keeps where true; a float one is added, floored at -1e30 so a query that sees no key of a part gets a weight of
exactly 0 for it, never NaN). Owns which nodes are attention nodes the rewrite takes (:func:`past_input`), the
check that each past KV feeds only its node, a standard node's refusals and its attributes under
GroupQueryAttention's names (:func:`onnx_attributes`), and the mask's two parts (:func:`mask_parts`).

Refused: 4-D inputs (no ``q_num_heads``), ``is_causal=0``, ``softcap`` (unchecked against the op's order of mask
and cap), ``nonpad_kv_seqlen`` (an external cache), the ``qk_matmul_output`` output, a mask whose type or shape
(``[B, 1, S, T]``) shape inference cannot tell, a windowed KV buffer.
"""

from __future__ import annotations

import numpy as np

from ortevals.runtime.cascade import ATTENTION_OPS, MS, Refused

ONNX = ("", "ai.onnx")
FLOOR = -1e30  # a masked score: finite, so a part nobody sees has lse -1e30 and weight 0 against the other


def past_input(node) -> str | None:
    """The past key input of an attention node the rewrite takes (GroupQueryAttention's input 3, the standard
    ``Attention``'s input 4), else None."""
    if node.op_type == "GroupQueryAttention" and node.domain == MS:
        return node.input[3] if len(node.input) > 3 else ""
    if node.op_type == "Attention" and node.domain in ONNX:
        return node.input[4] if len(node.input) > 4 else ""
    return None


def is_standard(node) -> bool:
    return node.op_type == "Attention" and node.domain in ONNX


def check_consumers(graph, layers: dict) -> None:
    """Every past KV input feeds exactly one attention node the rewrite takes, as its past, and no other node
    (an attention op it does not take is refused)."""
    fed: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in layers:
                fed.setdefault(name, []).append((node, i))
        if node.op_type in ATTENTION_OPS and past_input(node) is None:
            raise Refused(f"attention op {node.op_type} ({node.name}) is neither GroupQueryAttention nor the "
                          "standard Attention")
    for name in layers:
        uses = fed.get(name, [])
        first = 4 if uses and is_standard(uses[0][0]) else 3
        if len(uses) != 1 or past_input(uses[0][0]) is None or uses[0][1] not in (first, first + 1):
            what = ", ".join(f"{n.op_type} input {i}" for n, i in uses) or "nothing"
            raise Refused(f"past KV {name} feeds {what}, not one attention node's past")


def onnx_attributes(node, a: dict, spec) -> dict:
    """A standard ``Attention`` node's attributes under GroupQueryAttention's names (``num_heads``,
    ``kv_num_heads``, ``scale``); :class:`Refused` for what the rewrite does not compute."""
    why = _refusal(node, a, spec)
    if why:
        raise Refused(f"{node.name}: {why}")
    return {"num_heads": a["q_num_heads"], "kv_num_heads": a["kv_num_heads"], "scale": a.get("scale")}


def _refusal(node, a: dict, spec) -> str | None:
    if "q_num_heads" not in a or "kv_num_heads" not in a:
        return "4-D query, key and value (no q_num_heads/kv_num_heads)"
    if a.get("is_causal", 0) != 1:
        return "non-causal attention (is_causal=0)"
    if float(a.get("softcap", 0.0) or 0.0):
        return f"softcap={a['softcap']} on the standard Attention op"
    if len(node.input) > 6 and node.input[6]:
        return "its nonpad_kv_seqlen input is set (an external KV cache)"
    if len(node.output) > 3 and node.output[3]:
        return "its qk_matmul_output output is read"
    if spec.window:
        return f"a windowed KV buffer ({spec.window} rows)"
    return None


def mask_types(model) -> dict[str, tuple[int, list]]:
    """The element type and dims (ints, or None where symbolic) of every standard attention node's mask, by shape
    inference (weights are not read)."""
    from onnx import shape_inference

    masks = {n.input[3] for n in model.graph.node if is_standard(n) and len(n.input) > 3 and n.input[3]}
    if not masks:
        return {}
    inferred = shape_inference.infer_shapes(model).graph
    out = {}
    for v in list(inferred.value_info) + list(inferred.input):
        if v.name in masks and v.type.tensor_type.elem_type:
            dims = v.type.tensor_type.shape.dim
            out[v.name] = (v.type.tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else None
                                                          for d in dims])
    return out


def mask_parts(g, node, types: dict, length: str):
    """(prefix, own): functions applying the node's mask to the prefix part's scores ``[H_kv, B, S, g, P]`` and the
    own part's ``[B, H_kv, S, g, S]``, or ``(None, None)`` where the node has no mask. ``length``: P."""
    from onnx import TensorProto

    if len(node.input) <= 3 or not node.input[3]:
        return None, None
    mask = node.input[3]
    kind, dims = types.get(mask, (0, None))
    if dims is None or len(dims) != 4 or dims[1] != 1 or kind not in (TensorProto.BOOL, TensorProto.FLOAT,
                                                                      TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise Refused(f"{node.name}: its attn_mask is not a boolean or float [B, 1, S, T] tensor that shape "
                      f"inference can tell (type {kind}, dims {dims})")
    if kind != TensorProto.BOOL and kind != TensorProto.FLOAT:
        mask = g.op("Cast", mask, to=TensorProto.FLOAT)
    big = g.const([np.iinfo(np.int64).max])
    own = g.op("Unsqueeze", g.op("Slice", mask, length, big, g.const([3])), g.const([3]))  # [B,1,S,1,S]
    head = g.op("Slice", mask, g.const([0]), length, g.const([3]))  # [B,1,S,P]
    prefix = g.op("Unsqueeze", g.op("Transpose", head, perm=[1, 0, 2, 3]), g.const([3]))  # [1,B,S,1,P]

    def apply(part: str):
        if kind == TensorProto.BOOL:
            return lambda x: g.op("Where", part, x, g.const(FLOOR, np.float32))
        return lambda x: g.op("Add", x, g.op("Max", part, g.const(FLOOR, np.float32)))

    return apply(prefix), apply(own)
