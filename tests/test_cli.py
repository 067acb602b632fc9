"""The command line: end to end on real MMLU-Pro data, and one clear line for every bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import OrtEvalsError
from ortevals.presets import BUNDLED

REPO = Path(__file__).resolve().parent.parent


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0]


def test_info_describes_layers_and_providers(tiny_pkg):
    result = run("info", "--pkg", str(tiny_pkg))
    assert result.exit_code == 0, result.output
    assert "layers 0-1" in result.output and "[B, 2, past, 16]" in result.output
    assert "CPUExecutionProvider" in result.output


def test_help_has_examples():
    result = run("mmlu-pro", "--help")
    assert result.exit_code == 0 and "Examples:" in result.output and "--example" in result.output


@pytest.mark.parametrize("breaker,needles", [
    (lambda p: (p / "genai_config.json").unlink(), ["genai_config.json: not found"]),
    (lambda p: (p / "genai_config.json").write_text("{"), ["genai_config.json: invalid JSON"]),
    (lambda p: (p / "model.onnx").unlink(), ["model.decoder.filename='model.onnx' not found"]),
    (lambda p: (p / "genai_config.json").write_text(
        (p / "genai_config.json").read_text().replace('"model.onnx"', '"../../model.onnx"')), ["escapes"]),
])
def test_bad_package_exits_2_with_one_line(tiny_pkg, copy_pkg, breaker, needles):
    pkg = copy_pkg(tiny_pkg)
    breaker(pkg)
    for command in ("info", "mmlu-pro"):
        args = [command, "--pkg", str(pkg)] + (["--data", "bundled"] if command == "mmlu-pro" else [])
        assert_one_line_error(run(*args), *needles)


def test_unknown_and_missing_providers(tiny_pkg):
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--ep", "tpu"),
                          "unknown execution provider 'tpu'")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--ep", "cuda"),
                          "'cuda'", "not available")


def test_bad_data_folder(tiny_pkg, tmp_path):
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(tmp_path / "x")),
                          "data folder not found")
    (tmp_path / "data").mkdir()
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(tmp_path)), "no test split")


def test_offline_hub_without_data_says_what_to_do(tiny_pkg):
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--limit", "1")
    assert_one_line_error(result, "--data")


def test_other_tasks_on_local_or_bundled_data_are_one_line(tiny_pkg, tmp_path):
    """Issue 49 items 9 and 15: `run --data bundled --tasks arc_easy` (the flag the offline message recommended)
    was `internal error ValueError: BuilderConfig 'ARC-Easy' not found`; a local copy of another data set said the
    same; offline, arc_easy's message recommended the MMLU-Pro copy."""
    assert_one_line_error(run("run", "--pkg", str(tiny_pkg), "--data", "bundled", "--tasks", "arc_easy", "--limit",
                              "1"), "--data bundled holds MMLU-Pro only", "arc_easy reads allenai/ai2_arc")
    shutil.copytree(BUNDLED / "mmlu_pro" / "data", tmp_path / "copy" / "data")
    assert_one_line_error(run("run", "--pkg", str(tiny_pkg), "--data", str(tmp_path / "copy"), "--tasks", "arc_easy",
                              "--limit", "1"), f"--data {tmp_path / 'copy'}: arc_easy read the configuration "
                                               "'ARC-Easy' of a data set this folder is not a copy of")
    offline = run("run", "--pkg", str(tiny_pkg), "--tasks", "arc_easy", "--limit", "1")
    assert_one_line_error(offline, "task arc_easy reads allenai/ai2_arc (configuration ARC-Easy) from the Hugging Face "
                                   "hub, which is offline", "--data PATH")
    assert "bundled" not in offline.output


def test_no_package_given():
    assert_one_line_error(run("mmlu-pro", "--data", "bundled"), "--pkg")


def test_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ortevals.cli", "info", "--pkg", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "genai_config.json" in proc.stderr


def test_mmlu_pro_on_tiny_package_writes_outputs(tiny_pkg, tmp_path):
    out = tmp_path / "run"
    # MMLU-Pro prompts (~1800 tiny-tokenizer tokens) exceed the tiny model's 1024 context: truncate as hf does
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "3", "--output", str(out),
                 "--no-resume", "--truncate", "left")
    assert result.exit_code == 0, result.output
    assert "req/s" in result.output and "business" in result.output
    body = json.loads((out / "results.json").read_text())
    samples = [json.loads(ln) for ln in (out / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["resps"]) == len(s["doc"]["options"]) for s in samples)
    assert body["ortevals"]["questions"] == 3
    assert body["ortevals"]["requests"] == sum(len(s["resps"]) for s in samples)


def site_without_torch(folder: Path) -> Path:
    """A copy (as links) of site-packages without torch and what needs it, as a torch-free install has."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("torch", "functorch", "olive")):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.parametrize("extra", [[], ["--cot", "--max-gen-toks", "4"]], ids=["prefill", "generation"])
def test_runs_without_torch(tiny_pkg, tmp_path, extra):
    """Both scoring paths end to end where torch is not installed (`pip install 'ortevals[cpu]'`)."""
    site = site_without_torch(tmp_path / "site")
    code = (f"import sys; sys.path[1:1] = [{str(REPO)!r}, {str(site)!r}]; "
            "from ortevals.cli import main; sys.argv[0] = 'ortevals'; main()")
    # -S: the real site-packages (and its .pth files) stay off sys.path
    proc = subprocess.run([sys.executable, "-S", "-c", code, "mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled",
                           "--limit", "1", "--no-resume", "--truncate", "left", *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "req/s" in proc.stdout and "torch" not in proc.stderr


def test_collector_is_off_while_starting_and_frozen_at_the_first_request(tiny_pkg, monkeypatch):
    """Start-up's objects are frozen (never re-scanned) when the first requests arrive; collection is on from
    then, and on again after the command whatever happened (evaluate.collector_paused)."""
    import gc

    from ortevals import cli as cli_module
    from ortevals.integrations import lm as lm_module
    from ortevals.run.run import Run

    seen, ready, loaded = {}, Run.ready, lm_module.OrtLM.from_package

    def spy_load(*a, **k):
        seen["loading"] = gc.isenabled()
        return loaded(*a, **k)

    def spy_ready(self):  # the first requests' wait for the sessions
        seen.setdefault("first", (gc.isenabled(), gc.get_freeze_count()))
        return ready(self)

    monkeypatch.setattr(lm_module.OrtLM, "from_package", spy_load)
    monkeypatch.setattr(Run, "ready", spy_ready)
    monkeypatch.setattr(cli_module, "OWNS_PROCESS", True)  # as main() sets it
    gc.unfreeze()
    try:
        result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--no-resume",
                     "--truncate", "left")
        assert result.exit_code == 0, result.output
        assert seen["loading"] is False
        enabled, frozen = seen["first"]
        assert enabled and frozen > 10_000  # every module and task built so far
        assert gc.isenabled()
        monkeypatch.setattr(Run, "stored", lambda *a, **k: (_ for _ in ()).throw(OrtEvalsError("boom")))
        failed = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--no-resume",
                     "--truncate", "left")
        assert failed.exit_code == 2 and "Error: boom" in failed.output
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
