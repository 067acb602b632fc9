"""ortevals inside Olive workflows: `olive run --config configs/…` end to end on the tiny fixtures."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("olive")
REPO = Path(__file__).resolve().parent.parent
LIMIT = 4


def olive_run(work: Path, name: str, cfg: dict, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    path = work / f"{name}.json"
    cfg["cache_dir"] = str(work / ".olive-cache")
    cfg["output_dir"] = str(work / f"out-{name}")
    path.write_text(json.dumps(cfg))
    # offline, Olive's telemetry waits 10 s at exit for an export that cannot happen
    env = {**os.environ, "OLIVE_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-m", "olive", "run", "--config", str(path), *extra], cwd=work,
                          capture_output=True, text=True, timeout=900, env=env)
    return proc, read_metrics(Path(cfg["output_dir"]))


def read_metrics(out: Path) -> dict | None:
    """The input model's metrics from Olive's output folder."""
    for f in sorted(out.rglob("*.json")):
        try:
            body = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        found = _find_metrics(body)
        if found:
            return found
    return None


def _find_metrics(node) -> dict | None:
    if isinstance(node, dict):
        flat = {k: v.get("value") for k, v in node.items()
                if isinstance(v, dict) and isinstance(v.get("value"), (int, float)) and "higher_is_better" in v}
        if flat:
            return flat
        for v in node.values():
            if (hit := _find_metrics(v)) is not None:
                return hit
    elif isinstance(node, list):
        for v in node:
            if (hit := _find_metrics(v)) is not None:
                return hit
    return None


@pytest.fixture()
def work(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    return tmp_path


def config(name: str, model_path: Path, **evaluator) -> dict:
    cfg = json.loads((REPO / "configs" / name).read_text())
    cfg["input_model"]["model_path"] = str(model_path)
    # MMLU-Pro prompts exceed the tiny model's 1024-token context: left-truncate as lm-eval's hf does
    cfg["evaluators"]["ortevals"].update({"truncate": "left", **evaluator})
    return cfg


def ortevals_accuracy(pkg: Path, limit: int) -> float:
    from click.testing import CliRunner

    from ortevals.cli import cli

    out = pkg.parent / f"cli-{limit}"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", str(limit),
                                      "--output", str(out), "--no-resume", "--truncate", "left"])
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text())["results"]["leaderboard_mmlu_pro"]["acc,none"]


def test_evaluate_package_config_equals_the_cli(work, tiny_pkg):
    proc, metrics = olive_run(work, "eval", config("evaluate_package.json", tiny_pkg, limit=LIMIT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    acc = next(v for k, v in metrics.items() if k.endswith("-acc") or k.endswith("acc"))
    assert acc == pytest.approx(ortevals_accuracy(tiny_pkg, LIMIT), abs=1e-12)
    assert any("stderr" in k for k in metrics)


def test_build_and_evaluate_config_runs(work, tiny):
    """OrtEvalsModelBuilder (found through configs/olive_package.json) builds, then OrtEvalsEvaluator scores."""
    cfg = config("build_and_evaluate.json", tiny[0], limit=2)
    proc, metrics = olive_run(work, "build", cfg, "--package-config", str(work / "configs" / "olive_package.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert metrics and any("acc" in k for k in metrics)
    built = list((work / "out-build").rglob("genai_config.json"))
    assert built, "the ModelBuilder pass wrote no package"


def test_build_without_an_execution_provider_is_refused(work, tiny):
    """Olive asks no provider of a pass outside olive.passes.onnx; the pass refuses rather than build for CPU."""
    cfg = config("build_and_evaluate.json", tiny[0], limit=2)
    cfg["systems"]["local_system"]["accelerators"] = [{"device": "cpu"}]
    proc, metrics = olive_run(work, "noep", cfg, "--package-config", str(work / "configs" / "olive_package.json"))
    assert proc.returncode != 0 and metrics is None
    assert "OrtEvalsModelBuilder: no execution provider for the build" in proc.stderr
    assert not list((work / "out-noep").rglob("genai_config.json"))


def test_evaluation_error_fails_the_workflow(work, tiny_pkg):
    proc, metrics = olive_run(work, "bad", config("evaluate_package.json", tiny_pkg, data=str(work / "missing")))
    assert proc.returncode != 0
    assert "data folder not found" in proc.stderr + proc.stdout
    assert metrics is None


def test_changed_limit_is_never_served_from_olive_cache(work, tiny_pkg):
    """clean_evaluation_cache (set in the shipped configs) keeps Olive from reusing a stale evaluation."""
    accs = {}
    for limit in (2, 9):
        proc, metrics = olive_run(work, f"cache{limit}", config("evaluate_package.json", tiny_pkg, limit=limit))
        assert proc.returncode == 0, proc.stderr[-2000:]
        accs[limit] = metrics
    assert accs[2] != accs[9]
    for limit, metrics in accs.items():
        acc = next(v for k, v in metrics.items() if k.endswith("acc"))
        assert acc == pytest.approx(ortevals_accuracy(tiny_pkg, limit), abs=1e-12)


def test_import_ortevals_needs_no_olive():
    code = ("import sys, ortevals, ortevals.cli, ortevals.integrations.lm; "
            "print('olive' in sys.modules or 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.stdout.strip() == "False"


SHIM_PROBE = """
import sys
from olive.passes.onnx.model_builder import ModelBuilder
from onnxruntime_genai.models import builder

patch_quant, create_model = ModelBuilder.__dict__["maybe_patch_quant"], builder.create_model
import ortevals.integrations.olive, ortevals.integrations.olive_builder
from ortevals.integrations.olive_builder import builder_api

untouched = ModelBuilder.__dict__["maybe_patch_quant"] is patch_quant and builder.create_model is create_model
with builder_api():
    inside = builder.create_model is not create_model
try:
    with builder_api():
        raise KeyError("boom")
except KeyError:
    pass
restored = builder.create_model is create_model
print(untouched, inside, restored)
"""


def test_import_patches_nothing_and_the_builder_shim_is_scoped():
    """Importing ortevals.integrations.olive leaves Olive's ModelBuilder and the builder's create_model as they were;
    the shim replaces create_model only inside builder_api() and restores it on exit, also on error."""
    out = subprocess.run([sys.executable, "-c", SHIM_PROBE], capture_output=True, text=True, env=os.environ,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr[-2000:]


def test_an_unknown_evaluator_key_stops_the_workflow_naming_the_closest(work, tiny_pkg):
    """Olive hands keys it does not know to the evaluator; "limt" ran the whole benchmark before (issue 22)."""
    from ortevals.errors import OrtEvalsError
    from ortevals.integrations.olive import OrtEvalsEvaluator

    with pytest.raises(OrtEvalsError, match=r"unknown key 'limt' in the evaluator config \(did you mean 'limit'\?\)"):
        OrtEvalsEvaluator(tasks=["mmlu-pro"], limt=5)
    cfg = config("evaluate_package.json", tiny_pkg)
    cfg["evaluators"]["ortevals"].pop("limit", None)
    cfg["evaluators"]["ortevals"]["limt"] = 5
    proc, metrics = olive_run(work, "typo", cfg)
    assert proc.returncode != 0 and metrics is None
    assert "unknown key 'limt' in the evaluator config (did you mean 'limit'?)" in proc.stderr + proc.stdout
