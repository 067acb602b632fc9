"""The GPU kit (scripts/gpu/): parts and manifest, install into a fresh target that shadows the
site-packages' onnxruntime, its one-line errors, and the CPU run of scripts/bench_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fake_wheel_folder(root: Path, dist: str, version: str) -> None:
    """A folder as pip leaves it: the ``onnxruntime`` package and one wheel's dist-info (never imported)."""
    (root / "onnxruntime").mkdir(parents=True, exist_ok=True)
    (root / "onnxruntime" / "__init__.py").write_text(f"WHO = {dist!r}\n")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def check_install(*path: Path) -> subprocess.CompletedProcess:
    code = "from ortevals.runtime import check_install, installed, ORT_WHEELS\ncheck_install()\n" \
           "print(installed(ORT_WHEELS, 'onnxruntime'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, REPO]))}
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env)


def test_a_shadowed_cpu_onnxruntime_is_not_a_mixed_install(tmp_path):
    """The box keeps onnxruntime 1.30 (CPU) in site-packages; the kit puts onnxruntime-gpu in a folder
    first on sys.path. Only the GPU wheel owns the module that gets imported: no error. The two wheels
    in one folder (one overwrote the other's files) are still refused."""
    target, site = tmp_path / "target", tmp_path / "site"
    fake_wheel_folder(target, "onnxruntime-gpu", "1.31.1")
    fake_wheel_folder(site, "onnxruntime", "1.30.0")
    ok = check_install(target, site)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "['onnxruntime-gpu']"
    fake_wheel_folder(tmp_path / "both", "onnxruntime", "1.30.0")
    (tmp_path / "both" / "onnxruntime_gpu-1.31.1.dist-info").mkdir()
    (tmp_path / "both" / "onnxruntime_gpu-1.31.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.31.1\n")
    mixed = check_install(tmp_path / "both")
    assert mixed.returncode != 0
    assert "onnxruntime and onnxruntime-gpu are both installed" in mixed.stderr
