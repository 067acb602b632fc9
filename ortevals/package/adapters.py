"""LoRA adapters: the ``adapter`` option's values and the decoder inputs an adapter fills.

Owns the syntax of ``--adapter FILE[=NAME]`` (model arg ``adapter=FILE[=NAME]``): :func:`parse_adapters` (the
options table's parser: syntax only, no I/O) and :class:`AdapterSpec` (the file and the name onnxruntime-genai
loads it under: NAME, else the file's stem); and the package's adapter inputs (:func:`adapter_inputs`: the
decoder's optional LoRA weight inputs, package/graph.py), with the line ``ortevals info`` shows
(:func:`describe_adapter_inputs`). Reading an adapter file and checking it against these inputs is the runtime's
(runtime/adapters.py). Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.errors import OrtEvalsError
from ortevals.package.graph import graph_facts
from ortevals.package.loader import ModelPackage

SUFFIX = ".onnx_adapter"  # onnxruntime's adapter format (Olive's generate-adapter: adapter_weights.onnx_adapter)


@dataclass(frozen=True)
class AdapterSpec:
    """One ``FILE[=NAME]`` value: the adapter file and its name."""

    path: Path
    name: str

    @classmethod
    def parse(cls, value: str) -> AdapterSpec:
        head, sep, tail = value.rpartition("=")
        if sep and tail and "/" not in tail and "\\" not in tail:
            if not head.strip():
                raise OrtEvalsError(f"adapter {value!r}: expected FILE[=NAME], the file before '='")
            return cls(Path(head.strip()), tail.strip())
        if sep and not tail:
            raise OrtEvalsError(f"adapter {value!r}: expected FILE[=NAME], a name after '='")
        return cls(Path(value.strip()), Path(value.strip()).stem)


def parse_adapters(value: Any) -> tuple[str, ...]:
    """``"FILE[=NAME]"``, several separated by ``;``, or a list of them -> ``("FILE[=NAME]", …)`` (syntax checked)."""
    if isinstance(value, str):
        items = [p.strip() for p in value.split(";") if p.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(p).strip() for p in value]
    else:
        raise OrtEvalsError(f"adapter must be FILE[=NAME] (an .onnx_adapter file), got {value!r}")
    if any(not p for p in items):
        raise OrtEvalsError(f"adapter must be FILE[=NAME] (an .onnx_adapter file), got {value!r}")
    specs = [AdapterSpec.parse(p) for p in items]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise OrtEvalsError(f"adapter: two adapters named {next(n for n in names if names.count(n) > 1)!r}; "
                            "give each its own name (FILE=NAME)")
    return tuple(items)


def adapter_specs(values: tuple[str, ...]) -> tuple[AdapterSpec, ...]:
    return tuple(AdapterSpec.parse(v) for v in values)


def adapter_inputs(package: ModelPackage) -> tuple[tuple[str, str, tuple], ...]:
    """The decoder's adapter inputs: ``(name, element type, dims)`` (package/graph.py ``adapter_inputs``)."""
    return graph_facts(package.decoder.path).adapter_inputs


def describe_adapter_inputs(package: ModelPackage) -> list[str]:
    """``ortevals info``'s lines: how many adapter inputs the decoder has, then each module's (its weights' element
    type and dims, and the layers that have it)."""
    inputs = adapter_inputs(package)
    if not inputs:
        return []
    groups: dict[tuple, list[str]] = {}
    for name, elem, dims in inputs:
        layer = re.search(r"layers\.(\d+)\.", name)
        generic = re.sub(r"layers\.\d+\.", "layers.*.", name)
        groups.setdefault((generic, elem, dims), []).append(layer.group(1) if layer else "")
    lines = [f"adapter inputs: {len(inputs)} (LoRA weights as optional inputs: the base model unless --adapter FILE "
             f"names an {SUFFIX} file)"]
    for (generic, elem, dims), layers in groups.items():
        where = f"  layers {_span(layers)}" if any(layers) else ""
        lines.append(f"  {generic:<48} {elem} [{', '.join(map(str, dims))}]{where}")
    return lines


def _span(layers: list[str]) -> str:
    ids = sorted(int(x) for x in layers if x)
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))
