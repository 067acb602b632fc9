"""Derived scoring graph: the decoder with its LM head applied only where needed.

Scoring reads log-probabilities at a few positions (one per MMLU-Pro
question), yet a builder decoder computes the LM head and returns ``[B,S,V]``
logits for every position. The derived graph inserts one ``GatherND`` on the
hidden states that feed the LM head, driven by a new input
``ortevals_positions [B,K,1]``, so the head runs on K rows and ``[B,K,V]``
comes back. Elementwise ops after the head (Gemma's soft-capping) are
position-wise and stay as they are.

Scoring needs a few floats, not logits, so the graph also scores on the
device: a second input ``ortevals_targets [B,K,M]`` (int64: for each of the K
positions, the token of each of M continuations sharing the input) gives
``ortevals_logprobs [B,K,M]`` = log-softmax of the logits at those tokens and
``ortevals_greedy [B,K,M]`` = whether each is the argmax. The logits are cast
to float32 first, so fp16/bf16 heads never accumulate in their own type, and
the arithmetic is the host path's (engine/score/scoring.py; see ``_add_scores``). A pass then copies
``B·K·M·5`` bytes to the host instead of ``B·K·V`` logits (472 MB a call for a
900-token prompt on a 262k vocabulary without the gather). The logits output
stays, for the probe and callers that ask for it.

A tied embedding that the builder reads as ``Gather(Transpose(head weight), ids)`` is gathered from the
head's weight as it is instead (``Gather(weight, ids, axis=1)``, then a transpose of the few rows taken: the
same numbers, moved, not computed). onnxruntime folds such a transpose into a second copy of the table once,
or, above its 1 GiB folding limit (Gemma-3-1B's 262k × 1152 float32 table, 1.2 GB), transposes the whole
table again in every pass: 2.4 GB read and written, a fifth of a 200-token pass's CPU time there.

The derived ``model.onnx`` is cached under ``<cache>/derived/<scope>/``, where
``<scope>`` is the digest of a :class:`~ortevals.package.scope.Scope` over exactly
what the rewrite reads (:func:`derive_reads`): the decoder's graph file (its
protobuf, not its weights), the logits output name, the rewrite's version and
options (``REWRITE``), and the ortevals (source included) and onnx versions. A
fix to this rewrite reaches packages derived before it, and run settings (batch
size, ...) that do not shape the graph share one copy. ``scope.json`` beside it
says what went in. Weights are not copied: the session reads them from the
package folder (their files are in the sessions' own records,
:func:`ortevals.runtime.reads.session_reads`). The package folder is never
written to.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from ortevals.files import atomic_write, atomic_write_bytes
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope

log = logging.getLogger(__name__)

POSITIONS = "ortevals_positions"
TARGETS = "ortevals_targets"
LOGPROBS = "ortevals_logprobs"
GREEDY = "ortevals_greedy"
# the rewrite's own version and options: part of the cache key (the source digest in Scope covers code too)
REWRITE = {"rewrite": "gather-head+scores/2", "scores": "float32 x-max, float64 log-sum-exp, ArgMax==target",
           "embedding": "Gather(Transpose(W), ids) -> Transpose(Gather(W, ids, axis=1))"}
HEAD_OPS = {"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "QLinearMatMul"}
RESHAPES = {"Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast"}
CUTS = {"Gather", "Slice", "GatherND", "GatherElements"}
POINTWISE = {"Mul", "Div", "Tanh", "Cast", "Add", "Sub", "Identity"}


def derived_decoder(package: ModelPackage, cache: Path) -> Path | None:
    """Path of the derived decoder (built once), or None when the head cannot be found."""
    return written_once(package, cache, derive_scope(package), lambda: _derive(package), "derived scoring graph")


def written_once(package: ModelPackage, cache: Path, scope: Scope, build: Callable[[], bytes | None],
                 what: str) -> Path | None:
    """The graph ``build`` serializes, written once under ``cache`` at ``scope``'s key with its ``scope.json``
    beside it (what ``ortevals cache info`` reads); None where ``build`` gives None. Every derived decoder
    (this module's, the cascade's, the shared-prefix one) is cached this way."""
    target = derived_path(package, cache, scope)
    if target.is_file():
        return target
    data = build()
    if data is None:
        return None
    atomic_write_bytes(target, data)
    atomic_write(target.parent / "scope.json", json.dumps(scope.describe(), indent=1))
    log.info("%s written to %s", what, target)
    return target


def derive_reads(package: ModelPackage) -> Reads:
    """What :func:`_derive` reads: the decoder's graph without its external data, the logits name; and the
    rewrite it applies (``REWRITE``)."""
    return Reads("derived graph", (package.decoder.path,), {"logits_name": package.logits_name, **REWRITE}, ("onnx",))


def derive_scope(package: ModelPackage) -> Scope:
    """The key of the derived graph: exactly :func:`derive_reads`, and the versions."""
    return Scope.build("derived", package.root, [derive_reads(package)])


def derived_path(package: ModelPackage, cache: Path, scope: Scope | None = None) -> Path:
    """Where the derived decoder of ``package`` lives (or will) under ``cache``."""
    return cache / "derived" / (scope or derive_scope(package)).digest[:32] / package.decoder.path.name


def _derive(package: ModelPackage) -> bytes | None:
    model = derived_model(package)
    return None if model is None else model.SerializeToString()


def derived_model(package: ModelPackage):
    """The derived decoder as an ``onnx.ModelProto`` (weights left external), or None when the head cannot be
    found. The shared-prefix scoring graph (runtime/prefix_graph.py) is rewritten from it."""
    import onnx
    from onnx import TensorProto, helper

    reads = derive_reads(package)
    (decoder,) = reads.files
    model = onnx.load(str(decoder), load_external_data=False)
    graph = model.graph
    logits_name = reads.settings["logits_name"]
    head = _find_head(graph, logits_name)
    if head is None:
        log.info("no LM head MatMul found before %s: full logits will be returned", logits_name)
        return None
    if _cut_before(graph, head):  # a pruned head: the positions the gather would take are gone already
        log.info("the LM head's input is cut to fewer positions (%s): no derived scoring graph", head.input[0])
        return None
    gathered = f"{POSITIONS}/hidden"
    gather = helper.make_node("GatherND", [head.input[0], POSITIONS], [gathered], name=f"{POSITIONS}/GatherND",
                              batch_dims=1)
    head.input[0] = gathered
    nodes = list(graph.node)
    graph.node.insert(nodes.index(head), gather)
    graph.input.append(helper.make_tensor_value_info(POSITIONS, TensorProto.INT64, ["batch_size", "positions", 1]))
    for out in graph.output:
        if out.name == logits_name and len(out.type.tensor_type.shape.dim) == 3:
            out.type.tensor_type.shape.dim[1].dim_param = "positions"
    _add_scores(model, logits_name)
    _gather_untransposed(graph)
    return model


def _add_scores(model, logits: str) -> None:
    """Log-probabilities of the targets and argmax flags after the (gathered) logits ``[B,K,V]``.

    The host's float32 arithmetic (engine/scoring.log_softmax): ``s = x - max(x)``,
    ``s - log(sum(exp(s)))``, with x cast to float32 first. The sum runs in float64: onnxruntime's
    float32 LogSoftmax on CPU accumulates 262k terms to about 4e-5 from the float64 value, where
    numpy's pairwise sum stays near 4e-6; in float64 the graph's result is the host's to within
    one float32 rounding.
    """
    from onnx import TensorProto, helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)

    def name(n: str) -> str:
        return f"{TARGETS}/{n}"

    def reduce(op: str, x: str, out: str):  # axes became an input: ReduceSum in opset 13, ReduceMax in 18
        if opset >= (18 if op == "ReduceMax" else 13):
            return helper.make_node(op, [x, name("last_axis")], [out], name=name(op), keepdims=1)
        return helper.make_node(op, [x], [out], name=name(op), axes=[-1], keepdims=1)

    graph.initializer.append(helper.make_tensor(name("last_axis"), TensorProto.INT64, [1], [-1]))
    graph.node.extend([
        # float32 from the first op after the head: fp16/bf16 logits never accumulate in their own type
        helper.make_node("Cast", [logits], [name("x")], name=name("Cast"), to=TensorProto.FLOAT),
        reduce("ReduceMax", name("x"), name("max")),
        helper.make_node("Sub", [name("x"), name("max")], [name("shifted")], name=name("Sub")),
        helper.make_node("Exp", [name("shifted")], [name("exp")], name=name("Exp")),
        helper.make_node("Cast", [name("exp")], [name("exp64")], name=name("Cast64"), to=TensorProto.DOUBLE),
        reduce("ReduceSum", name("exp64"), name("sum64")),
        helper.make_node("Log", [name("sum64")], [name("log64")], name=name("Log")),
        helper.make_node("Cast", [name("log64")], [name("lse")], name=name("Cast32"), to=TensorProto.FLOAT),
        helper.make_node("GatherElements", [name("shifted"), TARGETS], [name("picked")], name=name("Gather"), axis=2),
        helper.make_node("Sub", [name("picked"), name("lse")], [LOGPROBS], name=name("LogProb")),
        # first maximum on ties, as numpy's argmax on the host path
        helper.make_node("ArgMax", [name("x")], [name("argmax")], name=name("ArgMax"), axis=-1, keepdims=1,
                         select_last_index=0),
        helper.make_node("Equal", [name("argmax"), TARGETS], [GREEDY], name=name("Equal")),
    ])
    dims = ["batch_size", "positions", "members"]
    graph.input.append(helper.make_tensor_value_info(TARGETS, TensorProto.INT64, dims))
    graph.output.extend([helper.make_tensor_value_info(LOGPROBS, TensorProto.FLOAT, dims),
                         helper.make_tensor_value_info(GREEDY, TensorProto.BOOL, dims)])


def _gather_untransposed(graph) -> None:
    """Each ``Gather(Transpose(W), ids)`` (W a 2-D initializer, the transpose feeding only such gathers, ids of
    known rank r) becomes ``Transpose(Gather(W, ids, axis=1), perm=[1..r, 0])``: the rows of Wᵀ are W's
    columns, taken and laid out as before, bit for bit."""
    from onnx import helper

    weights = {i.name: len(i.dims) for i in graph.initializer}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*graph.input, *graph.value_info]
             if v.type.tensor_type.HasField("shape")}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    for tr in [n for n in graph.node if n.op_type == "Transpose" and weights.get(n.input[0]) == 2]:
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), [1, 0])
        gathers = users.get(tr.output[0], [])
        if perm != [1, 0] or not gathers or any(
                g.op_type != "Gather" or g.input[0] != tr.output[0] or g.input[1] not in ranks
                or any(a.name == "axis" and a.i != 0 for a in g.attribute) for g in gathers):
            continue
        for g in gathers:
            rank, taken = ranks[g.input[1]], f"{g.output[0]}/untransposed"
            at = list(graph.node).index(g)
            graph.node.remove(g)
            graph.node.insert(at, helper.make_node("Transpose", [taken], [g.output[0]], name=f"{g.name}/Transpose",
                                                   perm=[*range(1, rank + 1), 0]))
            graph.node.insert(at, helper.make_node("Gather", [tr.input[0], g.input[1]], [taken], name=g.name, axis=1))
        graph.node.remove(tr)


def _cut_before(graph, head) -> bool:
    """Whether the head's input is taken from fewer positions than the hidden states hold: a Gather or Slice
    (the builder's ``prune_lm_head``: the last position) just before it, with only reshapes between."""
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(head.input[0])
    for _ in range(4):
        if node is None or node.op_type not in RESHAPES | CUTS:
            return False
        if node.op_type in CUTS:
            return True
        node = producer.get(node.input[0])
    return False


def _find_head(graph, logits_name: str):
    """Walk back from logits through position-wise ops to the LM head's matmul."""
    producer = {o: n for n in graph.node for o in n.output}
    initializers = {i.name for i in graph.initializer}
    name = logits_name
    for _ in range(8):
        node = producer.get(name)
        if node is None:
            return None
        if node.op_type in HEAD_OPS:
            return node
        if node.op_type not in POINTWISE:
            return None
        # follow the one non-constant input
        dynamic = [i for i in node.input if i and i not in initializers and producer.get(i) is not None
                   and producer[i].op_type != "Constant"]
        if len(dynamic) != 1:
            return None
        name = dynamic[0]
    return None
