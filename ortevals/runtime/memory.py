"""How much memory there is where a session keeps its tensors (the raw path's decode budget and cascade choice,
run/run.py; ``ortevals profile``'s batch estimate).

Owns two readings: :func:`free_bytes` (what is free now) and :func:`total_bytes` (what the device holds: the
same on every run on one machine, so a plan sized by it is a function of the run's scope). On the host, the
kernel's ``MemAvailable`` / ``MemTotal`` (``/proc/meminfo``; psutil where there is no ``/proc``); on a CUDA (or
ROCm) device, ``cudaMemGetInfo`` (``hipMemGetInfo``) through ctypes on the runtime library onnxruntime's
provider already loaded (``/proc/self/maps``), else the one the loader finds by name. None where nothing can
be read (DirectML, no runtime library): the caller then says so and uses a fixed budget.

The device figure is what the driver reports free. Memory onnxruntime's own arena holds but is not
using counts as used there (the arena never hands it back), so the reading errs low, never high.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)
# runtime library names by device kind, most recent first; the loaded one wins (/proc/self/maps)
GPU_RUNTIMES = (("libcudart.so", "cuda", ("libcudart.so.13", "libcudart.so.12", "libcudart.so")),
                ("libamdhip64.so", "hip", ("libamdhip64.so.6", "libamdhip64.so")))


def free_bytes(device: str, device_id: int = 0) -> int | None:
    """Bytes free on ``device`` ("cpu", "cuda", …) number ``device_id``; None when unknown."""
    if device == "cpu":
        return host_available()
    if device == "cuda":
        return gpu_free(device_id)
    return None


def total_bytes(device: str, device_id: int = 0) -> int | None:
    """Bytes ``device`` ("cpu", "cuda", …) number ``device_id`` holds in all; None when unknown."""
    if device == "cpu":
        return host_available("MemTotal:")
    if device == "cuda":
        found = _gpu_info(device_id)
        _gpu_runtime.cache_clear()  # read when a run opens, maybe before onnxruntime loads its own runtime
        return None if found is None else found[1]
    return None


def host_available(field: str = "MemAvailable:", meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's available memory (MemAvailable: free + reclaimable page cache; ``field`` MemTotal: all of it),
    in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    found = psutil.virtual_memory()
    return int(found.available if field == "MemAvailable:" else found.total)


def gpu_free(device_id: int = 0) -> int | None:
    """Free bytes of GPU ``device_id`` by the CUDA (or HIP) runtime; the current device is restored."""
    found = _gpu_info(device_id)
    return None if found is None else found[0]


def _gpu_info(device_id: int = 0) -> tuple[int, int] | None:
    """(free, total) bytes of GPU ``device_id``; the current device is restored."""
    lib = _gpu_runtime()
    if lib is None:
        return None
    handle, prefix = lib
    free, total, current = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int()
    try:
        if getattr(handle, f"{prefix}GetDevice")(ctypes.byref(current)) != 0:
            return None
        if getattr(handle, f"{prefix}SetDevice")(ctypes.c_int(device_id)) != 0:
            return None
        try:
            rc = getattr(handle, f"{prefix}MemGetInfo")(ctypes.byref(free), ctypes.byref(total))
        finally:
            getattr(handle, f"{prefix}SetDevice")(current)
    except (AttributeError, OSError) as e:
        log.info("GPU free memory: %s runtime unusable (%s)", prefix, e)
        return None
    return (int(free.value), int(total.value)) if rc == 0 else None


@functools.lru_cache(maxsize=1)
def _gpu_runtime():
    """(ctypes handle, symbol prefix) of the GPU runtime already in this process, else one found by name."""
    maps = _loaded_libraries()
    for stem, prefix, names in GPU_RUNTIMES:
        for path in [p for p in maps if Path(p).name.startswith(stem)] + list(names):
            try:
                return ctypes.CDLL(path), prefix
            except OSError:
                continue
    return None


def _loaded_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if line.split() and line.split()[-1].startswith("/")}
    return sorted(p for p in paths if ".so" in Path(p).name)
