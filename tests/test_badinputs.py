"""The rows of docs/bad-inputs.md not covered elsewhere: each a one-line error, exit 2."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import DataError, OrtEvalsError, PackageError
from ortevals.lm import ModelArgs, OrtLM
from ortevals.package import ModelPackage
from ortevals.presets import BUNDLED, PRESETS, validate_local
from ortevals.tokenizer import Tokenizer
from tests.test_cli import assert_one_line_error


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_tokenizer_that_does_not_match(tiny_pkg, copy_pkg, smollm2):
    pkg = copy_pkg(tiny_pkg)
    shutil.copy(smollm2[1] / "tokenizer.json", pkg / "tokenizer.json")  # 49,152 tokens for a 512-token model
    with pytest.raises(PackageError, match="tokenizer does not belong to this model"):
        Tokenizer.load(ModelPackage.load(pkg))
    assert_one_line_error(run("mmlu-pro", "--pkg", str(pkg), "--data", "bundled"), "tokenizer.json")


def test_missing_tokenizer(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    (pkg / "tokenizer.json").unlink()
    assert_one_line_error(run("mmlu-pro", "--pkg", str(pkg), "--data", "bundled"), "tokenizer.json: not found")


def mmlu_copy(tmp_path, edit):
    """A copy of the bundled MMLU-Pro with the test split edited by ``edit(table) -> table``."""
    dst = tmp_path / "mmlu"
    shutil.copytree(BUNDLED / "mmlu_pro", dst)
    path = dst / "data" / "test-00000-of-00001.parquet"
    pq.write_table(edit(pq.read_table(path).slice(0, 20)), path)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.drop_columns(["options"]), "column 'options' is missing"),
    (lambda t: t.set_column(t.column_names.index("question"), "question", pa.array(range(t.num_rows))),
     "column 'question' has type int64; expected string"),
    (lambda t: t.set_column(t.column_names.index("options"), "options",
                            pa.array([[]] * 3 + t.column("options").to_pylist()[3:], pa.list_(pa.string()))),
     "row 0 has empty or non-text options"),
    (lambda t: t.slice(0, 0), "has no rows"),
])
def test_bad_data_rows(tmp_path, tiny_pkg, edit, message):
    data = mmlu_copy(tmp_path, edit)
    with pytest.raises(DataError, match=message):
        validate_local(PRESETS["mmlu-pro"], data)
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(data)), message.split("'")[0])


def test_empty_after_filters(tmp_path, tiny_pkg):
    # every CoT subject keeps only its own category: none is left
    data = mmlu_copy(tmp_path, lambda t: t.set_column(t.column_names.index("category"), "category",
                                                       pa.array(["nothing"] * t.num_rows)))
    result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", str(data), "--cot", "--max-gen-toks", "4")
    # datasets' progress bars come first here (the data is read before it is found empty)
    last = [ln for ln in result.output.splitlines() if ln.strip()][-1]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert last.startswith("Error: the data set is empty after filters")


def test_options_out_of_range(tiny_pkg):
    for args in (["--limit", "0"], ["--threads", "-1"], ["--max-length", "0"]):
        result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", *args)
        assert result.exit_code == 2 and "Traceback" not in result.output
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--batch-size", "0"),
                          "batch_size must be > 0")
    with pytest.raises(OrtEvalsError, match="batch_size must be an integer"):
        ModelArgs.parse({"pkg": "x", "batch_size": "many"})


def test_unknown_model_args(tiny_pkg):
    with pytest.raises(OrtEvalsError, match=r"unknown ortevals model_args \['pkgg'\]"):
        OrtLM.create_from_arg_string(f"pkg={tiny_pkg},pkgg=1")
    with pytest.raises(OrtEvalsError, match="path must be one of"):
        OrtLM.create_from_arg_string(f"pkg={tiny_pkg},path=sideways")
