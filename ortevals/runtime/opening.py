"""Opening raw onnxruntime sessions: options, provider check.

Owns the ``SessionOptions`` built from a session's record
(:func:`ortevals.runtime.reads.session_reads`: what the result store's scope holds
is what the session is handed), opening one model file as an ``InferenceSession``
(availability checked first; a derived graph reads its weights from the package
folder), and the checks after opening: if
onnxruntime put the session on another provider than the one asked for (it
falls back to CPU with only a warning), that is an error naming the provider,
the file and the likely fix; on a device provider no node runs on the CPU
unless the user allowed it (:mod:`ortevals.runtime.placement`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ortevals.errors import PackageError, ProviderError, first_line
from ortevals.install import import_ort, load_cuda_libraries
from ortevals.package.graph import graph_facts, relocated
from ortevals.package.loader import ModelFile
from ortevals.runtime.placement import FALLBACK_KEY, RECORD_KEY, check_cpu_nodes, cpu_nodes, refused
from ortevals.runtime.plugins import plugin_devices
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.reads import session_reads, session_settings

log = logging.getLogger(__name__)


def session_options(settings: dict, model: ModelFile):
    """ORT SessionOptions from a session's record (:func:`~ortevals.runtime.reads.session_settings`:
    threads, optimization level, config entries)."""
    ort = import_ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, settings["graph_optimization_level"])
    # warnings shown: a provider fallback or a missing kernel is announced by ORT itself (a normal CPU
    # run of the test fixtures and SmolLM2 prints nothing even at level 1); -vv shows ORT's info lines
    so.log_severity_level = 1 if log.isEnabledFor(logging.DEBUG) else 2
    if so.log_severity_level == 2 and graph_facts(model.path).adapter_inputs:  # a LoRA package (runtime/adapters.py):
        so.log_severity_level = 3  # onnxruntime warns once per optional adapter input that it is not a constant
    if settings["intra_op_num_threads"]:
        so.intra_op_num_threads = settings["intra_op_num_threads"]
    so.inter_op_num_threads = settings["inter_op_num_threads"]
    for key, value in settings["session_config"].items():
        so.add_session_config_entry(key, value)
    if model.session_options.get("custom_ops_library"):
        raise PackageError(
            f"{model.path.parent / 'genai_config.json'}: model.{model.role}.session_options.custom_ops_library "
            "is set; ortevals does not load native libraries named by a package"
        )
    return so


INSTALL_HINTS = {"cuda": ", or install the CUDA runtime: pip install 'ortevals[cuda]' (onnxruntime-gpu and "
                         "onnxruntime-genai-cuda, in place of the CPU wheels)",
                 "dml": ", or install onnxruntime-directml (Windows)"}


def check_available(provider: ProviderConfig) -> list | None:
    """The provider is in this onnxruntime install (None), or an installed plugin package offers it here (the
    devices it offers, runtime/plugins.py), else one line naming the ones that are and what to install."""
    ort = import_ort()
    if provider.name == "cuda":
        load_cuda_libraries()
    available = ort.get_available_providers()
    if provider.ort_name not in available and provider.name in INSTALL_HINTS:
        raise ProviderError(
            f"execution provider {provider.name!r} ({provider.ort_name}) is not available in this onnxruntime "
            f"install; available: {', '.join(available)}. Pass --ep cpu (model_args ep=cpu) to run on the CPU"
            + INSTALL_HINTS[provider.name]
        )
    return plugin_devices(ort, provider.name, provider.ort_name)


def open_session(model: ModelFile, provider: ProviderConfig, derived: Path | None = None,
                 stop_spinning: bool = False):
    """One InferenceSession on ``provider``; availability is checked first. It is handed exactly its
    record's settings (:func:`~ortevals.runtime.reads.session_reads`).

    ``derived``: a rewritten copy of ``model``'s graph whose weights stay in the package folder.
    ``stop_spinning``: onnxruntime's threads stop spinning when a run returns (they spin between ops within
    one), for a session whose caller works on those cores between runs. The decode loop chooses tokens on them
    (engine/generate/rows/batch.py): with the threads spinning the choice took 4.0 s of a 52 s acceptance run,
    2.3 s without; spinning off altogether slowed the passes 46 -> 53 s; the scoring passes, back to back, are
    left spinning. Changes no number, so it is not in the session's record.
    """
    check_available(provider)
    settings = session_reads(model, provider).settings
    folder, relinked = relocated(model.path, derived)  # issue 22: data linked from a Hugging Face cache
    entries = {}
    if derived is not None or relinked is not None:
        entries["session.model_external_initializers_file_folder_path"] = str(folder)
    if stop_spinning:
        entries["session.force_spinning_stop"] = "1"

    def options(config: dict[str, str]):
        return session_options({**settings, "session_config": config}, model)

    return create_session(relinked or str(derived or model.path), provider, options, entries, model.path, settings)


def create_session(source: str | bytes, provider: ProviderConfig, options, entries: dict[str, str], where,
                   settings: dict | None = None):
    """An InferenceSession of ``source`` (a path or model bytes) on ``provider``, checked.

    ``options(config)`` makes fresh SessionOptions with the session config entries ``config`` (the
    record's, :func:`~ortevals.runtime.reads.session_settings`), ``entries`` (which change no number) are
    added. On a device provider with the CPU fallback refused (``session.disable_cpu_ep_fallback``,
    runtime/placement.py) the CPU provider is not listed, and onnxruntime's refusal is turned into a second
    opening that names the nodes it put on the CPU: integer shape nodes are accepted, any other is one line
    naming its op type (with ``allow_cpu_fallback``: a warning). ``settings``: the session's record, when it
    opens a package's model (its own session options, :func:`~ortevals.runtime.reads.session_settings`)."""
    ort = import_ort()
    devices = check_available(provider)  # a plugin provider's devices (None: built into onnxruntime)
    settings = settings or session_settings(provider)
    config = dict(settings["session_config"])
    strict = config.get(FALLBACK_KEY) == "1"
    providers = [(settings["provider"], settings["provider_options"])]  # og-only options (cuda graphs) filtered out
    if provider.on_device and not strict:  # allow_cpu_fallback: listed, and what runs there is named
        providers.append(("CPUExecutionProvider", {}))
        entries = {**entries, RECORD_KEY: "1"}
    so = options(config)
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    if strict and not log.isEnabledFor(logging.DEBUG):
        so.log_severity_level = 4  # the expected refusal is logged by onnxruntime as an error: the reopening says
    try:
        session = _session(ort, source, so, providers, devices)
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
        if not (strict and refused(e)):
            raise PackageError(f"{where}: onnxruntime could not load the model: {first_line(e)}") from None
        so = options({k: v for k, v in config.items() if k != FALLBACK_KEY})
        for key, value in {**entries, RECORD_KEY: "1"}.items():
            so.add_session_config_entry(key, value)
        session = _open(ort, source, so, [providers[0]], where, devices)
        check_provider(session, provider, where)  # the provider itself did not load: the install hint
        check_cpu_nodes(cpu_nodes(session, source), where, provider.ort_name, allowed=False)
        return session
    check_provider(session, provider, where)
    if provider.on_device and not strict:
        check_cpu_nodes(cpu_nodes(session, source), where, provider.ort_name, allowed=True)
    return session


def _session(ort, source, so, providers, devices):
    """A session on ``providers``, or on a plugin provider's ``devices`` (with the first provider's options)."""
    if devices is None:
        return ort.InferenceSession(source, so, providers=providers)
    so.add_provider_for_devices(devices, dict(providers[0][1]))
    return ort.InferenceSession(source, so)


def _open(ort, source, so, providers, where, devices=None):
    try:
        return _session(ort, source, so, providers, devices)
    except Exception as e:  # noqa: BLE001 - onnxruntime's own types
        raise PackageError(f"{where}: onnxruntime could not load the model: {first_line(e)}") from None


def check_provider(session, provider: ProviderConfig, path: Path) -> None:
    """Stop if onnxruntime silently put the session on another provider than ``provider``."""
    actual = list(session.get_providers())
    if not actual or actual[0] != provider.ort_name:
        runs_on = actual[0] if actual else "no provider"
        raise ProviderError(f"{path}: {provider.ort_name} requested but the session runs on {runs_on}: "
                            f"{FALLBACK_HINTS.get(provider.name, FALLBACK_HINTS['other'])}")


FALLBACK_HINTS = {
    "cuda": "onnxruntime (CPU) is installed instead of onnxruntime-gpu, or the CUDA/cuDNN libraries were not "
            "found (call onnxruntime.preload_dlls() / check LD_LIBRARY_PATH)",
    "rocm": "onnxruntime (CPU) is installed instead of an onnxruntime build with ROCm, or the ROCm libraries "
            "were not found (check LD_LIBRARY_PATH)",
    "dml": "onnxruntime (CPU) is installed instead of onnxruntime-directml, or no DirectX 12 device was found",
    "openvino": "OpenVINO is missing from this onnxruntime: install its plugin package (pip install "
                "onnxruntime-ep-openvino) or onnxruntime-openvino in place of onnxruntime; or the OpenVINO runtime "
                "found no device",
    "qnn": "QNN is missing from this onnxruntime: install its plugin package (pip install onnxruntime-qnn); or no "
           "Qualcomm NPU was found",
    "other": "this onnxruntime build or machine cannot create it (onnxruntime's warning above says why)",
}
FALLBACK_HINTS["tensorrt"] = FALLBACK_HINTS["nvtensorrtrtx"] = FALLBACK_HINTS["cuda"] + ", or TensorRT is missing"
