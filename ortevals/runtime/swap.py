"""A candidate package with some of its quantized weights put back at the reference's precision.

Owns the derived *package* in which chosen weight groups of a quantized candidate (builder node
names, :func:`ortevals.runtime.roles.weight_units`) compute with the reference package's float
weights, everything else unchanged: what the onnxruntime-genai builder's ``nodes_to_exclude``
would have exported, made without re-exporting. Per node (matched by role: the quantizer renames
``.../MatMul`` to ``.../MatMul_Q4``):

* a ``MatMulNBits`` node becomes a ``MatMul`` of its own activation input and the reference's
  weight; a QDQ ``MatMul`` gets the reference's weight in place of its ``DequantizeLinear``;
* where the "reference" is itself the builder's int8 export of the same model (``diagnose --int8``: a
  ``MatMulNBits`` of 8 bits), the candidate's ``MatMulNBits`` becomes a copy of that node (its
  attributes, its packed weight, scales and zero points) on the candidate's activation: the group at
  int8, as the builder's per-node int8 override exports it (int8 embeddings: refused, the builder's
  ``GatherBlockQuantized`` is int4 only);
* the embeddings (``/model/embed_tokens/Gather``): the reference's nodes that compute the
  embeddings from ``input_ids`` (its ``Gather``, and the ``Transpose`` of a tied table) replace
  the candidate's (``GatherBlockQuantized`` …), writing the same tensor;

then nodes and initializers no output needs any more are dropped (a tied table still read by the
other side stays). The reference's weights are cast to the candidate's activation type where
they differ and stored inline in the derived ``model.onnx``; the candidate's other weights are
read from its own data file through a link, so the derived folder holds the new graph and links
to the candidate's other files (ortevals opens linked data: package/graph.py ``relocated``).

:func:`size_delta` gives the bytes the change adds to a package, from the rewritten graph's
initializer shapes alone (no weights read): what a builder export with those nodes excluded adds.

The folder is cached under ``<cache>/derived/<scope>/`` keyed by a
:class:`~ortevals.package.scope.Scope` of what the rewrite reads (:func:`swap_reads`: both
decoders' graphs and data files, the nodes, the candidate's folder the links point into, the
rewrite's version). Neither package folder is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.files import atomic_write
from ortevals.package.graph import external_data_files, tensor_array
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope
from ortevals.runtime.roles import EMBED_NODE, nodes_by_base, residual_points

log = logging.getLogger(__name__)
PREFIX = "ortevals_ref/"
REWRITE = {"rewrite": "reference-weights/1"}
INLINE_LIMIT = 1_800_000_000  # protobuf's 2 GiB, with room for the graph


class Refused(OrtEvalsError):
    """A node cannot be put back at the reference's precision (the reason says why)."""


def swap_reads(cand: ModelPackage, ref: ModelPackage, nodes: tuple[str, ...]) -> Reads:
    """Both decoders' graphs and data (the candidate's data through the links), the nodes, the folder the links
    point into, the rewrite's version."""
    files = (cand.decoder.path, *sorted(external_data_files(cand.decoder.path)),
             ref.decoder.path, *sorted(external_data_files(ref.decoder.path)))
    settings = {"nodes": sorted(nodes), "candidate_folder": os.path.realpath(cand.root), **REWRITE}
    return Reads("reference weights", files, settings, ("onnx", "numpy"))


def _load(package: ModelPackage):
    import onnx

    return onnx.load(str(package.decoder.path), load_external_data=False)


def size_delta(cand: ModelPackage, ref: ModelPackage, nodes: tuple[str, ...]) -> int:
    """Bytes the swap adds to the candidate's weights (shapes only; may be negative)."""
    model = _load(cand)
    before = _bytes(model.graph)
    _swap(model, _load(ref), nodes, None)
    return _bytes(model.graph) - before


def swapped_package(cand: ModelPackage, ref: ModelPackage, nodes: tuple[str, ...], cache: Path) -> Path:
    """The derived package folder (built once) whose ``nodes`` use the reference's weights."""
    scope = Scope.build("derived", cand.root, [swap_reads(cand, ref, nodes)])
    folder = cache / "derived" / scope.digest[:32]
    if (folder / "genai_config.json").is_file() and all(p.exists() for p in folder.rglob("*")):
        return folder
    model = _load(cand)
    inline = _swap(model, _load(ref), nodes, ref.decoder.path.parent)
    if inline > INLINE_LIMIT:
        raise OrtEvalsError(f"{', '.join(nodes)}: {inline / 1e9:.1f} GB of reference weights is too much to hold "
                            "in one ONNX graph; rebuild with the builder's nodes_to_exclude instead (--checkpoint)")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    root = Path(os.path.abspath(cand.root))
    decoder = Path(os.path.abspath(cand.decoder.path)).relative_to(root)
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel != decoder:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(os.path.realpath(path))
    (tmp / decoder).parent.mkdir(parents=True, exist_ok=True)
    (tmp / decoder).write_bytes(model.SerializeToString())
    atomic_write(tmp / "scope.json", json.dumps(scope.describe(), indent=1))  # what `ortevals cache info` reads
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    log.info("candidate with %s at the reference's precision written to %s", ", ".join(nodes), folder)
    return folder


def _swap(model, ref_model, nodes: tuple[str, ...], ref_dir: Path | None) -> int:
    """Rewrite ``model`` in place; ``ref_dir`` None: shapes only (no data). Returns the inline bytes."""
    from ortevals.runtime.graph_nodes import prune

    graph, ref = model.graph, ref_model.graph
    theirs = nodes_by_base(ref)
    ref_inits = {t.name: t for t in ref.initializer}
    io_type = _io_type(graph)
    added = []
    for name in nodes:
        ours = nodes_by_base(graph)  # again after each rewrite
        if name not in theirs:
            raise Refused(f"{name}: not in the reference's graph")
        if name not in ours:
            raise Refused(f"{name}: not in the candidate's graph")
        if name == EMBED_NODE and any(n.op_type == "MatMulNBits" for n in ref.node):  # an int8 donor
            raise Refused(f"{EMBED_NODE}: no int8 embeddings (the builder exports int4 GatherBlockQuantized only); "
                          "put them back at the reference's precision instead")
        if name == EMBED_NODE:
            added += _swap_embeddings(graph, ref, ref_inits, io_type)
        else:
            added += _swap_matmul(graph, ours[name], theirs[name], ref_inits, io_type)
    inline = 0
    for tensor in {name: (src, name) for src, name in added}.values():  # a tied table once
        graph.initializer.append(_tensor(tensor, io_type, ref_dir))
        inline += _tensor_bytes(graph.initializer[-1])
    prune(graph)
    return inline


def _swap_matmul(graph, node, ref_node, ref_inits: dict, io_type: int) -> list:
    name = ref_node.name
    if ref_node.op_type == "MatMulNBits":
        return _swap_nbits(graph, node, ref_node, ref_inits)
    if ref_node.op_type != "MatMul" or ref_node.input[1] not in ref_inits:
        raise Refused(f"{name}: the reference's node is {ref_node.op_type} without a weight initializer")
    producers = {o: n for n in graph.node for o in n.output}
    from onnx import helper

    weight = PREFIX + ref_node.input[1]
    if node.op_type == "MatMulNBits":
        if len(node.input) > 4 and any(node.input[4:]):
            raise Refused(f"{name}: a MatMulNBits with g_idx or bias is not swapped")
        i = list(graph.node).index(node)
        new = helper.make_node("MatMul", [node.input[0], weight], [node.output[0]], name=name)
        del graph.node[i]
        graph.node.insert(i, new)
    elif node.op_type == "MatMul" and getattr(producers.get(node.input[1]), "op_type", None) == "DequantizeLinear":
        node.input[1] = weight
    else:
        raise Refused(f"{name}: not quantized in the candidate ({node.op_type}); it is at full precision already")
    return [(ref_inits[ref_node.input[1]], weight)]


def _swap_nbits(graph, node, donor, donor_inits: dict) -> list:
    """The candidate's ``MatMulNBits`` ``node`` replaced by a copy of the donor's (another bit width): the donor's
    attributes and weight, scales and zero points (inline, renamed) on the candidate's activation and output."""
    from onnx import helper

    base = donor.name
    if node.op_type != "MatMulNBits":
        raise Refused(f"{base}: the candidate's node is {node.op_type}, not a MatMulNBits to change the bits of")
    if len(donor.input) > 4 and any(donor.input[4:]) or len(node.input) > 4 and any(node.input[4:]):
        raise Refused(f"{base}: a MatMulNBits with g_idx or bias is not swapped")
    weights = [i for i in donor.input[1:4] if i]
    if any(i not in donor_inits for i in weights):
        raise Refused(f"{base}: the donor's MatMulNBits reads a weight that is not an initializer")
    i = list(graph.node).index(node)
    new = helper.make_node("MatMulNBits", [node.input[0], *[PREFIX + w if w else "" for w in donor.input[1:4]]],
                           [node.output[0]], name=base, domain=donor.domain)
    new.attribute.extend(donor.attribute)
    del graph.node[i]
    graph.node.insert(i, new)
    return [(donor_inits[w], PREFIX + w) for w in weights]


def _swap_embeddings(graph, ref, ref_inits: dict, io_type: int) -> list:
    ours, theirs = residual_points(graph).get("embed"), residual_points(ref).get("embed")
    inputs = {i.name for i in graph.input}
    if ours is None or theirs is None or ours.tensor in inputs:
        raise Refused(f"{EMBED_NODE}: the embeddings are not computed in the decoder graph (a separate model)")
    if not {n.op_type for n in _cone(graph, ours.tensor)} & {"GatherBlockQuantized", "DequantizeLinear"}:
        raise Refused(f"{EMBED_NODE}: not quantized in the candidate; it is at full precision already")
    cone = _cone(ref, theirs.tensor)
    ref_inputs = {i.name for i in ref.input}

    def rename(t: str) -> str:
        return ours.tensor if t == theirs.tensor else t if t in ref_inputs or not t else PREFIX + t

    from onnx import helper

    graph.node.remove(next(n for n in graph.node if ours.tensor in n.output))
    order = {n.name: i for i, n in enumerate(ref.node)}
    for node in sorted(cone, key=lambda n: order[n.name], reverse=True):  # inputs only: first, in order
        dup = helper.make_node(node.op_type, [rename(i) for i in node.input], [rename(o) for o in node.output],
                               name=PREFIX + node.name, domain=node.domain or None)
        dup.attribute.extend(node.attribute)
        graph.node.insert(0, dup)
    return [(ref_inits[i], PREFIX + i) for n in cone for i in n.input if i in ref_inits]


def _cone(graph, tensor: str) -> list:
    """The nodes ``tensor`` is computed from (back to graph inputs and initializers)."""
    producers = {o: n for n in graph.node for o in n.output}
    cone, todo, seen = [], [tensor], set()
    while todo:
        node = producers.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        cone.append(node)
        todo += [i for i in node.input if i]
    return cone


def _io_type(graph) -> int:
    """The candidate's activation type: a quantized node's scales, else the first float initializer."""
    inits = {i.name: i for i in graph.initializer}
    for node in graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized") and node.input[2] in inits:
            return inits[node.input[2]].data_type
    return next((t.data_type for t in graph.initializer if t.data_type in (1, 10, 16)), 1)


def _tensor(pair, io_type: int, ref_dir: Path | None):
    """The reference's initializer under its new name: cast to the candidate's activation type (floats);
    shapes only without ``ref_dir``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    src, name = pair
    floating = src.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    dtype = io_type if floating else src.data_type
    if ref_dir is None:
        return TensorProto(name=name, dims=list(src.dims), data_type=dtype)
    array = tensor_array(src, ref_dir)
    if floating and dtype != src.data_type:
        array = array.astype(np.float32).astype(helper.tensor_dtype_to_np_dtype(dtype))
    return numpy_helper.from_array(array, name)


def _tensor_bytes(t) -> int:
    from onnx import helper

    bits = 4 if t.data_type in (21, 22) else 8 * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return math.prod(t.dims) * bits // 8


def _bytes(graph) -> int:
    return sum(_tensor_bytes(t) for t in graph.initializer)


