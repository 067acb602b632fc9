"""Run results: summary records, the final table, and files on disk.

Owns turning lm-eval's results dict into a :class:`RunSummary` (metrics per
task, accuracy per category when the documents carry one, questions,
requests, wall time, requests/s), formatting the table the CLI prints, and
writing lm-eval's results JSON plus per-sample JSONL atomically (a crash never
leaves a half-written file).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.files import atomic_write

CATEGORY_KEYS = ("category", "subject")
SAMPLE_METRICS = ("acc", "exact_match", "acc_norm")  # the per-question score a category averages


@dataclass(frozen=True)
class CategoryScore:
    task: str
    category: str
    questions: int
    accuracy: float


@dataclass(frozen=True)
class RunSummary:
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    categories: tuple[CategoryScore, ...]
    questions: int
    requests: int
    overall: float | None  # the per-question metric over every question of every task
    seconds: float  # wall time of the whole run (data loading included)
    model_seconds: float  # time inside the scoring engine
    peak_rss_mb: float = 0.0  # the process's peak resident memory
    reused: int = 0  # requests answered from the result store (a resumed run), not in ``requests``
    mode: str = ""  # log-likelihood scoring mode and why: "batched (canary passed …)", "exact (…)"

    @property
    def requests_per_s(self) -> float:
        """Requests per second of scoring time, the figure the benchmarks compare."""
        return self.requests / self.model_seconds if self.model_seconds > 0 else 0.0


def summarize(results: dict[str, Any], requests: int, seconds: float, model_seconds: float,
              reused: int = 0, mode: str = "") -> RunSummary:
    """Build the summary from ``lm_eval.simple_evaluate``'s return value."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        metrics[task] = {k: float(v) for k, v in values.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "sample_len"}
    categories: list[CategoryScore] = []
    values: list[float] = []
    questions = 0
    for task, samples in results.get("samples", {}).items():
        questions += len(samples)
        categories.extend(_per_category(task, samples))
        values.extend(v for s in samples if (v := _sample_value(s)) is not None)
    overall = sum(values) / len(values) if values else None
    return RunSummary(metrics, tuple(categories), questions, requests, overall, seconds, model_seconds,
                      peak_rss_mb(), reused, mode)


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
    groups: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        doc = s.get("doc", {})
        key = next((doc[k] for k in CATEGORY_KEYS if isinstance(doc.get(k), str)), None)
        value = _sample_value(s)
        if key is not None and value is not None:
            groups[key].append(value)
    return [CategoryScore(task, k, len(v), sum(v) / len(v)) for k, v in sorted(groups.items())]


def format_table(summary: RunSummary) -> str:
    """A plain-text table: per-category accuracy, per-task metrics, then throughput."""
    lines = []
    if summary.categories:
        width = max(len(c.category) for c in summary.categories) + 2
        lines.append(f"{'category':<{width}}{'questions':>10}{'accuracy':>10}")
        for c in summary.categories:
            lines.append(f"{c.category:<{width}}{c.questions:>10}{c.accuracy:>10.4f}")
        lines.append("")
    for task, values in summary.metrics.items():
        shown = ", ".join(f"{k.split(',')[0]}={v:.4f}" for k, v in values.items() if "stderr" not in k)
        err = next((v for k, v in values.items() if "stderr" in k), None)
        lines.append(f"{task}: {shown}" + (f" (± {err:.4f})" if err is not None else ""))
    if summary.overall is not None and len(summary.metrics) > 1:
        lines.append(f"overall: {summary.overall:.4f} over {summary.questions} questions")
    lines.append(
        f"questions {summary.questions}  requests {summary.requests}"
        + (f" (+{summary.reused} reused from an earlier run)" if summary.reused else "")
        + f"  wall {summary.seconds:.1f} s  "
        f"scoring {summary.model_seconds:.1f} s  {summary.requests_per_s:.2f} req/s  "
        f"peak RSS {summary.peak_rss_mb:.0f} MiB"
    )
    if summary.mode:
        lines.append(f"scoring mode: {summary.mode}")
    return "\n".join(lines)


def write_outputs(out_dir: Path, results: dict[str, Any], summary: RunSummary) -> list[Path]:
    """``results.json`` (lm-eval's dict without samples, plus ortevals' summary) and samples JSONL."""
    written = []
    body = {k: v for k, v in results.items() if k != "samples"}
    body["ortevals"] = {"questions": summary.questions, "requests": summary.requests, "overall": summary.overall,
                        "seconds": summary.seconds, "model_seconds": summary.model_seconds,
                        "peak_rss_mb": summary.peak_rss_mb, "requests_per_s": summary.requests_per_s,
                        "reused": summary.reused, "mode": summary.mode,
                        "categories": [c.__dict__ for c in summary.categories]}
    path = out_dir / "results.json"
    atomic_write(path, json.dumps(body, indent=2, default=str, ensure_ascii=False))
    written.append(path)
    for task, samples in results.get("samples", {}).items():
        path = out_dir / f"samples_{task}.jsonl"
        atomic_write(path, "".join(json.dumps(s, default=str, ensure_ascii=False) + "\n" for s in samples))
        written.append(path)
    return written
