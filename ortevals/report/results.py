"""Run results: summary records, the final table, and files on disk.

Owns turning lm-eval's results dict into a :class:`RunSummary` and the text the CLI prints:

* one row per task, filter and metric with its stderr, as lm-eval's own table (gsm8k's
  ``strict-match`` and ``flexible-extract`` are two rows, never averaged together);
* accuracy per category when the documents carry one, and the overall accuracy per filter over
  every task's questions, each question counted once per filter;
* with ``--samples K`` the headline is the k=1 estimate (every sample of every question, not the
  first sample lm-eval's ``exact_match`` scores) with its interval, then maj@k / pass@k / best@k;
* questions, requests, the run's clock in parts that add up (start-up to the first pass + scoring to the
  end of lm-eval's evaluation + after it = seconds since launch), requests/s of the engine's time, then
  the efficiency line (report/efficiency.py), the scoring mode, what was scored, the workers.

A statistic with no value (one question has no standard error) prints as ``n/a`` and is ``null``
in the files. Writes lm-eval's results JSON (strict: no bare NaN, listing the run's files) plus per-sample
JSONL, and names the files an earlier run left in the same ``--output`` folder that this run's set replaces
(:func:`stale_outputs`; the caller publishes the set: files.py ``publish``).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ortevals.errors import first_line
from ortevals.files import atomic_write, json_text
from ortevals.report.efficiency import summary_line, timeline_text
from ortevals.report.model_info import describe
from ortevals.report.scaling import DEFINITIONS as ESTIMATOR_DEFINITIONS
from ortevals.report.selection import DEFINITIONS as SELECTOR_DEFINITIONS
from ortevals.report.selection import SELECTORS

log = logging.getLogger(__name__)
CATEGORY_KEYS = ("category", "subject")
SAMPLE_METRICS = ("acc", "exact_match", "acc_norm")  # the per-question score a category averages
SKIP_KEYS = ("alias", "name", "sample_len", " ")
TABLE_ESTIMATORS = ("maj", "pass", "best", "bon", "weighted_maj", "bon_certainty")  # the PRM variants: rows only
DEFINITIONS = {**ESTIMATOR_DEFINITIONS, **SELECTOR_DEFINITIONS}  # every @k metric's estimator, in one line


@dataclass(frozen=True)
class MetricRow:
    """One line of lm-eval's table: a task's metric under one filter."""

    task: str
    filter: str  # lm-eval's filter name; "none" for a task without filters
    metric: str
    value: float | None
    stderr: float | None  # None: lm-eval has none, or it is not a number (one question)


@dataclass(frozen=True)
class CategoryScore:
    task: str
    category: str
    questions: int
    accuracy: float
    filter: str = "none"


@dataclass(frozen=True)
class Overall:
    """The accuracy over every task's questions under one filter (a question counted once)."""

    filter: str
    value: float
    questions: int
    low: float | None = None  # a 95% interval where one is known (the k=1 estimate of --samples)
    high: float | None = None
    label: str = ""


@dataclass(frozen=True)
class RunSummary:
    rows: tuple[MetricRow, ...]
    categories: tuple[CategoryScore, ...]
    questions: int  # distinct (task, document) pairs
    requests: int
    overall: tuple[Overall, ...]
    seconds: float  # lm-eval's evaluation (simple_evaluate), its data loading included
    model_seconds: float  # time inside the scoring engine (requests/s)
    peak_rss_mb: float = 0.0  # the process's peak resident memory
    reused: int = 0  # requests answered from the result store (a resumed run), not in ``requests``
    mode: str = ""  # how requests were scored and why: "batched (canary passed …)", "exact (…)", resumed
    model: str = ""  # what was scored (report/model_info.py)
    workers: str = ""  # "4 Ray workers (local cluster)" when the run was data parallel
    scaling: dict | None = None  # --samples: results["scaling"] (pooled curve points)
    notes: tuple[str, ...] = ()  # what an option meant in this run (--limit)
    efficiency: dict | None = None  # results["efficiency"]["overall"] (report/efficiency.py)
    search: dict | None = None  # --search: results["search"] (run/search.py search_record)

    @property
    def requests_per_s(self) -> float:
        """Requests per second of scoring time, the figure the benchmarks compare."""
        return self.requests / self.model_seconds if self.model_seconds > 0 else 0.0

    @property
    def metrics(self) -> dict[str, dict[str, float | None]]:
        """task -> ``metric,filter`` -> value (lm-eval's keys)."""
        out: dict[str, dict[str, float | None]] = defaultdict(dict)
        for r in self.rows:
            out[r.task][f"{r.metric},{r.filter}"] = r.value
        return dict(out)


def summarize(results: dict[str, Any], requests: int, seconds: float, model_seconds: float,
              reused: int = 0, mode: str = "", workers: str = "", notes: tuple[str, ...] = (),
              efficiency: dict | None = None) -> RunSummary:
    """Build the summary from ``lm_eval.simple_evaluate``'s return value."""
    scaling = results.get("scaling")
    if scaling and results.get("verifier"):  # --verifier (issue 25): its cost, shown under the scaling table
        scaling = {**scaling, "verifier": results["verifier"]}
    by_filter: dict[str, dict[tuple[str, Any], float]] = defaultdict(dict)
    categories: list[CategoryScore] = []
    docs: set[tuple[str, Any]] = set()
    for task, samples in results.get("samples", {}).items():
        docs.update((task, s.get("doc_id")) for s in samples)
        for s in samples:
            if (v := _sample_value(s)) is not None:
                by_filter[s.get("filter", "none")][(task, s.get("doc_id"))] = v
        if not scaling:  # with --samples a sample file's score is its first sample's: no category table
            categories.extend(_per_category(task, samples))
    overall = _samples_overall(scaling) if scaling else tuple(
        Overall(f, sum(v.values()) / len(v), len(v)) for f, v in by_filter.items() if v)
    return RunSummary(_rows(results), tuple(categories), len(docs), requests, overall, seconds, model_seconds,
                      peak_rss_mb(), reused, mode, describe(results.get("config") or {}), workers, scaling, notes,
                      efficiency, results.get("search"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _rows(results: dict[str, Any]) -> tuple[MetricRow, ...]:
    """lm-eval's ``metric,filter`` / ``metric_stderr,filter`` keys as rows, in lm-eval's order."""
    rows = []
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if key in SKIP_KEYS or metric.endswith("_stderr") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            stderr = values.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            rows.append(MetricRow(task, filt or "none", metric, _number(value), _number(stderr)))
    return tuple(rows)


def _samples_overall(scaling: dict) -> tuple[Overall, ...]:
    """The k=1 estimate (pass@1: every sample of every question) with its bootstrap interval."""
    point = next((p for p in scaling.get("points", []) if p["estimator"] == "pass" and p["k"] == 1), None)
    if point is None:
        return ()
    return (Overall("pooled", point["value"], scaling["questions"], _number(point.get("low")),
                    _number(point.get("high")), f"k=1 estimate, all {scaling['samples']} samples of each question"),)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux/macOS), in MiB."""
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024
    except ImportError:  # Windows
        return 0.0


def _sample_value(sample: dict[str, Any]) -> float | None:
    value = next((sample[m] for m in SAMPLE_METRICS if isinstance(sample.get(m), (int, float))), None)
    return None if value is None else float(value)


def _per_category(task: str, samples: list[dict[str, Any]]) -> list[CategoryScore]:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in samples:
        doc = s.get("doc", {})
        key = next((doc[k] for k in CATEGORY_KEYS if isinstance(doc.get(k), str)), None)
        value = _sample_value(s)
        if key is not None and value is not None:
            groups[(s.get("filter", "none"), key)].append(value)
    return [CategoryScore(task, k, len(v), sum(v) / len(v), f) for (f, k), v in sorted(groups.items())]


def _num(value: float | None, width: int = 0) -> str:
    return f"{value:>{width}.4f}" if value is not None else f"{'n/a':>{width}}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns, the last ones (numbers) right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    numeric = {i for i, h in enumerate(header) if h in ("questions", "accuracy", "value", "stderr")}

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(header).rstrip(), *(line(r).rstrip() for r in rows)]


def _shown_rows(summary: RunSummary) -> list[MetricRow]:
    """Every row; with --samples, pass@1 (the k=1 estimate) and the largest k of each standard estimator (the
    ``_avg`` ones are in results.json)."""
    if not summary.scaling:
        return list(summary.rows)
    k = summary.scaling["samples"]
    keep = {"pass@1", *(f"{e}@{k}" for e in ("maj", "pass", "best", *SELECTORS) if not e.endswith("_avg"))}
    return [r for r in summary.rows if r.metric in keep]


def format_table(summary: RunSummary) -> str:
    """Per-category accuracy, lm-eval's task/filter/metric table, the overall line(s), then the run facts."""
    lines: list[str] = []
    if summary.categories:
        several = len({c.filter for c in summary.categories}) > 1
        header = ["category", *(["filter"] if several else []), "questions", "accuracy"]
        lines += _table(header, [[c.category, *([c.filter] if several else []), str(c.questions), _num(c.accuracy)]
                                 for c in summary.categories]) + [""]
    rows = _shown_rows(summary)
    if rows:
        lines += _table(["task", "filter", "metric", "value", "stderr"],
                        [[r.task, r.filter, r.metric, _num(r.value), _num(r.stderr)] for r in rows])
        if any(r.stderr is None for r in rows):
            lines.append("(stderr n/a: lm-eval gives none, or too few questions for one)")
        if any(r.metric.startswith("temperature_at_bound") for r in rows):
            lines.append("(temperature_at_bound: the NLL keeps falling up to the temperature search's bound, so no "
                         "finite temperature fits; ece_at_temperature_bound is the ECE there)")
    lines += _overall_lines(summary) + _scaling_lines(summary)
    lines.append(
        f"questions {summary.questions}  requests {summary.requests}"
        + (f" (+{summary.reused} reused from an earlier run)" if summary.reused else "")
        + f"  {_clock(summary)}  {summary.requests_per_s:.2f} req/s ({summary.model_seconds:.1f} s in the engine)  "
        f"peak RSS {summary.peak_rss_mb:.0f} MiB"
    )
    if summary.efficiency is not None:
        lines.append(summary_line(summary.efficiency))
    for label, value in (("scoring mode", summary.mode), ("model", summary.model), ("workers", summary.workers),
                         ("search", search_text(summary.search))):
        if value:
            lines.append(f"{label}: {value}")
    return "\n".join(lines + list(summary.notes))


def search_text(record: dict | None) -> str:
    """--search's line: which search ran with what budget and verifier, and what it cost (results["search"])."""
    if not record:
        return ""
    s = record["settings"]
    width = f", width {s['width']}" if record["method"] in ("beam", "dvts") else ""
    reused = f" (+{record['reused']} reused)" if record.get("reused") else ""
    return (f"{record['name']} (n {s['n']}{width}, at most {s['max_steps']} steps, step scores folded by "
            f"{s['aggregation']}) guided by verifier {record['verifier']['name']}: {record['requests']} requests"
            f"{reused}, {record['generated_tokens']} tokens generated (pruned rows included) in {record['steps']} "
            f"steps, {record['passes']} passes; the verifier ran {record['verifier_tokens']} tokens in "
            f"{record['verifier_seconds']:.1f} s of the generation's {record['seconds']:.1f} s")


def _clock(summary: RunSummary) -> str:
    """``start-up 1.2 s + scoring 3.6 s + after 0.4 s = 5.2 s since launch`` (report/efficiency.py), where the
    process start is known; else lm-eval's evaluation alone, data loading included."""
    return timeline_text(summary.efficiency or {}) or f"evaluation {summary.seconds:.1f} s"


def _overall_lines(summary: RunSummary) -> list[str]:
    lines = []
    for o in summary.overall:
        interval = f" [{o.low:.4f}, {o.high:.4f}] (95% bootstrap over questions)" if o.low is not None \
            and o.high is not None else ""
        if o.label:
            lines.append(f"overall ({o.label}): {o.value:.4f}{interval} over {o.questions} questions")
        elif len({r.task for r in summary.rows}) > 1:  # one task: its own row says it
            lines.append(f"overall, filter {o.filter}: {o.value:.4f} over {o.questions} questions")
    return lines


def _scaling_lines(summary: RunSummary) -> list[str]:
    """--samples: maj@k, pass@k and best@k pooled over every question, each with its 95% interval."""
    if not summary.scaling:
        return []
    points = summary.scaling["points"]
    cell = {(p["estimator"], p["k"]): p for p in points}
    ks = sorted({p["k"] for p in points})
    estimators = [e for e in TABLE_ESTIMATORS if any(key[0] == e for key in cell)]

    def show(p) -> str:
        if p is None:
            return "–"
        low, high = _number(p.get("low")), _number(p.get("high"))
        return _num(_number(p["value"])) + (f" [{low:.4f}, {high:.4f}]" if low is not None and high is not None
                                             else " [n/a]")

    rows = [[str(k), *(show(cell.get((e, k))) for e in estimators)] for k in ks]
    shown = {r.metric.split("@")[0] for r in _shown_rows(summary) if "@" in r.metric}
    return ["", f"inference-time scaling over {summary.scaling['questions']} questions, "
                f"K={summary.scaling['samples']} (pooled; 95% bootstrap intervals; n/a: too few questions):",
            *_table(["k", *(f"{e}@k" for e in estimators)], rows),
            "(exact_match in results.json is lm-eval's score of each question's first sample)",
            *estimator_legend([e for e in DEFINITIONS if e in shown or e in estimators]),
            *_verifier_line(summary)]


def estimator_legend(names: list[str]) -> list[str]:
    """Which estimator each @k metric is, one line each, and where ortevals' subset-averaged ones are."""
    lines = ["estimators:", *(f"  {name}@k: {DEFINITIONS[name]}" for name in names)]
    averaged = ", ".join(f"{n}@k" for n in DEFINITIONS if n.endswith("_avg") and n.removesuffix("_avg") in names)
    if averaged:
        lines.append(f"  in results.json also {averaged}: ortevals' own, expected over every k-subset of the K "
                     "samples (docs/search.md)")
    return lines


def _verifier_line(summary: RunSummary) -> list[str]:
    """--verifier: the tokens it ran and its seconds against generation's (same run)."""
    v = (summary.scaling or {}).get("verifier")
    if not v:
        return []
    ratio = f" ({v['cost_ratio']:.2f}x generation's {v['generation_seconds']:.1f} s)" if v.get("cost_ratio") else ""
    return [f"verifier {v['name']}: {v['questions']} questions, {v['tokens_run']} tokens run, "
            f"{v['seconds']:.1f} s{ratio}{', step scores (prm)' if v.get('prm') else ''}"]


def write_outputs(out_dir: Path, results: dict[str, Any], summary: RunSummary, others: Sequence[str] = ()
                  ) -> list[Path]:
    """``results.json`` (lm-eval's dict without samples, plus ortevals' summary) and samples JSONL into
    ``out_dir``; ``results.json``'s ``ortevals.files`` names every file of the run's set (these and ``others``,
    the plots written beside them), so a later run into the same folder knows which files were this run's."""
    tasks = list(results.get("samples", {}))
    samples = [f"samples_{task}.jsonl" for task in tasks]
    body = {k: v for k, v in results.items() if k != "samples"}
    body["ortevals"] = {"questions": summary.questions, "requests": summary.requests,
                        "overall": [asdict(o) for o in summary.overall], "seconds": summary.seconds,
                        "model_seconds": summary.model_seconds, "peak_rss_mb": summary.peak_rss_mb,
                        "requests_per_s": summary.requests_per_s, "reused": summary.reused, "mode": summary.mode,
                        "workers": summary.workers, "notes": list(summary.notes),
                        "categories": [asdict(c) for c in summary.categories],
                        "files": sorted({"results.json", *samples, *others})}
    return _write_files(out_dir, body, results)


def write_unreported(out_dir: Path, results: dict[str, Any], error: BaseException, others: Sequence[str] = ()
                     ) -> list[Path]:
    """After the model work, when reporting failed (or was interrupted): lm-eval's results and every sample as
    they are, ``results.json``'s ``ortevals.unreported`` saying why, so no generated answer is lost."""
    samples = [f"samples_{task}.jsonl" for task in results.get("samples", {})]
    body = {k: v for k, v in results.items() if k != "samples"}
    body["ortevals"] = {"unreported": f"{type(error).__name__}: {first_line(error)}",
                        "files": sorted({"results.json", *samples, *others})}
    return _write_files(out_dir, body, results)


def _write_files(out_dir: Path, body: dict[str, Any], results: dict[str, Any]) -> list[Path]:
    """The samples files first (the work), then ``results.json``; ``[results.json, samples…]``."""
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for task in results.get("samples", {}):
        path = out_dir / f"samples_{task}.jsonl"
        atomic_write(path, "".join(json_text(s) + "\n" for s in results["samples"][task]))
        written.append(path)
    path = out_dir / "results.json"
    atomic_write(path, json_text(body, indent=2))
    return [path, *written]


def stale_outputs(out_dir: Path, keep: set[str]) -> list[str]:
    """Files an earlier ortevals run wrote into ``out_dir`` (named by its results.json) that this run's set
    (``keep``) does not hold: they go when the new set is published, so a reused folder holds one run. A
    results.json not written by ortevals touches nothing; names are plain file names of ortevals' kinds."""
    previous = out_dir / "results.json"
    try:
        earlier = json.loads(previous.read_text(encoding="utf-8")) if previous.is_file() else {}
    except (OSError, ValueError):
        return []  # not an ortevals results file: touch nothing
    if not isinstance(earlier, dict) or not isinstance(earlier.get("ortevals"), dict):
        return []
    listed = earlier["ortevals"].get("files")
    if not isinstance(listed, list):  # an ortevals before the list: its tasks' samples and scaling plots
        listed = [f"samples_{t}.jsonl" for t in set(earlier.get("n-samples", {})) | set(earlier.get("configs", {}))]
        listed += ["scaling.png", "compute.png"] if "scaling" in earlier else []
    return sorted(n for n in {str(n) for n in listed} if n not in keep and _own_kind(n) and (out_dir / n).is_file())


def _own_kind(name: str) -> bool:
    """A plain file name of a kind ortevals writes into --output (never a path, never a hidden file)."""
    return Path(name).name == name and not name.startswith(".") and name.endswith((".jsonl", ".png", ".json"))
