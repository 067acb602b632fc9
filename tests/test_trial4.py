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


# --- item 11: the Olive route ----------------------------------------------------------------------------------
def olive_workflow(tmp_path, *args, edit=None, module: str = "ortevals.integrations.olive_workflow"):
    """The shipped configs/evaluate_package.json (``edit``ed) run through ``module`` (the wrapper, or Olive)."""
    import json

    shutil.copytree(REPO / "configs", tmp_path / "configs")
    cfg = json.loads((REPO / "configs" / "evaluate_package.json").read_text())
    if edit is not None:
        edit(cfg)
    (tmp_path / "wf.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OLIVE_DISABLE_TELEMETRY": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, "run", "--config", str(tmp_path / "wf.json"), *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)


def set_evaluator(pkg, **settings):
    def edit(cfg):
        cfg["input_model"]["model_path"] = str(pkg)
        cfg["evaluators"]["ortevals"].update(settings)
    return edit


@pytest.mark.parametrize("settings, needles", [
    (None, ("input_model.model_path 'models/smollm2-135m-instruct-fp32' does not exist", "ortevals example")),
    ({"limit": 0}, ("OrtEvalsEvaluator: limit must be an integer >= 1 in the evaluator config, got 0",)),
], ids=["shipped", "limit0"])
def test_olive_workflow_is_checked_before_olive_starts(tmp_path, tiny_pkg, settings, needles):
    """The shipped workflow names what to set; `limit: 0` names the JSON key (it named the CLI's --limit): each the
    only line, before Olive is imported (it took 26 s to get there)."""
    proc = olive_workflow(tmp_path, edit=None if settings is None else set_evaluator(tiny_pkg, **settings))
    out = one_line(proc, *needles)
    assert len(out.splitlines()) == 1


def test_olive_run_itself_ends_with_one_line(tmp_path):
    """`olive run` on the shipped workflow without the wrapper: Olive's assertion on the missing input model was a
    40-line traceback; the user script's import makes it (and any ortevals error) the one last line."""
    proc = olive_workflow(tmp_path, module="olive")
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert out.splitlines()[-1].startswith("Error: input_model.model_path 'models/smollm2-135m-instruct-fp32' "
                                           "does not exist; set it to a GenAI package folder")


def test_the_olive_hook_prints_ortevals_errors_as_one_line_and_passes_others_on(capsys):
    from ortevals.integrations.olive_workflow import one_line_errors

    seen = []
    hook = one_line_errors(lambda *exc: seen.append(exc[0]))
    hook(OrtEvalsError, OrtEvalsError("tasks: unknown task 'x'"), None)
    hook(KeyError, KeyError("k"), None)
    assert capsys.readouterr().err == "Error: tasks: unknown task 'x'\n" and seen == [KeyError]


def test_task_typos_get_the_closest_name_in_the_evaluator_and_on_the_cli(tiny_pkg):
    """Item 11: an Olive evaluator's task typo (a preset's or lm-eval's name) gets the closest name; on the CLI
    `run --tasks mmlu_pro_businss` said lm-eval's 'not a registered task/group/tag'."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.integrations.olive_workflow import check_evaluator
    from tests.test_cli import assert_one_line_error

    for task, near in (("mmlu-pr", "mmlu-pro"), ("mmlu_pro_businss", "mmlu_pro_business")):
        with pytest.raises(OrtEvalsError, match=f"OrtEvalsEvaluator: tasks: unknown task '{task}' \\(did you mean "
                                                f"'{near}'\\?\\)"):
            check_evaluator({"tasks": [task]})
    assert_one_line_error(CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--tasks", "mmlu_pro_businss",
                                                   "--limit", "1"]),
                          "--tasks: unknown task 'mmlu_pro_businss' (did you mean 'mmlu_pro_business'?)")
