"""Which nodes of a session onnxruntime put on the CPU when a device provider was asked for.

Owns the no-silent-fallback rule for ortevals' raw sessions on a device provider (CUDA, DirectML, ...).
Such a session is first opened with ``session.disable_cpu_ep_fallback=1`` and no CPU provider in its
list (listing it as well is refused by onnxruntime: "Conflicting session configuration"). onnxruntime
refuses the session when any node is assigned to the CPU, with one sentence that names no node
(onnxruntime/core/session/inference_session.cc, quoted in :data:`REFUSAL`). Then the session is opened
again with the fallback allowed and ``session.record_ep_graph_assignment_info=1``, and
:func:`cpu_nodes` reads the nodes onnxruntime placed on the CPU (``get_provider_graph_assignment_info``).

onnxruntime's CUDA provider places small integer computations on the CPU on purpose
(``GetCpuPreferredNodes``, onnxruntime/core/framework/fallback_cpu_capability.cc: the consumers of a
``Shape`` output, e.g. the builder's ``Shape(attention_mask) -> Gather -> Cast`` that feeds
GroupQueryAttention's ``total_sequence_length``, which that kernel reads on the CPU anyway). Those nodes
read and write only integer or bool tensors: they are accepted, and logged. Any other node on the CPU
(a MatMul, an attention, a float op without a kernel for this provider and type) is a refusal in one
line naming the op types, unless the user opted in with ``allow_cpu_fallback=true``: then a warning
names them and the run records the opt-in.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import ProviderError, first_line

log = logging.getLogger(__name__)

FALLBACK_KEY = "session.disable_cpu_ep_fallback"
RECORD_KEY = "session.record_ep_graph_assignment_info"
# onnxruntime/core/session/inference_session.cc, InferenceSession::Initialize (status FAIL)
REFUSAL = ("This session contains graph nodes that are assigned to the default CPU EP, but fallback to CPU EP "
           "has been explicitly disabled by the user.")
INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 9, 12, 13})  # onnx TensorProto: uint8 … int64, bool, uint32/64


def refused(error: BaseException) -> bool:
    """Whether ``error`` is onnxruntime's refusal of a session with nodes on the CPU (:data:`REFUSAL`)."""
    return REFUSAL in str(error)


@dataclass(frozen=True)
class CpuNodes:
    """The nodes of one session onnxruntime placed on the CPU: op types of the float (compute) ones and of
    the integer ones (shape arithmetic), each with its count."""

    compute: tuple[tuple[str, int], ...]
    integer: tuple[tuple[str, int], ...]

    def text(self, which: str = "compute") -> str:
        """``GroupQueryAttention x2, MatMul x7`` (most frequent first)."""
        return ", ".join(f"{op} x{n}" for op, n in getattr(self, which))


def cpu_nodes(session, graph: Path | bytes) -> CpuNodes:
    """The CPU nodes of ``session`` (opened with :data:`RECORD_KEY`), split by the tensor types that
    ``graph`` (the model file or bytes the session was opened from) gives their inputs and outputs."""
    info = session.get_provider_graph_assignment_info() if hasattr(session, "get_provider_graph_assignment_info") \
        else None
    if info is None:
        raise ProviderError("this onnxruntime cannot list which nodes it placed on the CPU "
                            "(InferenceSession.get_provider_graph_assignment_info is missing)")
    nodes = [(n.name, n.op_type) for sub in info if sub.ep_name == "CPUExecutionProvider" for n in sub.get_nodes()]
    integer = integer_nodes(graph)
    count = lambda pairs: tuple(Counter(op for _, op in pairs).most_common())  # noqa: E731
    return CpuNodes(count([p for p in nodes if p[0] not in integer]), count([p for p in nodes if p[0] in integer]))


def integer_nodes(graph: Path | bytes) -> frozenset[str]:
    """Names of the nodes of ``graph`` whose every input and output is an integer or bool tensor (onnx
    shape inference; a node whose types it cannot infer is not counted)."""
    return _integer_nodes(graph if isinstance(graph, bytes) else str(graph))


@functools.lru_cache(maxsize=8)
def _integer_nodes(source: str | bytes) -> frozenset[str]:
    import onnx

    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source, load_external_data=False)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as e:  # noqa: BLE001 - an op shape inference does not know: types stay partial
        log.debug("shape inference of the graph failed (%s); only declared types are used", first_line(e))
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
    types.update({t.name: t.data_type for t in graph.initializer})
    out = set()
    for node in graph.node:
        names = [n for n in (*node.input, *node.output) if n]
        if names and all(types.get(n) in INTEGER_TYPES for n in names):
            out.add(node.name)
    return frozenset(out)


def check_cpu_nodes(found: CpuNodes, where: Path | str, ort_name: str, allowed: bool) -> None:
    """Refuse compute nodes on the CPU (one line naming their op types) unless ``allowed``; log the rest."""
    if found.integer:
        log.info("%s: %s placed integer shape nodes on the CPU by design: %s", where, ort_name, found.text("integer"))
    if not found.compute:
        return
    if not allowed:
        raise ProviderError(f"{where}: {sum(n for _, n in found.compute)} node(s) would run on the CPU, not "
                            f"{ort_name} (no kernel for them there, or onnxruntime prefers the CPU): "
                            f"{found.text()}; give allow_cpu_fallback=true (--model-args) to run them there anyway "
                            "(slower, recorded in results.json)")
    log.warning("%s: allow_cpu_fallback=true: these nodes run on the CPU, not %s: %s", where, ort_name, found.text())
