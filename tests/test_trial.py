"""Issue 22, "from a trial as a new user": flags, paths and outputs a first run trips over.

Each test names the trial's item. Every bad input is one line, exit 2, before any work (the model is
not even loaded: a package path that does not exist proves it, since loading it would fail first).
"""

import json
import os
import re
import stat

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from tests.test_cli import assert_one_line_error


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False)


MISSING_PKG = "/nonexistent/package"  # loading it would fail: an error naming something else came first


# --- item 2: conflicting flags -------------------------------------------------------------------------
def test_pkg_and_example_conflict(tiny_pkg):
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--example", "--data", "bundled", "--limit", "1"),
                          "--pkg", "--example", "not both")
    assert_one_line_error(run("info", "--pkg", str(tiny_pkg), "--example"), "not both")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--model-args", f"pkg={tiny_pkg}x",
                              "--data", "bundled", "--limit", "1"), "both name the package")


def test_flag_and_model_arg_that_disagree_are_one_line(tiny_pkg):
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--batch-size", "4",
                              "--limit", "1", "--model-args", "batch_size=2"),
                          "--batch-size 4 and --model-args batch_size=2 disagree")


# --- item 3: flags accepted and ignored ------------------------------------------------------------------
def test_max_gen_toks_without_cot_is_refused(tiny_pkg):
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", "--max-gen-toks", "8"),
                          "--max-gen-toks 8 applies to --cot")


def test_provider_option_on_cpu_is_a_warning_naming_it(tiny_pkg, caplog):
    """og 0.18 refuses CPU provider options and onnxruntime drops them silently (checked below): ortevals never
    passes them to og on CPU, so the option does nothing, and a warning names it (before: nothing, even with -v)."""
    import onnxruntime as ort
    import onnxruntime_genai as og

    session = ort.InferenceSession(str(tiny_pkg / "model.onnx"), providers=[("CPUExecutionProvider", {"bogus": "1"})])
    assert session.get_provider_options()["CPUExecutionProvider"] == {}  # ignored: the option did nothing
    config = og.Config(str(tiny_pkg))
    config.clear_providers()
    config.append_provider("cpu")
    config.set_provider_option("cpu", "bogus", "1")
    with pytest.raises(Exception, match="does not support provider options"):
        og.Model(config)
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", "--truncate", "left",
                 "--no-resume", "--provider-option", "bogus=1")
    assert result.exit_code == 0, result.output
    assert any(r.levelname == "WARNING" and r.getMessage().startswith(
        "--provider-option bogus: the CPU execution provider takes no provider options, so it is ignored")
        for r in caplog.records), caplog.text


def test_unknown_cuda_option_is_a_warning_naming_the_closest(caplog):
    from ortevals.runtime.provider_names import check_user_options

    check_user_options("cuda", ["enable_cuda_grph", "device_id"])
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "enable_cuda_grph" in record.getMessage() and "did you mean 'enable_cuda_graph'" in record.getMessage()


def test_max_length_beyond_the_context_is_refused(tiny_pkg):
    """og refuses it too (``max_length (N) cannot be greater than model context_length``)."""
    import onnxruntime_genai as og

    config = og.Config(str(tiny_pkg))
    config.clear_providers()
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=100000000)
    with pytest.raises(Exception, match="cannot be greater than model context_length"):
        og.Generator(model, params)
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                              "--max-length", "100000000"), "max_length=100000000", "model.context_length=1024")


# --- item 5: errors that were internal errors, some after the whole run ------------------------------------
@pytest.mark.parametrize("make,flag,needle", [
    (lambda p: (p.write_text("x"), p)[1], "--output", "is a file; expected a folder"),
    (lambda p: (p.mkdir(), p)[1], "--use-cache", "is a folder; expected a file path"),
], ids=["output-is-a-file", "use-cache-is-a-folder"])
def test_bad_output_and_cache_paths_before_any_work(tmp_path, make, flag, needle):
    target = make(tmp_path / "target")
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", flag, str(target)), needle)


def test_unwritable_output_before_any_work(tmp_path):
    """/proc refuses a new folder even to root; permission bits would not tell."""
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled", "--output", "/proc/ortevals-out"),
                          "--output /proc/ortevals-out: not writable")


def test_empty_tasks_and_cache_that_is_a_file(tmp_path):
    assert_one_line_error(run("run", "--pkg", MISSING_PKG, "--tasks", ""), "--tasks ''")
    assert_one_line_error(run("run", "--pkg", MISSING_PKG, "--tasks", " , "), "expected comma-separated")
    file = tmp_path / "cache"
    file.write_text("x")
    assert_one_line_error(run("mmlu-pro", "--pkg", MISSING_PKG, "--data", "bundled",
                              env={"ORTEVALS_CACHE": str(file)}), f"ORTEVALS_CACHE={file}", "must be a folder")


def test_too_many_fewshot_is_one_line(tiny_pkg):
    """Found while lm-eval builds the prompts (its progress bars come first), before anything is scored."""
    result = run("run", "--pkg", str(tiny_pkg), "--data", "bundled", "--tasks", "leaderboard_mmlu_pro", "--limit",
                 "1", "--num-fewshot", "100", "--no-resume")
    last = [ln for ln in result.output.splitlines() if ln.strip()][-1]
    assert result.exit_code == 2 and "Traceback" not in result.output and "ortevals" not in result.output
    assert last == ("Error: --num-fewshot 100: leaderboard_mmlu_pro has only 70 few-shot examples; "
                    "expected --num-fewshot 70 or less")


# --- item 12: files as lm-eval writes them ---------------------------------------------------------------
def test_output_files_are_world_readable_and_strict_json(tmp_path):
    from ortevals.files import atomic_write, json_text

    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.json", json_text({"x": float("nan"), "y": [1.5, float("inf")]}))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644  # what open() and lm-eval give
    assert json.loads((tmp_path / "a.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == \
        {"x": None, "y": [1.5, None]}


# --- item 4: --limit is the first N questions -------------------------------------------------------------
def reordered_mmlu(tmp_path, categories):
    """The bundled MMLU-Pro with the test split's first rows from ``categories`` in that order (then the rest)."""
    import shutil

    import pyarrow.parquet as pq

    from ortevals.presets import BUNDLED

    dst = tmp_path / "mmlu"
    shutil.copytree(BUNDLED / "mmlu_pro", dst)
    path = dst / "data" / "test-00000-of-00001.parquet"
    table = pq.read_table(path)
    cats = table.column("category").to_pylist()
    first, used = [], set()
    for c in categories:
        i = next(i for i, x in enumerate(cats) if x == c and i not in used)
        first.append(i)
        used.add(i)
    order = first + [i for i in range(table.num_rows) if i not in used]
    pq.write_table(table.take(order), path)
    return dst, table.take(first).column("question_id").to_pylist()


def question_ids(out):
    return sorted(json.loads(ln)["doc"]["question_id"] for f in out.glob("samples_*.jsonl")
                  for ln in f.read_text().splitlines())


def test_limit_is_the_first_n_questions_of_the_test_split_with_and_without_cot(tmp_path, tiny_pkg):
    data, ids = reordered_mmlu(tmp_path, ["math", "law", "math", "biology", "history"])
    base = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(data), "--limit", "4", "--truncate", "left",
            "--no-resume"]
    cot = run(*base, "--cot", "--max-gen-toks", "2", "--output", str(tmp_path / "cot"))
    assert cot.exit_code == 0, cot.output
    # before: 4 questions from each of the 14 subjects (56); now the first 4 rows, each in its subject's task
    assert question_ids(tmp_path / "cot") == sorted(ids[:4])
    assert sorted(f.name for f in (tmp_path / "cot").glob("samples_*.jsonl")) == [
        "samples_mmlu_pro_biology.jsonl", "samples_mmlu_pro_law.jsonl", "samples_mmlu_pro_math.jsonl"]
    assert "questions 4 " in cot.output and "--limit 4: the first 4 questions of the test split" in cot.output
    loglik = run(*base, "--output", str(tmp_path / "ll"))
    assert loglik.exit_code == 0 and question_ids(tmp_path / "ll") == sorted(ids[:4])  # the same questions


# --- item 6: bad data rows are named, not scored --------------------------------------------------------------
def edited_row(column, row, value):
    def edit(table):
        import pyarrow as pa

        values = table.column(column).to_pylist()
        values[row] = value
        kind = table.schema.field(column).type
        return table.set_column(table.column_names.index(column), column, pa.array(values, kind))
    return edit


@pytest.mark.parametrize("edit,message", [
    (edited_row("question", 2, None), "row 2 (question_id 72): field question is None; expected non-empty text"),
    (edited_row("answer_index", 1, 12), "row 1 (question_id 71): field answer_index=12 is out of range for 10 "
                                        "options; expected 0-9"),
    (edited_row("answer", 0, "A"), "row 0 (question_id 70): field answer='A' but answer_index=8 is option I"),
    (edited_row("answer", 3, "Q"), "row 3 (question_id 73): field answer='Q'; expected one letter of A-J"),
], ids=["null-question", "index-out-of-range", "answer-vs-index", "answer-not-a-letter"])
def test_bad_data_rows_name_the_row_and_field(tmp_path, tiny_pkg, edit, message):
    from ortevals.errors import DataError
    from ortevals.presets import PRESETS, validate_local
    from tests.test_badinputs import mmlu_copy

    data = mmlu_copy(tmp_path, edit)
    with pytest.raises(DataError, match=re.escape(message)):
        validate_local(PRESETS["mmlu-pro"], data)
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(data), "--limit", "1",
                              "--truncate", "left", "--no-resume"), message)
