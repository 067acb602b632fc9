"""Issue 49 (trust, round 4): one line from every front door: lm-eval's command line through ortevals' wrapper
(`python -m ortevals.integrations.lm_eval_plugin`) and Olive's workflow, each bad input ending with its one-line
message as the last line of output, before the front door's own start-up where it can be known."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ortevals.errors import OrtEvalsError
from ortevals.options import parse_model_args
from ortevals.presets import BUNDLED

REPO = Path(__file__).resolve().parent.parent


def lm_eval_cli(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ortevals.integrations.lm_eval_plugin", "run", "--model", "ortevals",
                           *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The output ends with one ``Error:`` line holding ``needles``, exit 2, no traceback."""
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    last = out.splitlines()[-1]
    assert last.startswith("Error: ") and all(n in last for n in needles), last
    return out


def test_lm_eval_route_bad_model_args_are_one_line_before_lm_eval_starts(tiny_pkg):
    """Item 10: every bad --model_args ended a 30-52-line traceback after lm-eval's task loading (~20 s); now the
    wrapper checks them with lm-eval's own parsed arguments before it runs: the only line of output."""
    out = one_line(lm_eval_cli("--model_args", f"pkg={tiny_pkg},threads=four", "--tasks", "arc_easy"),
                   "threads must be an integer, got 'four'")
    assert len(out.splitlines()) == 1 and "Selected Tasks" not in out


def test_lm_eval_route_error_during_the_run_is_the_last_line(tiny_pkg, tmp_path):
    """An ortevals error raised while lm-eval evaluates (a request longer than the tiny model's context) is the
    last line, with no traceback."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    import lm_eval

    source = Path(lm_eval.__file__).parent / "tasks" / "leaderboard" / "mmlu_pro"
    shutil.copy(source / "utils.py", tasks / "utils.py")
    text = (source / "mmlu_pro.yaml").read_text().replace("task: leaderboard_mmlu_pro", "task: local_mmlu_pro")
    lines = [f"dataset_path: {BUNDLED / 'mmlu_pro'}" if ln.startswith("dataset_path:") else ln
             for ln in text.splitlines()]
    (tasks / "local.yaml").write_text("\n".join(lines) + "\n")
    one_line(lm_eval_cli("--model_args", f"pkg={tiny_pkg},store=none", "--include_path", tasks, "--tasks",
                         "local_mmlu_pro", "--limit", "1"), "needs 1823 tokens but the context is", "truncate=left")


def test_two_provider_options_split_by_lm_evals_commas_say_how_to_write_them():
    """Item 10: `provider_options=a=1,b=2` reaches ortevals as provider_options=a=1 and b=2 (lm-eval splits at
    commas): the message says to separate them with ';'."""
    from lm_eval.utils import simple_parse_args_string

    with pytest.raises(OrtEvalsError, match=r"unknown ortevals model_args \['b'\]: .*separate provider options "
                                            r"with ';' \(provider_options=a=1;b=2\)"):
        parse_model_args(simple_parse_args_string("pkg=x,provider_options=a=1,b=2"))
