"""A benchmark's table: each row's figures from its runs, and its statistics against the reference row.

Owns :class:`Row` (frozen: what the table, ``bench.json`` and ``ortevals.bench.run`` give) and
:func:`table_rows`. Timings are medians over a row's runs (with the fastest and slowest wall time); the
rate is the requests (or generated tokens, counted with the reference row's tokenizer) of one run over its
median wall time from launch to exit; peak device memory is the median of NVML's peaks (watch.py), else
what the backend reported itself. Answers come from the row's first run; the statistics against the
reference row are those of ``ortevals compare`` (report/compare.py's alignment and report/stats.py's
functions) pooled over the tasks, on the questions both rows ran: Wilson's interval for accuracy,
correctness flips, McNemar's exact p, the mean KL(reference‖row) of each question's distribution over its
choices, identical answers and the largest |Δ log-likelihood| of a choice.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ortevals.bench.measure import RunRecord
from ortevals.bench.plan import Plan
from ortevals.bench.spec import RowSpec
from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.report import stats
from ortevals.report.compare import align
from ortevals.report.runs import Run, TaskRun, load_run, read_jsonl


@dataclass(frozen=True)
class Paired:
    """A row against the reference on the N questions both ran, tasks pooled; C = the most choices."""

    n: int
    flips: stats.Flips
    mcnemar_p: float
    choice_kl: float | None  # mean KL(ref‖row) in nats over the choice questions; None: no choice task
    max_abs_dll: float | None  # largest |Δ log-likelihood| of any choice; None: no choice task


@dataclass(frozen=True)
class Row:
    label: str
    backend: str
    target: str
    args: str
    cache: str | None
    status: str  # "ok", "failed", "not installed", or "interrupted" (Ctrl-C came before any run of it finished)
    note: str  # why it failed or was not run ("" when ok)
    is_ref: bool
    runs: int  # timed runs the figures are over
    questions: int | None = None
    requests: int | None = None
    generated_tokens: int | None = None  # counted with the reference row's tokenizer (generation tasks)
    wall_s: float | None = None  # median, launch to exit
    wall_min_s: float | None = None
    wall_max_s: float | None = None
    rate: float | None = None  # requests/s or tokens/s over the median wall time
    x_ref: float | None = None  # rate over the reference row's
    first_result_s: float | None = None  # median: launch to the first finished item on its progress bar
    peak_rss_mib: float | None = None  # median of each run's peak
    device_mib: float | None = None  # peak device memory: median of NVML's per run, else the backend's own report
    device_source: str | None = None  # "nvml-process", "nvml-device-delta", "ortevals", "torch"; None: not measured
    size_mib: float | None = None  # the target folder on disk
    accuracy: stats.Interval | None = None  # Wilson 95% over the row's own questions
    paired: Paired | None = None  # against the reference (None for it, and when not comparable)
    repeat_same: bool | None = None  # every later run gave the first run's answers (None: one run)
    mfu: float | None = None  # ortevals rows with --peak-tflops: the engine's share of the device's peak (mfu())
    decision: dict | None = None  # --decide: the first run's results.json ``decide`` less its looks (decision.py)


SAMPLES_NOTE = ("not compared with the reference: with --samples each backend keeps its own draws (ortevals every "
                "sample's answer, lm-eval the first's)")


def table_rows(plan: Plan, records: dict[str, list[RunRecord]], rate: str, samples: bool = False,
               peak_flops: float | None = None, interrupted: bool = False) -> list[Row]:
    """The table, in the plan's order; comparisons need the reference row to have run (``samples``: K samples a
    question were drawn, so no row's answers are compared; ``peak_flops``: each ortevals row's :func:`mfu`;
    ``interrupted``: Ctrl-C stopped the benchmark, and a row with no finished run says so)."""
    rows = [_row(spec, records[spec.label], spec.label == plan.ref, interrupted) for spec in plan.rows]
    by_label = {r.label: r for r in rows}
    ref = by_label[plan.ref]
    ref_run = _first_run(records[plan.ref]) if ref.status == "ok" else None
    count = _counter(next(s for s in plan.rows if s.label == plan.ref).target) if rate == "tokens" else None
    out = []
    for spec, row in zip(plan.rows, rows):
        if row.status != "ok":
            out.append(row)
            continue
        requests, tokens = counts(records[spec.label][0].folder, count)
        row = replace(row, requests=requests, generated_tokens=tokens,
                      rate=(tokens if rate == "tokens" else requests) / row.wall_s,
                      mfu=mfu(spec.target, records[spec.label][0].folder, peak_flops)
                      if peak_flops and spec.backend == "ortevals" else None)
        if samples and not row.is_ref:
            row = replace(row, note=SAMPLES_NOTE)
        elif ref_run is not None and not row.is_ref:
            try:
                row = replace(row, paired=paired(ref_run, _first_run(records[spec.label])))
            except OrtEvalsError as e:  # another prompt or document: said, never compared
                row = replace(row, note=f"not compared with the reference: {e}")
        out.append(row)
    ref_rate = next(r.rate for r in out if r.is_ref)
    return [replace(r, x_ref=r.rate / ref_rate) if r.rate and ref_rate else r for r in out]


def _row(spec: RowSpec, recs: list[RunRecord], is_ref: bool, interrupted: bool = False) -> Row:
    base = dict(label=spec.label, backend=spec.backend, target=spec.target, args=spec.args, cache=spec.cache,
                is_ref=is_ref, size_mib=folder_mib(Path(spec.target)))
    if spec.missing:
        return Row(status="not installed", note=spec.missing, runs=0, **base)
    if interrupted and not recs:
        return Row(status="interrupted", note="no run finished before Ctrl-C", runs=0, **base)
    failed = next((r for r in recs if r.failure), None)
    if failed is not None or not recs:
        return Row(status="failed", note=failed.failure if failed else "not run", runs=0, **base)
    walls = [r.watched.wall_s for r in recs]
    firsts = [r.watched.first_result_s for r in recs if r.watched.first_result_s is not None]
    run = _first_run(recs)
    correct = np.concatenate([np.nan_to_num(t.correct) for t in run.tasks.values()])
    return Row(status="ok", note="", runs=len(recs), questions=len(correct),
               wall_s=statistics.median(walls), wall_min_s=min(walls), wall_max_s=max(walls),
               first_result_s=statistics.median(firsts) if firsts else None,
               peak_rss_mib=statistics.median(r.watched.peak_rss_mib for r in recs),
               **_device(recs), accuracy=stats.wilson(int(correct.sum()), len(correct)),
               repeat_same=_same_answers(recs) if len(recs) > 1 else None, decision=_decision(recs[0].folder),
               **base)


def paired(ref: Run, run: Run) -> Paired:
    """``run`` against ``ref`` on the questions of ``run`` (``ref`` may hold more), every task they share."""
    tasks = [t for t in ref.tasks if t in run.tasks]
    if not tasks:
        raise OrtEvalsError(f"{run.name} shares no task with {ref.name}")
    ref = Run(ref.name, ref.path, {t: subset(ref.tasks[t], run.tasks[t].doc_id) for t in tasks}, ref.model)
    for t in tasks:
        align(ref, run, t)  # the same documents, prompts and choices, or one line saying which differs
    a, b = [ref.tasks[t] for t in tasks], [run.tasks[t] for t in tasks]
    ra, rb = (np.concatenate([np.nan_to_num(t.correct) for t in x]) for x in (a, b))
    fl = stats.flips(ra, rb, [v for t in a for v in t.answer], [v for t in b for v in t.answer])
    choice = [(x, y) for x, y in zip(a, b) if x.kind == "choice"]
    kl = dll = None
    if choice:
        width = max(t.loglik.shape[1] for pair in choice for t in pair)
        la, lb = (_pad([p[i].loglik for p in choice], width) for i in (0, 1))
        kl = float(np.mean(stats.kl(log_softmax(la, np.float64), log_softmax(lb, np.float64))))
        finite = np.isfinite(la) & np.isfinite(lb)
        dll = float(np.max(np.abs(la[finite] - lb[finite]))) if finite.any() else None
    return Paired(len(ra), fl, stats.mcnemar_p(fl.correct_to_wrong, fl.wrong_to_correct), kl, dll)


def subset(task: TaskRun, doc_ids: np.ndarray) -> TaskRun:
    """``task`` on the questions ``doc_ids`` only (each must be among its own)."""
    keep = np.isin(task.doc_id, doc_ids)
    if keep.sum() != len(np.unique(doc_ids)):
        missing = np.setdiff1d(doc_ids, task.doc_id)
        raise OrtEvalsError(f"task {task.task}: doc_id {missing[0]} is not among the reference's questions")
    idx = np.flatnonzero(keep)

    def pick(values):
        return tuple(values[i] for i in idx)
    return replace(task, doc_id=task.doc_id[idx], doc_key=pick(task.doc_key), prompt_key=pick(task.prompt_key),
                   correct=task.correct[idx], answer=pick(task.answer), gold=task.gold[idx], loglik=task.loglik[idx],
                   labels=pick(task.labels), category=pick(task.category), text=pick(task.text),
                   p_true=None if task.p_true is None else task.p_true[idx])


def _pad(arrays: list[np.ndarray], width: int) -> np.ndarray:
    """[N_i, C_i] log-likelihood blocks stacked to [ΣN, width], ``-inf`` for choices a question lacks."""
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-np.inf) for a in arrays])


def counts(folder: Path, count_tokens=None) -> tuple[int, int | None]:
    """(requests, generated tokens) of a run's samples: each lm-eval request once (a task logged under several
    filters is counted under its first), the generated texts' tokens by ``count_tokens`` (None: not counted)."""
    requests, tokens = 0, 0
    for f in sorted(folder.glob("samples_*.jsonl")):
        records = read_jsonl(f)
        first = str(records[0].get("filter", "none"))
        for rec in (r for r in records if str(r.get("filter", "none")) == first):
            for resp in rec["resps"]:
                requests += len(resp)
                if count_tokens is not None:
                    tokens += sum(count_tokens(x) for x in resp if isinstance(x, str))
    return requests, tokens if count_tokens is not None else None


def _counter(target: str):
    """Token counts of text by the tokenizer.json of ``target`` (no special tokens added)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _decision(folder: Path) -> dict | None:
    """A decided run's ``decide`` record without its per-part looks (those stay in the run's results.json)."""
    record = _results(folder).get("decide")
    return {k: v for k, v in record.items() if k != "looks"} if record else None


def _first_run(recs: list[RunRecord]) -> Run:
    return load_run(recs[0].folder, recs[0].row)


def _same_answers(recs: list[RunRecord]) -> bool:
    first = _first_run(recs)
    for rec in recs[1:]:
        later = load_run(rec.folder, rec.row)
        if set(later.tasks) != set(first.tasks) or any(
                later.tasks[t].answer != first.tasks[t].answer for t in first.tasks):
            return False
    return True


def _device(recs: list[RunRecord]) -> dict:
    """A row's peak device memory: the median of what NVML saw for each run's process, else what the first run
    reported itself (ortevals' results.json efficiency, or the child's torch reading)."""
    sampled = [r.watched for r in recs if r.watched.device_mib is not None]
    if sampled:
        return {"device_mib": statistics.median(w.device_mib for w in sampled),
                "device_source": sampled[0].device_source}
    body = _results(recs[0].folder)
    own = _efficiency(body).get("peak_device_mib")
    torch = (body.get("bench") or {}).get("peak_device_mib")
    if own is not None:
        return {"device_mib": own, "device_source": "ortevals"}
    return {"device_mib": torch, "device_source": "torch"} if torch is not None else {}


def mfu(target: str, folder: Path, peak_flops: float) -> float | None:
    """Model FLOPs utilisation of an ortevals run: 2 x the matrix weights (the package's parameters less the
    embedding table, which is gathered, not multiplied) x the positions its passes computed over the seconds inside
    them (its results.json efficiency: rows x width of every pass, so padding counts as work: a batch's, a device's
    shape buckets; the engine feeds its passes an all-ones mask, docs/runtime-facts.md), against ``peak_flops``;
    attention's and the LM head's extra FLOPs at the scored positions are not counted. None where the run metered
    no pass."""
    eff = _efficiency(_results(folder))
    tokens = (eff.get("prefill_tokens") or 0) + (eff.get("decode_tokens") or 0)
    seconds = (eff.get("prefill_s") or 0) + (eff.get("decode_s") or 0)
    if not tokens or not seconds:
        return None
    package = ModelPackage.load(target)
    matrix = package.parameters - package.vocab_size * (package.config["model"]["decoder"].get("hidden_size") or 0)
    return 2 * matrix * tokens / seconds / peak_flops


def _results(folder: Path) -> dict:
    try:
        return json.loads((folder / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _efficiency(body: dict) -> dict:
    return (body.get("efficiency") or {}).get("overall") or {}


def folder_mib(path: Path) -> float | None:
    """The files under ``path``, MiB (1 MiB = 2^20 bytes); None where it cannot be read."""
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    except OSError:
        return None

