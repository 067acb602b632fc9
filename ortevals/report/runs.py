"""Reading finished runs: per task, one record per question.

A RUN is an ortevals ``--output`` folder (``results.json`` + ``samples_<task>.jsonl``,
see :func:`ortevals.report.results.write_outputs`), any lm-eval ``--output_path`` folder
(searched recursively for ``samples_<task>_<date>.jsonl`` from ``--log_samples``),
one such file, or lm-eval's in-memory results dict. Both layouts hold lm-eval's
per-sample records; lm-eval's EvaluationTracker stringifies ``resps`` and
``filtered_resps`` and turns ``arguments`` into ``{"gen_args_i": {"arg_j": …}}``,
so both forms are read here. Everything assumed about a record is checked: a
choice task's stored ``acc`` must equal "argmax of the log-likelihoods is the
gold choice", or the file is refused.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.report.model_info import describe, tokenizer_file

log = logging.getLogger(__name__)
CATEGORY_KEYS = ("category", "subject")
SCORE_METRICS = ("acc", "exact_match")  # the per-question 0/1 score compared
DATE_SUFFIX = re.compile(r"_\d{4}-\d{2}-\d{2}T[\d\-.]+$")  # lm-eval's date_id: isoformat with ':' -> '-'


@dataclass(frozen=True)
class Generations:
    """A generation task's outputs, per question ``[N]``: every sample (``--samples K``: K of them)."""

    outputs: tuple[tuple[str, ...], ...]  # [N][K] raw generated texts (``resps``)
    answers: tuple[tuple[str | None, ...], ...]  # [N][K] extracted answers (``filtered_resps``)
    tokens: tuple[tuple[int, ...], ...] | None  # [N][K] generated tokens where the run kept them (sample_tokens)
    max_gen_toks: np.ndarray  # [N] float64 the request's max_gen_toks, NaN where the arguments do not say


@dataclass(frozen=True)
class TaskRun:
    """One task of one run, sorted by doc_id. N questions, C = the most choices of any question."""

    task: str
    source: str  # the file it came from
    kind: str  # "choice" (per-choice log-likelihoods), "generation" or "other" (no per-choice scores)
    doc_id: np.ndarray  # [N] int64, ascending, unique
    doc_key: tuple[str, ...]  # [N] doc_hash, else the document's JSON
    prompt_key: tuple[str, ...]  # [N] prompt_hash, else the first request's context
    correct: np.ndarray  # [N] float64 0/1, NaN where the task has no 0/1 metric
    answer: tuple[str, ...]  # [N] the chosen choice's label, or the extracted answer of a generation
    gold: np.ndarray  # [N] int64 gold choice index, -1 where unknown or not a choice task
    loglik: np.ndarray  # [N, C] float64 per-choice log-likelihoods, -inf where a question has fewer choices
    labels: tuple[tuple[str, ...], ...]  # [N][C_i] the choices' continuations, stripped
    category: tuple[str | None, ...]  # [N]
    text: tuple[str, ...]  # [N] a generation's raw output, "" otherwise
    p_true: np.ndarray | None = None  # [N] --self-eval's P(True) of the proposed answer, NaN where none; None: none
    prompt: tuple[str, ...] = ()  # [N] the first request's context (the prompt's length: report/lengths.py)
    generations: Generations | None = None  # generation tasks

    @property
    def n(self) -> int:
        return len(self.doc_id)


@dataclass(frozen=True)
class Run:
    name: str  # a short label: the folder or file name
    path: str
    tasks: dict[str, TaskRun]
    model: str = ""  # what was scored, from the results' config (report/model_info.py), if the run says
    tokenizer: str = ""  # that model's tokenizer.json where the config names it and it is on disk, else ""


def run_config(path: Path) -> dict[str, Any]:
    """The ``config`` of a run folder's results file (ortevals' results.json, lm-eval's results_*.json) that says
    what was scored; {} where none does."""
    folder = path.parent if path.is_file() else path
    for f in [folder / "results.json", *sorted(folder.rglob("results_*.json"))]:
        if f.is_file():
            try:
                config = json.loads(f.read_text(encoding="utf-8")).get("config") or {}
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(config, dict) and describe(config):
                return config
    return {}


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Read a run folder or a samples file; a missing path or no samples is a one-line error."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OrtEvalsError(f"{path}: run not found (expected an ortevals --output folder, an lm-eval "
                            "--output_path folder or a samples_*.jsonl file)")
    files = [path] if path.is_file() else sorted(path.rglob("samples_*.jsonl"))
    if not files:
        raise OrtEvalsError(f"{path}: no samples_*.jsonl in this run (lm-eval needs --log_samples)")
    by_task: dict[str, Path] = {}
    for f in files:
        task = task_name(f)
        if task in by_task:
            raise OrtEvalsError(f"{path}: two sample files for task {task} ({by_task[task].name}, {f.name}); "
                                "pass one file as the run")
        by_task[task] = f
    tasks: dict[str, TaskRun] = {}
    for task, f in by_task.items():
        tasks.update(parse_task(task, read_jsonl(f), str(f)))
    label = name or (path.parent.name if path.is_file() else path.name)
    config = run_config(path)
    return Run(label, str(path), tasks, describe(config), tokenizer_file(config))


def run_from_results(results: dict[str, Any], name: str) -> Run:
    """A run from ``lm_eval.simple_evaluate``'s return value (samples logged), without files."""
    tasks: dict[str, TaskRun] = {}
    for task, samples in (results.get("samples") or {}).items():
        tasks.update(parse_task(task, samples, name))
    if not tasks:
        raise OrtEvalsError(f"{name}: the results hold no samples (log_samples was off)")
    config = results.get("config") or {}
    return Run(name, name, tasks, describe(config), tokenizer_file(config))


def task_name(file: Path) -> str:
    """``samples_<task>.jsonl`` (ortevals) or ``samples_<task>_<date>.jsonl`` (lm-eval) -> task."""
    stem = file.name.removesuffix(".jsonl")
    if not stem.startswith("samples_"):
        raise OrtEvalsError(f"{file}: expected a samples_<task>.jsonl file")
    return DATE_SUFFIX.sub("", stem.removeprefix("samples_"))


def read_jsonl(file: Path) -> list[dict[str, Any]]:
    records = []
    with open(file, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise OrtEvalsError(f"{file}:{i}: not JSON ({e.msg})") from None
    if not records:
        raise OrtEvalsError(f"{file}: empty samples file")
    return records


def parse_task(task: str, records: list[dict[str, Any]], source: str) -> dict[str, TaskRun]:
    """One TaskRun per filter: a task logged with several filters (gsm8k's two) becomes ``task[filter]``."""
    filters: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        filters.setdefault(str(r.get("filter", "none")), []).append(r)
    if len(filters) == 1:
        return {task: _task_run(task, records, source)}
    return {f"{task}[{f}]": _task_run(f"{task}[{f}]", recs, source) for f, recs in filters.items()}


def _task_run(task: str, records: list[dict[str, Any]], source: str) -> TaskRun:
    for r in records:
        missing = [k for k in ("doc_id", "filtered_resps", "arguments") if k not in r]
        if missing:
            raise OrtEvalsError(f"{source}: task {task}: a record lacks {', '.join(missing)} "
                                "(not an lm-eval samples file?)")
    records = sorted(records, key=lambda r: int(r["doc_id"]))
    ids = np.array([int(r["doc_id"]) for r in records], dtype=np.int64)
    if len(np.unique(ids)) != len(ids):
        dup = ids[np.flatnonzero(np.diff(ids) == 0)[0]]
        raise OrtEvalsError(f"{source}: task {task}: doc_id {dup} appears twice")
    args = [arguments(r["arguments"]) for r in records]
    kind = _kind(records, args)
    parsed = [_choice(r, a, source, task) if kind == "choice" else _other(r, kind) for r, a in zip(records, args)]
    width = max((len(p[2]) for p in parsed), default=0)
    loglik = np.full((len(records), max(width, 1)), -np.inf)
    for i, p in enumerate(parsed):
        loglik[i, :len(p[2])] = p[2]
    return TaskRun(
        task=task, source=source, kind=kind, doc_id=ids,
        doc_key=tuple(str(r.get("doc_hash") or json.dumps(r.get("doc"), sort_keys=True, default=str))
                      for r in records),
        prompt_key=tuple(str(r.get("prompt_hash") or _hash(a[0][0] if a and a[0] else "")) for r, a in
                         zip(records, args)),
        correct=np.array([_score(r) for r in records], dtype=np.float64),
        answer=tuple(p[0] for p in parsed), gold=np.array([p[1] for p in parsed], dtype=np.int64),
        loglik=loglik, labels=tuple(p[3] for p in parsed), category=tuple(_category(r) for r in records),
        text=tuple(p[4] for p in parsed), p_true=_p_true(records, loglik, kind),
        prompt=tuple(a[0][0] if a and a[0] else "" for a in args),
        generations=_generations(records) if kind == "generation" else None)


def _p_true(records: list[dict[str, Any]], loglik: np.ndarray, kind: str) -> np.ndarray | None:
    """Each record's ``p_true`` (ortevals --self-eval) of its proposed answer: a choice task's value for the
    chosen choice (argmax of the log-likelihoods), a generation's single value; None when no record has one."""
    out = np.full(len(records), np.nan)
    for i, r in enumerate(records):
        value = r.get("p_true")
        if kind == "choice" and isinstance(value, list) and len(value) == loglik.shape[1]:
            value = value[int(np.argmax(loglik[i]))]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
            out[i] = float(value)
    return out if np.isfinite(out).any() else None


def arguments(raw: Any) -> list[tuple[str, ...]]:
    """Each request's arguments; lm-eval's tracker writes ``{"gen_args_0": {"arg_0": ctx, "arg_1": cont}}``."""
    if isinstance(raw, dict):
        def idx(key: str) -> int:
            return int(key.rsplit("_", 1)[-1])
        return [tuple(str(raw[g][a]) for a in sorted(raw[g], key=idx)) for g in sorted(raw, key=idx)]
    return [tuple(str(x) for x in a) if isinstance(a, (list, tuple)) else (str(a),) for a in raw]


def _kind(records: list[dict[str, Any]], args: list[list[tuple[str, ...]]]) -> str:
    def pair(x: Any) -> bool:
        return isinstance(x, (list, tuple)) and len(x) == 2
    if all(len(a) >= 2 and all(pair(x) for x in r["filtered_resps"]) for r, a in zip(records, args)):
        return "choice"
    # ortevals' --samples writes null for an answer its filter could not extract (report/samples.py)
    if all(isinstance(x, str) or x is None for r in records for x in r["filtered_resps"]) and not any(
            pair(x) for r in records for x in r["filtered_resps"]):
        return "generation"
    return "other"


def _choice(r: dict[str, Any], args: list[tuple[str, ...]], source: str, task: str):
    """(answer label, gold index, log-likelihoods [C], labels [C], "") of a multiple-choice record."""
    try:
        ll = np.array([float(x[0]) for x in r["filtered_resps"]], dtype=np.float64)
    except (TypeError, ValueError):
        raise OrtEvalsError(f"{source}: task {task} doc_id {r['doc_id']}: filtered_resps are not "
                            "(log-likelihood, greedy) pairs") from None
    labels = tuple(a[1].strip() if len(a) > 1 else "" for a in args)
    pick = int(np.argmax(ll))  # lm-eval's acc: argmax of the raw log-likelihoods, first on ties
    score = _score(r)
    gold = _gold(r.get("target"), labels, pick, score)
    if gold >= 0 and not np.isnan(score) and "acc" in r and float(pick == gold) != score:
        raise OrtEvalsError(f"{source}: task {task} doc_id {r['doc_id']}: stored acc {score:g} disagrees with "
                            f"argmax of the log-likelihoods (choice {pick}, gold {gold})")
    return labels[pick], gold, ll, labels, ""


def _gold(target: Any, labels: tuple[str, ...], pick: int, score: float) -> int:
    """The gold choice index, -1 where unknown.

    An int target is an index; a str target is a choice's label, or an index that lm-eval's tracker
    stringified ("2"). Where both readings exist and differ, the one the stored score agrees with wins;
    if the score cannot tell them apart, the gold stays unknown rather than guessed.
    """
    if isinstance(target, int) and not isinstance(target, bool):
        return target if 0 <= target < len(labels) else -1
    text = str(target).strip()
    readings = []
    if text in labels:
        readings.append(labels.index(text))
    if text.isdigit() and int(text) < len(labels):
        readings.append(int(text))
    readings = list(dict.fromkeys(readings))
    if len(readings) > 1 and not np.isnan(score):
        readings = [g for g in readings if float(pick == g) == score] or readings
    return readings[0] if len(readings) == 1 else -1


def _other(r: dict[str, Any], kind: str):
    resps = r["filtered_resps"]
    answer = str(resps[0]) if resps and resps[0] is not None else ""
    raw = r.get("resps") or [[""]]
    text = raw[0][0] if isinstance(raw[0], (list, tuple)) and raw[0] else raw[0]
    return answer, -1, [], (), str(text) if kind == "generation" else ""


def _generations(records: list[dict[str, Any]]) -> Generations:
    """Every output of each question, its extracted answers, its token counts (all records: sample_tokens) and the
    request's max_gen_toks (its gen_kwargs: a dict, or the dict's text)."""
    outputs, answers, limits = [], [], []
    for r in records:
        raw = (r.get("resps") or [[""]])[0]
        outputs.append(tuple(str(x) for x in (raw if isinstance(raw, (list, tuple)) else [raw])))
        answers.append(tuple(None if a is None else str(a) for a in r["filtered_resps"]))
        limits.append(_max_gen_toks(r["arguments"]))
    counts = [r.get("sample_tokens") for r in records]
    tokens = tuple(tuple(int(x) for x in c) for c in counts) if all(
        isinstance(c, list) and len(c) == len(o) for c, o in zip(counts, outputs)) else None
    return Generations(tuple(outputs), tuple(answers), tokens, np.array(limits, np.float64))


def _max_gen_toks(raw: Any) -> float:
    """The first request's ``max_gen_toks`` (lm-eval's gen_kwargs, the second argument), NaN where not given."""
    first = next(iter(raw.values()), {}) if isinstance(raw, dict) else (raw[0] if raw else [])
    kwargs = (list(first.values()) if isinstance(first, dict) else list(first))[1:2]
    kw = kwargs[0] if kwargs else None
    if isinstance(kw, str):
        try:
            kw = ast.literal_eval(kw)
        except (ValueError, SyntaxError):
            kw = None
    value = kw.get("max_gen_toks") if isinstance(kw, dict) else None
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else float("nan")


def _score(r: dict[str, Any]) -> float:
    names = [m for m in SCORE_METRICS if m in r] + [m for m in r.get("metrics", []) if m in r]
    for m in names:
        v = r[m]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v in (0, 1):
            return float(v)
    return float("nan")


def _category(r: dict[str, Any]) -> str | None:
    doc = r.get("doc")
    if not isinstance(doc, dict):
        return None
    return next((str(doc[k]) for k in CATEGORY_KEYS if isinstance(doc.get(k), str)), None)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
