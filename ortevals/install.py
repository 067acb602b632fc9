"""The runtime wheels: the only place that imports onnxruntime and onnxruntime_genai.

Importable from every layer (the package layer asks onnxruntime-genai about a config,
package/og_config.py). Both modules are imported lazily, through :func:`import_ort` and :func:`import_og`,
which first check that the installed wheels are consistent (the CPU and GPU
wheels own the same module and must never be installed together in one
folder) and turn a missing runtime into a one-line error with the pip command
that fixes it. A wheel in a later ``sys.path`` folder than the one the module
is imported from is shadowed, not mixed: the GPU kit (scripts/gpu/) installs
onnxruntime-gpu into a folder put before a site-packages that keeps its CPU
onnxruntime.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from importlib import metadata, util
from pathlib import Path

from ortevals.errors import RuntimeMissingError, first_line

log = logging.getLogger(__name__)

# ortevals' one list of runtime wheels: every wheel that installs the ``onnxruntime`` module (they overwrite
# each other's files, so two in one folder is a mixed install) and every onnxruntime-genai wheel with the
# onnxruntime wheel it is built against. The result store's scope (package/scope.py) records the same lists.
ORT_WHEELS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn",
              "onnxruntime-rocm", "onnxruntime-training")
OG_WHEELS = {"onnxruntime-genai": "onnxruntime", "onnxruntime-genai-cuda": "onnxruntime-gpu",
             "onnxruntime-genai-directml": "onnxruntime-directml", "onnxruntime-genai-rocm": "onnxruntime-rocm"}
FIX_CPU = "pip uninstall -y onnxruntime-gpu onnxruntime-genai-cuda && pip install 'ortevals[cpu]'"
FIX_CUDA = "pip uninstall -y onnxruntime onnxruntime-genai && pip install --force-reinstall 'ortevals[cuda]'"


def installed(names, module: str | None = None) -> list[str]:
    """The wheels among ``names`` that are installed; with ``module``, only those installed in the folder
    that ``import module`` loads from (one in another folder owns no file that gets imported)."""
    home = module_home(module) if module else None
    found = []
    for name in names:
        folders = {Path(d.locate_file("")).resolve() for d in metadata.distributions(name=name)}
        if folders and (home is None or home in folders):
            found.append(name)
    return found


def module_home(module: str) -> Path | None:
    """The ``sys.path`` folder that ``import module`` would load a top-level package from, without importing it."""
    try:
        spec = util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    where = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
    return Path(where[0]).resolve().parent if where else None


def check_install() -> None:
    """Refuse a mixed CPU/GPU install before importing anything from it."""
    ort = installed(ORT_WHEELS, "onnxruntime")
    if len(ort) > 1:
        raise RuntimeMissingError(
            f"mixed onnxruntime install: {' and '.join(ort)} are both installed and overwrite each other's "
            f"module; keep one. CPU: {FIX_CPU}   CUDA: {FIX_CUDA}"
        )
    og = installed(OG_WHEELS, "onnxruntime_genai")
    if len(og) > 1:
        raise RuntimeMissingError(f"mixed onnxruntime-genai install: {' and '.join(og)}; keep one. "
                                  f"CPU: {FIX_CPU}   CUDA: {FIX_CUDA}")
    if og and ort and OG_WHEELS[og[0]] != ort[0]:
        raise RuntimeMissingError(
            f"mixed install: {og[0]} needs {OG_WHEELS[og[0]]} but {ort[0]} is installed. "
            f"CPU: {FIX_CPU}   CUDA: {FIX_CUDA}"
        )


@functools.cache
def import_ort():
    """Return the ``onnxruntime`` module, or raise a one-line install hint."""
    check_install()
    try:
        import onnxruntime
    except ImportError as e:
        raise RuntimeMissingError(
            f"onnxruntime is not installed ({e}); install it with: pip install 'ortevals[cpu]' "
            "(or 'ortevals[cuda]' for NVIDIA GPUs)"
        ) from None
    return onnxruntime


@functools.cache
def import_og():
    """Return the ``onnxruntime_genai`` module, or raise a one-line install hint."""
    check_install()
    try:
        import onnxruntime_genai
    except ImportError as e:
        raise RuntimeMissingError(
            f"onnxruntime-genai is not installed ({e}); install it with: pip install 'ortevals[cpu]' "
            "(or 'ortevals[cuda]' for NVIDIA GPUs)"
        ) from None
    return onnxruntime_genai


@functools.cache
def load_cuda_libraries() -> None:
    """``onnxruntime.preload_dlls()``, once a process, before the first CUDA session or Generator.

    onnxruntime-gpu's CUDA and cuDNN come as the ``nvidia-*`` pip packages, which the dynamic loader does not
    search: without this (or torch imported first, or LD_LIBRARY_PATH naming them) the CUDA provider fails to
    load and the session would fall back to the CPU (runtime/opening.py stops there). onnxruntime-genai's CUDA
    provider then finds the same libraries already loaded. A CPU onnxruntime returns at once; what it prints
    goes to the log. Changes no number."""
    ort = import_ort()
    if not hasattr(ort, "preload_dlls"):  # onnxruntime < 1.21
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            ort.preload_dlls()
    except Exception as e:  # noqa: BLE001 - a failed preload leaves the loader's own search: the session says
        log.warning("onnxruntime.preload_dlls() failed: %s", first_line(e))
    for line in said.getvalue().splitlines():
        log.info("onnxruntime.preload_dlls(): %s", line.strip())


def available_providers() -> list[str]:
    """onnxruntime's available execution providers, in its priority order."""
    return list(import_ort().get_available_providers())
