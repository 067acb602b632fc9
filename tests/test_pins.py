"""Issue 38 item 7: installs that break. Every lower bound of pyproject.toml is a version ortevals runs on, and
every optional module a test needs is installed by CI (scripts/install.sh: the cpu, dev and lmms extras).

The lowest-pins run installs from PyPI (CI and the developer machines reach it): about 1 minute with pip's
cache warm, 3 to 4 minutes cold, on 2 cores (docs: README, "Install"). Python 3.11+ (tomllib)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from lowest_pins import lowest_pins, make_venv  # noqa: E402

# what a test skips on -> the distribution that provides it, where the names differ
PROVIDES = {"olive": "olive-ai", "lmms_eval": "lmms-eval", "skimage": "scikit-image"}


def test_every_requirement_has_a_lower_bound():
    pins = lowest_pins(REPO / "pyproject.toml")
    assert pins["scipy"] == "1.15.0" and pins["onnxruntime-genai"] == "0.12.0" and pins["onnxruntime"] == "1.28.0"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("cuda", "olive", "torch", "ray", "dev"):
        lowest_pins(REPO / "pyproject.toml", (extra,))  # raises on a requirement without one
    assert all(Requirement(r).specifier for r in project["dependencies"])


def test_every_module_a_test_skips_on_is_installed_by_ci():
    """A test that skips where a module is missing is skipped for ever if CI does not install it (statsmodels was
    not: the clustered interval was never checked against cluster-robust OLS). CI installs the cpu, dev and lmms
    extras (scripts/install.sh); the standard library needs nothing."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *(r for e in ("cpu", "dev", "lmms") for r in extras[e])]
    installed_by_ci = {canonicalize_name(Requirement(r).name) for r in wanted}
    missing = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args:
                module = node.args[0].value.split(".")[0]
                if module in sys.stdlib_module_names:
                    continue
                dist = canonicalize_name(PROVIDES.get(module, module))
                if dist not in installed_by_ci:
                    missing.append(f"{path.name}: {module}")
    assert not missing, f"tests skip on modules CI does not install: {missing}"


def test_lowest_pins_venv_sees_the_packages_of_the_venv_running_it(tmp_path):
    """Issue 49 item 0: run from inside a virtual environment (the README's install in a venv), the lowest-pins venv
    saw the base interpreter's packages, not the running venv's: no lm-eval, a traceback. A distribution that
    only the outer venv holds must be visible in the venv make_venv builds from there, and a pin installed into
    the new venv must come first."""
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    # the outer venv: this environment (run from a venv or not) plus a distribution of its own
    purelib = subprocess.run([str(make_venv(outer, pip=False)), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dist = Path(purelib) / "only_in_outer-1.5.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: only-in-outer\nVersion: 1.5\n")
    (Path(purelib) / "only_in_outer.py").write_text("WHERE = 'outer'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO / "scripts")}
    code = f"from pathlib import Path; from lowest_pins import make_venv; make_venv(Path({str(inner)!r}), pip=False)"
    made = subprocess.run([str(outer / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    python = inner / "bin" / "python"
    inner_lib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (Path(inner_lib) / "only_in_outer.py").write_text("WHERE = 'inner'\n")  # as if pip installed a pin here
    probe = ("import importlib.metadata as m, only_in_outer, packaging; "
             "print(m.version('only-in-outer'), only_in_outer.WHERE)")
    got = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["1.5", "inner"]


@pytest.mark.slow
def test_ortevals_runs_on_the_lowest_pins(tiny_pkg, tmp_path):
    """The core and cpu lower bounds turned into == in a virtual environment over this one's packages (only the
    pins that differ, and what they break, are installed), then mmlu-pro, --cot --samples 2 and gen_path=og on
    the tiny package (scripts/lowest_pins.py). On the pins before (scipy 1.11, onnxruntime-genai 0.9, onnxruntime
    1.22, tokenizers 0.19) it fails: tokenizers 0.19 cannot read the builder's tokenizer.json, onnxruntime
    before 1.28 the derived graph's weights, scipy before 1.15 bootstrap's rng=, onnxruntime-genai before 0.12
    get_search_options."""
    env = {**os.environ, "ORTEVALS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "lowest_pins.py"), "--pkg", str(tiny_pkg),
                           "--venv", str(tmp_path / "venv")], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "mmlu-pro --cot gen_path=og (onnxruntime-genai): exit 0" in proc.stdout, proc.stdout
    for name, version in lowest_pins(REPO / "pyproject.toml").items():
        assert f'"{name}": "{version}"' in proc.stdout, (name, proc.stdout)


def test_dev_extras_are_what_runs_here():
    """The dev extra's bounds are versions this suite runs with: none above what is installed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for text in project["optional-dependencies"]["dev"]:
        req = Requirement(text)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            continue  # not installed here (statsmodels before CI's install): the skip test above covers it
        assert req.specifier.contains(have, prereleases=True), f"{req} but {have} is installed"


@pytest.mark.parametrize("have", [False, True])
def test_install_script_says_each_step_before_it_runs(tmp_path, have):
    """Issue 49 item 16: scripts/install.sh was silent for 3 minutes. With a stand-in `python` on PATH that echoes
    what it is asked to run (torch and torchvision importable or not), every pip command is preceded by its own
    step line, the steps count up to 5/5, and the last line says what to run next."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then exit {0 if have else 1}; fi\necho \"RAN $*\"\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True, text=True,
                          env={"PATH": f"{fake.parent}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("install.sh [")]
    assert [s.split("]")[0] for s in steps] == [f"install.sh [{i}/5" for i in range(1, 6)]
    for i, line in enumerate(lines):
        if line.startswith("RAN"):
            assert lines[i - 1].startswith("install.sh ["), (line, lines)
    assert sum(line.startswith("RAN") for line in lines) == (2 if have else 4)
    assert "pytest" in lines[-1]
