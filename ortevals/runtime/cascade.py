"""Cascade decode graph: decode rows attend to a shared prompt KV plus their own suffix KV.

The sampler (engine/sampler.py) decodes K samples of a prompt together. With the package's
own decoder every row carries its own copy of the prompt's KV, so a decode pass reads the
prompt K times. This module derives a decoder in which each ``com.microsoft``
GroupQueryAttention node is split in two exact parts (the "cascade" / Hydragen decomposition of
attention over a shared prefix, as FlashInfer's cascade attention computes it):

* **prompt part**, plain ONNX ops, for each of :data:`GROUPS` groups of rows (the rows of one prompt:
  rows ``0..n0-1`` read the first prompt, the next ``n1`` the second, ...; ``ortevals_group_rows
  [GROUPS]``): the new token's query (rotated at its true position ``P + t``, scaled) against the group's
  prompt KV
  ``ortevals_prompt.<layer>.key/value`` / ``ortevals_prompt2.<layer>...`` ``[H_kv, P_g, D]``. A group's
  rows and the query heads of one KV head are folded into the M dimension of one GEMM per KV head
  (``[H_kv, n_g*g, D] x [H_kv, D, P_g]``), so each prompt is read once per pass, not once a row.
  Gives ``out_p`` and ``lse_p`` (log-sum-exp of the scaled scores). A group may have no rows. Each
  group's prompt is read every pass (~64 MB at 1,400 tokens of SmolLM2-135M fp32: ~3.5 ms a group on
  the 2-core machine), which is why the groups are few.
* **suffix part**: the original GroupQueryAttention node on the rows' own KV (past ``[B, H_kv, W,
  D]`` written in place), told each row's suffix length (``seqlens_k - P_row``: the groups need not step
  together, a prompt's rows join a running batch with none) and the true rotary positions (its
  ``position_ids`` input, ``P_row + t_row``). Gives ``out_s``; ``lse_s`` comes from the query against the
  keys the node just wrote (rotated), over the buffer's whole width W with the positions past the row's
  own masked, so a row's sums run over the same columns whatever the other rows hold.
* combined: softmax over the union = ``out_s + sigmoid(lse_p - lse_s) * (out_p - out_s)``.

A row's numbers do not depend on the other rows: its prompt part is its group's GEMM (rows are
independent in the M dimension), its suffix part its own GroupQueryAttention row and its own masked
columns. The attention mask spans each row's whole sequence, right-padded (row b: ``P_b + t_b + 1``
ones), so the graph's own ``seqlens_k`` subgraph is untouched; each row's prompt length is
``ortevals_prompt_lengths [B]``. One new token per row (decode).

Refused (:class:`Refused`, the sampler keeps the current path and logs why once): sliding windows,
softcap, smooth softmax, attention sinks or biases, quantized KV, per-head Q/K norms, a
``position_ids`` input, past KV that feeds anything but GroupQueryAttention, layers that attend to another
layer's KV (Gemma 4 E2B/E4B's KV sharing), rotary tables that are not constant, opsets before 13 (Split's sizes
became an input). Cached like runtime/derive.py's
scoring graph: ``derived/<scope>/`` under a :class:`~ortevals.package.scope.Scope` of exactly what
the rewrite reads (:func:`cascade_reads`: the decoder's graph, not its weights; the rewrite's
version), weights left in the package folder.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope
from ortevals.runtime.derive import written_once

PROMPT_KEY = "ortevals_prompt.%d.key"
PROMPT_VALUE = "ortevals_prompt.%d.value"
GROUPS = 8  # prompts whose rows one decode pass can take (a group with no rows costs ~0.4 ms a pass)
# one (key, value) name pair per group: ortevals_prompt.<layer>.key, then ortevals_prompt2.<layer>.key, ...
PROMPT_NAMES = ((PROMPT_KEY, PROMPT_VALUE),
                *((f"ortevals_prompt{g + 1}.%d.key", f"ortevals_prompt{g + 1}.%d.value") for g in range(1, GROUPS)))
GROUP_ROWS = "ortevals_group_rows"  # int64 [GROUPS]: rows reading each prompt, in batch order
PROMPT_LENGTHS = "ortevals_prompt_lengths"  # int32 [B]: each row's prompt length
REWRITE = {"rewrite": "cascade-decode/6", "groups": GROUPS,
           "combine": "prompt GEMM per KV head and group (rows folded), split once a layer, GQA suffix in place, "
                      "sigmoid(lse_p - lse_s)"}
MS = "com.microsoft"
# GroupQueryAttention inputs this rewrite keeps as they are; any later one (position_ids, attention_bias,
# head_sink, k/v scales, q/k norms, query_seqlens) changes what the op computes and is refused
KNOWN_INPUTS = 9
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "PagedAttention", "SparseAttention", "PackedAttention",
                 "DecoderMaskedMultiHeadAttention", "GroupQueryAttention", "LongformerAttention"}


class Refused(Exception):
    """The graph cannot be rewritten exactly; the message says why."""


def cascade_reads(package: ModelPackage) -> Reads:
    """What :func:`_rewrite` reads: the decoder's graph without its external data; the rewrite's version."""
    return Reads("cascade graph", (package.decoder.path,), dict(REWRITE), ("onnx",))


def cascade_decoder(package: ModelPackage, cache: Path) -> Path:
    """Path of the cascade decoder under ``cache`` (built once); :class:`Refused` where it cannot be."""
    if package.has_position_ids:
        raise Refused("the decoder takes position_ids (its rotary positions come from outside the attention)")
    if package.windowed:
        raise Refused("its sliding layers keep a windowed KV cache")
    if package.recurrent:
        raise Refused(f"the decoder carries recurrent state ({package.states[0].name}, ...): each row needs its own")
    if package.shared_kv:  # the rewrite splits each layer's attention over that layer's own prompt and rows' KV
        raise Refused("layers attend to another layer's KV (KV sharing: "
                      + ", ".join(f"{layer}<-{source}" for layer, source in package.shared_kv) + ")")
    scope = Scope.build("cascade", package.root, [cascade_reads(package)])
    return written_once(package, cache, scope, lambda: _rewrite(package), "cascade decode graph")


class PromptBinding:
    """One IOBinding of the cascade graph kept from pass to pass, its shared-prompt inputs bound once a group.

    A group's prompt tensors (2 per layer) are rebound only when another prompt takes its slot: binding eight
    prompts' 480 tensors every pass cost ~3 ms of a ~120 ms pass (SmolLM2-135M, 2 cores). A slot with no rows
    binds the first group's prompt (read by no row), so only live prompts are held here (the memory bound
    stays alive, and a finished prompt's copy is not kept). The caller binds every other input and the
    outputs each pass."""

    def __init__(self, package: ModelPackage, session) -> None:
        self.package, self.binding = package, session.io_binding()
        self.slots: list = [None] * GROUPS  # the prompt (a one-row KVCache) bound in each slot

    def bind(self, groups) -> object:
        """The binding with ``groups`` bound: ``((prompt, rows, ...), ...)``, at most :data:`GROUPS`, in batch
        order, each prompt a one-row KVCache (``[1,H,P,D]``, contiguous) bound as it is (without its batch
        axis)."""
        if not 1 <= len(groups) <= GROUPS:
            raise ValueError(f"the cascade graph takes 1 to {GROUPS} groups of rows, not {len(groups)}")
        for g, names in enumerate(PROMPT_NAMES):
            prompt = groups[g][0] if g < len(groups) else groups[0][0]  # a slot with no rows: any live prompt
            if prompt is not self.slots[g]:
                for spec, pair in zip(self.package.kv, prompt.layers, strict=True):
                    for name, t in zip(names, pair, strict=True):
                        _bind(self.binding, name % spec.layer, _heads(t))
                self.slots[g] = prompt
        counts = [g[1] for g in groups] + [0] * (GROUPS - len(groups))
        self.binding.bind_cpu_input(GROUP_ROWS, np.asarray(counts, dtype=np.int64))
        lengths = np.repeat([p.length for p, *_ in groups], counts[:len(groups)]).astype(np.int32)
        self.binding.bind_cpu_input(PROMPT_LENGTHS, lengths)
        return self.binding


def _bind(binding, name: str, t) -> None:
    if isinstance(t, np.ndarray):
        binding.bind_cpu_input(name, t)  # wraps the array's memory (contiguous: CascadeKV made it so)
    else:
        t.bind_input(binding, name)


def _heads(t):
    """A one-row ``[1,H,P,D]`` tensor as ``[H,P,D]``, the same memory: the graph's prompt inputs have no batch
    dimension, as its GEMMs read them (a Reshape node of a graph input would copy it every pass: ~5 ms a pass
    at eight 1,400-token prompts of SmolLM2-135M on the 2-core machine)."""
    return t.reshape(t.shape[1:]) if isinstance(t, np.ndarray) else replace(t, shape=tuple(t.shape[1:]))


def _rewrite(package: ModelPackage) -> bytes:
    import onnx
    from onnx import helper

    model = onnx.load(str(package.decoder.path), load_external_data=False)
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    if opset < 13:
        raise Refused(f"opset {opset}: Split takes its sizes as an input from opset 13")
    layers = {n: s for s in package.kv for n in (s.key_name, s.value_name)}
    _check_consumers(graph, layers)
    tables = {i.name: list(i.dims) for i in graph.initializer}
    kept, lengths = [], {}
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == MS:
            spec = layers.get(node.input[3])
            if spec is None:  # another layer's present KV (KV sharing), or no past at all
                raise Refused(f"{node.name}: its past KV {node.input[3] or '(none)'} is not a past input of the "
                              "decoder (KV sharing)")
            key = tuple(node.input[5:7])  # the builder feeds every layer the same seqlens_k and total
            if key not in lengths:
                shared, lengths[key] = _lengths(node, len(lengths))
                kept += shared.nodes
                graph.initializer.extend(shared.inits)
            nodes, inits = _rewrite_node(node, spec, tables, opset, lengths[key])
            kept += nodes
            graph.initializer.extend(inits)
            for g, names in enumerate(PROMPT_NAMES):
                for name in names:
                    graph.input.append(helper.make_tensor_value_info(
                        name % spec.layer, _elem_type(spec.dtype), [spec.kv_heads, f"prompt{g}_length",
                                                                    spec.head_size]))
        else:
            kept.append(node)
    graph.input.append(helper.make_tensor_value_info(GROUP_ROWS, onnx.TensorProto.INT64, [GROUPS]))
    graph.input.append(helper.make_tensor_value_info(PROMPT_LENGTHS, onnx.TensorProto.INT32, ["batch_size"]))
    del graph.node[:]
    graph.node.extend(kept)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model.SerializeToString()


def _check_consumers(graph, layers: dict) -> None:
    """Every past KV input feeds exactly one GroupQueryAttention (as its past), and no other attention op."""
    fed: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in layers:
                fed.setdefault(name, []).append((node, i))
        if node.op_type in ATTENTION_OPS and not (node.op_type == "GroupQueryAttention" and node.domain == MS):
            raise Refused(f"attention op {node.op_type} ({node.name}) is not GroupQueryAttention")
    for name in layers:
        uses = fed.get(name, [])
        if len(uses) != 1 or uses[0][0].op_type != "GroupQueryAttention" or uses[0][1] not in (3, 4):
            what = ", ".join(f"{n.op_type} input {i}" for n, i in uses) or "nothing"
            raise Refused(f"past KV {name} feeds {what}, not one GroupQueryAttention's past")


def _refusal(node, a: dict) -> str | None:
    if a.get("local_window_size", -1) != -1:
        return f"sliding window of {a['local_window_size']} tokens"
    for name, off in (("softcap", 0.0), ("smooth_softmax", 0), ("qk_output", 0), ("sliding_window_cache", 0),
                      ("kv_cache_bit_width", 0)):
        if a.get(name, off) != off:
            return f"{name}={a[name]}"
    if a.get("causal", 1) != 1:
        return "non-causal attention"
    for name in ("k_quant_type", "v_quant_type"):
        kind = a.get(name, "NONE")
        if (kind.decode() if isinstance(kind, bytes) else kind).upper() != "NONE":
            return f"quantized KV ({name})"
    extra = [i for i, n in enumerate(node.input) if n and i >= KNOWN_INPUTS]
    return f"input {extra[0]} of GroupQueryAttention is set" if extra else None


def _lengths(node, index: int):
    """(the nodes, (suffix seqlens_k ``[B]``, suffix total (scalar int32), the rows' valid suffix positions
    ``[B,1,1,W]`` (bool, W the KV buffers' capacity), rotary positions ``[B,1]`` = P_row + t_row)) from a
    GroupQueryAttention's ``seqlens_k`` (it spans prompt and suffix: the mask does, right-padded) and the rows'
    prompt lengths."""
    from onnx import TensorProto

    from ortevals.runtime.graph_nodes import Nodes

    g = Nodes(f"ortevals_cascade/lengths{index}")
    seqlens = g.op("Sub", node.input[5], PROMPT_LENGTHS)  # [B] t_row: the row's own tokens before this one
    # GroupQueryAttention's total two past the longest row's t: at total == 1 (a first decode step) the CPU kernel
    # takes its first-prompt path, which rotates every row's new key at the FIRST row's position_ids (rows of
    # prompts of different lengths were rotated wrongly: tests/test_cascade.py). The kernel reads each row's own
    # length from seqlens; total only bounds the shared present buffer (capacity max_gen_toks + 1, while the
    # largest t fed is max_gen_toks - 2: the last token chosen is never fed).
    total = g.op("Add", g.op("ReduceMax", seqlens, keepdims=0), g.const(2, np.int32))
    width = g.op("Gather", g.op("Shape", node.input[3]), g.const(2))  # W: the rows' KV buffers' capacity
    upto = g.op("Cast", g.op("Add", seqlens, g.const(1, np.int32)), to=TensorProto.INT64)  # [B] t + 1
    valid = g.op("Less", g.op("Range", g.const(0), width, g.const(1)), g.op("Unsqueeze", upto, g.const([1, 2, 3])))
    pos = g.op("Unsqueeze", g.op("Cast", node.input[5], to=TensorProto.INT64), g.const([1]))  # [B,1] = P + t
    return g, (seqlens, total, valid, pos)


def _rewrite_node(node, spec, tables: dict, opset: int, lengths: tuple) -> tuple[list, list]:
    """The nodes replacing one GroupQueryAttention (its outputs keep their names)."""
    from onnx import helper

    from ortevals.runtime.graph_nodes import Nodes, attrs

    a = attrs(node)
    why = _refusal(node, a)
    if why:
        raise Refused(f"{node.name}: {why}")
    nq, nk, d = a["num_heads"], a["kv_num_heads"], spec.head_size
    g = Nodes(node.name + "/cascade")
    seqlens, total, valid, pos = lengths
    inputs = list(node.input) + [""] * (KNOWN_INPUTS + 1 - len(node.input))
    inputs[5], inputs[6], inputs[9] = seqlens, total, pos
    out_s = f"{g.prefix}/suffix_out"
    g.nodes.append(helper.make_node("GroupQueryAttention", inputs, [out_s, *node.output[1:3]], name=f"{g.prefix}/gqa",
                                    domain=MS, **a))
    q = _query(g, node, a, nq * d, pos, tables)
    q = g.op("Mul", q, g.op("Cast", g.const(a.get("scale") or 1 / math.sqrt(d), np.float32),
                            to=_elem_type(spec.dtype)))
    q4 = g.op("Reshape", q, g.const([0, nk, nq // nk, d]))  # [B, H_kv, g, D]: query head h reads KV head h // g
    out_p, lse_p = _prompt_parts(g, q4, spec.layer, nk, nq // nk, d, opset)
    # the rows' own keys, rotated, over the whole buffer (W columns whatever the other rows' lengths: a row's sums
    # run over the same columns in any batch), the positions past each row's own masked out (stale or unset)
    scores = g.op("MatMul", q4, g.op("Transpose", node.output[1], perm=[0, 1, 3, 2]))  # [B,H_kv,g,W]
    masked = g.op("Where", valid, scores, g.op("Cast", g.const(-np.inf, np.float32), to=_elem_type(spec.dtype)))
    lse_s = _softmax(g, masked, opset)[1]  # [B,H_kv,g,1]
    o_s = g.op("Reshape", out_s, g.const([0, nk, nq // nk, d]))
    weight = g.op("Sigmoid", g.op("Sub", lse_p, lse_s))  # Z_p / (Z_p + Z_s)
    out = g.op("Add", o_s, g.op("Mul", weight, g.op("Sub", out_p, o_s)))
    g.nodes.append(helper.make_node("Reshape", [out, g.const([0, 1, nq * d])], [node.output[0]],
                                    name=f"{g.prefix}/out"))
    return g.nodes, g.inits


def _query(g, node, a: dict, width: int, pos: str, tables: dict) -> str:
    """The new tokens' queries ``[B,1,Nq*D]``, rotated at ``pos`` as the node rotates them."""
    packed = len(node.input) < 2 or not node.input[1]
    q = g.op("Slice", node.input[0], g.const([0]), g.const([width]), g.const([2])) if packed else node.input[0]
    if not a.get("do_rotary", 0):
        return q
    if node.input[7] not in tables:
        raise Refused(f"{node.name}: rotary tables are not constant")
    rotary = 2 * tables[node.input[7]][1]
    return g.op("RotaryEmbedding", q, pos, node.input[7], node.input[8], domain=MS, num_heads=a["num_heads"],
                rotary_embedding_dim=rotary, interleaved=a.get("rotary_interleaved", 0))


def _prompt_parts(g, q4: str, layer: int, nk: int, groups: int, d: int, opset: int) -> tuple[str, str]:
    """Attention of the rows' queries ``q4 [B,H_kv,g,D]`` over their groups' shared prompts: (out ``[B,H_kv,g,D]``,
    lse ``[B,H_kv,g,1]``).

    One GEMM pair per KV head and group, the group's rows and the query heads of a KV head folded into M:
    ``[n*g, D] x K^T`` and ``softmax [n*g, P] x V``. A row's numbers do not depend on how many rows its group
    has: only M varies with the rows, and onnxruntime's CPU GEMM (MLAS) blocks the sum over P by N and K (here
    P and D, or D and P), not by M. (The GEMMs the other way round, ``K x q`` and ``V^T x probs``, ran ~35%
    faster but put the rows in N, and MLAS widens its K blocks as N shrinks: the sums over P were split
    differently as rows ended.) The queries are transposed, split and gathered back once a layer for all
    groups."""
    rows = g.op("Reshape", g.op("Transpose", q4, perm=[1, 0, 2, 3]), g.const([nk, -1, d]))  # [H_kv, B*g, D]
    sizes = g.op("Mul", GROUP_ROWS, g.const(groups))
    outs, tops, peaks = [], [], []
    for q, (key, value) in zip(g.ops("Split", GROUPS, rows, sizes, axis=1), PROMPT_NAMES, strict=True):
        scores = g.op("MatMul", q, g.op("Transpose", key % layer, perm=[0, 2, 1]))  # [H_kv, n*g, P]
        probs = g.op("Softmax", scores, axis=-1)
        tops.append(_max(g, scores, opset))
        peaks.append(_max(g, probs, opset))
        outs.append(g.op("MatMul", probs, value % layer))  # [H_kv, n*g, D]
    out, top, peak = (g.op("Concat", *x, axis=1) for x in (outs, tops, peaks))  # back in batch order
    lse = g.op("Sub", top, g.op("Log", peak))  # as _softmax: max(s) - log(max(softmax(s)))

    def back(x: str, width: int) -> str:  # [H_kv, B*g, w] -> [B, H_kv, g, w]
        return g.op("Transpose", g.op("Reshape", x, g.const([nk, -1, groups, width])), perm=[1, 0, 2, 3])

    return back(out, d), back(lse, 1)


def _softmax(g, scores: str, opset: int) -> tuple[str, str]:
    """(softmax, log-sum-exp kept) over the last axis.

    lse = max(s) - log(max(softmax(s))): the largest probability is at least 1/n, so its log is
    well conditioned (a float32 rounding of it moves lse by ~1e-7), and it costs two max reductions
    after the vectorised Softmax. onnxruntime's ReduceLogSumExp on CPU took 17 ms a pass on SmolLM2
    at a 2048-token prompt (16 rows) against 1 ms for Softmax.
    """
    probs = g.op("Softmax", scores, axis=-1)
    return probs, g.op("Sub", _max(g, scores, opset), g.op("Log", _max(g, probs, opset)))


def _max(g, x: str, opset: int) -> str:
    """max over the last axis, kept (ReduceMax: axes became an input in opset 18)."""
    if opset >= 18:
        return g.op("ReduceMax", x, g.const([-1]), keepdims=1)
    return g.op("ReduceMax", x, axes=[-1], keepdims=1)


def _elem_type(dtype: str) -> int:
    from ortevals.runtime.buffers import ONNX_TYPES

    return ONNX_TYPES[dtype]
