"""The GPU as NVML sees it, from outside the measured process: its name and a peak-memory sampler.

Owns :func:`device_info` and :class:`PeakSampler`. The benchmark's backends each run in a child process;
the parent samples NVML every 20 ms while the child runs, so nothing (no torch, no CUDA context) is added
to the measured process. The peak is the child's own
``usedGpuMemory`` where NVML lists processes (per-process accounting), else the device's used memory minus
what was used before the child started (``source`` says which). Without NVML (no GPU, or no
nvidia-ml-py) every figure is None.
"""

from __future__ import annotations

import threading


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: all mean "not measured"
        return None


def device_info(index: int = 0) -> dict:
    """Name, memory and driver of GPU ``index`` (Nones without NVML)."""
    nv = _nvml()
    if nv is None:
        return {"name": None, "memory_mib": None, "driver": None}
    h = nv.nvmlDeviceGetHandleByIndex(index)
    name = nv.nvmlDeviceGetName(h)
    return {"name": name.decode() if isinstance(name, bytes) else name,
            "memory_mib": nv.nvmlDeviceGetMemoryInfo(h).total // (1 << 20),
            "driver": nv.nvmlSystemGetDriverVersion()}


class PeakSampler:
    """``with PeakSampler(pid) as s: …`` then ``s.result()``: peak device MiB of process ``pid``."""

    def __init__(self, pid: int, index: int = 0, every: float = 0.02):
        self.pid, self.every = pid, every
        self.nv = _nvml()
        self.handle = self.nv.nvmlDeviceGetHandleByIndex(index) if self.nv else None
        self.base = self._used() if self.nv else 0
        self.peak_process = self.peak_device = 0
        self.process_seen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        return self.nv.nvmlDeviceGetMemoryInfo(self.handle).used

    def _sample(self) -> None:
        self.peak_device = max(self.peak_device, self._used() - self.base)
        try:
            procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # noqa: BLE001 - some virtual machines refuse per-process queries
            return
        used = [p.usedGpuMemory or 0 for p in procs if p.pid == self.pid]
        if used:
            self.process_seen = True
            self.peak_process = max(self.peak_process, sum(used))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self):
        if self.nv:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.nv:
            self._stop.set()
            self._thread.join()

    def result(self) -> dict:
        if not self.nv:
            return {"peak_device_mib": None, "peak_device_source": None}
        if self.process_seen:
            return {"peak_device_mib": round(self.peak_process / (1 << 20)), "peak_device_source": "nvml-process",
                    "peak_device_delta_mib": round(self.peak_device / (1 << 20))}
        return {"peak_device_mib": round(self.peak_device / (1 << 20)), "peak_device_source": "nvml-device-delta"}

