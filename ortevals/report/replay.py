"""``ortevals compare --replay-decide MARGIN``: the decision's stopping rule replayed on two complete runs.

Reads a reference and each candidate run (report/runs.py), aligns them task by task as ``compare`` does (the same
questions, documents, prompts and choices), pools every scored task's questions into one set of paired 0/1
outcomes, and replays report/decide.py's rule over random orders of that set: how often the final interval missed
the whole-set difference, and how many questions each order used (docs/decide.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.report.compare import align
from ortevals.report.decide import Replay, replay, replay_lines
from ortevals.report.runs import Run, load_run


def paired_scores(ref: Run, run: Run) -> tuple[np.ndarray, np.ndarray]:
    """The two runs' 0/1 correctness [N] on every task both hold with a per-question score, aligned."""
    tasks = [t for t in ref.tasks if t in run.tasks and not np.isnan(ref.tasks[t].correct).all()]
    if not tasks:
        raise OrtEvalsError(f"runs {ref.path} and {run.path} share no task with a per-question 0/1 score")
    for t in tasks:
        align(ref, run, t)
    return (np.concatenate([run.tasks[t].correct for t in tasks]),
            np.concatenate([ref.tasks[t].correct for t in tasks]))


def replay_paths(ref: str | Path, runs: list[str | Path], margin_points: float, echo, orders: int = 200,
                 alpha: float = 0.05, part: int = 50, seed: int = 0) -> list[Replay]:
    """Each run in ``runs`` against ``ref``: :func:`~ortevals.report.decide.replay` at ±``margin_points``, printed
    with ``echo``."""
    if not 0 < margin_points < 100:
        raise OrtEvalsError(f"--replay-decide {margin_points:g}: expected a margin in points, above 0 and below 100")
    if orders < 1:
        raise OrtEvalsError(f"--replay-orders {orders}: expected at least 1")
    reference = load_run(ref)
    out = []
    for path in runs:
        run = load_run(path)
        cand, base = paired_scores(reference, run)
        result = replay(cand, base, margin_points / 100, alpha, orders, part, seed=seed)
        echo("\n".join([f"{run.name} against {reference.name}:", *replay_lines(result)]))
        out.append(result)
    return out
