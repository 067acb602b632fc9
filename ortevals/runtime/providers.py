"""Execution providers: the provider a run uses, its options, thread settings.

Owns what each runtime is handed: the provider (names, aliases and the checks of a
package's ``session_options`` live in :mod:`ortevals.package.session_options`), the
merge of package options with user overrides, and which of those options are safe for ortevals' own raw
onnxruntime sessions (:func:`raw_session_options`). Pure data: the runtime
module checks availability.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ortevals.errors import ProviderError
from ortevals.package.session_options import PROVIDERS, normalize, provider_entries, thread_count
from ortevals.runtime.provider_names import check_user_options

log = logging.getLogger(__name__)

# Providers that can only run the pruned-head / fixed-shape exports: scored incrementally.
NPU_PROVIDERS = frozenset({"qnn", "vitisai"})
# Refused until measured on a GPU (issue 20). TensorRT: the raw sessions would get CPU as the only fallback, so
# the contrib ops TensorRT does not take (GroupQueryAttention, ...) would run on CPU beside KV bound to CUDA,
# and no shape profiles are set for shapes that change every pass.
REFUSED = {"tensorrt": "not supported by ortevals yet (its raw sessions would run GroupQueryAttention on CPU "
                       "beside KV on CUDA, with no TensorRT shape profiles); use --ep cuda"}


# onnxruntime's CUDA provider runs float32 MatMuls (and convolutions) in TF32 unless told otherwise
# (OrtCUDAProviderOptionsV2.use_tf32, default 1): a 10-bit mantissa for the products, where PyTorch's
# float32 matmuls keep full float32 (torch.backends.cuda.matmul.allow_tf32 is False by default). So
# ortevals turns it off on CUDA; float16/bfloat16 graphs are unchanged by it. The user may opt back in
# with provider_options=use_tf32=1 (part of the store's scope like every provider option).
TF32_OFF = {"use_tf32": "0"}
# On sm90 and later, onnxruntime 1.31's attention ops (GroupQueryAttention, MultiHeadAttention) prefer cuDNN's
# SDPA for float16/bfloat16 unless a kernel is pinned, and build a cuDNN graph for every new (batch, new tokens,
# KV length) on the host: measured on an H200 (docs/benchmarks.md section 11), 2.4 s of a 2.9 s profile inside
# GroupQueryAttention against 0.04 s of GPU kernel time, a few tens of ms a pass, since scoring's shapes change
# every pass. sdpa_kernel is the AttentionBackend bitmask (attention_common.h): 1 flash attention, 2 memory
# efficient attention (the fallback where flash cannot run, e.g. before sm80); decode steps on a shared buffer
# keep XQA, which it does not govern. The user may give another value (sdpa_kernel=0: onnxruntime's choice).
FLASH_ATTENTION = {"sdpa_kernel": "3"}
CUDA_DEFAULTS = {**TF32_OFF, **FLASH_ATTENTION}
# OpenVINO infers in bf16 (CPU, where it has AMX or AVX512-BF16) or f16 (GPU) unless told otherwise, where
# onnxruntime's CPU provider and PyTorch compute float32 graphs in float32. ortevals pins f32 through load_config,
# the option the OpenVINO plugin (onnxruntime-ep-openvino 1.8.1) reads it from ("precision" is ignored there with a
# warning; onnxruntime-openvino reads load_config too). The user's own load_config or precision replaces it.
OPENVINO_PRECISION = "INFERENCE_PRECISION_HINT"
OPENVINO_F32 = {"CPU": {OPENVINO_PRECISION: "f32"}, "GPU": {OPENVINO_PRECISION: "f32"}}


# Provider options known to be safe for raw sessions whose input shapes change every
# pass (ortevals' prefill path). A package's options were written for onnxruntime-genai,
# which captures CUDA/HIP graphs and pins streams itself; anything not listed here is
# dropped for the raw sessions (og still gets every option).
GENERIC_OPTIONS = frozenset({"device_id"})
SAFE_OPTIONS: dict[str, frozenset[str]] = {
    "cpu": frozenset(),
    "cuda": GENERIC_OPTIONS | {"gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_algo_search",
                               "do_copy_in_default_stream", "cudnn_conv_use_max_workspace",
                               "cudnn_conv1d_pad_to_nc1d", "enable_skip_layer_norm_strict_mode", "prefer_nhwc",
                               "use_tf32", "use_ep_level_unified_stream", "fuse_conv_bias", "sdpa_kernel"},
    "tensorrt": GENERIC_OPTIONS | {"trt_max_workspace_size", "trt_fp16_enable", "trt_bf16_enable",
                                   "trt_int8_enable", "trt_engine_cache_enable", "trt_engine_cache_path",
                                   "trt_timing_cache_enable", "trt_timing_cache_path",
                                   "trt_builder_optimization_level", "trt_max_partition_iterations",
                                   "trt_min_subgraph_size", "trt_profile_min_shapes", "trt_profile_max_shapes",
                                   "trt_profile_opt_shapes", "trt_detailed_build_log"},
    "nvtensorrtrtx": GENERIC_OPTIONS,
    "rocm": GENERIC_OPTIONS | {"gpu_mem_limit", "arena_extend_strategy", "miopen_conv_exhaustive_search",
                               "do_copy_in_default_stream"},
    "migraphx": GENERIC_OPTIONS | {"migraphx_fp16_enable", "migraphx_int8_enable"},
    "dml": GENERIC_OPTIONS | {"performance_preference", "device_filter", "disable_metacommands"},
    "openvino": frozenset({"device_type", "precision", "num_of_threads", "num_streams", "cache_dir", "load_config",
                           "enable_qdq_optimizer", "model_priority", "enable_opencl_throttling"}),
}
# Options that capture a graph for fixed shapes, bind a foreign stream or autotune kernels
# (numbers that vary run to run): never passed to a raw session, even when the user asks.
UNSAFE_OPTIONS = frozenset({"enable_cuda_graph", "trt_cuda_graph_enable", "enable_hip_graph", "enable_graph_capture",
                            "enableGraphCapture", "user_compute_stream", "has_user_compute_stream",
                            "tunable_op_enable", "tunable_op_tuning_enable", "tunable_op_max_tuning_duration_ms"})


@dataclass(frozen=True)
class RawOptions:
    """Provider options for ortevals' raw sessions, and what was left for onnxruntime-genai only."""

    kept: dict[str, str]
    dropped_package: tuple[str, ...]  # not on the provider's safe list
    dropped_user: tuple[str, ...]  # the user's own options that are known to be unsafe


def raw_session_options(name: str, options: dict[str, str], user_keys=()) -> RawOptions:
    """Filter ``options`` (package options merged with user overrides) for a raw session.

    Package options keep only the provider's :data:`SAFE_OPTIONS` (an unlisted provider
    keeps :data:`GENERIC_OPTIONS`). The user's own options (``user_keys``) are trusted
    unless they are in :data:`UNSAFE_OPTIONS`: those are dropped for raw sessions only.
    """
    safe = SAFE_OPTIONS.get(name, GENERIC_OPTIONS)
    kept, dropped_package, dropped_user = {}, [], []
    for key, value in options.items():
        if key in UNSAFE_OPTIONS:
            (dropped_user if key in user_keys else dropped_package).append(key)
        elif key in safe or key in user_keys:
            kept[key] = value
        else:
            dropped_package.append(key)
    return RawOptions(kept, tuple(dropped_package), tuple(dropped_user))


@dataclass(frozen=True)
class ProviderConfig:
    """Which provider to run on and how: ``ort_name``, its options, session settings.

    ``options`` go to onnxruntime-genai unchanged; the raw sessions get :attr:`raw_options`.
    """

    name: str
    options: dict[str, str] = field(default_factory=dict)
    intra_op_threads: int = 0  # 0: onnxruntime's default for the provider
    session_config: dict[str, str] = field(default_factory=dict)
    user_keys: tuple[str, ...] = ()  # which options the user set (the rest came from the package)
    allow_cpu_fallback: bool = False  # a device provider's nodes may run on the CPU (runtime/placement.py)

    @property
    def ort_name(self) -> str:
        return PROVIDERS[self.name]

    @property
    def raw_options(self) -> dict[str, str]:
        """The options the raw onnxruntime sessions get (and the store's scope records)."""
        return raw_session_options(self.name, self.options, self.user_keys).kept

    @property
    def on_device(self) -> bool:
        return self.name != "cpu"


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
    allow_cpu_fallback: bool = False,
) -> ProviderConfig:
    """Resolve the provider from the package's session options and the user's choice.

    ``ep`` wins over the package's first provider; the package's options for
    that provider are kept and ``overrides`` are applied on top. ``where``
    names the section in errors (``…/genai_config.json: field model.decoder.session_options``).
    On CUDA, :data:`CUDA_DEFAULTS` (``use_tf32=0``, ``sdpa_kernel=3``) unless the user sets them.
    """
    listed = provider_entries(session_options, where)
    name = normalize(ep) if ep else (listed[0][0] if listed else "cpu")
    if name in REFUSED:
        source = f"--ep {ep}" if ep else f"the package's model.decoder.{where}.provider_options (first entry)"
        raise ProviderError(f"{source}: execution provider {name} ({PROVIDERS[name]}) is {REFUSED[name]}")
    options = dict(next((o for n, o in listed if n == name), {}))
    check_user_options(name, overrides or {})  # runtime/provider_names.py: warnings naming ignored options
    options.update(overrides or {})
    if name == "cuda":
        _cuda_defaults(options, overrides or {})
    if name == "openvino" and not {"load_config", "precision"} & set(overrides or {}):
        options["load_config"] = _openvino_f32(options.get("load_config"), where)
    if threads is None:
        threads = thread_count(session_options, where)
    if threads < 0:
        raise ProviderError(f"threads must be >= 0, got {threads}")
    config = ProviderConfig(name=name, options=options, intra_op_threads=threads or default_threads(name),
                            user_keys=tuple(overrides or {}), allow_cpu_fallback=allow_cpu_fallback)
    _log_dropped(config)
    return config


def _cuda_defaults(options: dict[str, str], overrides: dict[str, str]) -> None:
    """:data:`CUDA_DEFAULTS` into ``options`` where the user set none (a package's own value is replaced)."""
    for key, value in CUDA_DEFAULTS.items():
        if key in overrides:
            continue
        if options.get(key, value) != value:
            log.info("%s=%s from the package replaced by %s (give provider_options=%s=... to choose)", key,
                     options[key], value, key)
        options[key] = value


def _openvino_f32(load_config: str | None, where: str) -> str:
    """The package's OpenVINO ``load_config`` (a JSON object of per-device properties) with :data:`OPENVINO_F32`
    set in it (a package's other precision replaced, logged), as compact sorted JSON (the scope's value)."""
    try:
        config = json.loads(load_config) if load_config else {}
    except json.JSONDecodeError as e:
        raise ProviderError(f"{where}: openvino load_config={load_config!r} is not JSON ({e.msg}); expected an object "
                            'of device properties, such as {"CPU": {"INFERENCE_PRECISION_HINT": "f32"}}') from None
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise ProviderError(f"{where}: openvino load_config={load_config!r} must be a JSON object of device "
                            'properties, such as {"CPU": {"INFERENCE_PRECISION_HINT": "f32"}}')
    for device, hint in OPENVINO_F32.items():
        own = config.setdefault(device, {}).get(OPENVINO_PRECISION, "f32")
        if own != "f32":
            log.info("openvino load_config %s.%s=%s from the package replaced by f32 (give --provider-option "
                     "load_config=... to choose)", device, OPENVINO_PRECISION, own)
        config[device].update(hint)
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _log_dropped(config: ProviderConfig) -> None:
    raw = raw_session_options(config.name, config.options, config.user_keys)
    if raw.dropped_package:
        log.info("%s options from the package not passed to raw onnxruntime sessions (kept for "
                 "onnxruntime-genai): %s", config.name, ", ".join(raw.dropped_package))
    if raw.dropped_user:
        log.warning("%s options unsafe for raw onnxruntime sessions (shapes change every pass), used for "
                    "onnxruntime-genai only: %s", config.name, ", ".join(raw.dropped_user))


def provider_mode(config: ProviderConfig) -> str:
    """The run's mode line for a device provider (empty on CPU): TF32 and the CPU fallback policy."""
    if not config.on_device:
        return ""
    parts = [config.ort_name]
    if config.name == "cuda":
        tf32 = config.raw_options.get("use_tf32", "1")
        parts.append(f"use_tf32={tf32}" + (" (float32 MatMuls in full float32, as PyTorch)" if tf32 == "0" else
                                           " (float32 MatMuls in TF32)"))
        sdpa = config.raw_options.get("sdpa_kernel", "0")
        parts.append(f"sdpa_kernel={sdpa}" + (" (flash attention, no cuDNN graph per shape)"
                                              if sdpa == FLASH_ATTENTION["sdpa_kernel"] else ""))
    if config.name == "openvino":
        parts.append(_openvino_precision(config.raw_options))
    parts.append("nodes without a kernel there run on the CPU (allow_cpu_fallback=true)" if config.allow_cpu_fallback
                 else "every node on it or refused (no CPU fallback)")
    return ", ".join(parts)


def _openvino_precision(options: dict[str, str]) -> str:
    """The run's mode line part for OpenVINO: the inference precision each device was given."""
    try:
        config = json.loads(options.get("load_config") or "{}")
    except json.JSONDecodeError:
        config = {}
    hints = [f"{d}={p[OPENVINO_PRECISION]}" for d, p in sorted(config.items())
             if isinstance(p, dict) and OPENVINO_PRECISION in p]
    return (f"inference precision {', '.join(hints)}" if hints else
            "OpenVINO's default inference precision (bf16 or f16 where the device has it)")


def default_threads(name: str) -> int:
    """On CPU, one thread per physical-ish core measured fastest here; devices need few."""
    if name != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
