"""Derived scoring graph: the decoder with its LM head applied only where needed.

Scoring reads log-probabilities at a few positions (one per MMLU-Pro
question), yet a builder decoder computes the LM head and returns ``[B,S,V]``
logits for every position. The derived graph inserts one ``GatherND`` on the
hidden states that feed the LM head, driven by a new input
``ortevals_positions [B,K,1]``, so the head runs on K rows and ``[B,K,V]``
comes back. Elementwise ops after the head (Gemma's soft-capping) are
position-wise and stay as they are.

The derived ``model.onnx`` is cached under ``<cache>/derived/<scope>/``, where
``<scope>`` is the digest of a :class:`~ortevals.package.scope.Scope` over exactly
what the rewrite reads (:func:`derive_reads`): the decoder's graph file (its
protobuf, not its weights), the logits output name, and the ortevals (source
included) and onnx versions. A fix to this rewrite reaches packages derived
before it, and run settings (batch size, ...) that do not shape the graph share
one copy. ``scope.json`` beside it says what went in. Weights are not copied:
the session reads them from the package folder (their files are in the
sessions' own records, :func:`ortevals.runtime.sessions.session_reads`). The
package folder is never written to.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ortevals.files import atomic_write, atomic_write_bytes
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope

log = logging.getLogger(__name__)

POSITIONS = "ortevals_positions"
HEAD_OPS = {"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "QLinearMatMul"}
POINTWISE = {"Mul", "Div", "Tanh", "Cast", "Add", "Sub", "Identity"}


def derived_decoder(package: ModelPackage, cache: Path) -> Path | None:
    """Path of the derived decoder (built once), or None when the head cannot be found."""
    scope = derive_scope(package)
    target = derived_path(package, cache, scope)
    if target.is_file():
        return target
    data = _derive(package)
    if data is None:
        return None
    atomic_write_bytes(target, data)
    atomic_write(target.parent / "scope.json", json.dumps(scope.describe(), indent=1))
    log.info("derived scoring graph written to %s", target)
    return target


def derive_reads(package: ModelPackage) -> Reads:
    """What :func:`_derive` reads: the decoder's graph without its external data, the logits name."""
    return Reads("derived graph", (package.decoder.path,), {"logits_name": package.logits_name}, ("onnx",))


def derive_scope(package: ModelPackage) -> Scope:
    """The key of the derived graph: exactly :func:`derive_reads`, and the versions."""
    return Scope.build("derived", package.root, [derive_reads(package)])


def derived_path(package: ModelPackage, cache: Path, scope: Scope | None = None) -> Path:
    """Where the derived decoder of ``package`` lives (or will) under ``cache``."""
    return cache / "derived" / (scope or derive_scope(package)).digest[:32] / package.decoder.path.name


def _derive(package: ModelPackage) -> bytes | None:
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
    return model.SerializeToString()


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
