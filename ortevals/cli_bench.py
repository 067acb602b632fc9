"""The ``ortevals bench`` command: flags to :class:`~ortevals.bench.spec.BenchOptions`, the table printed.

Glue only (the harness is ortevals/bench/); cli.py adds it to the ``ortevals`` group, whose error handling
turns a bad input into one line and exit code 2. The table is printed (and written) whatever the rows did; the
exit code is 1 when a row failed or was cut at ``--timeout``, 130 after Ctrl-C (the finished runs kept).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ortevals.errors import OrtEvalsError

EPILOG = """\b
Examples:
  ortevals bench --pkg ./fp32 --pkg ./int4 --hf ./hf --backends ortevals,hf,onnxruntime-genai --limit 20
  ortevals bench --pkg ./fp32 --pkg nocache=./fp32:prefix_cache=false --limit 50     # one package, two settings
  ortevals bench --pkg ./fp32 --pkg ./fp32 --repeat 2 --limit 20      # the same row twice: the noise
  ortevals bench --pkg ./fp32 --hf ./hf --cache cold,warm,stored --limit 20 --output bench/startup
  ortevals bench --pkg ./fp32 --hf ./hf --cot --max-gen-toks 64 --limit 14   # generated tokens/s
  ortevals bench --pkg ./int4 --pkg ./int8kv --against runs/fp32 --decide 1   # each decided against a run
"""
CANDIDATE = "[LABEL=]PATH[:K=V,…]"


@click.command("bench", epilog=EPILOG)
@click.option("--pkg", "pkgs", multiple=True, metavar=CANDIDATE,
              help="A GenAI package and its ortevals model args; repeatable, the same package too (each its own row).")
@click.option("--hf", metavar=CANDIDATE, help="The same model as a transformers folder, for hf and vllm "
              "(lm-eval hf model args after ':', e.g. :batch_size=8).")
@click.option("--backends", default=None, metavar="B,…",
              help="Of ortevals, hf, onnxruntime-genai, onnxruntime, vllm. Default: ortevals, and hf with --hf.")
@click.option("--tasks", default=None, help="lm-eval tasks, comma-separated. Default: MMLU-Pro (5-shot).")
@click.option("--cot", is_flag=True, help="MMLU-Pro chain of thought (generation) instead of log-likelihood.")
@click.option("--data", default=None, help="Local copy of the data (default: the bundled MMLU-Pro; the hub for "
              "--tasks).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N questions.")
@click.option("--peer-limit", type=click.IntRange(min=1), default=None,
              help="Questions for lm-eval's onnxruntime-genai and onnxruntime rows (default 3: seconds a request).")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="K samples a question (with --cot).")
@click.option("--max-gen-toks", type=click.IntRange(min=1), default=None, help="Cap generated tokens.")
@click.option("--ref", default=None, help="The reference row: its label, or a backend with one row (default: hf "
              "when run, else the first row).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timed runs of every row, in rounds; figures are medians.")
@click.option("--cache", default=None, metavar="STATE,…",
              help="ortevals cache states, each its own row: cold, warm (default), stored.")
@click.option("--cold", is_flag=True, help="Same as --cache cold: every ortevals run on a new, empty cache.")
@click.option("--rate", type=click.Choice(["requests", "tokens"]), default=None,
              help="Per request (default) or per generated token (default with --cot).")
@click.option("--ep", default=None, help="Execution provider for every backend (hf: cuda:0 with cuda).")
@click.option("--timeout", type=float, default=None, help="Seconds a run may take before it is killed.")
@click.option("--peak-tflops", type=float, default=None,
              help="The device's dense peak TFLOP/s (989 for fp16 on an H100/H200): each ortevals row's MFU.")
@click.option("--against", default=None, metavar="RUN",
              help="With --decide: every ortevals row decided against this finished run (docs/decide.md).")
@click.option("--decide", type=float, default=None, metavar="MARGIN",
              help="With --against: each row stops when decided within, below or above ±MARGIN points.")
@click.option("--decide-order", default=None, metavar="ORDER", help="With --decide: uniform (default) or guided.")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Folder for bench.json, bench.md, bench.png and each run's output (runs/).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def bench(pkgs, hf, backends, tasks, cache, cold, verbose, **kw) -> None:
    """Packages and backends side by side on the same questions: speed, memory, accuracy, agreement.

    Every row runs as its own process, timed from launch to exit (docs/bench.md)."""
    from ortevals.bench import BenchOptions, run

    logging.basicConfig(level=logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    if cold and cache:
        raise OrtEvalsError(f"--cold and --cache {cache}: give one (--cold is --cache cold)")
    options = BenchOptions(pkgs=tuple(pkgs), hf=hf, backends=_list(backends), tasks=_list(tasks),
                           cache=("cold",) if cold else _list(cache) or ("warm",), **kw)
    result = run(options, progress=lambda line: click.echo(line, err=True))
    wrote = [f"wrote {p}" for p in result.files]
    click.echo("\n".join([result.meta["command"], "", result.table, "", *result.notes, *wrote]))
    if result.interrupted:  # the table and files above hold the runs that finished
        click.echo(result.meta["interrupted"], err=True)
        sys.exit(130)
    if result.failed:
        click.echo(f"{len(result.failed)} of {len(result.rows)} rows failed ({'; '.join(result.failed)}): the table "
                   "says why", err=True)
        sys.exit(1)


def _list(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())
