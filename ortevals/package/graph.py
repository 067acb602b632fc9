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
from pathlib import Path

from ortevals.errors import PackageError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=16)
def read_signature(path: Path) -> tuple[tuple, tuple, frozenset[Path]]:
    """Return (inputs, outputs, external files) of the ONNX model at ``path``.

    inputs/outputs are tuples of ``(name, numpy dtype name, shape)`` where each
    dim is an int, a symbol string, or None.
    """
    import onnx

    if not path.is_file():
        raise PackageError(f"{path}: model file not found")
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
    return inputs, outputs, frozenset(_check_external_data(model, path))


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
