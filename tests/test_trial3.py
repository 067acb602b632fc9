"""Issue 38, "trust, round 3": bad stores, paths, settings and gates a new user trips over.

Each bad input is one line naming the file, field or flag, exit 2, before any model work (where a package path
that does not exist is given, loading it would have failed first: the error proves nothing was loaded).
"""

import dataclasses
import json
import os
import re
import sqlite3

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from tests.test_cli import assert_one_line_error


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False)


MISSING_PKG = "/nonexistent/package"


# --- item 12: result store errors ------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda p: (p.write_text("not a database, and long enough to be read as one " * 4), p)[1],
    lambda p: (p.mkdir(), p)[1],
], ids=["corrupt-file", "folder"])
def test_an_unusable_store_is_one_line_naming_it(tiny_pkg, tmp_path, make):
    store = make(tmp_path / "answers.sqlite")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                              "--model-args", f"store={store}"), str(store), "ortevals cache clear")


def test_a_corrupt_default_store_is_one_line_naming_it(tiny_pkg, tmp_path):
    from ortevals.files import store_path

    env = {"ORTEVALS_CACHE": str(tmp_path / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTEVALS_CACHE", env["ORTEVALS_CACHE"])
        default = store_path(tiny_pkg)
    default.parent.mkdir(parents=True)
    default.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # a header, then garbage pages
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", env=env),
                          str(default), "ortevals cache clear")


def test_a_store_that_breaks_while_reading_is_a_store_error(tmp_path):
    """Malformed pages found at a read, not at open: the same one line (was sqlite3.DatabaseError)."""
    from ortevals.errors import StoreError
    from ortevals.report.scope import Scope
    from ortevals.report.store import ResultStore

    SCOPE = Scope("results", "/p", (("model.onnx", "abc"),), "{}", ())  # noqa: N806
    path = tmp_path / "s.sqlite"
    store = ResultStore.open(path, SCOPE)
    for i in range(2000):
        store.put("kind", [i, "x" * 200], i)
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    data[8192:len(data) - 4096] = b"\x07" * (len(data) - 4096 - 8192)  # the answers' pages, header kept
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{path}: result store unusable .*ortevals cache clear"):
        reopened = ResultStore.open(path, SCOPE)
        for i in range(2000):
            reopened.get("kind", [i, "x" * 200])


# --- item 14: CI gates that cannot fire or always fire ------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--max-kl", "nan"), ("--margin", "inf"), ("--max-flip-rate", "-1"),
                                         ("--max-flip-rate", "1.5"), ("--max-kl", "-0.1"), ("--margin", "-0.02")])
def test_gate_thresholds_out_of_range_are_one_line(tmp_path, flag, value):
    """Refused before the runs are read (the paths do not exist: reading them would fail first)."""
    assert_one_line_error(run("compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "run"), flag, value),
                          f"{flag} {value}", "expected")


# --- item 15: settings accepted silently that do nothing or harm -----------------------------------------------
NOTHING = [("search_n=8", "search_n=8 does nothing without --search"),
           ("search=particles,search_width=4,verifier=self",
            "search_width=4 does nothing without --search beam or dvts"),
           ("search_max_steps=3", "search_max_steps=3 does nothing without --search"),
           ("prm_aggregation=min", "prm_aggregation='min' does nothing without --search"),
           ("prm=true", "prm=True does nothing without --verifier"),
           ("step_separator=\\n", "step_separator='\\n' does nothing without prm=true or --search"),
           ("cascade=on,gen_path=og", "cascade='on' does nothing without gen_path=auto or raw"),
           ("gen_batch_size=4,gen_path=raw", "gen_batch_size=4 does nothing without gen_path=auto or og"),
           (f"threads={(os.cpu_count() or 1) + 1}", f"is more than the {os.cpu_count() or 1} CPU cores"),
           ("passes=2,ep=cuda", "passes=2 does nothing with --ep cuda"),
           ("passes=2,path=incremental", "passes=2 does nothing with path=incremental"),
           ("passes=2,workers=2", "passes=2 does nothing with --workers"),
           (f"passes={(os.cpu_count() or 1) + 1}", f"is more than the {os.cpu_count() or 1} CPU cores"),
           (f"passes=2,threads={os.cpu_count() or 1}", "intra-op threads at once on the")]  # issue 49 item 14


@pytest.mark.parametrize("model_args, needle", NOTHING, ids=[a.split("=")[0] for a, _ in NOTHING])
def test_settings_that_do_nothing_are_refused_by_every_front_door(model_args, needle):
    """The options table checks them (options.check_settings): the CLI refuses them before the package is loaded
    (it does not exist), lm-eval's route (create_from_arg_string) and Olive's parse the same table."""
    from ortevals.errors import OrtEvalsError
    from ortevals.integrations.lm import OrtLM

    assert_one_line_error(run("run", "--pkg", MISSING_PKG, "--tasks", "gsm8k", "--model-args", model_args), needle)
    with pytest.raises(OrtEvalsError, match=re.escape(needle)):
        OrtLM.create_from_arg_string(f"pkg={MISSING_PKG},{model_args}")


def test_the_defaults_and_settings_that_act_are_accepted():
    from ortevals.options import parse_model_args

    cores = os.cpu_count() or 1
    for args in ({}, {"search": "beam", "search_n": "8", "verifier": "self", "prm_aggregation": "min"},
                 {"verifier": "self", "prm": "true", "step_separator": "\\n"}, {"cascade": "off", "gen_path": "raw"},
                 {"gen_batch_size": "4"}, {"threads": str(cores)}, {"threads": str(cores + 1), "workers": "2"},
                 {"passes": "auto", "ep": "cuda"}, {"passes": "1", "workers": "2"}, {"passes": str(cores)}):
        parse_model_args({"pkg": MISSING_PKG, **args})


@pytest.mark.parametrize("key, value", [("temperature", "inf"), ("temperature", "nan"), ("temperature", "hot"),
                                        ("repetition_penalty", "inf"), ("mirostat_eta", "inf"), ("top_k", "inf"),
                                        ("diversity_penalty", "inf"), ("seed", "x"), ("max_gen_toks", "many")])
def test_gen_kwargs_that_are_not_finite_numbers_are_one_line_before_any_work(key, value):
    """temperature=inf decoded uniformly random tokens; 'hot' and top_k=inf were internal errors."""
    assert_one_line_error(run("run", "--pkg", MISSING_PKG, "--tasks", "gsm8k", "--gen-kwargs", f"{key}={value}"),
                          f"gen_kwargs {key}=", "expected")


def test_help_names_only_flags_the_command_has():
    """An option's help shown under a command names no flag that command lacks (mmlu-pro's --samples help sent
    users to --gen-kwargs, which only `run` has). Flags of other programs (`ray start --head`) are not ours."""
    from ortevals.options import OPTIONS

    for name, command in cli.commands.items():
        flags = {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
        for option in OPTIONS:
            if option.flag not in flags:
                continue
            named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", option.help)) - {"--head"}
            assert named <= flags, f"ortevals {name} --help: {option.flag} names {sorted(named - flags)}"


# --- item 16: messages that named the wrong thing -----------------------------------------------------------
def test_data_given_a_file_names_the_folder_to_give():
    from ortevals.presets import BUNDLED

    parquet = next((BUNDLED / "mmlu_pro" / "data").glob("test-*.parquet"))
    for command in (["mmlu-pro"], ["run", "--tasks", "leaderboard_mmlu_pro"]):
        assert_one_line_error(run(*command, "--pkg", MISSING_PKG, "--data", str(parquet)),
                              f"--data {parquet}: is a file; expected the folder",
                              f"give --data {BUNDLED / 'mmlu_pro'}")


def test_pkg_given_a_file_or_a_checkpoint_says_what_to_give(tiny, tmp_path):
    hf_dir, pkg = tiny
    assert_one_line_error(run("info", "--pkg", str(pkg / "model.onnx")),
                          f"{pkg / 'model.onnx'}: is a file; expected the package folder", f"give its folder: {pkg}")
    assert_one_line_error(run("info", "--pkg", str(hf_dir)), f"{hf_dir} is a transformers checkpoint",
                          f"python -m onnxruntime_genai.models.builder -i {hf_dir} -o OUT")
    (tmp_path / "olive-out" / "model").mkdir(parents=True)
    (tmp_path / "olive-out" / "model" / "genai_config.json").write_text("{}")
    inner = tmp_path / "olive-out" / "model"
    assert_one_line_error(run("info", "--pkg", str(tmp_path / "olive-out")), f"{inner} holds one: pass --pkg {inner}")


def test_a_decoder_path_that_is_a_folder_says_so(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    config = json.loads((pkg / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "weights"
    (pkg / "weights").mkdir()
    (pkg / "genai_config.json").write_text(json.dumps(config))
    assert_one_line_error(run("info", "--pkg", str(pkg)), "model.decoder.filename='weights' is a folder",
                          "expected an ONNX model file")


def test_a_provider_missing_from_the_install_hints_at_ep_cpu(tiny_pkg):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this install has CUDA")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--ep", "cuda"),
                          "'cuda' (CUDAExecutionProvider) is not available", "Pass --ep cpu",
                          "pip install 'ortevals[cuda]'")


# --- item 10: the verifier phase shows progress ---------------------------------------------------------------
def test_the_verifier_phase_draws_a_progress_bar_of_answers(capsys):
    """380 s of silence in a 14-question --samples 8 --verifier self run: now a bar like generation's."""
    import numpy as np

    from ortevals.integrations.verify import Question, verify_run

    class Fake:
        name, kind, params, tokens_run = "fake", "classifier", 0, 0
        meaning = "a made-up score"

        def score_texts(self, context, answers):
            return np.arange(len(answers), dtype=float)

    questions = [Question(("t", i), "Q", ("a", "b", "c")) for i in range(4)]
    out = verify_run(Fake(), questions)
    assert out.scores[("t", 3)] == [0.0, 1.0, 2.0]
    err = capsys.readouterr().err
    assert "verifier fake: 100%" in err and "12/12" in err and "answer" in err, err
    verify_run(Fake(), questions, progress=False)
    assert "verifier fake" not in capsys.readouterr().err


# --- item 18: smaller --------------------------------------------------------------------------------------
def test_no_user_facing_string_names_an_issue_number():
    """report.html's headings read "Reliability diagram (issue 24)": every string literal of the package that
    is not a docstring (what reaches a user: headings, messages, help) is checked."""
    import ast
    from pathlib import Path

    import ortevals

    found = []
    for path in sorted(Path(ortevals.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.name}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  and re.search(r"\bissues? \d+", n.value, re.I)]
    assert not found, found


def test_model_args_reproduce_the_run_and_config_batch_size_agrees(tiny_pkg, tmp_path):
    """results.json's model_args held a raw newline (step_separator), and config.batch_size was null beside
    model_args' batch_size=8. The string parses back to the same arguments."""
    from ortevals.options import parse_arg_string, parse_model_args
    from ortevals.report.model_info import model_args_string
    from ortevals.runtime.providers import from_package

    args = parse_model_args({"pkg": str(tiny_pkg), "verifier": "self", "prm": "true", "step_separator": "\\n\\n",
                             "batch_size": "8"})
    text = model_args_string(args, from_package({}, "cpu"))
    assert "\n" not in text and "step_separator=\\n\\n" in text
    resolved = dataclasses.replace(args, pkg=str(tiny_pkg.resolve()), ep="cpu")  # as the string records them
    assert parse_model_args(parse_arg_string(text)) == resolved
    for flags, want in ((["--batch-size", "8"], 8), ([], "auto")):
        out = tmp_path / f"run{want}"
        result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
                     "--no-resume", "--output", str(out), *flags)
        assert result.exit_code == 0, result.output
        config = json.loads((out / "results.json").read_text())["config"]
        assert config["batch_size"] == want and f"batch_size={want}," in config["model_args"]


def test_the_lm_eval_route_shares_the_cli_answers_and_says_it_resumed(tiny_pkg, tmp_path):
    """lm-eval's CLI hands the model batch_size=1 (its default): it ran under another scope than the CLI's
    (auto), so nothing was shared, and its resume notice was an info record no lm-eval handler shows."""
    import subprocess
    import sys

    env = {"ORTEVALS_CACHE": str(tmp_path / "cache")}
    first = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
                env=env)
    assert first.exit_code == 0, first.output
    script = (
        "from ortevals.integrations.lm_eval_plugin import register; register()\n"
        "import lm_eval\n"
        "from ortevals.presets import PRESETS, resolve_data, task_specs\n"
        "p = PRESETS['mmlu-pro']\n"
        "specs = task_specs(p, resolve_data(p, 'bundled'))\n"
        f"r = lm_eval.simple_evaluate(model='ortevals', model_args='pkg={tiny_pkg},truncate=left', tasks=specs,\n"
        "                             batch_size=1, limit=1)\n"
        "print('acc', r['results']['leaderboard_mmlu_pro']['acc,none'])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming: 9 of 9 loglikelihood requests reused from" in proc.stderr, proc.stderr[-3000:]


# --- item 9: --search leaves a trace; with --samples it is refused ---------------------------------------------
def test_search_with_samples_is_refused_in_one_line():
    """A search returns one answer a question; K samples of it would be K searches (and the verifier phase after
    printed `verifier self: … 0 tokens run, 0.0 s`)."""
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", "--cot", "--search", "beam",
                              "--verifier", "self", "--samples", "4"),
                          "--search beam with --samples 4", "not both")


def test_a_search_run_says_what_ran_and_what_it_cost(tiny_pkg, tiny_orm, tmp_path):
    """The mode line, a `search:` line and results.json's `search` name the method, its settings and verifier,
    and count the tokens generated, the steps, the passes and the verifier's tokens and seconds (before: nothing
    said a search ran)."""
    out = tmp_path / "run"
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "2", "--max-gen-toks",
                 "12", "--no-resume", "--truncate", "left", "--search", "particles", "--verifier", str(tiny_orm[1]),
                 "--model-args", "search_n=3,search_max_steps=2,step_separator=.,prm_aggregation=min",
                 "--output", str(out))
    assert result.exit_code == 0, result.output
    record = json.loads((out / "results.json").read_text())["search"]
    assert record["method"] == "particles" and record["name"] == "particle filtering"
    assert {k: record["settings"][k] for k in ("n", "max_steps", "aggregation", "step_separator")} == {
        "n": 3, "max_steps": 2, "aggregation": "min", "step_separator": "."}
    assert record["verifier"] == {"name": str(tiny_orm[1]), "kind": "classifier"}
    assert record["requests"] == 2 and record["generated_tokens"] > 0 and record["steps"] > 0
    assert record["passes"] >= record["steps"] and record["verifier_tokens"] > 0
    assert 0 < record["verifier_seconds"] <= record["seconds"]
    mode = next(ln for ln in result.output.splitlines() if ln.startswith("scoring mode: "))
    assert "step-level search: particle filtering (--search particles, n 3" in mode
    line = next(ln for ln in result.output.splitlines() if ln.startswith("search: "))
    assert line.startswith(f"search: particle filtering (n 3, at most 2 steps, step scores folded by min) guided by "
                           f"verifier {tiny_orm[1]}: 2 requests, {record['generated_tokens']} tokens generated")
    assert f"the verifier ran {record['verifier_tokens']} tokens" in line


@pytest.mark.parametrize("args, needle", [
    (("--model-args", "allow_cpu_fallback=true"), "allow_cpu_fallback=true does nothing on the cpu execution provider"),
    (("--model-args", "cascade=on"), "cascade=on does nothing on this run: leaderboard_mmlu_pro score log-likelihoods"),
    (("--cot", "--samples", "2", "--self-eval", "--max-gen-toks", "4"), "--self-eval with --samples 2: P(True) is "
                                                                         "asked about a question's one generated"),
], ids=["allow_cpu_fallback", "cascade", "self_eval"])
def test_settings_that_do_nothing_on_this_run_are_one_line_before_it(tiny_pkg, tmp_path, args, needle):
    """Issue 49 item 14: allow_cpu_fallback=true on the CPU provider, cascade=on on a log-likelihood run, and
    --self-eval with --samples (which warned after the run that no P(True) was reported) are one line before any
    answer is computed: nothing is written."""
    out = tmp_path / "out"
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate",
                              "left", "--no-resume", "--output", str(out), *args), needle)
    assert not out.exists() or not any(out.iterdir())
