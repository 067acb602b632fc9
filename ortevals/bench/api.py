"""``ortevals.bench.run``: one benchmark from options to rows, and its files.

Owns the order of a benchmark (plan and check everything, run the rows in rounds, build the table, write
``bench.json``, ``bench.md`` and ``bench.png`` into ``--output``) and :class:`BenchResult`, what a script
gets back. The runs' outputs stay under ``--output``'s ``runs/`` (each an ``ortevals compare``-able run);
without ``--output`` they live in a temporary folder removed at the end.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.bench.devmem import device_info
from ortevals.bench.measure import RunRecord, measure
from ortevals.bench.plan import plan
from ortevals.bench.rows import Row, table_rows
from ortevals.bench.spec import BenchOptions, command_line
from ortevals.bench.workload import Work
from ortevals.bench.write import markdown_table, notes, plot, text_table, to_json
from ortevals.files import atomic_write, atomic_write_bytes, json_text
from ortevals.package.scope import versions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchResult:
    rows: tuple[Row, ...]
    rate: str  # "requests" or "tokens"
    reference: str
    meta: dict[str, Any]  # the command, the options, the machine
    records: dict[str, list[RunRecord]]
    files: tuple[Path, ...] = ()

    @property
    def table(self) -> str:
        return text_table(list(self.rows), self.rate)

    @property
    def notes(self) -> list[str]:
        stopped = [self.meta["interrupted"]] if self.interrupted else []
        return stopped + notes(list(self.rows), self.rate, self.meta["machine"])

    @property
    def interrupted(self) -> bool:
        """Ctrl-C stopped the benchmark: the rows hold the runs finished before it."""
        return bool(self.meta.get("interrupted"))

    @property
    def failed(self) -> tuple[str, ...]:
        """The labels of the rows that failed (a run that exited non-zero, wrote no samples or was cut at
        ``--timeout``)."""
        return tuple(r.label for r in self.rows if r.status == "failed")


def run(options: BenchOptions, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Every row of ``options`` in its own process, the table and its files; bad input raises
    :class:`~ortevals.errors.OrtEvalsError` before anything runs. ``progress``: called with a line per run
    (default: logged)."""
    bench = plan(options)
    command = command_line(options)
    say = progress or log.info
    folder = Path(options.output).expanduser() if options.output else Path(tempfile.mkdtemp(prefix="ortevals-bench-"))
    machine = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "load_start": os.getloadavg()[0], "device": device_info(), "versions": versions(LIBRARIES)}
    try:
        records, interrupted = measure(bench, Work.of(options), folder, options.repeat, options.timeout, say)
        machine["load_end"] = os.getloadavg()[0]
        peak = options.peak_tflops * 1e12 if options.peak_tflops else None
        rows = tuple(table_rows(bench, records, bench.rate, options.samples is not None, peak,  # from the runs
                                interrupted))
    finally:
        shutil.rmtree(folder / "cache", ignore_errors=True)
        shutil.rmtree(folder / "prepare", ignore_errors=True)
        if options.output is None:
            shutil.rmtree(folder, ignore_errors=True)
    meta = {"command": command, "reference": bench.ref, "rate": bench.rate, "machine": machine,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
            "interrupted": _stopped(bench, records, options.repeat) if interrupted else None}
    result = BenchResult(rows, bench.rate, bench.ref, meta, records)
    if options.output is None:
        return result
    return BenchResult(rows, bench.rate, bench.ref, meta, records, _write(result, folder))


def _stopped(bench, records: dict[str, list[RunRecord]], repeat: int) -> str:
    """The line saying where Ctrl-C stopped the benchmark (bench.json's ``interrupted``; the first note)."""
    done = sum(len(v) for v in records.values())
    planned = repeat * sum(1 for r in bench.rows if r.missing is None)
    return (f"Interrupted (Ctrl-C) after {done} of {planned} runs: the rows hold the runs that finished; the run it "
            "cut is left out.")


# the libraries whose versions can move a row's figures (beside ortevals and its source digest; the runtimes as
# the wheels installed: onnxruntime-gpu==…)
LIBRARIES = ("onnxruntime", "onnxruntime-genai", "numpy", "torch", "transformers", "lm_eval", "vllm")


def _write(result: BenchResult, folder: Path) -> tuple[Path, ...]:
    md = [f"`{result.meta['command']}`\n",
          markdown_table(list(result.rows), result.rate), "", *(f"- {n}" for n in result.notes)]
    files = (folder / "bench.json", folder / "bench.md", folder / "bench.png")
    atomic_write(files[0], json_text(to_json(list(result.rows), result.records, result.meta), indent=1) + "\n")
    atomic_write(files[1], "\n".join(md) + "\n")
    if any(r.status == "ok" for r in result.rows):
        atomic_write_bytes(files[2], plot(list(result.rows), result.rate))
        return files
    return files[:2]
