"""The shared-prefix scoring graph: many inputs that share one cached prefix scored in one pass.

onnxruntime's GroupQueryAttention runs several rows of several new tokens on a past only where each row has a
past of its own (``CheckInputs``: "batch_size must be 1 when sequence_length > 1 and past context is given";
onnxruntime 1.32's ``query_seqlens`` lifts the refusal, still with one past per row). Scoring MMLU-Pro that way
means one question per pass, or the five-shot header's KV copied into every row. This module derives, from the
derived scoring graph (runtime/derive.py: the LM head at the scored positions, scores on the device), a graph in
which every ``com.microsoft`` GroupQueryAttention node, or every standard ONNX ``Attention`` node (Mobius'
``--ep default``: runtime/prefix_onnx.py), is replaced by plain ONNX ops that read ONE prefix for every row:

* inputs: the rows' own tokens ``[B,S]`` (right-padded), and per KV layer the prefix KV as the original graph
  wrote it (rotated, normed) ``ortevals_prefix.<layer>.key/value [H_kv, P, D]``, bound as it is (no batch axis,
  never replicated); no past or present KV; ``position_ids`` ``P + s`` where the decoder takes them, and
  ``attention_mask`` (all ones, ``[B, P + S]``) only where a standard ``Attention`` node's mask is computed from
  it. Row b's token s sits at position ``P + s``.
* per attention node: the packed or separate Q/K/V split into heads; the per-head Q/K RMS norm where the node
  takes its weights (inputs 14/15, the builder's fused Qwen3 norm on CUDA); rotary at ``P + s`` by
  ``com.microsoft`` RotaryEmbedding on the node's own cos/sin tables (interleaved or not, partial rotary);
  the scale (``scale`` or 1/sqrt(D)); softcap where set (``softcap * tanh(x / softcap)``).
* the prefix part: every row's queries folded into the M dimension of one GEMM pair per KV head (``[H_kv,
  B*S*g, D] x [H_kv, D, P]``, g = H_q / H_kv), so the prefix is read once a pass and a row's numbers do not
  depend on the batch (onnxruntime's CPU GEMM blocks its sums by N and K, not M: runtime/cascade.py);
* the own part: each row's queries against its own keys, causal, ``[B, H_kv, S*g, S]``; right padding sits
  after a row's real tokens, so causality keeps it out of them;
* combined by log-sum-exp, as the cascade decode graph combines its two parts:
  ``out_own + sigmoid(lse_prefix - lse_own) * (out_prefix - out_own)``.

Attention runs in float32 whatever the graph's float type (fp16/bf16 inputs are cast; the output is cast
back), so an fp16 package's scores accumulate as flash attention's do. Refused (:class:`Refused`, one line; the
engine scores that package one question per pass): smooth softmax, sinks, attention biases, quantized KV,
``position_ids`` beside GroupQueryAttention (its rotary is the node's own), non-constant rotary tables (LongRoPE's
length switch), recurrent state, attention ops other than GroupQueryAttention and the standard ``Attention``
(and what runtime/prefix_onnx.py refuses of the latter), past KV feeding anything else, a GroupQueryAttention
graph's attention mask that feeds more than the attention's lengths, opsets before 13. Cached like the derived
graph under ``derived/<scope>/``, keyed by :func:`prefix_graph_reads` (the decoder's graph, the derived graph's
rewrite and this one's version); weights stay in the package folder.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ortevals.package.graph import graph_facts
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope
from ortevals.runtime.cascade import MS, Refused, _elem_type, _softmax
from ortevals.runtime.derive import REWRITE as DERIVE_REWRITE
from ortevals.runtime.derive import derived_model, written_once
from ortevals.runtime.prefix_onnx import (
    check_consumers,
    is_standard,
    mask_parts,
    mask_types,
    onnx_attributes,
    past_input,
)

PREFIX_KEY = "ortevals_prefix.%d.key"
PREFIX_VALUE = "ortevals_prefix.%d.value"
PREFIX_LENGTH = "ortevals_prefix_length"  # int64 [1]: P, the prefix's tokens (the rows' positions start there)
PREFIX_RESIDENT = "ortevals_prefix_resident"  # int64 [1]: rows of a windowed layer's buffer holding the prefix's last
REWRITE = {"rewrite": "shared-prefix/3",
           "attention": "float32; prefix GEMM per KV head (rows folded into M), own causal part, "
                        "sigmoid(lse_p - lse_o); qk-norm SimplifiedLayerNormalization; com.microsoft RotaryEmbedding",
           "windows": "prefix rows i < L, i - s > L - W (masked at -1e30); own t > s - W",
           "standard Attention": "the package's attn_mask from attention_mask ones [B,P+S], cut at P, floored at -1e30"}
# GroupQueryAttention inputs the rewrite reads (query, key, value, past, lengths, rotary tables) or computes
# (14/15: the per-head Q/K norm weights); any other set input changes what the op computes and is refused
KNOWN = {0, 1, 2, 3, 4, 5, 6, 7, 8, 14, 15}
NAMED_INPUTS = {9: "position_ids", 10: "attention_bias", 11: "head_sink", 12: "k_scale", 13: "v_scale",
                16: "query_seqlens"}


def prefix_graph_reads(package: ModelPackage) -> Reads:
    """What the rewrite reads: the decoder's graph (not its weights), the logits name; both rewrites' versions."""
    settings = {"logits_name": package.logits_name, **DERIVE_REWRITE, **{f"prefix_{k}": v for k, v in REWRITE.items()}}
    return Reads("shared-prefix graph", (package.decoder.path,), settings, ("onnx",))


def prefix_decoder(package: ModelPackage, cache: Path) -> Path:
    """Path of the shared-prefix scoring graph under ``cache`` (built once); :class:`Refused` where it cannot be."""
    why = package_refusal(package)
    if why:
        raise Refused(why)
    scope = Scope.build("shared-prefix", package.root, [prefix_graph_reads(package)])
    return written_once(package, cache, scope, lambda: _built(package), "shared-prefix scoring graph")


def _built(package: ModelPackage) -> bytes:
    model = derived_model(package)
    if model is None:
        raise Refused("no LM head was found to score at the chosen positions")
    rewrite(model, package)
    return model.SerializeToString()


def package_refusal(package: ModelPackage) -> str:
    """Why the package as a whole cannot be scored this way ('' where it may be: the graph decides the rest)."""
    if package.has_position_ids and "GroupQueryAttention" in graph_facts(package.decoder.path).attention_ops:
        return "the decoder takes position_ids (its rotary positions come from outside the attention)"
    if package.recurrent:
        return f"the decoder carries recurrent state ({package.states[0].name}, ...)"
    if graph_facts(package.decoder.path).reads_outputs:
        return "its layers share KV (a layer reads another layer's present KV, as Gemma 4 E2B/E4B)"
    return ""


def rewrite(model, package: ModelPackage) -> None:
    """Replace every GroupQueryAttention and standard Attention of ``model`` (the derived graph, in place) by the
    shared-prefix form."""
    from onnx import TensorProto, helper

    from ortevals.runtime.graph_nodes import prune

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    if opset < 13:
        raise Refused(f"opset {opset}: Split takes its sizes as an input from opset 13")
    layers = {n: s for s in package.kv for n in (s.key_name, s.value_name)}
    check_consumers(graph, layers)
    tables = {i.name: list(i.dims) for i in graph.initializer}
    masks = mask_types(model)  # the standard Attention nodes' masks: type and shape
    kept, shared = [], None
    for node in graph.node:
        past = past_input(node)
        if past is not None:
            if not past:
                raise Refused(f"{node.name}: no past KV input")
            spec = layers[past]
            if shared is None:
                shared = _positions(node)
                kept += shared[0].nodes
                graph.initializer.extend(shared[0].inits)
            nodes, inits = _rewrite_node(node, spec, tables, opset, shared[1:], masks)
            kept += nodes
            graph.initializer.extend(inits)
            rows = f"prefix_rows_{spec.window}" if spec.window else "prefix_length"  # a windowed buffer's capacity
            for name in (PREFIX_KEY, PREFIX_VALUE):
                graph.input.append(helper.make_tensor_value_info(name % spec.layer, _elem_type(spec.dtype),
                                                                 [spec.kv_heads, rows, spec.head_size]))
        else:
            kept.append(node)
    if shared is None:
        raise Refused("the decoder has no GroupQueryAttention or standard Attention node")
    del graph.node[:]
    graph.node.extend(kept)
    present = {n for s in package.kv for n in (s.present_key_name, s.present_value_name)}
    _keep_outputs(graph, [o for o in graph.output if o.name not in present])
    prune(graph)
    mask = package.decoder.inputs.get("attention_mask", "attention_mask")
    read = any(mask in n.input for n in graph.node)
    if read and not masks:  # GroupQueryAttention reads it as lengths only; a standard node's mask is computed from it
        raise Refused(f"{mask} feeds more than the attention's lengths")
    _keep_inputs(graph, [i for i in graph.input if i.name not in layers and (read or i.name != mask)])
    graph.input.extend(helper.make_tensor_value_info(name, TensorProto.INT64, [1]) for name in (PREFIX_LENGTH,
                                                                                              PREFIX_RESIDENT))


def _positions(node):
    """(nodes, rotary positions ``[B,S]`` = P + s, the own tokens ``[S]``): once a graph, from the first attention
    node's query and the prefix's length."""
    from ortevals.runtime.graph_nodes import Nodes

    g = Nodes("ortevals_prefix/positions")
    shape = g.op("Shape", node.input[0])
    batch, seq = g.op("Gather", shape, g.const([0])), g.op("Gather", shape, g.const([1]))
    own = g.op("Range", g.const(0), g.op("Squeeze", seq), g.const(1))  # [S]
    pos = g.op("Expand", g.op("Unsqueeze", g.op("Add", own, PREFIX_LENGTH), g.const([0])),
               g.op("Concat", batch, seq, axis=0))  # [B,S]
    return g, pos, own


def _own_mask(g, own: str, window: int) -> str:
    """Query s sees its own keys t <= s (and t > s - W in a window of W): ``[S,1,S]``, to broadcast over
    ``[B,H_kv,S,g,S]``."""
    keys, queries = g.op("Unsqueeze", own, g.const([0, 1])), g.op("Unsqueeze", own, g.const([1, 2]))
    seen = g.op("LessOrEqual", keys, queries)
    if window > 0:
        seen = g.op("And", seen, g.op("Greater", keys, g.op("Sub", queries, g.const(window))))
    return seen


def _prefix_mask(g, own: str, rows: str, resident: str, window: int) -> str:
    """The prefix rows query s sees in a window of W: row i (of the buffer's ``rows``) holds position P - L + i
    for i < L (``resident``; the rest holds nothing), visible where P - L + i > P + s - W: ``[S,1,rows]``."""
    i = g.op("Unsqueeze", g.op("Range", g.const(0), g.op("Squeeze", rows), g.const(1)), g.const([0, 1]))
    s = g.op("Unsqueeze", own, g.const([1, 2]))
    held = g.op("Less", i, resident)
    return g.op("And", held, g.op("Greater", g.op("Sub", i, s), g.op("Sub", resident, g.const(window))))


def _refusal(node, a: dict) -> str | None:
    for name, off in (("smooth_softmax", 0), ("qk_output", 0), ("kv_cache_bit_width", 0)):
        if a.get(name, off) != off:
            return f"{name}={a[name]}"
    if a.get("causal", 1) != 1:
        return "non-causal attention"
    for name in ("k_quant_type", "v_quant_type"):
        kind = a.get(name, "NONE")
        if (kind.decode() if isinstance(kind, bytes) else kind).upper() != "NONE":
            return f"quantized KV ({name})"
    extra = [i for i, n in enumerate(node.input) if n and i not in KNOWN]
    if extra:
        return f"its {NAMED_INPUTS.get(extra[0], f'input {extra[0]}')} input is set"
    return None


def _rewrite_node(node, spec, tables: dict, opset: int, shared: tuple, types: dict) -> tuple[list, list]:
    """The nodes replacing one GroupQueryAttention or standard Attention (output 0 keeps its name; the present
    outputs go)."""
    from onnx import TensorProto, helper

    from ortevals.runtime.graph_nodes import Nodes, attrs

    a = attrs(node)
    why = None if is_standard(node) else _refusal(node, a)
    if why:
        raise Refused(f"{node.name}: {why}")
    if is_standard(node):  # queries and keys come rotated; the mask is the package's own
        a = onnx_attributes(node, a, spec)
    nq, nk, d = a["num_heads"], a["kv_num_heads"], spec.head_size
    groups = nq // nk
    g = Nodes(node.name + "/shared")
    pos, own = shared
    window = int(a.get("local_window_size", -1))
    keys = PREFIX_KEY % spec.layer
    # a windowed layer's prefix: the buffer's first L rows (L: the resident rows of a windowed cache, else P)
    rows = g.op("Gather", g.op("Shape", keys), g.const([1]))
    held = (PREFIX_RESIDENT if spec.window else rows) if window > 0 else None
    cut = mask_parts(g, node, types, PREFIX_LENGTH) if is_standard(node) else (None, None)
    seen = _prefix_mask(g, own, rows, held, window) if held else None
    masks = (cut[0] or (seen and (lambda x: g.op("Where", seen, x, g.const(-1e30, np.float32)))),
             _own_mask(g, own, window), cut[1])
    q, k, v = _split(g, node, nq, nk, d)
    if len(node.input) > 15 and node.input[14]:  # the per-head RMS norm fused into the node (before rotary)
        q, k = (_head_norm(g, x, node.input[i], n, d, _norm_eps(a, which))
                for x, i, n, which in ((q, 14, nq, "q"), (k, 15, nk, "k")))
    if a.get("do_rotary", 0):
        q, k = (_rotary(g, node, a, x, n, pos, tables) for x, n in ((q, nq), (k, nk)))
    f32 = spec.dtype != "float32"
    if f32:  # attention in float32 whatever the graph's type
        q, k, v = (g.op("Cast", x, to=TensorProto.FLOAT) for x in (q, k, v))
    # the scale inside the product (FusedMatMul's alpha), as onnxruntime's CPU kernel scales its GEMM
    scale = float(a.get("scale") or 1 / math.sqrt(d))
    cap = float(a.get("softcap", 0.0) or 0.0)
    out_p, lse_p = _prefix_part(g, q, spec, (nk, groups, d), (scale, cap), masks[0], opset, f32)
    out_o, lse_o = _own_part(g, q, k, v, (nk, groups, d), (scale, cap), masks[1:], opset)
    out = g.op("Add", out_o, g.op("Mul", g.op("Sigmoid", g.op("Sub", lse_p, lse_o)), g.op("Sub", out_p, out_o)))
    out = g.op("Reshape", g.op("Transpose", out, perm=[0, 2, 1, 3, 4]), g.const([0, 0, nq * d]))  # [B,S,Hq*D]
    if f32:
        out = g.op("Cast", out, to=_elem_type(spec.dtype))
    g.nodes.append(helper.make_node("Identity", [out], [node.output[0]], name=f"{g.prefix}/out"))
    return g.nodes, g.inits


def _split(g, node, nq: int, nk: int, d: int) -> tuple[str, str, str]:
    """q ``[B,S,Hq*D]``, k and v ``[B,S,Hkv*D]`` from packed (input 0 alone) or separate inputs."""
    if len(node.input) > 2 and node.input[1] and node.input[2]:
        return node.input[0], node.input[1], node.input[2]
    q, k, v = g.ops("Split", 3, node.input[0], g.const([nq * d, nk * d, nk * d]), axis=2)
    return q, k, v


def _norm_eps(a: dict, which: str) -> float:
    return float(a.get(f"{which}_norm_epsilon") or a.get("qk_norm_epsilon") or 1e-6)


def _head_norm(g, x: str, weight: str, heads: int, d: int, eps: float) -> str:
    """RMS norm over each head's D values (float32 inside, as the builder's unfused SimplifiedLayerNormalization)."""
    from onnx import helper

    heads4 = g.op("Reshape", x, g.const([0, 0, heads, d]))
    out = f"{g.prefix}/norm{g.n}"
    g.n += 1
    g.nodes.append(helper.make_node("SimplifiedLayerNormalization", [heads4, weight], [out], name=out, axis=-1,
                                    epsilon=eps, stash_type=1))
    return g.op("Reshape", out, g.const([0, 0, heads * d]))


def _rotary(g, node, a: dict, x: str, heads: int, pos: str, tables: dict) -> str:
    """``x [B,S,heads*D]`` rotated at ``pos`` by the node's cos/sin tables (as the node rotates it)."""
    if node.input[7] not in tables or node.input[8] not in tables:
        raise Refused(f"{node.name}: rotary tables are not constant")
    return g.op("RotaryEmbedding", x, pos, node.input[7], node.input[8], domain=MS, num_heads=heads,
                rotary_embedding_dim=2 * tables[node.input[7]][1], interleaved=a.get("rotary_interleaved", 0))


def _scores(g, q: str, k: str, scaling: tuple[float, float]) -> str:
    """``scale * q @ k^T`` over the last two axes (k not transposed in memory), soft-capped where the node is:
    ``softcap * tanh(x / softcap)``."""
    scale, cap = scaling
    scores = g.op("FusedMatMul", q, k, domain=MS, alpha=scale, transA=0, transB=1)
    if not cap:
        return scores
    return g.op("Mul", g.op("Tanh", g.op("Div", scores, g.const(cap, np.float32))), g.const(cap, np.float32))


def _prefix_part(g, q: str, spec, heads: tuple, scaling: tuple, mask, opset: int, f32: bool):
    """The rows' queries against the prefix: (out, lse) ``[B, H_kv, S, g, D|1]``; every row and position folded
    into M of one GEMM pair per KV head, so the prefix is read once and a row's sums do not depend on the batch.
    ``mask`` (a window, or a standard node's mask): a function of the scores ``[H_kv, B, S, g, rows]`` scoring the
    rows a query does not see -1e30, finite, so a query that sees none of the prefix gets a finite part whose
    weight against its own part is exactly 0."""
    from onnx import TensorProto

    nk, groups, d = heads
    keys, values = PREFIX_KEY % spec.layer, PREFIX_VALUE % spec.layer
    if f32:
        keys, values = (g.op("Cast", x, to=TensorProto.FLOAT) for x in (keys, values))
    q5 = g.op("Reshape", q, g.const([0, 0, nk, groups, d]))  # [B,S,H_kv,g,D]
    folded = g.op("Reshape", g.op("Transpose", q5, perm=[2, 0, 1, 3, 4]), g.const([nk, -1, d]))  # [H_kv,B*S*g,D]
    scores = _scores(g, folded, keys, scaling)  # [H_kv,M,P]
    if mask is not None:  # [H_kv, B, S, g, rows] to meet the mask, then back
        five = g.op("Concat", g.const([nk]), _dims(g, q5, 0, 2), g.const([groups, -1]), axis=0)
        scores = g.op("Reshape", mask(g.op("Reshape", scores, five)), g.op("Shape", scores))
    probs, lse = _softmax(g, scores, opset)  # lse [H_kv,M,1]
    out = g.op("MatMul", probs, values)  # [H_kv,M,D]
    shape = g.op("Concat", g.const([nk]), _dims(g, q5, 0, 2), g.const([groups, -1]), axis=0)

    def back(x: str) -> str:  # [H_kv, B*S*g, w] -> [B, H_kv, S, g, w]
        return g.op("Transpose", g.op("Reshape", x, shape), perm=[1, 0, 2, 3, 4])

    return back(out), back(lse)


def _own_part(g, q: str, k: str, v: str, heads: tuple, scaling: tuple, masks: tuple, opset: int):
    """Each row's queries against its own keys, causal (``masks``: the causal ``[S,1,S]``, and a standard node's
    mask as a function of the scores ``[B, H_kv, S, g, S]`` or None): (out, lse) ``[B, H_kv, S, g, D|1]``."""
    nk, groups, d = heads
    seen, extra = masks
    q5 = g.op("Transpose", g.op("Reshape", q, g.const([0, 0, nk, groups, d])), perm=[0, 2, 1, 3, 4])  # [B,Hkv,S,g,D]
    rows = g.op("Reshape", q5, g.const([0, 0, -1, d]))  # [B,H_kv,S*g,D]
    keys = g.op("Transpose", g.op("Reshape", k, g.const([0, 0, nk, d])), perm=[0, 2, 1, 3])  # [B,H_kv,S,D]
    vals = g.op("Transpose", g.op("Reshape", v, g.const([0, 0, nk, d])), perm=[0, 2, 1, 3])  # [B,H_kv,S,D]
    scores = _scores(g, rows, keys, scaling)  # [B,H_kv,S*g,S]
    lead = _dims(g, q5, 0, 4)  # B, H_kv, S, g
    five = g.op("Reshape", scores, g.op("Concat", lead, g.const([-1]), axis=0))  # [B,H_kv,S,g,S]
    masked = g.op("Where", seen, extra(five) if extra else five, g.const(-np.inf, np.float32))
    flat = g.op("Reshape", masked, g.op("Shape", scores))
    probs, lse = _softmax(g, flat, opset)  # lse [B,H_kv,S*g,1]
    out = g.op("MatMul", probs, vals)  # [B,H_kv,S*g,D]
    return (g.op("Reshape", out, g.op("Concat", lead, g.const([d]), axis=0)),
            g.op("Reshape", lse, g.op("Concat", lead, g.const([1]), axis=0)))


def _dims(g, x: str, start: int, end: int) -> str:
    """``Shape(x)[start:end]`` (Shape's own start/end need opset 15)."""
    return g.op("Slice", g.op("Shape", x), g.const([start]), g.const([end]), g.const([0]))


def _keep_outputs(graph, outputs) -> None:
    kept = list(outputs)
    del graph.output[:]
    graph.output.extend(kept)


def _keep_inputs(graph, inputs) -> None:
    kept = list(inputs)
    del graph.input[:]
    graph.input.extend(kept)

