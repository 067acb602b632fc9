"""Execution providers that ship as plugin packages (onnxruntime 1.32's plugin EP interface).

WebGPU, TensorRT-RTX, OpenVINO, QNN 2.x and others install as packages of their own (``onnxruntime-ep-openvino``,
``onnxruntime-ep-webgpu``, …): a module whose ``get_library_path()`` names the provider's shared library and
``get_ep_names()`` its provider names. onnxruntime loads it with ``register_execution_provider_library(name,
path)``; the devices it then offers (``get_ep_devices()``) are handed to a session with
``SessionOptions.add_provider_for_devices``.

Owns finding the plugin for a provider (an installed plugin package whose provider names include it),
registering it once per process with onnxruntime and with onnxruntime-genai (each keeps its own environment), the
route a session takes to the provider (:func:`route`: by name where onnxruntime has it built in, else through the
devices a registered plugin offers), and the one-line refusals: no plugin installed (naming the package to install)
or a plugin that offers no device on this machine. ``plugin_distribution`` names what the scope records: the
plugin's distribution, whose version is what computes the numbers.

The route is decided from ortevals' registration record, never from ``get_available_providers()`` alone: once a
plugin is registered and offers a device, onnxruntime lists it there too, yet a session handed its name (the
built-in route) lands on the CPU provider (onnxruntime-ep-openvino 1.8.1 on an Intel Xeon).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import ProviderError, first_line

log = logging.getLogger(__name__)

# the package a provider ships in (package index, November 2026); a provider not listed ships with onnxruntime
PACKAGES = {"openvino": "onnxruntime-ep-openvino", "webgpu": "onnxruntime-ep-webgpu",
            "nvtensorrtrtx": "onnxruntime-ep-nv-tensorrt-rtx", "qnn": "onnxruntime-qnn"}
# how a session is handed a provider (:func:`route`)
BY_NAME, BY_DEVICES, REGISTER, NO_DEVICE = "by name", "by devices", "register", "no device"


@dataclass(frozen=True)
class Plugin:
    """A plugin library for one provider: onnxruntime's provider name, the library, the package that ships it."""

    ep_name: str
    library: Path
    distribution: str


_REGISTERED: dict[tuple[str, str], Plugin] = {}  # (runtime, provider name) -> the plugin registered for it


def route(registered: bool, listed: bool, devices: int = 0) -> str:
    """How a session is handed a provider: :data:`BY_DEVICES` (``SessionOptions.add_provider_for_devices``) where
    ortevals registered a plugin for it (``registered``) that offers ``devices`` here, :data:`NO_DEVICE` where that
    plugin offers none; not registered, :data:`BY_NAME` where onnxruntime lists it (``listed``: built in), else
    :data:`REGISTER` (a plugin package to find and register first). ``listed`` decides only for a provider
    ortevals did not register: after registration onnxruntime lists a plugin provider as well."""
    if registered:
        return BY_DEVICES if devices else NO_DEVICE
    return BY_NAME if listed else REGISTER


def find_plugin(ep_name: str) -> Plugin | None:
    """The installed plugin package whose provider names include onnxruntime provider ``ep_name``, else None."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not (name.startswith("onnxruntime-ep-") or name == "onnxruntime-qnn"):
            continue
        module = _module(dist)
        if module is not None and ep_name in _names(module):
            return Plugin(ep_name, Path(module.get_library_path()), dist.metadata["Name"])
    return None


def _module(dist):
    """The distribution's top-level module that has ``get_library_path`` (the plugin packages' convention)."""
    top = (dist.read_text("top_level.txt") or "").split() or [
        f.parts[0] for f in (dist.files or []) if f.name == "__init__.py" and len(f.parts) == 2]
    for name in dict.fromkeys(top):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken plugin package is skipped (the refusal names the package)
            continue
        if hasattr(module, "get_library_path"):
            return module
    return None


def _names(module) -> list[str]:
    if hasattr(module, "get_ep_names"):
        return list(module.get_ep_names())
    return [module.get_ep_name()] if hasattr(module, "get_ep_name") else []


def register(runtime, plugin: Plugin, which: str = "onnxruntime") -> None:
    """Register ``plugin`` with ``runtime`` (the onnxruntime or onnxruntime_genai module) once per process."""
    key = (which, plugin.ep_name)
    if key in _REGISTERED:
        if _REGISTERED[key].library != plugin.library:
            raise ProviderError(f"{plugin.ep_name} is already registered from {_REGISTERED[key].library}; one library "
                                "a process")
        return
    try:
        runtime.register_execution_provider_library(plugin.ep_name, str(plugin.library))
    except Exception as e:  # onnxruntime's own error: the library could not be loaded
        raise ProviderError(f"{plugin.library}: {which} could not load the {plugin.ep_name} plugin: "
                            f"{first_line(e)}") from None
    _REGISTERED[key] = plugin
    log.info("%s: %s registered from %s", which, plugin.ep_name, plugin.distribution or plugin.library)


def plugin_devices(ort, short: str, ep_name: str) -> list | None:
    """The devices onnxruntime's plugin for ``ep_name`` offers (registered first); None for a provider built into
    this onnxruntime (the route by name, :func:`route`). One line where it is neither built in nor installed, or
    offers no device here."""
    plugin = _REGISTERED.get(("onnxruntime", ep_name))
    if plugin is None:
        if route(False, ep_name in ort.get_available_providers()) == BY_NAME:
            return None
        plugin = find_plugin(ep_name)
        if plugin is None:
            raise ProviderError(f"execution provider {short!r} ({ep_name}) is not available in this onnxruntime "
                                f"install (available: {', '.join(ort.get_available_providers())}); "
                                f"{install_hint(short)}, or pass --ep cpu")
        register(ort, plugin)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep_name]
    if route(True, True, len(devices)) == NO_DEVICE:
        offered = ", ".join(f"{d.ep_name} ({d.device.type.name.split('.')[-1]}, {d.device.vendor})"
                            for d in ort.get_ep_devices())
        raise ProviderError(f"{ep_name} registered from {plugin.distribution} "
                            f"{importlib.metadata.version(plugin.distribution)} offers no device on this machine "
                            f"(onnxruntime's devices: {offered}); pass --ep cpu")
    return devices


def install_hint(short: str) -> str:
    """What to install for provider ``short``: its plugin package, else the onnxruntime build with it."""
    package = PACKAGES.get(short)
    return (f"it ships as a plugin package: pip install {package}" if package else
            "install the onnxruntime package built with it")


def plugin_distribution(short: str) -> str | None:
    """The installed plugin package of provider ``short`` (its version goes into the scope), from metadata only."""
    package = PACKAGES.get(short)
    try:
        return package if package and importlib.metadata.version(package) else None
    except importlib.metadata.PackageNotFoundError:
        return None


def with_plugin(short: str, dists: tuple[str, ...]) -> tuple[str, ...]:
    """``dists`` (what a path's scope records the versions of) and provider ``short``'s plugin package where one is
    installed: its version computes the numbers too."""
    plugin = plugin_distribution(short)
    return (*dists, *((plugin,) if plugin else ()))
