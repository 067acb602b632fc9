"""What a real `ortevals` process prints on stderr: no third-party noise, and our own warnings intact."""

import os
import subprocess
import sys

REPO_CARD = "Repo card metadata block was not found"


def ortevals(tmp_path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_VERBOSITY", "LMEVAL_LOG_LEVEL")}
    env["ORTEVALS_CACHE"] = str(tmp_path / "cache")  # a store of our own, so the rerun resumes from the first run
    proc = subprocess.run([sys.executable, "-m", "ortevals.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def bundled(tiny_pkg, tmp_path) -> list[str]:
    # the tiny model's 1024-token context is shorter than MMLU-Pro prompts: truncate as lm-eval's hf does
    return ["--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2", "--output", str(tmp_path / "out"),
            "--truncate", "left"]


def test_mmlu_pro_on_bundled_data_prints_no_repo_card_warning_and_ours_still_show(tiny_pkg, tmp_path):
    first = ortevals(tmp_path, "mmlu-pro", *bundled(tiny_pkg, tmp_path))
    again = ortevals(tmp_path, "mmlu-pro", *bundled(tiny_pkg, tmp_path))
    for proc in (first, again):
        assert REPO_CARD not in proc.stderr, proc.stderr[-2000:]
    assert "resuming:" not in first.stderr
    # our own WARNING-level log lines are not hidden along with the hub's message (left truncation here), and
    # the resume notice is a plain line, not a warning (issue 22)
    assert "WARNING ortevals.integrations.lm: truncate=left" in first.stderr, first.stderr[-2000:]
    assert "\nresuming: 19 of 19 loglikelihood requests" in again.stderr, again.stderr[-2000:]


def test_run_on_bundled_data_prints_no_repo_card_warning(tiny_pkg, tmp_path):
    proc = ortevals(tmp_path, "run", "--tasks", "leaderboard_mmlu_pro", *bundled(tiny_pkg, tmp_path))
    assert REPO_CARD not in proc.stderr, proc.stderr[-2000:]
