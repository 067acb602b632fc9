"""Which wheels the GPU machine lacks, and fetching them from PyPI (runs here, with network).

pip resolves the roots (the runtime wheels, lm-eval, ortevals) for the box's python and platform in a dry
run, with the box's known versions as constraints; the kit is every resolved wheel whose name the box's
list (``box_packages.txt``) lacks, plus the roots themselves (onnxruntime-gpu must shadow the box's CPU
onnxruntime, which owns the same module). pip ignores this machine's pip configuration (local indexes,
find-links) so every wheel is PyPI's, with PyPI's sha256. A package PyPI has only as an sdist is built
here into a wheel, which must be pure Python (``py3-none-any``) to run there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from pack import KitError, sha256

INDEX = "https://pypi.org/simple"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
ROOTS = {  # onnxruntime-gpu 1.31 is the CUDA 13 build; onnxruntime-genai-cuda 0.18 needs onnxruntime-gpu >= 1.31
    "gpu": ("onnxruntime-gpu==1.31.1", "onnxruntime-genai-cuda==0.18.0", "lm-eval==0.4.13"),
    "cpu-rehearsal": ("onnxruntime==1.31.1", "onnxruntime-genai==0.18.0", "lm-eval==0.4.13"),
}
NO_DIST = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_box(path: Path) -> dict[str, str | None]:
    """``box_packages.txt``: canonical name → pinned version or None."""
    box = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name.strip()):
            raise KitError(f"{path}:{n}: expected NAME or NAME==VERSION, got {line!r}")
        box[canon(name)] = version.strip() or None
    return box


def installed_versions(names) -> dict[str, str | None]:
    """The versions this interpreter has of ``names`` (the CPU rehearsal's box is this machine)."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m pip`` with this machine's pip configuration switched off (PyPI only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, cwd=cwd)
    return proc


def target_flags(python_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for plat in PLATFORMS:
        flags += ["--platform", plat]
    return flags


def build_ortevals(repo: Path, out: Path) -> tuple[Path, str]:
    """A wheel of ortevals from the repo's committed HEAD (``git archive``: no stray build files); (wheel, commit)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=repo, capture_output=True)
        if archive.returncode != 0:
            raise KitError(f"{repo}: git archive HEAD failed: {archive.stderr.decode().strip()[:200]}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        proc = pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src))
        if proc.returncode != 0:
            raise KitError(f"building the ortevals wheel failed: {_last(proc)}")
    return next(out.glob("ortevals-*.whl")), commit


def build_sdist_wheel(name: str, out: Path) -> None:
    proc = pip("wheel", "--no-deps", "-q", "--index-url", INDEX, "-w", str(out), name)
    if proc.returncode != 0:
        raise KitError(f"{name}: PyPI has no wheel for the box and building one failed: {_last(proc)}")
    built = [p for p in out.glob("*.whl") if canon(p.name.split("-")[0]) == canon(name)]
    if not built or not built[0].name.endswith("-none-any.whl"):
        raise KitError(f"{name}: PyPI has no wheel for the box and the one built here is not pure Python "
                       f"({built[0].name if built else 'none'}): it would not run there")


def resolve(roots: list[str], constraints: dict[str, str], local: Path, python_version: str) -> list[dict]:
    """pip's dry-run install report for ``roots`` on the box's python/platform: one dict per wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        cons = Path(tmp) / "constraints.txt"
        cons.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
        report = Path(tmp) / "report.json"
        for _ in range(12):  # each round builds one sdist-only package PyPI has no wheel for
            proc = pip("install", "--dry-run", "--ignore-installed", "--ignore-requires-python", "-q",
                       "--report", str(report), "--target", str(Path(tmp) / "t"), "--index-url", INDEX,
                       "--find-links", str(local), "-c", str(cons), *target_flags(python_version), *roots)
            if proc.returncode == 0:
                return json.loads(report.read_text())["install"]
            missing = NO_DIST.search(proc.stderr)
            if not missing:
                raise KitError(f"pip could not resolve {' '.join(roots)}: {_last(proc)}")
            build_sdist_wheel(missing.group(1), local)
    raise KitError("pip kept asking for packages that have no wheel; giving up after 12")


def download(entries: list[dict], local: Path, dest: Path, python_version: str) -> list[dict]:
    """Fetch each entry's exact version into ``dest``; check each sha256 against pip's report and each
    wheel's Requires-Python against the box's python. Returns one dict per wheel, in a fixed order."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [f"{e['metadata']['name']}=={e['metadata']['version']}" for e in entries]
    proc = pip("download", "--no-deps", "-q", "--index-url", INDEX, "--find-links", str(local), "-d", str(dest),
               *target_flags(python_version), *specs)
    if proc.returncode != 0:
        raise KitError(f"pip download failed: {_last(proc)}")
    files = {_wheel_key(p.name): p for p in dest.glob("*.whl")}
    wheels = []
    for e in entries:
        name, version = e["metadata"]["name"], e["metadata"]["version"]
        path = files.get((canon(name), version))
        if path is None:
            raise KitError(f"{name}=={version}: pip download left no wheel in {dest}")
        want = e["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        got = sha256(path)
        if want and got != want:
            raise KitError(f"{path.name}: sha256 {got[:16]}… differs from the index's {want[:16]}…")
        _check_python(path, python_version)
        source = ("pypi" if e["download_info"]["url"].startswith("https://") else
                  "this repo" if canon(name) == "ortevals" else "built here from PyPI's sdist")
        wheels.append({"file": path.name, "name": canon(name), "version": version, "sha256": got,
                       "bytes": path.stat().st_size, "source": source})
    return sorted(wheels, key=lambda w: (-w["bytes"], w["file"]))


def _wheel_key(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return canon(name), version


def _check_python(path: Path, python_version: str) -> None:
    from packaging.specifiers import SpecifierSet

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(z.read(meta).decode()).get("Requires-Python")
    if requires and python_version not in SpecifierSet(requires):
        raise KitError(f"{path.name}: requires Python {requires}, the box has {python_version}")


def _last(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else f"exit {proc.returncode}"
