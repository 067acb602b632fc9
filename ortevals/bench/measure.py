"""Running a benchmark's rows: every run its own process, started, timed and read the same way.

Owns the rounds (:func:`measure`: round 1 runs every row once in table order, round 2 again, …, so a machine
growing busier weighs on every row alike), the ortevals cache state each ortevals run starts from (cold: a
new empty cache folder for each run; warm: derived graphs and the invariance check's verdict from an
untimed one-question run, every answer scored again; stored: every answer already in the result store from
an untimed full run), each run's command (workload.py) and output folder, and :class:`RunRecord`, what a
run left. ortevals' own modules are compiled to bytecode first, as an installed package holds them. The
user's own ortevals cache is never read or written: the states live in a folder of the benchmark's own.
"""

from __future__ import annotations

import compileall
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ortevals
from ortevals.bench.plan import Plan
from ortevals.bench.spec import RowSpec
from ortevals.bench.watch import Watched, watch
from ortevals.bench.workload import Work, child_command, ortevals_command
from ortevals.files import CACHE_ENV


@dataclass(frozen=True)
class RunRecord:
    row: str  # the row's label
    round: int  # 1-based
    folder: Path  # its output: results.json and samples_<task>.jsonl
    watched: Watched
    failure: str | None  # None: it ran to the end and wrote its samples


def measure(plan: Plan, work: Work, folder: Path, repeat: int, timeout: float | None,
            progress: Callable[[str], None]) -> tuple[dict[str, list[RunRecord]], bool]:
    """Every runnable row ``repeat`` times, in rounds; a row whose run failed is not run again. ``folder``
    holds the runs' outputs (``runs/``) and the cache states (``cache/``). Returns the runs and whether Ctrl-C
    stopped the benchmark: the runs finished before it are kept (the run it cut ended with its process)."""
    records: dict[str, list[RunRecord]] = {r.label: [] for r in plan.rows}
    rows = [r for r in plan.rows if r.missing is None]
    # ortevals' bytecode compiled first, as `pip install` leaves it (and lm-eval, torch…): a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every module it imports in every row's process
    compileall.compile_dir(str(Path(ortevals.__file__).parent), quiet=2)
    names = {r.label: f"{i:02d}-{_slug(r.label)}" for i, r in enumerate(plan.rows, 1)}  # folder names
    try:
        _prepare(rows, names, work, folder, progress)
        for n in range(1, repeat + 1):
            for i, row in enumerate(rows, 1):
                if records[row.label] and records[row.label][-1].failure:
                    continue
                progress(f"[{i}/{len(rows)}] {row.label}: run {n} of {repeat}, {_questions(row)} …")
                rec = _run(row, names[row.label], work, folder, n, timeout)
                records[row.label].append(rec)
                progress(f"  {_said(rec, timeout)}")
    except KeyboardInterrupt:  # watch() ended the run's process; what finished is kept (the caller writes it)
        return records, True
    return records, False


def _questions(row: RowSpec) -> str:
    return f"first {row.limit} questions" if row.limit else "every question"


def _said(rec: RunRecord, timeout: float | None) -> str:
    w = rec.watched
    first = f", first result at {w.first_result_s:.1f} s" if w.first_result_s is not None else ""
    state = f"failed: {rec.failure}" if rec.failure else "done"
    return f"{state} ({w.wall_s:.1f} s launch to exit{first}, peak RSS {w.peak_rss_mib:.0f} MiB)"


def _prepare(rows: list[RowSpec], names: dict[str, str], work: Work, folder: Path,
             progress: Callable[[str], None]) -> None:
    """The warm and stored states, untimed: one question scored (derived graphs built, the verdict stored) or
    every question (the answers stored), in the benchmark's shared cache folder."""
    for row in rows:
        if row.cache not in ("warm", "stored"):
            continue
        limit = 1 if row.cache == "warm" else row.limit
        progress(f"preparing the {row.cache} cache for {row.label} (untimed) …")
        out = folder / "prepare" / names[row.label]
        # warm: one question, so not a decision (--limit and --against refuse each other); stored: the decision
        prepared = replace(work, decide=()) if row.cache == "warm" else work
        cmd = ortevals_command(row, prepared, out, limit, resume=row.cache == "stored")
        w = watch(cmd, _env(folder / "cache" / "shared"))
        if w.exit_code != 0:  # the timed runs would fail the same way and say why
            progress(f"  failed: {w.failure()}")
        shutil.rmtree(out, ignore_errors=True)


def _run(row: RowSpec, name: str, work: Work, folder: Path, n: int, timeout: float | None) -> RunRecord:
    out = folder / "runs" / name / f"run{n}"
    shutil.rmtree(out, ignore_errors=True)
    if row.backend == "ortevals":
        cache = folder / "cache" / (f"cold-{name}-{n}" if row.cache == "cold" else "shared")
        w = watch(ortevals_command(row, work, out, row.limit, resume=row.cache == "stored"), _env(cache), timeout)
        if row.cache == "cold":
            shutil.rmtree(cache, ignore_errors=True)  # a real package's derived graphs take gigabytes
    else:
        spec = folder / "runs" / name / f"run{n}.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps({"backend": row.backend, "target": row.target, "limit": row.limit,
                                    "args": row.args, "output": str(out), "work": work.to_json()}))
        w = watch(child_command(spec), _env(None), timeout)
    failure = None
    if w.exit_code != 0 or not any(out.glob("samples_*.jsonl")):
        failure = w.failure(timeout)
    return RunRecord(row.label, n, out, w, failure)


def _env(cache: Path | None) -> dict[str, str]:
    """This process's environment, ortevals importable from where this process imports it, and for an ortevals
    row its cache state's folder."""
    env = dict(os.environ)
    root = str(Path(ortevals.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        env[CACHE_ENV] = str(cache)
    return env


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label).strip("_") or "row"
