"""Issue 55 (trust, round 5), the front doors: inputs refused in one line before the work they would waste (lm-eval's
command line with a provider this install lacks, a task whose data is nowhere offline, a verifier whose context is
too short for the answers, an Olive evaluator's misspelt ``data``), and messages that point the right way (no
did-you-mean for a name nothing is close to; ``--data`` with a name that is no task)."""

from __future__ import annotations

import difflib

import pytest

from ortevals.errors import OrtEvalsError, did_you_mean
from tests.test_trial4 import lm_eval_cli, one_line


def _cuda_available() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


# --- item 11: lm-eval's route, ep=cuda without CUDA ------------------------------------------------------------
@pytest.mark.skipif(_cuda_available(), reason="this onnxruntime has CUDA")
def test_lm_eval_route_refuses_a_missing_provider_before_lm_eval_starts(tiny_pkg):
    """`--model_args ep=cuda` on a CPU-only install was refused by the model's constructor, after lm-eval had indexed
    and loaded the tasks (27 s); the wrapper's preflight now resolves the provider too: the only line of output."""
    import onnxruntime

    from ortevals.integrations.lm_eval_plugin import preflight

    with pytest.raises(OrtEvalsError, match=r"execution provider 'cuda' \(CUDAExecutionProvider\) is not available"):
        preflight({"pkg": str(tiny_pkg), "ep": "cuda"}, None)
    out = one_line(lm_eval_cli("--model_args", f"pkg={tiny_pkg},ep=cuda", "--tasks", "arc_easy", "--limit", "1"),
                   "execution provider 'cuda' (CUDAExecutionProvider) is not available",
                   *onnxruntime.get_available_providers())
    assert len(out.splitlines()) == 1 and "Selected Tasks" not in out


# --- item 13: did-you-mean only for close names --------------------------------------------------------------------
def test_did_you_mean_suggests_only_close_names():
    """`nonexistent_task` was offered 'injongointent_tasks' (difflib ratio 0.74, over the default cutoff 0.6); a
    typo's ratio to the name meant stays high (one letter off: 'hff'/'hf' 0.8, 'limt'/'limit' 0.89)."""
    ratio = difflib.SequenceMatcher(None, "nonexistent_task", "injongointent_tasks").ratio()
    assert 0.7 < ratio < 0.8
    assert did_you_mean("nonexistent_task", ["injongointent_tasks", "noor_stem_tasks"]) == ""
    for typo, meant in (("hff", "hf"), ("limt", "limit"), ("pkgg", "pkg"), ("mmlu-pr", "mmlu-pro"),
                        ("bundeld", "bundled")):
        assert did_you_mean(typo, [meant, "nonexistent_task"]) == f" (did you mean {meant!r}?)"


def test_an_unknown_task_far_from_every_name_gets_no_suggestion(tiny_pkg):
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_cli import assert_one_line_error

    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--tasks", "nonexistent_task", "--limit", "1"])
    assert_one_line_error(result, "--tasks: unknown task 'nonexistent_task'; expected an lm-eval task")
    assert "did you mean" not in result.output


# --- item 11: an Olive evaluator's misspelt data ----------------------------------------------------------------
def test_olive_data_typo_names_the_key_and_the_close_value(tmp_path, tiny_pkg):
    """`"data": "bundeld"` said `bundeld: data folder not found` after Olive had started (42 s), naming neither the
    JSON key nor "bundled"; the wrapper's check now names both, the only line, before Olive is imported."""
    from ortevals.integrations.olive_workflow import check_evaluator
    from tests.test_trial4 import olive_workflow, set_evaluator

    with pytest.raises(OrtEvalsError, match=r"^OrtEvalsEvaluator: data 'bundeld': data folder not found \(did you "
                                            r"mean 'bundled'\?\); expected \"bundled\""):
        check_evaluator({"data": "bundeld"})
    with pytest.raises(OrtEvalsError, match=r"^OrtEvalsEvaluator: data '.*/elsewhere': data folder not found; "):
        check_evaluator({"data": str(tmp_path / "elsewhere")})
    (tmp_path / "one.parquet").write_bytes(b"")
    with pytest.raises(OrtEvalsError, match=r"^OrtEvalsEvaluator: data '.*one.parquet': is a file; expected the "
                                            r"folder of the data set"):
        check_evaluator({"data": str(tmp_path / "one.parquet")})
    check_evaluator({"data": "bundled"})
    check_evaluator({"data": str(tmp_path)})
    out = one_line(olive_workflow(tmp_path / "wf", edit=set_evaluator(tiny_pkg, data="bundeld")),
                   "OrtEvalsEvaluator: data 'bundeld'", "(did you mean 'bundled'?)")
    assert len(out.splitlines()) == 1


# --- item 13: --data with a name that is no task ---------------------------------------------------------------
def test_data_with_an_unknown_task_says_the_task_is_unknown(tmp_path, tiny_pkg):
    """`--tasks nonexistent_task --data DIR` said `… is not a YAML task lm-eval knows …; --data cannot re-point it`,
    read as blame on --data: now the task is named unknown, as without --data."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_cli import assert_one_line_error

    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--tasks", "nonexistent_task", "--data",
                                      str(tmp_path), "--limit", "1"])
    assert_one_line_error(result, "unknown task 'nonexistent_task'; expected an lm-eval task, group or tag name")
    assert "re-point" not in result.output and "did you mean" not in result.output


def test_data_with_a_tag_re_points_each_of_its_tasks(tmp_path):
    """A tag (lm-eval's `ai2_arc`: arc_easy.yaml's `tag`, which arc_challenge.yaml includes) names tasks, not one
    YAML: with --data each of its tasks is re-pointed, as a group's are (it was refused, `--data cannot re-point
    it`)."""
    from ortevals.presets import task_specs

    specs = task_specs(("ai2_arc",), tmp_path)
    assert sorted(s["task"] for s in specs) == ["arc_challenge", "arc_easy"]
    assert {s["dataset_path"] for s in specs} == {str(tmp_path)}
    assert {s["task"]: s["dataset_name"] for s in specs} == {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}


# --- item 11: a task's data set nowhere here, offline ----------------------------------------------------------
def _cache_like_the_hub(cache, repo: str, config: str, table) -> None:
    """What ``datasets`` leaves in its cache after loading ``repo``'s ``config`` from the hub (its parquet builder
    under ``{owner}___{name}/{config}/{version}/{hash}``), built from a local parquet file."""
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    source = cache.parent / f"{config}.parquet"
    pq.write_table(table, source)
    builder = Parquet(cache_dir=str(cache), dataset_name=repo.split("/")[1], config_name=config, config_id=config,
                      hash="0123abcd", data_files={"test": str(source)})
    builder.repo_id = repo  # the hub's naming of the folder (set after __init__: the files are not the repo's)
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import datasets.config

    cache = tmp_path / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    return cache


def test_offline_a_task_whose_data_is_not_cached_is_one_line_before_lm_eval(offline_cache, tiny_pkg, monkeypatch):
    """`ortevals run --tasks arc_easy` offline took 32 s (and, with the hub unreachable rather than offline, 22 retry
    warnings) to say the hub could not be reached; now the datasets cache is read first: one line naming the task,
    the data set and how to provide it, before lm-eval builds a task."""
    import lm_eval
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_cli import assert_one_line_error

    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: pytest.fail("lm-eval was started"))
    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--tasks", "arc_easy", "--limit", "1"])
    assert_one_line_error(result, "task arc_easy reads allenai/ai2_arc (configuration ARC-Easy) from the Hugging "
                                  "Face hub, which is offline (HF_HUB_OFFLINE=1)", str(offline_cache),
                          "run once online to cache it, or pass --data PATH to a local copy")


def test_offline_the_check_agrees_with_datasets_own_offline_load(offline_cache):
    """The oracle: ``datasets.load_dataset`` offline. A configuration it loads from the cache passes the check; one
    it cannot load (another configuration, another data set) is refused, naming it."""
    import datasets
    import pyarrow as pa

    from ortevals.presets import check_hub_data, in_datasets_cache
    from ortevals.tasks import task_manager

    _cache_like_the_hub(offline_cache, "allenai/ai2_arc", "ARC-Easy", pa.table({"question": ["q"], "answerKey": ["A"]}))
    assert datasets.load_dataset("allenai/ai2_arc", "ARC-Easy")["test"]["question"] == ["q"]
    check_hub_data(["arc_easy"], task_manager())
    for path, name in (("allenai/ai2_arc", "ARC-Challenge"), ("allenai/openbookqa", "main")):
        with pytest.raises((ConnectionError, ValueError)):
            datasets.load_dataset(path, name)
        assert not in_datasets_cache(path, name)
    with pytest.raises(OrtEvalsError, match=r"^task arc_challenge reads allenai/ai2_arc \(configuration "
                                            r"ARC-Challenge\) from the Hugging Face hub, which is offline"):
        check_hub_data(["arc_easy", "arc_challenge"], task_manager())
    with pytest.raises(OrtEvalsError, match=r"^tasks leaderboard_mmlu_pro reads TIGER-Lab/MMLU-Pro|^task "
                                            r"leaderboard_mmlu_pro reads TIGER-Lab/MMLU-Pro .*, or --data bundled"):
        check_hub_data(["leaderboard_mmlu_pro"], task_manager())


def test_an_unreachable_hub_is_said_without_retries(offline_cache, monkeypatch):
    """Not declared offline, the hub not answering (here: a closed local port as its endpoint): one line at once,
    naming the endpoint, instead of huggingface_hub's retries."""
    import datasets.config

    from ortevals.presets import check_hub_data
    from ortevals.tasks import task_manager

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(OrtEvalsError, match=r"^task arc_easy reads allenai/ai2_arc \(configuration ARC-Easy\) from "
                                            r"the Hugging Face hub, which is unreachable \(http://127.0.0.1:9: "):
        check_hub_data(["arc_easy"], task_manager())


# --- item 11: a verifier whose context cannot hold the answers -------------------------------------------------
def test_a_verifier_context_too_short_for_the_answers_is_refused_before_generation(tiny_pkg, tmp_path, monkeypatch):
    """`--samples 2 --verifier self` with max_length=24 generated every answer, then stopped on the first P(True)
    input (`loglikelihood request 0 … needs 69 tokens`, not naming --verifier); now the longest input each prompt
    can give (its tokens, max_gen_toks, the P(True) question's) is checked first. The oracle for the count: the
    tokenizer on the prompt and on the question, by hand."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.integrations.self_eval import SUFFIX, TRUE
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer
    from ortevals.run.generate import Generation
    from tests.test_samples_mode import json_task

    tasks = json_task(tmp_path, "vt_task", "generation_kwargs:\n  until: [\"Question\"]\n  max_gen_toks: 6\n")
    tok = Tokenizer.load(ModelPackage.load(tiny_pkg))
    need = len(tok.encode("Question 0: the cat sat on the", None)) + 6 + len(tok.encode(SUFFIX + TRUE, False)) - 1
    assert 24 < need
    monkeypatch.setattr(Generation, "generate", lambda *a, **k: pytest.fail("generation started"))
    result = CliRunner().invoke(cli, ["run", "--pkg", str(tiny_pkg), "--include-path", str(tasks), "--tasks",
                                      "vt_task", "--samples", "2", "--verifier", "self", "--no-resume",
                                      "--model-args", "max_length=24"])
    last = result.output.strip().splitlines()[-1]  # lm-eval's own bars (building the requests) come before it
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    for needle in (f"Error: --verifier self: a P(True) input would run up to {need} tokens (a prompt of",
                   "'Question 0: the cat sat on the'", "max_gen_toks=6", "the verifier's context is max_length=24",
                   "truncate=left"):
        assert needle in last, last


def test_a_verifier_input_refused_while_scoring_names_the_verifier(tiny_pkg):
    """An answer whose text re-encodes longer than the check's bound is refused when it is scored: the line names
    --verifier (it said `loglikelihood request 0 … needs N tokens`, as if the run's own request)."""
    from ortevals.integrations.lm import OrtLM
    from ortevals.integrations.verify import Question, SelfVerifier, verify_run
    from ortevals.options import parse_model_args

    lm = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg), "store": "none", "max_length": "24"}))
    with pytest.raises(OrtEvalsError, match=r"^--verifier self: loglikelihood request .* needs \d+ tokens but the "
                                            r"context is max_length=24"):
        verify_run(SelfVerifier(lm.ptrue_model()), [Question(("t", 0), "Q:", (" a", " b"))], progress=False)
