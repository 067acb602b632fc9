"""``ortevals bench``: packages and backends side by side on the same questions, one table.

Each row (ortevals on a package with its model args and cache state, lm-eval's ``hf``,
``onnxruntime-genai``, ``onnxruntime`` or ``vllm``) runs as its own process, started, timed and read
the same way; the table gives each row's speed, memory and accuracy, and its answers against a
reference row (docs/bench.md). ``run`` is the Python API: the same rows the command prints.

Modules: spec.py (options, candidate syntax), plan.py (checks, rows), workload.py (what every row
runs), child.py (a non-ortevals row's process), watch.py (one process timed), devmem.py (NVML: the
device, a process's peak device memory), measure.py (the rounds, cache states), rows.py (figures,
statistics), write.py (table, files, plot), api.py.
"""

from __future__ import annotations

from ortevals.bench.spec import BenchOptions, parse_candidate


def run(options: BenchOptions | None = None, *, progress=None, **fields):
    """Run a benchmark and return its :class:`~ortevals.bench.api.BenchResult` (``.rows``: the table).

    ``options`` or its fields as keywords: ``run(pkgs=("./fp32", "./int4"), hf="./hf",
    backends=("ortevals", "hf"), limit=20)``. Bad input raises ``OrtEvalsError`` before any run."""
    from ortevals.bench.api import run as run_bench  # the harness loads here, never in a row's own process

    return run_bench(options or BenchOptions(**fields), progress)


__all__ = ["BenchOptions", "parse_candidate", "run"]
