"""Run ortevals on the lowest versions pyproject.toml allows (its lower bounds turned into ``==``).

A virtual environment layered over the running environment's packages (its own site-packages first, then
every site directory of the interpreter running this script: a venv's, a conda env's or the system's, through
a ``.pth`` file; ``--system-site-packages`` alone would reach only a venv's base interpreter) gets only the pins
whose installed version differs, plus, unpinned, every installed package of ortevals' dependency closure whose own
requirements the pins break (pandas needing a newer numpy, datasets a newer pyarrow), so pip picks versions of
those that go with the pins. Then a smoke run there: ``mmlu-pro`` on a package (log-likelihoods, the canary,
calibration's scipy bootstrap, the results files) and ``mmlu-pro --cot --samples 2`` (raw sampling, the
cascade graph's check, scaling curves, compute.png), and onnxruntime-genai's path (``gen_path=og``, its
search options read back). Exits non-zero on the first failure, naming it.

    python scripts/lowest_pins.py --pkg PKG --venv /tmp/lowest [--extras cpu] [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import site
import subprocess
import sys
import time
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent


def lowest_pins(pyproject: Path, extras: tuple[str, ...] = ("cpu",)) -> dict[str, str]:
    """name -> the lowest version each runtime requirement allows (its ``>=`` bound); extras' too."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for e in extras for r in project["optional-dependencies"][e]]
    pins = {}
    for r in reqs:
        lows = [s.version for s in r.specifier if s.operator in (">=", "==", "~=")]
        if not lows:
            raise SystemExit(f"{pyproject}: {r} has no lower bound; expected name>=VERSION")
        pins[canonicalize_name(r.name)] = max(lows, key=Version)
    return pins


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def closure(names: list[str]) -> set[str]:
    """The installed distributions ``names`` need, transitively (extras left out)."""
    seen, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or installed(name) is None:
            continue
        seen.add(name)
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def broken_by(pins: dict[str, str], names: set[str]) -> list[str]:
    """Installed packages among ``names`` (not pinned) whose requirements the pins do not satisfy."""
    out = []
    for name in sorted(names - set(pins)):
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            pinned = pins.get(canonicalize_name(req.name))
            if pinned is not None and not req.specifier.contains(pinned, prereleases=True):
                out.append(name)
                break
    return out


def install_args(pins: dict[str, str]) -> list[str]:
    """What the venv's pip installs: each pin whose installed version differs, and the packages they break."""
    differ = [f"{n}=={v}" for n, v in pins.items() if installed(n) is None or Version(installed(n)) != Version(v)]
    return differ + broken_by(pins, closure(["ortevals", *pins]))


def site_dirs() -> list[str]:
    """The running interpreter's site directories, in its own order: a venv's site-packages (and its base's when
    it was made with ``--system-site-packages``), a conda env's, the system's, and the user's where it is on."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def make_venv(venv: Path, pip: bool = True) -> Path:
    """A virtual environment at ``venv`` that sees the running environment's packages below its own; returns its
    interpreter. ``venv --system-site-packages`` from inside a venv reaches only the base interpreter's packages,
    so a ``.pth`` file adds each of ``site_dirs()`` with ``site.addsitedir`` (their own ``.pth`` files, editable
    installs among them, processed too). What pip installs into the new venv comes first on ``sys.path``.
    ``pip=False``: no pip of its own (a test's faster venv)."""
    python = venv / "bin" / "python"
    if not python.exists():
        no_pip = [] if pip else ["--without-pip"]
        run([sys.executable, "-m", "venv", "--system-site-packages", *no_pip, str(venv)], dict(os.environ), "venv")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in site_dirs()]
    (Path(purelib) / "zz_lowest_pins_layer.pth").write_text("\n".join(lines) + "\n")
    return python


def run(cmd: list[str], env: dict, what: str) -> None:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(f"{what}: exit {proc.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        raise SystemExit(f"{what} failed on the lowest pins:\n" + "\n".join(tail))


def smoke(python: Path, pkg: Path, work: Path, env: dict) -> None:
    """The runs named in the module docstring, each a fresh process of the venv's interpreter."""
    base = [str(python), "-m", "ortevals.cli", "mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "2",
            "--truncate", "left", "--no-resume"]
    run(base + ["--output", str(work / "mc")], env, "mmlu-pro (log-likelihood, calibration)")
    run(base + ["--cot", "--max-gen-toks", "8", "--samples", "2", "--output", str(work / "cot")], env,
        "mmlu-pro --cot --samples 2 (raw sampling, cascade check, scaling)")
    run(base + ["--cot", "--max-gen-toks", "8", "--model-args", "gen_path=og", "--output", str(work / "og")], env,
        "mmlu-pro --cot gen_path=og (onnxruntime-genai)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pkg", type=Path, required=True, help="a GenAI package (the tiny fixture, or the example)")
    p.add_argument("--venv", type=Path, required=True, help="where the environment goes (made if missing)")
    p.add_argument("--extras", default="cpu")
    p.add_argument("--dry-run", action="store_true", help="print what would be installed, and stop")
    a = p.parse_args()
    pins = lowest_pins(REPO / "pyproject.toml", tuple(x for x in a.extras.split(",") if x))
    args = install_args(pins)
    print("lowest pins:", " ".join(f"{n}=={v}" for n, v in pins.items()))
    print("installing:", " ".join(args) or "nothing (every pin is the installed version)", flush=True)
    if a.dry_run:
        return
    python = make_venv(a.venv)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    if args:
        run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], env, "pip install")
    check = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
             f"{sorted(pins)!r}}}))")
    proc = subprocess.run([str(python), "-c", check], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"the venv at {a.venv} cannot read the pinned packages' versions: {last}")
    got = proc.stdout
    wrong = {n: v for n, v in __import__("json").loads(got).items() if Version(v) != Version(pins[n])}
    if wrong:
        raise SystemExit(f"the venv did not get the lowest pins: {wrong}")
    print("venv versions:", re.sub(r"\s+", " ", got.strip()), flush=True)
    smoke(python, a.pkg, a.venv / "runs", env)


if __name__ == "__main__":
    main()
