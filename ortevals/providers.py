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
    where: str = "session_options",
) -> ProviderConfig:
    """Resolve the provider from the package's session options and the user's choice.

    ``ep`` wins over the package's first provider; the package's options for
    that provider are kept and ``overrides`` are applied on top. ``where``
    names the section in errors (``…/genai_config.json: field model.decoder.session_options``).
    """
    listed = provider_entries(session_options, where)
    name = normalize(ep) if ep else (listed[0][0] if listed else "cpu")
    options = dict(next((o for n, o in listed if n == name), {}))
    options.update(overrides or {})
    if threads is None:
        threads = thread_count(session_options, where)
    if threads < 0:
        raise ProviderError(f"threads must be >= 0, got {threads}")
    return ProviderConfig(name=name, options=options, intra_op_threads=threads or default_threads(name))


# session options that ortevals or onnxruntime-genai read as integers
INT_SESSION_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads", "log_severity_level", "log_verbosity_level")
OPTION_VALUE = (str, int, float, bool)


def check_session_options(session_options: Any, where: str) -> None:
    """Refuse a malformed ``session_options`` section with one line naming the field.

    ``where``: the section's name as the user should read it. Checks the
    integer settings and the whole ``provider_options`` structure: a list of
    objects, each mapping a known provider name to an object of option values.
    """
    if not isinstance(session_options, dict):
        raise ProviderError(f"{where} must be an object, got {session_options!r}")
    for key in INT_SESSION_OPTIONS:
        value = session_options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ProviderError(f"{where}.{key} must be an integer >= 0, got {value!r}")
    provider_entries(session_options, where)


def thread_count(session_options: dict[str, Any], where: str = "session_options") -> int:
    value = session_options.get("intra_op_num_threads") or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProviderError(f"{where}.intra_op_num_threads must be an integer >= 0, got {value!r}")
    return value


def provider_entries(session_options: dict[str, Any], where: str = "session_options") -> list[tuple[str, dict]]:
    """``provider_options`` as ``[(short name, {option: str value})]``, in the package's order."""
    entries = session_options.get("provider_options")
    if entries is None:
        return []
    field_name = f"{where}.provider_options"
    if not isinstance(entries, list):
        raise ProviderError(f"{field_name} must be a list of {{provider: {{option: value}}}} objects, "
                            f"got {entries!r}")
    listed = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry:
            raise ProviderError(f"{field_name}[{i}] must be an object mapping a provider name to its options, "
                                f"got {entry!r}")
        for key, options in entry.items():
            try:
                name = normalize(key)
            except ProviderError as e:
                raise ProviderError(f"{field_name}[{i}]: {e}") from None
            if options is None:
                options = {}
            if not isinstance(options, dict):
                raise ProviderError(f"{field_name}[{i}].{key} must be an object of option values, got {options!r}")
            for opt, value in options.items():
                if not isinstance(value, OPTION_VALUE):
                    raise ProviderError(f"{field_name}[{i}].{key}.{opt} must be a string or number, got {value!r}")
            listed.append((name, {str(a): str(b) for a, b in options.items()}))
    return listed


def default_threads(name: str) -> int:
    """On CPU, one thread per physical-ish core measured fastest here; devices need few."""
    if name != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
