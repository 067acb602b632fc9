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


def full_disk(monkeypatch, where, free: int = 2**20):
    """``shutil.disk_usage`` reporting ``free`` bytes on the disk of ``where`` (the real figure elsewhere)."""
    import shutil

    real = shutil.disk_usage

    def usage(path):
        got = real(path)
        return got._replace(free=free) if str(path).startswith(str(where)) else got

    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_a_full_disk_is_refused_before_the_work_naming_the_folder(tmp_path, monkeypatch, tiny_int4, tiny_pkg):
    """Issue 49 item 7: with the output's disk full, mmlu-pro --output, compare --report and diagnose --output
    ran their work and ended `internal error OSError: [Errno 28]` with no path; now one line each, before any
    model or run is read (the packages and runs here do not exist, or would be measured first)."""
    full = tmp_path / "full"
    full_disk(monkeypatch, full)
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", "--output", str(full / "a")),
                          f"--output {full / 'a'}: 1.0 MiB free on its disk, and this command writes up to 16 MiB")
    assert_one_line_error(run("compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "run"), "--report",
                              str(full / "b")), f"--report {full / 'b'}: 1.0 MiB free on its disk")
    assert_one_line_error(run("diagnose", "--pkg", str(tiny_int4), "--ref", str(tiny_pkg), "--output",
                              str(full / "c")), f"--output {full / 'c'}: 1.0 MiB free on its disk")
    assert not any(p.is_file() for p in full.rglob("*"))


def test_a_disk_that_fills_during_the_writes_is_one_line_and_nothing_half_written(tiny_pkg, tmp_path, monkeypatch):
    """Issue 49 item 7: the disk filling while the run's files are written (after the work): one line naming
    --output and the file, exit 2, the earlier files exactly as they were and no temp file left."""
    out = tmp_path / "run"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    real = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(str(out)) and ".samples_" in target:
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    failed = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
                 "--no-resume", "--output", str(out))
    assert failed.exit_code == 2 and "Traceback" not in failed.output, failed.output
    last = failed.output.strip().splitlines()[-1]
    assert last.startswith(f"Error: --output {out}: could not write samples_leaderboard_mmlu_pro.jsonl (No space "
                           "left on device); nothing of this set was written there"), failed.output
    assert snapshot(out) == EARLIER
