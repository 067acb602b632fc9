"""The rows of docs/bad-inputs.md not covered elsewhere: each a one-line error, exit 2."""

import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import DataError, OrtEvalsError, PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.tokenizer import Tokenizer
from ortevals.presets import BUNDLED, PRESETS, validate_local
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
     "row 0 (question_id 70) has empty or non-text options"),
    (lambda t: t.slice(0, 0), "has no rows"),
])
def test_bad_data_rows(tmp_path, tiny_pkg, edit, message):
    data = mmlu_copy(tmp_path, edit)
    with pytest.raises(DataError, match=re.escape(message)):
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


def assert_error_after_data(result, *needles):
    """An error found while scoring: datasets' progress bars come first, then exactly one Error line."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert lines[-1].startswith("Error: ") and sum("Error" in ln for ln in lines) == 1, result.output
    for n in needles:
        assert n in lines[-1]


def edit_config(pkg, fn):
    import json

    path = pkg / "genai_config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


BAD_VALUES = [  # (edit of genai_config.json, the field the one line must name, what it must say)
    (lambda c: c["model"]["decoder"]["session_options"].update(provider_options=[{"cuda": ["x"]}]),
     "model.decoder.session_options.provider_options[0].cuda must be an object of option values, got ['x']"),
    (lambda c: c["model"]["decoder"]["session_options"].update(provider_options={"cuda": {}}),
     "model.decoder.session_options.provider_options must be a list"),
    (lambda c: c["model"]["decoder"]["session_options"].update(provider_options=["cuda"]),
     "model.decoder.session_options.provider_options[0] must be an object mapping a provider name"),
    (lambda c: c["model"]["decoder"]["session_options"].update(provider_options=[{"tpu": {}}]),
     "model.decoder.session_options.provider_options[0]: unknown execution provider 'tpu'"),
    (lambda c: c["model"]["decoder"]["session_options"].update(provider_options=[{"cuda": {"device_id": [0]}}]),
     "model.decoder.session_options.provider_options[0].cuda.device_id must be a string or number"),
    (lambda c: c["model"]["decoder"]["session_options"].update(intra_op_num_threads="four"),
     "model.decoder.session_options.intra_op_num_threads must be an integer >= 0, got 'four'"),
    (lambda c: c["model"]["decoder"]["session_options"].update(inter_op_num_threads=-1),
     "model.decoder.session_options.inter_op_num_threads must be an integer >= 0, got -1"),
    (lambda c: c["model"].update(context_length=0), "field model.context_length must be a positive int, got 0"),
    (lambda c: c["model"].update(context_length=-5), "field model.context_length must be a positive int, got -5"),
]


@pytest.mark.parametrize("edit,message", BAD_VALUES, ids=[
    "provider_options list value", "provider_options not a list", "provider_options entry", "unknown provider",
    "provider option value", "intra_op_num_threads string", "inter_op_num_threads negative",
    "context_length 0", "context_length negative"])
def test_bad_config_values_are_one_line_naming_the_field(tiny_pkg, copy_pkg, edit, message):
    """Before issue 10: AttributeError/ValueError from inside ortevals, or silently accepted."""
    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, edit)
    with pytest.raises(OrtEvalsError) as err:
        OrtLM.from_package(ModelArgs(pkg=str(pkg)))
    assert message in str(err.value) and "genai_config.json" in str(err.value) and "\n" not in str(err.value)
    assert_one_line_error(run("mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "1", "--no-resume"),
                          message)


def test_requests_longer_than_the_context_are_an_error_naming_the_limit(tiny_pkg, copy_pkg):
    """Before issue 10 they were left-truncated in silence: a score of another text."""
    from lm_eval.api.instance import Instance

    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, lambda c: c["model"].update(context_length=3))
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " paris"), 0)]
    with pytest.raises(OrtEvalsError, match=r"loglikelihood request 0 'The capital of France is paris' needs \d+ "
                                            r"tokens but the context is model.context_length=3 in .*genai_config."
                                            r"json; pass the model arg truncate=left") as err:
        OrtLM.from_package(ModelArgs(pkg=str(pkg))).loglikelihood(reqs, disable_tqdm=True)
    assert "\n" not in str(err.value)
    # the user's max_length is named as the source when it is the limit
    with pytest.raises(OrtEvalsError, match="but the context is max_length=4; "):
        OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=4)).loglikelihood(reqs, disable_tqdm=True)
    assert_error_after_data(run("mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "1", "--no-resume"),
                            "model.context_length=3 in", "truncate=left")
    assert_error_after_data(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                                "--max-length", "16", "--no-resume"), "but the context is max_length=16")
    with pytest.raises(OrtEvalsError, match="truncate must be one of error, left, got 'right'"):
        OrtLM.create_from_arg_string(f"pkg={tiny_pkg},truncate=right")


def test_left_truncation_when_asked_is_hf_truncation_and_counted(tiny_pkg):
    """truncate=left scores the last max_length tokens, exactly what a full-context run gives for them."""
    from lm_eval.api.instance import Instance

    ctx, cont = "one two three four five six seven eight nine ten the of and", " paris"
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=6, truncate="left", batch_size=1))
    ((lp, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)], disable_tqdm=True)
    assert lm.stats["truncated"] == 1
    full = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), batch_size=1))
    c, w = full.tok_encode(ctx), full.tok_encode(cont, add_special_tokens=False)
    window = (c + w)[-7:]  # hf: the last max_length + 1 tokens, the last one predicted only
    (want,) = full._loglikelihood_tokens([(None, window[:-len(w)], w)], disable_tqdm=True)
    assert lp == pytest.approx(want[0], abs=1e-5) and full.stats["truncated"] == 0
    # rolling windows are built to fit max_length: never an error, never counted as truncated
    rolling = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=8, batch_size=1))
    (total,) = rolling.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ctx * 3,), 0)],
                                             disable_tqdm=True)
    assert np.isfinite(total) and rolling.stats["truncated"] == 0


def test_a_declared_window_the_graph_lacks_is_refused_by_og_and_scored_as_the_graph_runs(tiny_pkg, copy_pkg):
    """The builder drops Mistral's window from the graph but keeps it in genai_config.json; onnxruntime-genai then
    sizes its KV cache to the window (plus 16) and fails past it. Before: onnxruntime's RuntimeError from inside
    the og paths (scoring a 30-token input, generating). path=incremental and gen_path=og refuse it in one line;
    the prefill path scores the graph as it is (the unmodified package's numbers)."""
    from lm_eval.api.instance import Instance

    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, lambda c: c["model"]["decoder"].update(
        sliding_window={"window_size": 4, "slide_key_value_cache": False, "slide_inputs": False, "layers": [],
                        "cache_slack": 0}))
    assert "declares a 4-token window that model.onnx's attention does not have" in ModelPackage.load(pkg).unwindowed
    context = "one two three four five six seven eight nine ten " * 3
    reqs = [Instance("loglikelihood", {}, (context, x), i) for i, x in enumerate([" one two", " three"])]
    gen = [Instance("generate_until", {}, (context, {"until": ["zzz"], "max_gen_toks": 8, "do_sample": False}), 0)]
    for args, run_it in (({"path": "incremental"}, lambda lm: lm.loglikelihood(reqs, disable_tqdm=True)),
                         ({"gen_path": "og"}, lambda lm: lm.generate_until(gen, disable_tqdm=True))):
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), batch_size=1, **args))
        with pytest.raises(PackageError, match="onnxruntime-genai sizes its KV cache to that window") as err:
            run_it(lm)
        assert "\n" not in str(err.value)
    ours, plain = (OrtLM.from_package(ModelArgs(pkg=str(p), batch_size=1)).loglikelihood(reqs, disable_tqdm=True)
                   for p in (pkg, tiny_pkg))
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in plain], abs=1e-6)
