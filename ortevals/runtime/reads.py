"""What ortevals' own onnxruntime sessions read: the record each is opened with.

Owns :func:`session_settings` (everything a raw session is handed that can change a number),
:func:`session_reads` (a model's graph and external data with those settings) and
:func:`runner_reads` (a :class:`~ortevals.runtime.sessions.DecoderRunner`'s sessions and, with a
cache, the derived scoring graph). :func:`ortevals.runtime.opening.open_session` takes its
providers, options and threads from :func:`session_reads`' record, so what a session is handed
and what the result store's scope holds (:mod:`ortevals.package.scope`) are one value.

Pure: reads graph protobufs for external-data names, imports no runtime.
"""

from __future__ import annotations

from pathlib import Path

from ortevals.package.graph import external_data_files
from ortevals.package.loader import ModelFile, ModelPackage
from ortevals.package.scope import Reads
from ortevals.package.session_options import package_session_config
from ortevals.runtime.derive import derive_reads
from ortevals.runtime.placement import FALLBACK_KEY
from ortevals.runtime.plugins import with_plugin
from ortevals.runtime.providers import ProviderConfig


def session_settings(provider: ProviderConfig, model: ModelFile | None = None) -> dict:
    """Everything a raw session is handed that can change a number (:func:`open_session` passes exactly
    this): the provider, its options filtered for raw sessions (``raw_options``), threads, graph
    optimization level and session config entries: those ``model``'s own ``session_options`` section asks
    for, as onnxruntime-genai applies them (package/session_options.py), then ortevals' own on top
    (``session.disable_cpu_ep_fallback=1`` on a device provider unless ``allow_cpu_fallback``)."""
    config, level = ({}, None) if model is None else package_session_config(
        model.session_options, f"{model.path.parent / 'genai_config.json'}: model.{model.role}.session_options")
    config.update(provider.session_config)
    if provider.on_device and not provider.allow_cpu_fallback:  # no node on the CPU (runtime/placement.py)
        config[FALLBACK_KEY] = "1"
    return {"provider": provider.ort_name, "provider_options": dict(provider.raw_options),
            "intra_op_num_threads": provider.intra_op_threads, "inter_op_num_threads": 1,
            "graph_optimization_level": level or "ORT_ENABLE_ALL", "session_config": config}


def session_reads(model: ModelFile, provider: ProviderConfig) -> Reads:
    """What :func:`open_session` reads for ``model``: its graph, its external data, :func:`session_settings`."""
    return Reads("raw sessions", (model.path, *sorted(external_data_files(model.path))),
                 session_settings(provider, model), with_plugin(provider.name, ("onnxruntime",)))


def runner_reads(package: ModelPackage, provider: ProviderConfig, cache: Path | None = None) -> list[Reads]:
    """What :meth:`DecoderRunner.open` reads: embedding and decoder sessions, and with ``cache`` the
    derived scoring graph (built from :func:`~ortevals.runtime.derive.derive_reads`)."""
    models = [m for m in (package.embedding, package.decoder) if m is not None]
    return [*(session_reads(m, provider) for m in models), *([derive_reads(package)] if cache is not None else [])]
