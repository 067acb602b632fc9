"""scripts/gpu/probe.py, the first GPU command, run here with ``--ep cpu``: every call it makes on the device
runs on the CPU too, so on the GPU only the device can fail it; a package that cannot run fails its lines
(and only those), with exit status 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALLS = ("ortvalue_from_shape_and_type", "update_inplace + numpy()", "data_ptr", "IOBinding by pointer into a buffer",
         "replicate expand", "replicate gather", "replicate narrow", "replicate copy", "replicate fit",
         "replicate zero", "free device memory", "decoder session, no node on the CPU",
         "derived scoring graph (float64 sums), no node on the CPU", "derived scores = full logits",
         "attention at 12 new shapes", "cascade graph = plain sessions at 1024 tokens",
         # scripts/gpu/probe_scoring.py (issue 46)
         "GroupQueryAttention, two rows of new tokens on a past", "GroupQueryAttention takes query_seqlens",
         "shared-prefix graph = one pass a row", "one attention layer, plain ops against the kernel",
         "CUDA graph on the decoder", "PagedAttention kernel", "zeros from one session read by another at once")


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "gpu" / "probe.py"), "--ep", "cpu", *args],
                          capture_output=True, text=True, timeout=900)


def verdicts(proc) -> dict[str, str]:
    return {ln.split(": ", 1)[0][5:]: ln[:4] for ln in proc.stdout.splitlines() if ln[:4] in ("PASS", "FAIL")}


def test_probe_passes_every_call_on_the_cpu_with_its_own_tiny_package(fixture_cache):
    proc = probe("--work", str(fixture_cache / "gpu-probe"))  # scripts/gpu/tinypkg.py's fp32 package, cached
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdicts(proc) == dict.fromkeys(CALLS, "PASS")


def test_a_package_the_provider_cannot_run_fails_its_lines_only(fixture_cache, tmp_path, capsys):
    """The Qwen3 CUDA package on the CPU (its GroupQueryAttention takes q/k norms the CPU kernel refuses):
    the device calls pass, the decoder's lines fail, exit 1."""
    from tests.test_gpu_packages import build

    proc = probe("--work", str(tmp_path), "--pkg", str(build(fixture_cache, "qwen3", "fp16", capsys)))
    assert proc.returncode == 1
    got = verdicts(proc)
    assert set(got) == set(CALLS) and all(got[c] == "PASS" for c in CALLS[:11])
    assert got["decoder session, no node on the CPU"] == "FAIL" and "q_norm_weight" in proc.stdout
