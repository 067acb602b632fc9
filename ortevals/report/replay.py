"""``ortevals compare --replay-decide MARGIN``: the decision's stopping rule replayed on two complete runs.

Reads a reference and each candidate run (report/runs.py), aligns them task by task as ``compare`` does (the same
questions, documents, prompts and choices), pools every scored task's questions into one set of paired 0/1
outcomes, and replays report/decide.py's rule over random orders of that set: how often the final interval missed
the whole-set difference, and how many questions each order used (docs/decide.md). With ``--order guided`` the
reference's choice margins (report/guided.py) draw the orders too, and both orders are reported side by side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.report.compare import align
from ortevals.report.decide import ORDERS, Replay, replay, replay_lines
from ortevals.report.guided import choice_margins
from ortevals.report.runs import Run, load_run


def shared_tasks(ref: Run, run: Run) -> list[str]:
    """The tasks both runs hold with a per-question 0/1 score, aligned (the same questions in the same order)."""
    tasks = [t for t in ref.tasks if t in run.tasks and not np.isnan(ref.tasks[t].correct).all()]
    if not tasks:
        raise OrtEvalsError(f"runs {ref.path} and {run.path} share no task with a per-question 0/1 score")
    for t in tasks:
        align(ref, run, t)
    return tasks


def paired_scores(ref: Run, run: Run) -> tuple[np.ndarray, np.ndarray]:
    """The two runs' 0/1 correctness [N] on every task both hold with a per-question score, aligned."""
    tasks = shared_tasks(ref, run)
    return (np.concatenate([run.tasks[t].correct for t in tasks]),
            np.concatenate([ref.tasks[t].correct for t in tasks]))


def reference_margins(ref: Run, run: Run) -> np.ndarray:
    """The reference's choice margin [N] on the questions :func:`paired_scores` pairs, in its order (NaN where
    a question has no per-choice log-likelihoods)."""
    return np.concatenate([choice_margins(ref.tasks[t].loglik) for t in shared_tasks(ref, run)])


def replay_paths(ref: str | Path, runs: list[str | Path], margin_points: float, echo, orders: int = 200,
                 alpha: float = 0.05, part: int = 50, seed: int = 0, order: str = "uniform") -> list[Replay]:
    """Each run in ``runs`` against ``ref``: :func:`~ortevals.report.decide.replay` at ±``margin_points``, printed
    with ``echo``; ``order`` "guided" replays the uniform and the reference-guided order, both printed."""
    if not 0 < margin_points < 100:
        raise OrtEvalsError(f"--replay-decide {margin_points:g}: expected a margin in points, above 0 and below 100")
    if orders < 1:
        raise OrtEvalsError(f"--replay-orders {orders}: expected at least 1")
    if order not in ORDERS:
        raise OrtEvalsError(f"--order {order}: expected one of {', '.join(ORDERS)}")
    reference = load_run(ref)
    pairs = [(load_run(path), reference) for path in runs]
    scores = [(*paired_scores(reference, run), reference_margins(reference, run)) for run, _ in pairs]
    if order == "guided":
        for (run, _), (_, _, margins) in zip(pairs, scores):
            if not np.isfinite(margins).any():
                raise OrtEvalsError(f"--order guided: the reference {reference.path} holds no per-choice "
                                    f"log-likelihoods on the questions it shares with {run.path}")
    out = []
    for (run, _), (cand, base, margins) in zip(pairs, scores):
        lines = [f"{run.name} against {reference.name}:"]
        for name in ("uniform", "guided") if order == "guided" else ("uniform",):
            out.append(replay(cand, base, margin_points / 100, alpha, orders, part, seed=seed, order=name,
                              reference_margin=margins))
            lines += replay_lines(out[-1])
        if order == "guided":
            lines.append(saving_line(out[-2], out[-1]))
        echo("\n".join(lines))
    return out


def saving_line(uniform: Replay, guided: Replay) -> str:
    """How many fewer questions the guided order used than the uniform one, at the median."""
    a, b = float(np.median(uniform.used)), float(np.median(guided.used))
    return (f"  guided order: median {b:.0f} questions against {a:.0f} in a uniform order "
            f"({a / b:.2f}x {'fewer' if b <= a else 'as many'})")
