"""Execution providers: names, aliases, options, thread settings.

Owns the mapping from the short names users type (``--ep cuda``) and that
``genai_config.json`` uses (``provider_options: [{"cuda": {...}}]``) to
onnxruntime's provider names, and the merge of package options with user
overrides. Pure data: the runtime module checks availability.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ortevals.errors import ProviderError

# short name -> onnxruntime provider name
PROVIDERS: dict[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "nvtensorrtrtx": "NvTensorRTRTXExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "vitisai": "VitisAIExecutionProvider",
}
ALIASES = {"gpu": "cuda", "directml": "dml", "trt": "tensorrt", "trt-rtx": "nvtensorrtrtx", "ov": "openvino"}
# Providers that can only run the pruned-head / fixed-shape exports: scored incrementally.
NPU_PROVIDERS = frozenset({"qnn", "vitisai"})


@dataclass(frozen=True)
class ProviderConfig:
    """Which provider to run on and how: ``ort_name``, its options, session settings."""

    name: str
    options: dict[str, str] = field(default_factory=dict)
    intra_op_threads: int = 0  # 0: onnxruntime's default for the provider
    session_config: dict[str, str] = field(default_factory=dict)

    @property
    def ort_name(self) -> str:
        return PROVIDERS[self.name]

    @property
    def on_device(self) -> bool:
        return self.name != "cpu"


def normalize(name: str) -> str:
    """Map a user or config spelling (``CUDA``, ``CUDAExecutionProvider``, ``gpu``) to a short name."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in PROVIDERS:
        return key
    by_ort = {v.lower(): k for k, v in PROVIDERS.items()}
    if key in by_ort:
        return by_ort[key]
    raise ProviderError(f"unknown execution provider {name!r}; expected one of {', '.join(PROVIDERS)}")


def parse_options(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["device_id=1", "enable_cuda_graph=0"]`` -> dict; a bad pair names itself."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ProviderError(f"provider option {pair!r} must look like key=value")
        out[key.strip()] = value.strip()
    return out


def from_package(
    session_options: dict[str, Any],
    ep: str | None = None,
    overrides: dict[str, str] | None = None,
    threads: int | None = None,
) -> ProviderConfig:
    """Resolve the provider from the package's session options and the user's choice.

    ``ep`` wins over the package's first provider; the package's options for
    that provider are kept and ``overrides`` are applied on top.
    """
    listed: list[tuple[str, dict[str, str]]] = []
    for entry in session_options.get("provider_options", []) or []:
        if isinstance(entry, dict):
            listed.extend((normalize(k), {str(a): str(b) for a, b in (v or {}).items()}) for k, v in entry.items())
    name = normalize(ep) if ep else (listed[0][0] if listed else "cpu")
    options = dict(next((o for n, o in listed if n == name), {}))
    options.update(overrides or {})
    if threads is None:
        threads = int(session_options.get("intra_op_num_threads", 0) or 0)
    if threads < 0:
        raise ProviderError(f"threads must be >= 0, got {threads}")
    return ProviderConfig(name=name, options=options, intra_op_threads=threads or default_threads(name))


def default_threads(name: str) -> int:
    """On CPU, one thread per physical-ish core measured fastest here; devices need few."""
    if name != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
