"""The one options table: the CLI, lm-eval model args and Olive take the same arguments."""

import json
import logging

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import OrtEvalsError
from ortevals.options import OPTIONS, ModelArgs, parse_arg_string, parse_model_args
from tests.test_cli import assert_one_line_error


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_every_option_reaches_model_args():
    fields = set(ModelArgs.__dataclass_fields__)
    assert fields == {o.name for o in OPTIONS}
    # each option parses its string form (what lm-eval's K=V and --model-args deliver) to a typed value
    strings = {"pkg": "p", "ep": "cuda", "provider_options": "a=1;b=2", "threads": "3", "batch_size": "auto",
               "max_length": "64", "add_bos_token": "false", "memory_budget_mb": "10", "prefix_cache": "off",
               "prefix_budget_mb": "5", "scoring_graph": "0", "path": "incremental", "store": "s.sqlite",
               "max_gen_toks": "7", "gen_batch_size": "2", "seed": "0", "exact": "yes", "check": "no",
               "truncate": "left", "media_path": "og", "workers": "2", "ray_address": "10.0.0.1:6379",
               "gen_path": "AUTO", "samples": "8", "self_eval": "true", "temperature_fit": "split",
               "verifier": "Self", "prm": "on", "step_separator": "\\n---\\n", "prm_aggregation": "min",
               "search": "DVTS", "search_n": "8", "search_width": "4", "search_max_steps": "3", "cascade": "off",
               "resume": "false", "decode_budget_mb": "512", "passes": "auto",
               "allow_cpu_fallback": "yes", "shared_prefix_batch": "AUTO",
               "adapter": "a.onnx_adapter;b/c.onnx_adapter=x"}
    missing = fields - set(strings)
    assert not missing, f"add a string form for {missing}"
    # --search with --samples is refused (options.check_settings): samples parsed on its own
    assert parse_model_args({"pkg": "p", "samples": strings.pop("samples")}).samples == 8
    args = parse_model_args(strings)
    assert (args.threads, args.batch_size, args.add_bos_token, args.prefix_cache, args.path) == \
        (3, None, False, False, "incremental")
    assert args.provider_options == ("a=1", "b=2")
    assert (args.workers, args.ray_address) == (2, "10.0.0.1:6379")
    assert args.gen_path == "auto"  # og with cascade=off: refused (does nothing)
    assert (args.self_eval, args.temperature_fit) == (True, "split")
    assert (args.verifier, args.prm, args.step_separator, args.prm_aggregation) == ("self", True, "\n---\n", "min")
    assert (args.search, args.search_n, args.search_width, args.search_max_steps) == ("dvts", 8, 4, 3)
    assert args.decode_budget_mb == 512
    assert args.passes == 0 and parse_model_args({"pkg": "p", "passes": "2"}).passes == 2  # auto: resolved at open
    assert args.allow_cpu_fallback is True
    assert args.adapter == ("a.onnx_adapter", "b/c.onnx_adapter=x")  # syntax only: files are checked at open
    assert args.shared_prefix_batch == "auto"  # on/off with prefix_cache=off: refused (does nothing)


@pytest.mark.parametrize("text,needle", [
    ("pkg=x,threads=four", "threads must be an integer, got 'four'"),
    ("pkg=x,prefix_cache=maybe", "prefix_cache must be true or false"),
    ("pkg=x,path=sideways", "path must be one of auto, prefill, incremental"),
    ("pkg=x,provider_options=novalue", "provider option 'novalue' must look like key=value"),
    ("pkg=x,gen_batch_size=0", "gen_batch_size must be > 0, got 0"),
    ("pkg=x,media_path=gpu", "media_path must be one of auto, og, fast"),
    ("pkg=x,gen_path=gpu", "gen_path must be one of auto, raw, og, got 'gpu'"),
    ("pkg=x,samples=0", "samples must be > 0, got 0"),
    ("pkg=x,prm_aggregation=mean", "prm_aggregation must be one of last, min, prod, got 'mean'"),
    ("pkg=x,step_separator=", "step_separator must be a non-empty string"),
    ("pkg=x,prm=sometimes", "prm must be true or false"),
    ("pkg=x,search=mcts", "search must be one of none, beam, dvts, particles, got 'mcts'"),
    ("pkg=x,search_n=0", "search_n must be > 0, got 0"),
    ("pkg=x,batch_size=99999999999999999999", "batch_size must be at most 65536 rows per forward pass, got "
                                               "99999999999999999999"),
    ("pkg=x,gen_batch_size=70000", "gen_batch_size must be at most 65536 rows decoded together"),
    ("pkg=x,samples=100000", "samples must be at most 10000 per question"),
])
def test_bad_values_name_the_option(text, needle):
    with pytest.raises(OrtEvalsError, match=needle):
        parse_model_args(parse_arg_string(text))


def test_model_args_on_the_cli_choose_the_path(tiny_pkg, tmp_path, caplog):
    """--model-args reaches the engine: path=incremental serves log-likelihoods from onnxruntime-genai,
    and the scores agree with the default prefill path."""
    outs = {}
    for name, extra in (("prefill", []), ("incremental", ["--model-args", "path=incremental,prefix_cache=false"])):
        with caplog.at_level(logging.INFO, logger="ortevals"):
            # the tiny model's 1024-token context is shorter than MMLU-Pro prompts: truncate as hf does
            result = run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2", "--no-resume",
                         "--truncate", "left", "--output", str(tmp_path / name), *extra)
        assert result.exit_code == 0, result.output
        assert f"loglikelihood requests go to the {name} path" in caplog.text
        caplog.clear()
        rows = [json.loads(ln) for f in sorted((tmp_path / name).glob("samples_*.jsonl"))
                for ln in f.read_text().splitlines()]
        outs[name] = [float(r[0][0]) for s in rows for r in s["resps"]]
    assert len(outs["prefill"]) == len(outs["incremental"]) >= 10  # two questions, up to ten choices each
    assert max(abs(a - b) for a, b in zip(outs["prefill"], outs["incremental"])) < 1e-4


def test_flags_and_model_args_agree_and_bad_model_args_are_one_line(tiny_pkg):
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--model-args", "pkgg=1"),
                          "unknown ortevals model_args ['pkgg']")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--model-args", "seed"),
                          "--model-args entry 'seed' must look like key=value")
    # a flag and a --model-args entry for the same option: a bad value is named first, then any disagreement
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--batch-size", "0",
                              "--model-args", "batch_size=2"), "batch_size must be > 0, got 0")


@pytest.mark.parametrize("flag,value,needle", [("--batch-size", "99999999999999999999", "batch_size must be at most"),
                                               ("--samples", "100000", "samples must be at most 10000")])
def test_huge_counts_are_one_line_before_any_work(tiny_pkg, flag, value, needle):
    """Issue 49 items 8 and 14: `--batch-size 99999999999999999999` hung at 0/1 questions (a loop up to the batch
    size), `--samples 100000` ran on; both are one line from the options table, before the package opens."""
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", flag,
                                      value, *(["--cot"] if flag == "--samples" else [])])
    assert_one_line_error(result, needle, value)
