"""Read an ONNX model's signature without loading its weights.

Owns: graph inputs/outputs (names, dtypes, symbolic or fixed dims) and the
external-data files a model refers to, checked to exist inside the package and
to be long enough for every tensor that points into them. Uses the ``onnx``
protobuf reader only; no runtime is imported.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import PackageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphFacts:
    """What a model's proto says beyond its signature (read once with it, weights never loaded)."""

    precision: str  # "float32", "int4 (MatMulNBits)", "int8 (dynamic: MatMulInteger)", ...
    attention_heads: frozenset[int]  # num_heads of the attention nodes (GroupQueryAttention, ...)
    kv_heads: frozenset[int]  # kv_num_heads of the GroupQueryAttention nodes
    parameters: int = 0  # weights the graph holds (:func:`parameter_count`)
    windows: frozenset[int] = frozenset()  # local_window_size of the attention nodes that have one (> 0)
    # GroupQueryAttention nodes that rotate inside the kernel (do_rotary=1): (node, its head size from the
    # query's declared width, the width of its cos_cache initializer: half the rotary dim)
    fused_rotary: tuple[tuple[str, int, int], ...] = ()
    attention_nodes: int = 0  # nodes of ATTENTION_OPS (one a decoder layer)
    # attention nodes whose key/value is another node's graph output (a layer reading another layer's present KV:
    # Gemma 4 E2B/E4B's KV sharing), reached through data movement only: (node, the graph output), in graph order
    reads_outputs: tuple[tuple[str, str], ...] = ()
    attention_ops: frozenset[str] = frozenset()  # the attention nodes' op types
    # rows of the smallest constant rotary table (cos_cache) an attention or RotaryEmbedding node reads: the
    # positions a pass may span (onnxruntime refuses any past it); 0 where no node reads a constant table
    rotary_rows: int = 0
    # LoRA/DoRA/LoHa weights as optional inputs (Olive's ExtractAdapters: an input with a default initializer, its
    # rank dim symbolic and the default empty): (name, element type, dims: int or symbol) in graph order
    adapter_inputs: tuple[tuple[str, str, tuple], ...] = ()


def read_signature(path: Path) -> tuple[tuple, tuple, frozenset[Path]]:
    """Return (inputs, outputs, external files) of the ONNX model at ``path``.

    inputs/outputs are tuples of ``(name, numpy dtype name, shape)`` where each
    dim is an int, a symbol string, or None.
    """
    return _read(path)[:3]


def graph_facts(path: Path) -> GraphFacts:
    """Precision and attention head counts of the ONNX model at ``path``."""
    return _read(path)[3]


@functools.lru_cache(maxsize=16)
def _read(path: Path) -> tuple[tuple, tuple, frozenset[Path], GraphFacts]:
    import onnx

    if not path.is_file():
        what = "is a folder; expected an ONNX model file" if path.is_dir() else "model file not found"
        raise PackageError(f"{path}: {what}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types
        raise PackageError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    graph = model.graph
    if not graph.input or not graph.output:
        raise PackageError(f"{path}: ONNX graph has no inputs or outputs; expected a decoder/embedding model")
    initializers = {i.name for i in graph.initializer}
    inputs = tuple(_value_info(v, path) for v in graph.input if v.name not in initializers)
    outputs = tuple(_value_info(v, path) for v in graph.output)
    return inputs, outputs, frozenset(_check_external_data(model, path)), _facts(graph)


ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "PagedAttention")
FLOAT_NAMES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}


def _facts(graph) -> GraphFacts:
    """Weight precision from the quantized ops (their ``bits``) or the float initializers' dominant type; the
    attention nodes' head counts and sliding windows."""
    import onnx

    bits: set[int] = set()
    ops: set[str] = set()
    heads: set[int] = set()
    kv_heads: set[int] = set()
    windows: set[int] = set()
    dims = {t.name: list(t.dims) for t in graph.initializer}
    dims.update({v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
                 for v in graph.value_info})
    rotary = []
    attention = []
    for node in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            bits.add(int(attrs.get("bits", 4)))
            ops.add(node.op_type)
        elif node.op_type in ("MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "DequantizeLinear"):
            ops.add(node.op_type)
        if node.op_type in ATTENTION_OPS:
            attention.append(node)
        if node.op_type in ATTENTION_OPS and "num_heads" in attrs:
            heads.add(int(attrs["num_heads"]))
            if "kv_num_heads" in attrs:
                kv_heads.add(int(attrs["kv_num_heads"]))
            if int(attrs.get("local_window_size", -1)) > 0:
                windows.add(int(attrs["local_window_size"]))
        if node.op_type == "GroupQueryAttention" and attrs.get("do_rotary") and len(node.input) > 7 \
                and len(dims.get(node.input[7], ())) == 2:
            rotary.append((node.name, _head_size(node, attrs, dims), int(dims[node.input[7]][1])))
    return GraphFacts(_precision(graph, bits, ops), frozenset(heads), frozenset(kv_heads), parameter_count(graph),
                      frozenset(windows), tuple(rotary), len(attention), _reads_outputs(graph, attention),
                      frozenset(n.op_type for n in attention), _rotary_rows(graph, dims), _adapter_inputs(graph))


ADAPTER_NAMES = ("lora_A", "lora_B", "dora_M", "hada_w")  # Olive's adapter weight names


def _adapter_inputs(graph) -> tuple[tuple[str, str, tuple], ...]:
    """Inputs an adapter file fills: a graph input backed by an initializer of its name (optional) that is named
    as Olive names adapter weights or whose default is empty (the rank dim 0: no adapter active)."""
    import onnx

    defaults = {t.name: t for t in graph.initializer}
    found: dict[str, tuple[str, str, tuple]] = {}
    for v in graph.input:
        init = defaults.get(v.name)
        if init is None or v.name in found:
            continue
        if any(n in v.name for n in ADAPTER_NAMES) or 0 in init.dims:
            elem = onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower()  # onnxruntime's tensor(…)
            dims = tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)
            found[v.name] = (v.name, elem, dims)
    return tuple(found.values())


def _rotary_rows(graph, dims: dict) -> int:
    """The fewest rows of any constant ``cos_cache`` a node reads (GroupQueryAttention with ``do_rotary``,
    ``com.microsoft`` RotaryEmbedding, onnx's RotaryEmbedding fed the table or a ``Gather`` of it); 0: none."""
    producer = {out: node for node in graph.node for out in node.output}
    rows = []
    for node in graph.node:
        at = None
        if node.op_type == "GroupQueryAttention" and any(a.name == "do_rotary" and a.i for a in node.attribute):
            at = 7
        elif node.op_type == "RotaryEmbedding":
            at = 2 if node.domain == "com.microsoft" else 1
        cos = node.input[at] if at is not None and len(node.input) > at else ""
        if cos in producer and producer[cos].op_type == "Gather":  # a table gathered by position
            cos = producer[cos].input[0]
        if len(dims.get(cos, ())) == 2 and dims[cos][0] > 0:
            rows.append(int(dims[cos][0]))
    return min(rows, default=0)


MOVEMENT = {"Identity", "Reshape", "Transpose", "Cast", "CastLike", "Squeeze", "Unsqueeze", "Flatten"}


def _reads_outputs(graph, attention: list) -> tuple[tuple[str, str], ...]:
    """Each attention node that reads a graph output through data movement alone (Mobius wires a KV-shared
    layer's past as the source layer's ``present.%d.key``, or its key as that tensor transposed and reshaped)."""
    outputs = {o.name for o in graph.output}
    producer = {out: node for node in graph.node for out in node.output}
    found = []
    for node in attention:
        for name in node.input:
            while name and name not in outputs and name in producer and producer[name].op_type in MOVEMENT:
                name = producer[name].input[0]
            if name in outputs:
                found.append((node.name, name))
                break
    return tuple(found)


def _head_size(node, attrs: dict, dims: dict) -> int:
    """A GroupQueryAttention node's head size from its query's declared last dim (packed Q/K/V when the key
    input is empty), 0 where the graph does not declare it."""
    width = (dims.get(node.input[0]) or [0])[-1]
    heads = int(attrs.get("num_heads", 0)) + (2 * int(attrs.get("kv_num_heads", 0)) if not node.input[1] else 0)
    return width // heads if width and heads and width % heads == 0 else 0


ROTARY_CACHES = {"GroupQueryAttention": (7, 8), "RotaryEmbedding": (2, 3)}  # cos_cache, sin_cache inputs
NOT_WEIGHTS = {"MatMulNBits": (2, 3, 4, 5), "GatherBlockQuantized": (2, 3)}  # scales, zero points, g_idx, bias


def parameter_count(graph) -> int:
    """The weights an ONNX graph holds, from its initializers' shapes (data never read): each initializer's
    element count, except a 4/8-bit ``MatMulNBits`` weight counted as its K·N and a ``GatherBlockQuantized``
    table as its unpacked elements; rotary caches (an attention node's cos/sin inputs) and the quantized ops'
    scales and zero points are not weights. On the builder's fp32 decoders this is transformers' parameter
    count (tests/test_verify.py)."""
    import onnx

    sizes = {t.name: _elements(t.dims) for t in graph.initializer}
    packed = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.UINT8}
    for node in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for at in ROTARY_CACHES.get(node.op_type, ()) + NOT_WEIGHTS.get(node.op_type, ()):
            if at < len(node.input):
                sizes.pop(node.input[at], None)
        if node.op_type == "MatMulNBits" and node.input[1] in sizes:
            sizes[node.input[1]] = int(attrs["K"]) * int(attrs["N"])
        elif node.op_type == "GatherBlockQuantized" and node.input[0] in packed:
            sizes[node.input[0]] *= 8 // int(attrs.get("bits", 4))  # 8/bits values a byte
    return sum(sizes.values())


def _elements(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _precision(graph, bits: set[int], ops: set[str]) -> str:
    if bits:
        return f"{'/'.join(f'int{b}' for b in sorted(bits))} ({', '.join(sorted(ops))})"
    if "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops:
        return "int8 (dynamic: MatMulInteger)"
    if "QLinearMatMul" in ops or "DequantizeLinear" in ops:
        return f"int8 ({', '.join(sorted(ops))})"
    sizes: dict[str, int] = {}
    for t in graph.initializer:
        if t.data_type in FLOAT_NAMES:
            n = 1
            for d in t.dims:
                n *= d
            sizes[FLOAT_NAMES[t.data_type]] = sizes.get(FLOAT_NAMES[t.data_type], 0) + n
    return max(sizes, key=sizes.get) if sizes else "unknown"


def tensor_array(tensor, folder: Path):
    """An initializer's values as numpy, its external data read from ``folder``. onnx refuses external data in a
    file with several hard links (a package copied with ``cp -al``), which onnxruntime, and so every scoring
    command, reads: such a file is read here directly (its location inside ``folder``, offset and length as the
    tensor names them), so diagnose accepts what the scoring commands accept."""
    from onnx import numpy_helper
    from onnx.checker import ValidationError

    try:
        return numpy_helper.to_array(tensor, base_dir=str(folder))
    except ValidationError as e:
        if "hard link" not in str(e).lower() and "hardlink" not in str(e).lower():
            raise PackageError(f"{folder}: onnx refuses to read the weights of {tensor.name!r} ({e})") from None
        return numpy_helper.to_array(_inline(tensor, folder))


def _inline(tensor, folder: Path):
    """A copy of ``tensor`` holding its external data in ``raw_data``, read from a file inside ``folder``."""
    import onnx

    info = {e.key: e.value for e in tensor.external_data}
    root = Path(folder).resolve()
    path = (root / info.get("location", "")).resolve()
    if root not in path.parents:
        raise PackageError(f"{folder}: the weights of {tensor.name!r} are in {info.get('location')!r}, outside the "
                           "package folder; expected a file inside it")
    offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length) if length else f.read()
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = onnx.TensorProto.DEFAULT
    inline.raw_data = raw
    return inline


def external_data_files(path: Path) -> frozenset[Path]:
    return read_signature(path)[2]


def _value_info(v, path: Path) -> tuple[str, str, tuple]:
    import onnx

    tt = v.type.tensor_type
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
    except Exception:
        raise PackageError(f"{path}: tensor {v.name!r} has unsupported element type {tt.elem_type}") from None
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return v.name, dtype, tuple(dims)


def _check_external_data(model, path: Path) -> set[Path]:
    """Every external-data file must sit inside the model's folder and be long enough."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = Path(os.path.abspath(path.parent))
    needed: dict[Path, int] = {}
    for tensor in _all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        target = Path(os.path.normpath(folder / info.location))
        if not target.is_relative_to(folder):
            raise PackageError(
                f"{path}: tensor {tensor.name!r} points at external data {info.location!r} outside the package folder"
            )
        end = (info.offset or 0) + (info.length or 0)
        needed[target] = max(needed.get(target, 0), end)
    for target, end in needed.items():
        if not target.is_file():
            raise PackageError(f"{path}: external data file {target.name!r} is missing; expected it beside the model")
        size = target.stat().st_size
        if size < end:
            raise PackageError(
                f"{target}: external data is truncated ({size} bytes, the model needs at least {end}); "
                "re-copy or re-export the package"
            )
    return set(needed)


def _all_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def relocated(path: Path, source: Path | None = None) -> tuple[Path, bytes | None]:
    """Where onnxruntime should read ``path``'s external data from, and the model to give it.

    Returns ``(folder, None)`` in the usual case: the data sit in the model's folder (``source``, a
    derived copy of the model kept elsewhere, is opened as it is). When the data files are symlinks
    into another folder (a Hugging Face cache snapshot: every file links to ``../../blobs/<hash>``),
    onnxruntime refuses them ("External data path escapes model directory") once the model is opened
    from anywhere but that folder; then the folder is the one they resolve into and the model
    (``source`` or ``path``, protobuf only, no weights) comes back as bytes naming the real files. Data
    that resolve into several folders cannot be named that way: a one-line error says what to do.
    """
    folder = Path(os.path.abspath(path.parent))
    files = sorted(external_data_files(path))
    real = {f: Path(os.path.realpath(f)) for f in files}
    if all(r == f or r.parent == Path(os.path.realpath(folder)) and r.name == f.name for f, r in real.items()):
        return folder, None
    targets = {r.parent for r in real.values()}
    if len(targets) != 1:
        raise PackageError(f"{path}: its external data files are links into {len(targets)} different folders "
                           f"({', '.join(sorted(map(str, targets)))}); onnxruntime needs them in one folder: copy "
                           "the package with its links resolved (cp -rL)")
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(source or path), load_external_data=False)
    for tensor in _all_tensors(model):
        if uses_external_data(tensor):
            name = real[Path(os.path.normpath(folder / ExternalDataInfo(tensor).location))].name
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = name
    log.info("%s: external data read from %s (the package's files are links there)", path, targets.pop())
    return Path(os.path.realpath(files[0])).parent, model.SerializeToString()
