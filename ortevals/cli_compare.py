"""The comparison commands, ``ortevals compare`` (question by question) and ``ortevals fidelity`` (token
by token): glue only, the logic is in ortevals/report/ and ortevals/fidelity/. cli.py adds them to the
``ortevals`` group, whose error handling turns a bad input into one line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import click

from ortevals import cli_help
from ortevals.cli_common import fail_gates, setup_logging
from ortevals.errors import OrtEvalsError


# --- ortevals compare (issue 12): glue only; the logic is in ortevals/report/ ---
@click.command("compare", epilog=cli_help.EPILOG_COMPARE)
@click.option("--ref", required=True, type=click.Path(path_type=Path), help="The reference run.")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="One object per run and task.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path), help="Write report.md and report.html.")
@click.option("--changed", "changed_path", type=click.Path(path_type=Path), help="The changed questions, JSONL.")
@click.option("--max-flip-rate", type=float, help="Gate: fail when a flip rate exceeds this.")
@click.option("--max-kl", type=float, help="Gate: fail when a kl_mean (nats) exceeds this.")
@click.option("--margin", type=float, help="Gate: fail unless Δ accuracy's 95% lower bound is above -MARGIN.")
@click.option("--by-length", is_flag=True, help="Accuracy and choice-KL by prompt length.")
@click.option("--length-buckets", default=None, help="With --by-length: the lengths between buckets, e.g. 512,2048.")
@click.option("--kl-threshold", type=float, help="With --by-length: name the prompt length where the mean "
              "choice-KL first exceeds this (nats).")
@click.option("--tokenizer", type=click.Path(path_type=Path), help="A tokenizer.json (or a package folder), "
              "one of the runs' models' where they name theirs: lengths in its tokens (default: the runs' tokenizer "
              "where all name the same one on disk, else characters; generations: the runs' own token counts first).")
@click.option("--replay-decide", type=float, default=None, metavar="MARGIN",
              help="Replay the decision at ±MARGIN points over random orders of the complete runs: how often its "
                   "final interval misses the whole-set difference, and the questions it used (docs/decide.md).")
@click.option("--replay-orders", type=int, default=200, show_default=True, help="With --replay-decide: orders.")
@click.option("--order", type=click.Choice(["uniform", "guided"]), default=None,
              help="With --replay-decide: guided also replays orders drawn by the reference's choice margins "
                   "(questions it barely decided first) and reports both [default: uniform].")
def compare(ref, runs, json_path, report_dir, changed_path, max_flip_rate, max_kl, margin, by_length,
            length_buckets, kl_threshold, tokenizer, replay_decide, replay_orders, order) -> None:
    """Runs against a reference, question by question: flips, McNemar, KL, intervals; exit 1 on a failed gate.

    A RUN is an ortevals --output folder, an lm-eval --output_path folder (with --log_samples) or one
    samples_*.jsonl file."""
    from ortevals.report.compare import Gates
    from ortevals.report.lengths import length_options
    from ortevals.report.output import compare_paths

    if order is not None and replay_decide is None:
        raise OrtEvalsError("--order applies to --replay-decide; give --replay-decide MARGIN with it")
    if replay_decide is not None:
        from ortevals.report.replay import replay_paths

        replay_paths(ref, list(runs), replay_decide, click.echo, replay_orders, order=order or "uniform")
        return
    gates = Gates(max_flip_rate, max_kl, margin)  # a threshold that can never fire or always fires: one line
    fail_gates(compare_paths(ref, list(runs), click.echo, json_path, report_dir, changed_path, gates,
                             length_options=length_options(by_length, length_buckets, kl_threshold, tokenizer)))


# --- fidelity (issue 12 §2): all logic lives in ortevals/fidelity/ ---
@click.command("fidelity", epilog=cli_help.EPILOG_FIDELITY)
@click.option("--pkg", type=click.Path(path_type=Path), default=None, help="Candidate GenAI package folder.")
@click.option("--ref", default=None, help="Reference: a GenAI package, a transformers checkpoint folder "
              "(config.json; needs the torch extra) or a file from --save-ref.")
@click.option("--text", type=click.Path(path_type=Path), default=None, help="UTF-8 text file to score.")
@click.option("--data", default=None, help="'bundled' (default) or an MMLU-Pro folder: questions + worked answers.")
@click.option("--tokens", type=int, default=None,
              help="Cap on scored tokens (default 32768; with a reference file, at most what it holds).")
@click.option("--ctx", type=int, default=None, help="Window length n_ctx (default 512); the second half is scored.")
@click.option("--top-k", type=int, default=None, help="Reference top-k kept per token, 64-256 (default 128).")
@click.option("--save-ref", type=click.Path(path_type=Path), default=None, help="Write the reference to FILE (.npz).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the summary as JSON.")
@click.option("--ep", default=None, help="Execution provider for the packages (default: the package's).")
@click.option("--by-position", is_flag=True, help="Score every position and break the numbers down by context "
              "length (default --ctx 4096).")
@click.option("--buckets", default=None, help="With --by-position: the context lengths between buckets, e.g. "
              "512,2048 (default 128,512,1024,2048,4096,… below --ctx).")
@click.option("--kl-threshold", type=float, default=None, help="With --by-position: name the context length where "
              "the mean KL first exceeds this (nats).")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="With --by-position: write the plot "
              "by context length (PNG).")
@click.option("--trajectories", type=click.Path(path_type=Path), default=None, help="A generation run of the "
              "reference (chain of thought): the KL along its outputs, teacher-forced, by generated token.")
@click.option("--first", type=int, default=None, help="With --trajectories: the first N generated tokens of each "
              "output (default 256).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def fidelity(verbose: int, json_path: Path | None, buckets: str | None, **kw) -> None:
    """Token-level distance of a package from a reference on real text: KL, top-1, Δp, PPL ratio."""
    from ortevals.fidelity.positions import parse_buckets
    from ortevals.fidelity.run import FidelityOptions, format_report, run_fidelity

    setup_logging(verbose)
    report = run_fidelity(FidelityOptions(json=json_path, buckets=parse_buckets(buckets), **kw))
    click.echo(format_report(report.summary))
    for path in report.files:
        click.echo(f"wrote {path}")
