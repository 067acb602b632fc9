"""Calibration in a run's results (issue 24), computed after lm-eval from the samples it logged.

Owns, for every multiple-choice task of a finished run (``results["samples"]``):

* the numbers of :mod:`ortevals.report.calibration` in lm-eval's metric layout beside ``acc``
  (``ece,none``, ``ece_stderr,none``, …: :data:`METRICS`), again with a ``_norm`` suffix on acc_norm's
  length-normalised scores where the task logs acc_norm, with ``higher_is_better`` flags, so
  ortevals' table, lm-eval's ``make_table`` and Olive's metrics all show them; each Brier score names
  its scale (``brier_multiclass``: Σ over the choices, in [0, 2]; ``ptrue_brier_binary``: the binary
  mean, in [0, 1], as scikit-learn's ``brier_score_loss`` scales each); a temperature fitted on a bound
  of its search (no finite optimum) is reported as ``temperature_at_bound`` with ``ece_at_temperature_bound``,
  never as a fitted ``temperature`` / ``ece_scaled``;
* ``results["calibration"][task]``: the reliability bins and how the temperature was fitted;
* P(True) (``--self-eval``) from the scores the caller collected: ``ptrue_auroc``, ``ptrue_ece``,
  ``ptrue_brier``, ``ptrue_mean`` (choice tasks: of the chosen choice; generation tasks: of the
  generated answer against its exact_match), and each sample's ``p_true``;
* ``temperature_fit=split``: copies of the tasks on their validation (else few-shot) split, named
  ``<task>@<split>`` and run with the rest (made before the run: :func:`ortevals.tasks.with_fit_split`),
  whose questions fit the temperature, detached from the results after it;
* ``reliability_<task>.png`` and ``risk_coverage_<task>.png`` in ``--output``.

Only numpy and scipy work on log-likelihoods already held; nothing here runs the model.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.files import atomic_write, atomic_write_bytes
from ortevals.report import calibration as cal
from ortevals.report.runs import TaskRun, arguments, parse_task
from ortevals.report.stats import Interval

log = logging.getLogger(__name__)
FIT_MARK = "@"  # <task>@<split>: the copy of a task whose questions fit the temperature
# metric name, Calibration field (dotted), higher is better (None: no direction, a temperature)
METRICS = (("ece", "ece", False), ("ece_mass", "ece_mass", False), ("brier_multiclass", "brier", False),
           ("nll", "nll", False), ("aurc", "aurc", False), ("selective_acc@50", "acc_at_half", True),
           ("auroc", "auroc", True), ("temperature", "temperature.value", None),
           ("ece_scaled", "temperature.ece", False))
AT_BOUND = {"temperature": "temperature_at_bound", "ece_scaled": "ece_at_temperature_bound"}  # no finite optimum
PTRUE = (("ptrue_auroc", "auroc", True), ("ptrue_ece", "ece", False), ("ptrue_brier_binary", "brier", False))
BOUND_NOTE = ("the NLL keeps falling up to the search's bound T = {:g}: no finite temperature fits (a model near "
              "chance, or one right on every question); ece_at_temperature_bound is the ECE at that bound")
SelfEvalScores = Mapping[tuple[str, int], Mapping[int, tuple[float, float]]]  # (task, doc_id) -> idx -> (A, B)


def add_calibration(results: dict[str, Any], output: Path | None = None,
                    self_eval: SelfEvalScores | None = None) -> list[Path]:
    """Calibration metrics (and P(True) where ``self_eval`` has scores) into ``results``; PNGs into
    ``output``. Returns the PNG paths written."""
    samples = results.get("samples") or {}
    fits = {name.rsplit(FIT_MARK, 1)[0]: name for name in samples if FIT_MARK in name}
    written: list[Path] = []
    for task, records in samples.items():
        if FIT_MARK in task:
            continue
        for filt, run in _task_runs(task, records).items():
            plots = _one_task(results, task, filt, run, records, _fit_arrays(samples.get(fits.get(task, "")), task),
                              fits.get(task, ""), self_eval)
            if output is not None and plots:
                written += _write_plots(output, run.task, *plots)
    return written + _detach_fits(results, list(fits.values()), output)


def _detach_fits(results: dict[str, Any], names: list[str], output: Path | None) -> list[Path]:
    """Take the ``<task>@<split>`` copies out of the run's results (its table, accuracy and comparisons are
    about the test split); their samples go to ``output`` on their own, their accuracy into
    ``results["calibration"]``."""
    written = []
    for name in names:
        records = results["samples"].pop(name)
        base = name.rsplit(FIT_MARK, 1)[0]
        acc = results.get("results", {}).get(name, {}).get("acc,none")
        results.setdefault("calibration", {}).setdefault(base, {})["fit_split"] = {
            "task": name, "questions": len(records), "acc": acc}
        for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            (results.get(key) or {}).pop(name, None)
        if output is not None:
            path = output / f"calibration_fit_{name}.jsonl"  # not samples_*: compare reads those as tasks
            atomic_write(path, "".join(json.dumps(r, default=str, ensure_ascii=False) + "\n" for r in records))
            written.append(path)
    return written


def _one_task(results, task: str, filt: str, run: TaskRun, records, fit, fit_name: str, self_eval):
    """Metrics of one task and filter into ``results``; the plot series, or None when nothing applies."""
    entry = results.setdefault("results", {}).setdefault(task, {})
    flags = results.setdefault("higher_is_better", {}).setdefault(task, {})
    series, risks = [], []
    if run.kind == "choice" and (run.gold >= 0).any():
        c = cal.calibrate(run.loglik, run.gold, fit, f"{fit_name.rsplit(FIT_MARK, 1)[-1]} split")
        entry.update(metric_entries(c, filt))
        flags.update({name: better for name, _, better in metric_names(c)})
        conf, correct = cal.confidence(*cal.known(run.loglik, run.gold))
        rel = cal.reliability(conf, correct)
        results.setdefault("calibration", {})[run.task] = describe(c, rel)
        series.append((f"choice confidence (ECE {c.ece.estimate:.3f})", rel))
        risks.append((f"choice confidence (AURC {c.aurc.estimate:.3f})", cal.risk_curve(conf, correct)))
        norm = _normalised(results, task, records, run)
        if norm is not None:
            scaled = cal.calibrate(norm, run.gold)
            entry.update(metric_entries(scaled, filt, "_norm"))
            flags.update({name: better for name, _, better in metric_names(scaled, "_norm")})
    found = _p_true(task, run, self_eval) if self_eval else None
    if found is not None:
        ptrue, correct, by_doc = found
        s = cal.self_eval(ptrue, correct)
        entry.update(_entries(((n, _get(s, f), b) for n, f, b in PTRUE), filt) | {f"ptrue_mean,{filt}": s.mean})
        flags.update({name: better for name, _, better in PTRUE})
        for r in records:  # each sample keeps its P(True), so the numbers can be redrawn from the file
            r["p_true"] = by_doc.get(int(r["doc_id"]))
        series.append((f"P(True) (ECE {s.ece.estimate:.3f})", cal.reliability(ptrue, correct)))
        risks.append((f"P(True) (AURC {float(cal.aurc(ptrue, correct)):.3f})", cal.risk_curve(ptrue, correct)))
    return (series, risks) if series else None


def metric_names(c: cal.Calibration, suffix: str = "") -> list[tuple[str, str, bool | None]]:
    """(metric name, Calibration field, higher is better) of one Calibration: the temperature's only where one was
    fitted, named ``AT_BOUND``'s way where the fit stopped on a bound of its search."""
    t = c.temperature
    bound = AT_BOUND if t is not None and t.at_bound else {}
    return [(f"{bound.get(name, name)}{suffix}", field, better) for name, field, better in METRICS
            if t is not None or not field.startswith("temperature")]


def metric_entries(c: cal.Calibration, filt: str, suffix: str = "") -> dict[str, Any]:
    """``{"ece,none": …, "ece_stderr,none": …, …}`` for one Calibration (lm-eval's ``name,filter`` keys)."""
    return _entries(((name, _get(c, field), better) for name, field, better in metric_names(c, suffix)), filt)


def _entries(items, filt: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value, _ in items:
        out[f"{name},{filt}"] = _number(value.estimate)
        out[f"{name}_stderr,{filt}"] = _number(value.se)
    return out


def _get(obj: Any, dotted: str) -> Interval:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _number(x: float) -> float | str:
    return float(x) if math.isfinite(x) else "N/A"  # lm-eval's spelling of a missing value


def describe(c: cal.Calibration, rel: cal.Reliability) -> dict[str, Any]:
    """The JSON block ``results["calibration"][task]``: counts, the bins, the temperature's provenance."""
    t = c.temperature

    def listed(x: np.ndarray) -> list:
        return [float(v) if math.isfinite(v) else None for v in x]

    return {"questions": c.n, "accuracy": c.accuracy, "bin_rule": "as sklearn's calibration_curve: a value on "
            "an edge goes to the bin below", "temperature_fitted_on": t.fitted_on if t else None,
            "temperature_at_bound": t.at_bound if t else None,
            **({"temperature_bound": BOUND_NOTE.format(t.value.estimate)} if t and t.at_bound else {}),
            "reliability": {"edges": listed(rel.edges), "count": [int(v) for v in rel.count],
                            "accuracy": listed(rel.accuracy), "confidence": listed(rel.confidence)}}


def _task_runs(task: str, records: list[dict]) -> dict[str, TaskRun]:
    """The task's TaskRun per filter; a file lm-eval's reader refuses is skipped with a warning."""
    try:
        parsed = parse_task(task, records, task)
    except OrtEvalsError as e:
        log.warning("calibration: task %s skipped: %s", task, e)
        return {}
    if len(parsed) == 1:
        return {str(records[0].get("filter", "none")): next(iter(parsed.values()))}
    return {name[len(task) + 1:-1]: run for name, run in parsed.items()}


def _fit_arrays(records: list[dict] | None, task: str) -> tuple[np.ndarray, np.ndarray] | None:
    if not records:
        return None
    runs = _task_runs(f"{task}{FIT_MARK}fit", records)
    run = next(iter(runs.values()), None)
    return (run.loglik, run.gold) if run is not None and run.kind == "choice" else None


def _normalised(results, task: str, records: Sequence[dict], run: TaskRun) -> np.ndarray | None:
    """acc_norm's scores, log-likelihood / characters of the choice (lm-eval's ``completion_len``), [N, C];
    None unless the task logs acc_norm and argmax of them reproduces every stored acc_norm."""
    if not records or "acc_norm" not in records[0]:
        return None
    delim = str((results.get("configs", {}).get(task) or {}).get("target_delimiter", " "))
    by_doc = {int(r["doc_id"]): r for r in records}
    lengths = np.full(run.loglik.shape, np.nan)
    for i, doc in enumerate(run.doc_id):
        for j, cont in enumerate(a[1] for a in arguments(by_doc[int(doc)]["arguments"])):
            lengths[i, j] = len(cont[len(delim):] if cont.startswith(delim) else cont)
    with np.errstate(invalid="ignore", divide="ignore"):
        norm = np.where(np.isfinite(run.loglik), run.loglik / lengths, -np.inf)
    stored = np.array([float(by_doc[int(d)]["acc_norm"]) for d in run.doc_id])
    known = run.gold >= 0
    if not np.all((np.argmax(norm, axis=1) == run.gold)[known] == stored[known].astype(bool)):
        log.warning("calibration: task %s: acc_norm is not argmax(log-likelihood / characters); "
                    "no _norm calibration", task)
        return None
    return norm


def _p_true(task: str, run: TaskRun, scores: SelfEvalScores):
    """([M] P(True) of each proposed answer, [M] its 0/1 correctness, doc_id -> P(True) per choice or of
    the generation) over the questions that have self-eval scores; None when none has."""
    ptrue, correct, by_doc = [], [], {}
    for i, doc in enumerate(run.doc_id):
        pairs = scores.get((task, int(doc)))
        if not pairs or np.isnan(run.correct[i]):
            continue
        p = {k: float(cal.p_true(a, b)) for k, (a, b) in pairs.items()}
        pick = int(np.argmax(run.loglik[i])) if run.kind == "choice" else 0
        if pick not in p:
            continue
        by_doc[int(doc)] = [p[k] for k in sorted(p)] if run.kind == "choice" else p[0]
        ptrue.append(p[pick])
        correct.append(run.correct[i])
    if not ptrue:
        return None
    return np.array(ptrue), np.array(correct), by_doc


def _write_plots(output: Path, name: str, series, risks) -> list[Path]:
    from ortevals.report.calibration_plots import reliability_png, risk_coverage_png  # matplotlib: only with --output

    output.mkdir(parents=True, exist_ok=True)
    safe = name.replace("/", "_").replace("[", "_").replace("]", "")
    paths = [output / f"reliability_{safe}.png", output / f"risk_coverage_{safe}.png"]
    atomic_write_bytes(paths[0], reliability_png(series, f"{name}: reliability (10 equal-width bins)"))
    atomic_write_bytes(paths[1], risk_coverage_png(risks, f"{name}: risk against coverage"))
    return paths


