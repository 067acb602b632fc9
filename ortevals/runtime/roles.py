"""What each tensor and weight of a builder decoder graph is for, found by the builder's node names.

Owns reading roles out of an ONNX graph written by the onnxruntime-genai model builder, whose
nodes are named ``/model/layers.{i}/<block>/<op>`` (``/model/layers.3/attn/o_proj/MatMul``,
``/model/layers.3/post_attention_layernorm/SkipLayerNorm``), ``/model/embed_tokens/...`` and
``/lm_head/...``. Pure functions over ``onnx`` protos (weights never read):

* :func:`residual_points`: the residual stream where it can be read, by role, not by tensor name:
  ``embed`` (the embeddings entering layer 0: the first layer norm's input), ``attn.{i}`` (after
  layer i's attention block: output 3 of its middle skip norm, ``post_attention_layernorm`` or
  Gemma's ``pre_feedforward_layernorm``) and ``out.{i}`` (after layer i: output 3 of layer i+1's
  ``input_layernorm`` skip norm, or of the final norm after the last layer). A skip norm computes
  that sum whether or not its output 3 is named; a rewrite names it (runtime/taps.py).
* :func:`weight_units`: the weights that can be kept at a higher precision one group at a time,
  by the builder's own node names (the names its ``nodes_to_exclude`` option takes): per layer
  ``qkv`` (q/k/v or fused qkv projections), ``o``, ``gate_up`` and ``down``, plus ``lm_head`` and
  ``embeddings``. A quantized node is matched to its float name by role: the quantizer renames
  ``.../MatMul`` to ``.../MatMul_Q4`` (``_Q4G32``, ``_Q8`` …) and the tied embedding's
  ``Gather`` to ``GatherBlockQuantized``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

LAYER = re.compile(r"^/model/layers\.(\d+)/")
QUANT_SUFFIX = re.compile(r"_Q\d+(G\d+)?$")
SKIP_NORMS = {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}
NORMS = SKIP_NORMS | {"SimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization"}
QUANTIZED_OPS = {"MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul",
                 "DequantizeLinear"}
# the builder's projection names → the group a user keeps at higher precision together
GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o", "dense": "o",
          "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up", "fc1": "gate_up",
          "down_proj": "down", "fc2": "down"}
GROUP_ORDER = ("embeddings", "qkv", "o", "gate_up", "down", "lm_head")
EMBED_NODE = "/model/embed_tokens/Gather"
LM_HEAD_NODE = "/lm_head/MatMul"


@dataclass(frozen=True)
class Source:
    """Where a residual point is read: output ``slot`` of ``node`` (``tensor`` its name, '' when unnamed),
    or, with ``node`` None, the tensor ``tensor`` itself."""

    tensor: str
    node: str | None = None
    slot: int = 0


@dataclass(frozen=True)
class Unit:
    """A group of weights kept at the reference's precision together: ``nodes`` are the builder's float node
    names (``nodes_to_exclude`` entries), in graph order."""

    name: str  # "layers.3.down", "lm_head", "embeddings"
    layer: int | None
    group: str
    nodes: tuple[str, ...]


def layer_of(name: str) -> int | None:
    """The layer index in a builder node name, or None."""
    m = LAYER.match(name)
    return int(m.group(1)) if m else None


def named_layers(graph) -> set[int]:
    """Layer indices that appear in the graph's node names (the final norm's index L included)."""
    return {i for i in (layer_of(n.name) for n in graph.node) if i is not None}


def _block(name: str) -> str:
    """``/model/layers.3/post_attention_layernorm/SkipLayerNorm`` → ``post_attention_layernorm``."""
    parts = name.split("/")
    return parts[3] if len(parts) > 3 else ""


def residual_points(graph) -> dict[str, Source]:
    """``embed``, ``attn.{i}``, ``out.{i}`` → where each is read (see the module docstring)."""
    points: dict[str, Source] = {}
    middle: dict[int, list] = {}
    for node in graph.node:
        i = layer_of(node.name)
        if i is None or node.op_type not in NORMS:
            continue
        block, skip = _block(node.name), node.op_type in SKIP_NORMS
        slot3 = node.output[3] if len(node.output) > 3 else ""
        if block in ("input_layernorm", "final_norm_layernorm") and skip and i > 0:
            points[f"out.{i - 1}"] = Source(slot3, node.name, 3)
        elif block == "input_layernorm" and i == 0 and not skip:
            points["embed"] = Source(node.input[0])
        elif skip and block not in ("input_layernorm", "final_norm_layernorm"):
            middle.setdefault(i, []).append(node)
    for i, nodes in middle.items():
        if len(nodes) == 1:  # one residual add inside the layer: after its attention block
            points[f"attn.{i}"] = Source(nodes[0].output[3] if len(nodes[0].output) > 3 else "", nodes[0].name, 3)
    return points


def base_name(node) -> str:
    """The builder's float name of a (possibly quantized) weight node: ``.../MatMul_Q4`` → ``.../MatMul``,
    the embedding's ``GatherBlockQuantized`` (or ``Gather``) → ``/model/embed_tokens/Gather``."""
    if node.name.startswith("/model/embed_tokens/") and node.op_type in ("Gather", "GatherBlockQuantized"):
        return EMBED_NODE
    return QUANT_SUFFIX.sub("", node.name)


def _unit_of(base: str) -> tuple[str, int | None, str] | None:
    if base == EMBED_NODE:
        return "embeddings", None, "embeddings"
    if base == LM_HEAD_NODE:
        return "lm_head", None, "lm_head"
    i = layer_of(base)
    parts = base.split("/")
    if i is None or len(parts) < 5 or not parts[-1].startswith("MatMul"):
        return None
    group = GROUPS.get(parts[-2], parts[-2])
    return f"layers.{i}.{group}", i, group


WEIGHT_OPS = {"MatMul", "MatMulNBits", "Gather", "GatherBlockQuantized"}


def weight_units(graph) -> dict[str, Unit]:
    """Every weight group the graph names (see the module docstring), in graph order."""
    nodes: dict[str, list[str]] = {}
    meta: dict[str, tuple[int | None, str]] = {}
    for node in graph.node:
        if node.op_type not in WEIGHT_OPS:
            continue
        base = base_name(node)
        unit = _unit_of(base)
        if unit is None:
            continue
        name, layer, group = unit
        if base not in nodes.setdefault(name, []):
            nodes[name].append(base)
        meta[name] = (layer, group)
    return {n: Unit(n, meta[n][0], meta[n][1], tuple(b)) for n, b in nodes.items()}


def unit_sort_key(unit: Unit) -> tuple:
    """Graph order: embeddings, then layer by layer (qkv, o, gate_up, down), then the LM head."""
    layer = -1 if unit.group == "embeddings" else (10**9 if unit.layer is None else unit.layer)
    rank = GROUP_ORDER.index(unit.group) if unit.group in GROUP_ORDER else len(GROUP_ORDER)
    return layer, rank, unit.name


def quantized_ops(graph) -> set[str]:
    """The quantized op types the graph uses (empty for a float graph)."""
    return {n.op_type for n in graph.node if n.op_type in QUANTIZED_OPS}


def nodes_by_base(graph) -> dict[str, object]:
    """Float name → the node computing it (quantized or not); see :func:`base_name`."""
    out = {}
    for node in graph.node:
        if node.op_type in WEIGHT_OPS and _unit_of(base_name(node)) is not None:
            out.setdefault(base_name(node), node)
    return out


def layer_ranges(layers: Iterable[int]) -> str:
    """``[0,1,2,5,7,8]`` → ``0-2, 5, 7-8``."""
    xs = sorted(set(layers))
    parts, start = [], None
    for a, b in zip(xs, xs[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ", ".join(parts)
