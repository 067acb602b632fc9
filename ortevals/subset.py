"""``--sample N [--seed S]``: which questions a sampled run scores, and the whole-set estimate it reports.

Owns the draw for ``ortevals mmlu-pro`` and ``ortevals run``: every task's evaluation documents are read as
lm-eval reads them (its own task objects, built from the run's specs; a group expanded to its tasks), the
strata are the documents' categories where they carry one (MMLU-Pro's 14; a ``category`` or ``subject`` field),
else the tasks (a group's subtasks), and report/sampling.py draws N questions stratified by them. The run scores
exactly those documents through lm-eval's ``samples``; after it, :meth:`SamplePlan.record` turns each scored
question's 0/1 score into ``results["sample"]``: the draw and the whole-set accuracy estimate with its interval.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.presets import reword_data_error
from ortevals.report import sampling
from ortevals.report.results import CATEGORY_KEYS, SAMPLE_METRICS
from ortevals.tasks import leaf_configs


@dataclass(frozen=True)
class SamplePlan:
    """A drawn sample: N, seed, the strata (names, whole-set sizes) and, per task, the stratum of each document
    scored by its index in the task's documents (the ``doc_id`` lm-eval logs for a document of ``samples``)."""

    n: int
    seed: int
    strata_by: str  # "category" or "task"
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strata: dict[str, dict[int, int]]

    def record(self, results: dict[str, Any]) -> dict:
        """``results["sample"]`` (report/sampling.py ``record``) from lm-eval's logged samples: each scored
        question's score (acc, exact_match or acc_norm; the first filter of its task) counted in its stratum."""
        taken, right = np.zeros(len(self.names), np.int64), np.zeros(len(self.names))
        for task, logged in (results.get("samples") or {}).items():
            codes = self.strata.get(task)
            first = logged[0].get("filter", "none") if logged else None
            for s in logged:
                value = next((s[m] for m in SAMPLE_METRICS if isinstance(s.get(m), (int, float))), None)
                if codes is None or value is None or s.get("filter", "none") != first:
                    continue
                taken[codes[int(s["doc_id"])]] += 1
                right[codes[int(s["doc_id"])]] += float(value)
        return sampling.record(self.n, self.seed, self.strata_by, self.names, self.sizes, taken, right)


def check_sample(sample: int | None, limit: int | None, seed: int | None) -> None:
    """--sample with --limit, or --seed without --sample: one line before any work."""
    if sample is not None and limit is not None:
        raise OrtEvalsError(f"--sample {sample} and --limit {limit}: give one (--limit scores the first N questions, "
                            "--sample N drawn at random within each category)")
    if seed is not None and sample is None:
        raise OrtEvalsError(f"--seed {seed} seeds --sample's draw: add --sample N")


def apply_sample(specs: list, n: int, seed: int, task_manager) -> tuple[list, dict[str, list[int]], SamplePlan]:
    """``--sample n --seed seed`` on the run's task specs (names or configs): the leaf tasks holding sampled
    questions (as configs), lm-eval's ``samples`` (each task's document indices, ascending) and the plan."""
    from lm_eval.tasks._yaml_loader import load_yaml

    configs = [c for t in specs for c in ([t] if isinstance(t, dict) else leaf_configs(task_manager, t, load_yaml))]
    try:
        built = task_manager.load(configs)["tasks"]  # lm-eval 0.4.13: task name -> Task
    except OrtEvalsError:
        raise
    except Exception as e:  # datasets/hub raise many types; only data problems are re-worded
        reword_data_error(e, configs, None)
        raise
    tasks = {str(k): v for k, v in built.items()}
    keys, owner, position = [], [], []
    for cfg in configs:
        docs = tasks[cfg["task"]].eval_docs
        cats = _categories(docs)
        keys += [(cfg["task"], c) for c in cats]
        owner += [cfg["task"]] * len(cats)
        position += range(len(cats))
    if not keys:
        raise OrtEvalsError(f"--sample {n}: the tasks hold no documents to draw from")
    by_category = any(c is not None for _, c in keys)
    owners = defaultdict(set)  # a category in several tasks is named with its task
    for t, c in set(keys):
        owners[c].add(t)
    labels = [(c if len(owners[c]) == 1 else f"{t}/{c}") if by_category and c is not None else t for t, c in keys]
    names, codes = np.unique(np.array(labels, dtype=object), return_inverse=True)
    chosen = sampling.draw(codes, n, seed)
    samples: dict[str, list[int]] = defaultdict(list)
    strata: dict[str, dict[int, int]] = defaultdict(dict)
    for i in chosen:
        samples[owner[i]].append(int(position[i]))
        strata[owner[i]][int(position[i])] = int(codes[i])
    kept = [c for c in configs if c["task"] in samples]
    plan = SamplePlan(n, seed, "category" if by_category else "task", tuple(str(x) for x in names),
                      tuple(int(x) for x in np.bincount(codes, minlength=len(names))),
                      dict(strata))
    return kept, dict(samples), plan


def _categories(docs) -> list[str | None]:
    """Each document's category (the first of report/results.py's CATEGORY_KEYS it holds as text), else None."""
    columns = getattr(docs, "column_names", None)
    if columns is not None:
        key = next((k for k in CATEGORY_KEYS if k in columns), None)
        return [x if isinstance(x, str) else None for x in docs[key]] if key else [None] * len(docs)
    return [next((d[k] for k in CATEGORY_KEYS if isinstance(d, dict) and isinstance(d.get(k), str)), None)
            for d in docs]
