"""``genai_config.json``'s ``session_options``: provider names, their options, integer settings.

Owns the short provider names users type (``--ep cuda``) and packages use
(``provider_options: [{"cuda": {...}}]``), their aliases and onnxruntime's long names
(:func:`normalize`), and the checks of a ``session_options`` section, each error one
line naming the field (:func:`check_session_options`, :func:`provider_entries`,
:func:`thread_count`). Pure data: :mod:`ortevals.runtime.providers` decides what each
runtime is handed.
"""

from __future__ import annotations

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


# session options that ortevals or onnxruntime-genai read as integers
INT_SESSION_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads", "log_severity_level", "log_verbosity_level")
OPTION_VALUE = (str, int, float, bool)
# the keys onnxruntime-genai 0.18 reads itself from a session_options section (config.cpp SessionOptions_Element);
# every other scalar is handed to onnxruntime as a session config entry (AddConfigEntry: "ep.cuda.fpa_intb_gemm",
# "optimization.disable_specified_optimizers", ...), a string
OG_SESSION_KEYS = frozenset({"log_id", "enable_profiling", *INT_SESSION_OPTIONS, "enable_cpu_mem_arena",
                             "enable_mem_pattern", "graph_optimization_level", "custom_ops_library",
                             "provider_options", "runtime"})
OPTIMIZATION_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_LAYOUT",
                       "ORT_ENABLE_ALL")
# config entries that make onnxruntime write files (an EP context model beside the package's): onnxruntime-genai
# applies them; ortevals' sessions never write into the package folder, and they change no number
WRITES_FILES = ("ep.context_enable", "ep.context_file_path", "ep.context_embed_mode", "session.optimized_model")


def package_session_config(session_options: dict[str, Any], where: str) -> tuple[dict[str, str], str | None]:
    """What onnxruntime-genai hands onnxruntime from a model's ``session_options`` section that can change a
    number: its session config entries (every key it does not read itself, :data:`OG_SESSION_KEYS`; those that
    write files left out) and its ``graph_optimization_level`` (None: onnxruntime's default, ORT_ENABLE_ALL)."""
    level = session_options.get("graph_optimization_level")
    if level is not None and level not in OPTIMIZATION_LEVELS:
        raise ProviderError(f"{where}.graph_optimization_level={level!r}; expected one of "
                            f"{', '.join(OPTIMIZATION_LEVELS)}")
    entries = {}
    for key, value in session_options.items():
        if key in OG_SESSION_KEYS or key.startswith(WRITES_FILES):
            continue
        if not isinstance(value, str):
            raise ProviderError(f"{where}.{key}={value!r} must be a string: onnxruntime-genai hands it to "
                                "onnxruntime as a session config entry")
        entries[key] = value
    return entries, level


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
    package_session_config(session_options, where)


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
