"""Batch and prefix invariance: checked, not assumed.

The prefill engine batches right-padded rows, reuses shared-prefix KV and
(with the derived graph) runs the LM head only on gathered rows. That gives
the numbers of "one sequence run alone" only if no op mixes rows or tokens of
a pass. This module owns the two checks that decide whether it does:

* **graph detection** (:func:`detect`): ops whose output depends on what else
  is in the pass, read from the ONNX protos without weights: dynamic
  activation quantization (``DynamicQuantizeLinear``, com.microsoft
  ``DynamicQuantizeMatMul``, ``MatMulIntegerToFloat`` fed a computed scale)
  and reductions over the batch or sequence axis (axis 0 or 1);
* **the canary** (:func:`pick_canary`, :func:`slices`, :func:`compare`): a
  handful of a run's own requests, cut short, scored the configured way (a
  padded batch, a shared prefix's past, the gathered head) and the exact way
  (one row per pass, no prefix reuse); a difference beyond the dtype's
  tolerance switches the run to exact mode.

Also owns :class:`Verdicts`: a canary's verdict is an artefact like a score,
filed in the result store (whose scope covers the package files, the run's
settings and the versions) under a key naming the canary and the settings that
shape its passes, so the same package and settings pay for it once.

Pure functions over protos, token tuples and numpy arrays; ``onnx`` is
imported lazily, no runtime.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)

DYNAMIC_QUANT = {"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"}
SCALED_INTEGER = {"MatMulIntegerToFloat": 2}  # op -> index of its activation-scale input
REDUCE = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
NORMS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
         "SkipSimplifiedLayerNormalization")  # every output has the input's rank
SINGLE_AXIS = {"ArgMax": 0, "ArgMin": 0, "TopK": -1, **dict.fromkeys(NORMS, -1)}  # op -> default axis
# ops whose first output has the rank of their widest input (for ranks onnx's inference misses past contrib ops)
SAME_RANK = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Cast", "Identity", "Tanh", "Sigmoid", "Relu",
             "Neg", "Exp", "Erf", "Softmax", "MatMul", "MatMulNBits", "MatMulInteger", "Where", "Gelu", "FastGelu",
             "DynamicQuantizeLinear", "DequantizeLinear", "QuickGelu", "GroupQueryAttention", "MultiHeadAttention",
             "RotaryEmbedding", *NORMS}
# tolerance on one continuation token's log-prob, by the graph's float type
TOLERANCE = {
    "float32": 1e-4,  # fp32 passes of different shapes agree to ~1e-6 per logit; the parity tests use 1e-4
    # fp16 keeps 11 significant bits: a logit in [16, 32) is rounded to 2**-6 = 0.0156, so kernels that
    # accumulate in another order for another batch shape can move it by about a half ulp (0.008);
    # 2e-2 allows ~2.5 half ulps, still 10x under the 0.18-0.37 nats that a dynamic scale moves
    "float16": 2e-2,
    # bf16 keeps 8 bits: the same logit is rounded to 2**-3 = 0.125; 1e-1 is under one ulp there
    "bfloat16": 1e-1,
}


@dataclass(frozen=True)
class BatchDependence:
    """What detection found: ``ops`` is ((op type, count), ...) sorted by op type; empty when none."""

    ops: tuple[tuple[str, int], ...] = ()

    @property
    def found(self) -> bool:
        return bool(self.ops)

    @property
    def reason(self) -> str:
        return ", ".join(f"{op} x{n}" for op, n in self.ops)


def detect(paths: Sequence[Path], mask_inputs: Sequence[str] = ("attention_mask",)) -> BatchDependence:
    """Scan the ONNX files (decoder, embedding) for ops that mix rows or tokens of a pass."""
    import onnx

    found: Counter[str] = Counter()
    for path in paths:
        found.update(scan_graph(onnx.load(str(path), load_external_data=False), mask_inputs))
    return BatchDependence(tuple(sorted(found.items())))


def scan_graph(model, mask_inputs: Sequence[str] = ("attention_mask",)) -> Counter[str]:
    """Op type -> count of batch- or sequence-dependent nodes in ``model`` (a ModelProto)."""
    graph = model.graph
    consts = _constants(graph)
    ranks = _ranks(model)
    found: Counter[str] = Counter()
    for node in graph.node:
        if _dependent(node, consts, ranks, set(mask_inputs)):
            found[node.op_type] += 1
    return found


def _dependent(node, consts: dict, ranks: dict[str, int], masks: set[str]) -> bool:
    op = node.op_type
    if op in DYNAMIC_QUANT:
        return True
    if op in SCALED_INTEGER:
        scale = node.input[SCALED_INTEGER[op]] if len(node.input) > SCALED_INTEGER[op] else ""
        return bool(scale) and scale not in consts  # a scale computed in the pass
    if op in REDUCE:
        axes = _reduced_axes(node, consts, ranks.get(node.input[0]))
        # the builder's ReduceSum(attention_mask, 1) is each row's own length: exact under right padding
        mixing = {0} if node.input[0] in masks else {0, 1}
        return axes is None or bool(axes & mixing)
    if op in SINGLE_AXIS:
        axes = _resolve([_attr(node, "axis", SINGLE_AXIS[op])], ranks.get(node.input[0]))
        return axes is None or bool(axes & {0, 1})
    return False


def _reduced_axes(node, consts: dict, rank: int | None) -> set[int] | None:
    """Axes a Reduce* node reduces, resolved; None: every axis, or not knowable here."""
    axes = _attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        if node.input[1] not in consts:
            return None  # axes computed at run time
        axes = [int(a) for a in np.asarray(consts[node.input[1]]).ravel()]
    if not axes:
        return set() if _attr(node, "noop_with_empty_axes", 0) else None
    return _resolve(axes, rank)


def _resolve(axes: Sequence[int], rank: int | None) -> set[int] | None:
    """Non-negative axes; None when a negative axis meets an unknown rank.

    ``rank`` may be a lower bound: a negative axis resolved against it is at most the true
    axis, so "not 0 or 1" stays true."""
    out = set()
    for a in axes:
        if a < 0:
            if rank is None:
                return None
            a += rank
        out.add(int(a))
    return out


def _attr(node, name: str, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return list(value) if isinstance(value, (list, tuple)) else value
    return default


def _constants(graph) -> dict[str, np.ndarray]:
    """Small constant tensors (axes, scales): initializers with inline data and Constant nodes."""
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        inline = init.data_location != 1  # 1: EXTERNAL, never read here
        out[init.name] = numpy_helper.to_array(init) if inline and _small(init) else np.zeros(0)
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            value = _constant_value(node.attribute[0])
            if value is not None:
                out[node.output[0]] = value
    return out


# Constant's value attributes other than a tensor (onnx's Constant-13 forms): the numpy type each stands for
_CONSTANT_LISTS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32, "value_floats": np.float32}


def _constant_value(attr) -> np.ndarray | None:
    """A Constant node's value in any form onnx allows (``value``, ``sparse_value``, ``value_int(s)``,
    ``value_float(s)``; Mobius writes axes as ``value_ints``); None for strings, which no op here reads."""
    from onnx import helper, numpy_helper

    if attr.name == "value":
        return numpy_helper.to_array(attr.t)
    if attr.name == "sparse_value":
        return _dense(attr.sparse_tensor)
    if attr.name in _CONSTANT_LISTS:
        return np.asarray(helper.get_attribute_value(attr), dtype=_CONSTANT_LISTS[attr.name])
    return None


def _dense(sparse) -> np.ndarray:
    """A SparseTensorProto as a dense array: indices are [NNZ] linear or [NNZ, rank] coordinates."""
    from onnx import numpy_helper

    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(math.prod(sparse.dims), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), tuple(sparse.dims))
    dense[flat] = values
    return dense.reshape(tuple(sparse.dims))


def _small(init) -> bool:
    return math.prod(init.dims) <= 64


def _ranks(model) -> dict[str, int]:
    """Rank (or a lower bound on it) of each value: onnx shape inference, then SAME_RANK
    propagation past the contrib ops that inference cannot see through."""
    import onnx

    try:
        graph = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception:  # inference is best effort; unknown ranks are treated conservatively
        graph = model.graph
    ranks: dict[str, int] = {}
    for v in (*graph.input, *graph.value_info, *graph.output):
        if v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    for init in graph.initializer:
        ranks[init.name] = len(init.dims)
    for node in graph.node:  # nodes are in topological order
        known = [ranks[i] for i in node.input if i in ranks]
        if node.op_type in SAME_RANK and known:
            # the widest known input is a lower bound on the output's rank (broadcasting only widens)
            for out in node.output if node.op_type in NORMS else node.output[:1]:
                ranks.setdefault(out, max(known))
    return ranks


# --- the canary -----------------------------------------------------------------------------------------


def tolerance(dtype: str, tokens: int) -> float:
    """Allowed |Δ log-likelihood| for a continuation of ``tokens`` tokens (errors add like a random walk)."""
    return TOLERANCE.get(dtype, TOLERANCE["float16"]) * max(1.0, math.sqrt(tokens))


CANARY_TOKENS = 256  # canary inputs are cut to about this many tokens (see shorten)
SHARED_KEEP = 64  # tokens the shared-prefix canary inputs still share after cutting


def pick_canary(inputs: Sequence[tuple[int, ...]], k: int = 6) -> list[int]:
    """Indices of up to ``k`` distinct inputs: the three that share the longest prefix, then the
    longest and the shortest (batched together they pad), then others spread over the set."""
    if len(inputs) <= k:
        return list(range(len(inputs)))
    order = sorted(range(len(inputs)), key=lambda i: inputs[i])
    shared = [common_prefix(inputs[order[j]], inputs[order[j + 1]]) for j in range(len(order) - 1)]
    best = max(range(len(shared) - 1), key=lambda j: min(shared[j], shared[j + 1]))
    picked = [order[best], order[best + 1], order[best + 2]]
    by_len = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    for i in (by_len[-1], by_len[0], *by_len[:: max(1, len(by_len) // k)]):
        if len(picked) < k and i not in picked:
            picked.append(i)
    return picked


def shorten(pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], budget: int = CANARY_TOKENS,
            keep_shared: int = SHARED_KEEP) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Canary inputs cut to about ``budget`` tokens: (context, continuation) pairs with leading context dropped.

    The check is about the graph (does batching or prefix reuse change a number?), not about the text, so
    the canary need not pay for 900-token prompts. Inputs that share the longest prefix with the first one
    (``pick_canary`` puts that group first) drop the same number of tokens, so they still share
    ``keep_shared`` of it and prefix reuse is still exercised; the others keep their last ``budget``.
    A context keeps at least one token; continuations are never cut.
    """
    if not pairs:
        return []
    inputs = [c + x for c, x in pairs]
    shared = [common_prefix(inputs[0], t) for t in inputs[1:]]
    top = max(shared, default=0)
    group_drop = max(0, top - keep_shared)
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        in_group = i == 0 or (top > keep_shared and shared[i - 1] >= top)
        drop = group_drop if in_group else len(ctx) + len(cont) - budget
        drop = min(max(drop, 0), len(ctx) - 1)
        out.append((ctx[drop:], cont))
    return out


SLICE_TOKENS = 64  # the prefill canary's inputs are cut to at most this many tokens (see slices)
SLICE_SHARED = 32  # tokens of their shared prefix that the prefill canary's shared-prefix inputs keep


def slices(pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], budget: int = SLICE_TOKENS,
           keep_shared: int = SLICE_SHARED) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The prefill canary's inputs: (context, continuation) pairs cut to at most ``budget`` tokens each.

    What the canary checks is the graph's contract (does a padded batch, a past or the gathered head change
    a number?), which shows on short inputs as on long ones, while each of its tokens is paid twice. So:

    * the inputs that share the longest prefix with the first (``pick_canary`` puts that group first), if
      it is ``keep_shared`` tokens or more, keep the last ``keep_shared`` tokens of that prefix and then
      their own last tokens: on the configured side that prefix's KV is their past;
    * the others keep their last ``budget``, ``budget - step``, ... tokens: distinct lengths, so the
      configured side's batch of them is right-padded (inputs already shorter keep their length).

    Continuations are never cut; a context keeps at least one token. Middle context cut from a shared-prefix
    input makes a token sequence no request has, which both sides of the comparison score alike.
    """
    if not pairs:
        return []
    inputs = [c + x for c, x in pairs]
    shared = [common_prefix(inputs[0], t) for t in inputs[1:]]
    top = max(shared, default=0)
    group = {0, *(i + 1 for i, n in enumerate(shared) if n == top)} if top >= keep_shared else set()
    others = [i for i in range(len(pairs)) if i not in group]
    step = max(1, budget // (2 * max(1, len(others))))
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        if i in group:
            end = min(top, len(ctx))
            head = ctx[max(0, end - keep_shared):end]
            want = max(0, budget - len(head) - len(cont))
            ctx = head + (ctx[end:][-want:] if want else ())
        else:
            length = budget - step * others.index(i)
            ctx = ctx[len(ctx) - max(1, length - len(cont)):]
        out.append((ctx or pairs[i][0][-1:], cont))
    return out


STRADDLE_OVER = 8  # tokens past a length switch the straddling canary inputs run


def straddle(pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
             switch: int | None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Canary inputs across a length switch (LongRoPE: package/reuse.py), made from the longest of ``pairs``
    when it is longer than ``switch``: A, its last ``switch + 8`` tokens; B, A with one token dropped at
    ``switch - 16`` (A and B share a prefix no longer than the switch, both longer: the prefix's KV must be the
    long class's); C, A's last 4 tokens fewer (no shared prefix, longer than the switch: batched with the short
    slices it pads them past the switch). Empty without a switch or a long enough input. Each costs about
    ``switch`` tokens twice, paid only by runs whose inputs cross the switch."""
    if switch is None or not pairs:
        return []
    ctx, cont = max(pairs, key=lambda p: len(p[0]) + len(p[1]))
    n = min(len(ctx), switch + STRADDLE_OVER - len(cont))
    if n + len(cont) <= switch or n < 8:
        return []
    a = ctx[-n:]
    cut = min(max(16, switch - 16), n - 2)
    return [(a, cont), (a[:cut] + a[cut + 1:], cont), (a[4:], cont)]


@dataclass(frozen=True)
class CanaryResult:
    """Worst request of a canary comparison: ``index`` into the compared arrays."""

    passed: bool
    max_diff: float
    index: int
    tolerance: float


def compare(configured: np.ndarray, exact: np.ndarray, tokens: np.ndarray, dtype: str) -> CanaryResult:
    """configured, exact: ``[N]`` log-likelihoods; tokens: ``[N]`` continuation lengths.

    A non-finite value on either side fails (NaN never compares equal)."""
    configured, exact = np.asarray(configured, np.float64), np.asarray(exact, np.float64)
    tol = np.array([tolerance(dtype, int(n)) for n in tokens])
    diff = np.abs(configured - exact)
    diff = np.where(np.isfinite(diff), diff, np.inf)
    worst = int(np.argmax(diff / tol))
    return CanaryResult(bool(np.all(diff <= tol)), float(diff[worst]), worst, float(tol[worst]))


# --- verdicts ---------------------------------------------------------------------------------------------


class AnswerStore(Protocol):
    """What :class:`Verdicts` needs of a store (:class:`ortevals.report.store.ResultStore` has it)."""

    def get(self, kind: str, request: Any) -> Any | None: ...

    def put(self, kind: str, request: Any, value: Any) -> None: ...

    def commit(self) -> None: ...


class Verdicts:
    """Canary verdicts across runs. ``store`` (None: nothing is kept) keys by its scope; ``key`` adds what
    the verdict depends on beyond it: which canary, and the settings that shape its passes."""

    KIND = "canary"

    def __init__(self, store: AnswerStore | None = None) -> None:
        self.store = store

    def get(self, key: Mapping[str, Any]) -> dict | None:
        return self.store.get(self.KIND, dict(key)) if self.store is not None else None

    def put(self, key: Mapping[str, Any], verdict: Mapping[str, Any]) -> None:
        if self.store is not None:
            self.store.put(self.KIND, dict(key), dict(verdict))
            self.store.commit()  # a verdict is small and saves a canary: on disk at once

    def canary(self, key: Mapping[str, Any]) -> tuple[CanaryResult, str] | None:
        """A stored prefill canary's result and its mode line, if a run with this scope and ``key`` kept one."""
        stored = self.get(key)
        if stored is None:
            return None
        return CanaryResult(**stored["result"]), f"{stored['mode']}; stored verdict reused"

    def keep_canary(self, key: Mapping[str, Any], result: CanaryResult, mode: str) -> None:
        self.put(key, {"result": asdict(result), "mode": mode})


def canary_key(kind: str, settings) -> dict:
    """What a canary's verdict depends on beyond the store's scope: which canary, and the settings (a
    dataclass) that shape its passes."""
    return {"canary": kind, "settings": asdict(settings)}
