"""LoRA adapters: the ``adapter`` option's values and the decoder inputs an adapter fills.

Owns the syntax of ``--adapter FILE[=NAME]`` (model arg ``adapter=FILE[=NAME]``): :func:`parse_adapters` (the
options table's parser: syntax only, no I/O) and :class:`AdapterSpec` (the file and the name onnxruntime-genai
loads it under: NAME, else the file's stem); and the package's adapter inputs (:func:`adapter_inputs`: the
decoder's optional LoRA weight inputs, package/graph.py), with the line ``ortevals info`` shows
(:func:`describe_adapter_inputs`). Reading an adapter file and checking it against these inputs is the runtime's
(runtime/adapters.py). Pure.
"""

from __future__ import annotations

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


def describe_adapter_inputs(package: ModelPackage) -> str:
    """One line for ``ortevals info``: how many LoRA inputs the decoder has, and the modules they adapt."""
    inputs = adapter_inputs(package)
    if not inputs:
        return ""
    modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _, _ in inputs if ".lora_" in n})
    ranks = sorted({str(d) for _, _, dims in inputs for d in dims if isinstance(d, str)})
    return (f"adapter inputs: {len(inputs)} optional LoRA weights ({', '.join(modules) or 'adapter weights'}; rank "
            f"{', '.join(ranks) or 'fixed'}): scored with the base weights unless --adapter FILE names an "
            f"{SUFFIX} file")
