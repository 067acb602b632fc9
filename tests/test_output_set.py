"""Issue 38 item 13: a run's files are one set (the earlier set or the new one, never a mix), and every place a
command will write is checked before the work. Failures are injected at each step of publishing."""

import json
import os

import pytest
from click.testing import CliRunner

from ortevals import files
from ortevals.cli import cli
from ortevals.errors import OrtEvalsError
from tests.test_cli import assert_one_line_error

MISSING_PKG = "/nonexistent/package"


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


EARLIER = {"results.json": b'{"ortevals": {}}', "samples_a.jsonl": b"old a\n", "old.png": b"old plot",
           "notes.txt": b"the user's own file"}
NEW = {"results.json": b'{"ortevals": {"new": 1}}', "samples_a.jsonl": b"new a\n", "samples_b.jsonl": b"new b\n"}


def stage_new(stage):
    for name, data in NEW.items():
        (stage / name).write_bytes(data)


def test_publish_moves_the_set_and_removes_what_it_names(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    with files.staged(out) as stage:
        stage_new(stage)
        published = files.publish(stage, out, "--output", remove=["old.png"])
    assert [p.name for p in published][-1] == "results.json"  # the file a reader trusts moves last
    assert snapshot(out) == {**NEW, "notes.txt": EARLIER["notes.txt"]}  # no staging folder left either


@pytest.mark.parametrize("failing", range(1, 7))
def test_a_failure_at_any_step_leaves_the_earlier_set_exactly(tmp_path, monkeypatch, failing):
    """Six renames publish this set (three moved aside, three moved in, one removal): the n-th one fails."""
    out = tmp_path / "out"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == failing:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OrtEvalsError, match="--output .*: could not write .*No space left on device.*nothing there "
                                            "was changed"):
        with files.staged(out) as stage:
            stage_new(stage)
            files.publish(stage, out, "--output", remove=["old.png"])
    monkeypatch.undo()
    assert snapshot(out) == EARLIER


def test_a_target_that_is_a_folder_changes_nothing(tmp_path):
    out = tmp_path / "out"
    (out / "samples_b.jsonl").mkdir(parents=True)
    (out / "results.json").write_bytes(b"{}")
    with pytest.raises(OrtEvalsError, match="samples_b.jsonl there is a folder"):
        with files.staged(out) as stage:
            stage_new(stage)
            files.publish(stage, out, "--output")
    assert (out / "results.json").read_bytes() == b"{}" and sorted(p.name for p in out.iterdir()) == [
        "results.json", "samples_b.jsonl"]


def test_unwritable_places_are_refused_before_any_work(tmp_path):
    """compare and fidelity: the runs and packages do not exist, so reading them would fail first; the writes
    are checked before."""
    ref, other = str(tmp_path / "ref"), str(tmp_path / "run")
    assert_one_line_error(run("compare", "--ref", ref, other, "--json", "/proc/ortevals.json"),
                          "--json /proc/ortevals.json: not writable")
    assert_one_line_error(run("compare", "--ref", ref, other, "--changed", str(tmp_path)),
                          f"--changed {tmp_path}: is a folder")
    (tmp_path / "report.html").mkdir()
    assert_one_line_error(run("compare", "--ref", ref, other, "--report", str(tmp_path)),
                          f"--report {tmp_path}: report.html there is a folder")
    for flag in ("--json", "--save-ref"):  # fidelity: the package does not exist either
        assert_one_line_error(run("fidelity", "--pkg", MISSING_PKG, "--ref", MISSING_PKG, flag, "/proc/x.out"),
                              f"{flag} /proc/x.out: not writable")
    out = tmp_path / "out"
    (out / "results.json").mkdir(parents=True)
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", "--output", str(out)),
                          f"--output {out}: results.json there is a folder")


def test_a_run_whose_files_cannot_be_published_keeps_the_earlier_set(tiny_pkg, tmp_path, monkeypatch):
    """The run's own results.json refused at the last step: one line, exit 2, the earlier run's files as they
    were (the samples were already in place and go back); the rerun publishes (answers from the store) and says
    which earlier file it removed (item 18: was removed without a line)."""
    out = tmp_path / "run"
    out.mkdir()
    earlier = {"results.json": json.dumps({"ortevals": {}, "configs": {"old_task": {}}}).encode(),
               "samples_old_task.jsonl": b"{}\n", "samples_leaderboard_mmlu_pro.jsonl": b"{}\n"}
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    args = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
            "--output", str(out)]
    env = {"ORTEVALS_CACHE": str(tmp_path / "cache")}
    real = os.rename

    def rename(src, dst):
        if str(dst) == str(out / "results.json") and ".ortevals-new-" in str(src):
            raise OSError(13, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    failed = run(*args, env=env)  # the progress bars of the run come first
    assert failed.exit_code == 2 and "Traceback" not in failed.output, failed.output
    assert failed.output.strip().splitlines()[-1].startswith(
        f"Error: --output {out}: could not write results.json (Permission denied)"), failed.output
    monkeypatch.undo()
    assert snapshot(out) == earlier
    again = run(*args, env=env)
    assert again.exit_code == 0, again.output
    assert f"removed {out / 'samples_old_task.jsonl'}: an earlier run's file" in again.output
    body = json.loads((out / "results.json").read_text())
    assert body["ortevals"]["files"] == ["reliability_leaderboard_mmlu_pro.png", "results.json",
                                         "risk_coverage_leaderboard_mmlu_pro.png", "samples_leaderboard_mmlu_pro.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == body["ortevals"]["files"]
