"""A benchmark's outputs: the terminal table, ``bench.md``, ``bench.json`` and ``bench.png``.

Owns the table's columns (:data:`HEADER`, :func:`cells`, one formatting for the terminal and Markdown),
the notes printed under it (what the rate counts, rows on fewer questions, runs, the machine's load), the
JSON layout (every row's figures, each run's own) and the plot (rate and accuracy per row, matplotlib
through report/plots.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from ortevals.bench.measure import RunRecord
from ortevals.bench.rows import Row
from ortevals.report.plots import figure, log_ticks, png

HEADER = ("row", "questions", "runs", "wall s", "{rate}", "× ref", "first result s", "peak RSS MiB", "device MiB",
          "size MiB", "accuracy [95% CI]", "flips −/+", "McNemar p", "choice-KL", "same answers", "max |Δ ll|")
RATE = {"requests": "req/s", "tokens": "tok/s"}
MFU_COUNTS = ("2 x the matrix weights x the positions the engine's passes computed, padding included (a batch's, "
              "a device's shape buckets), over its seconds in the passes, against --peak-tflops; with padding, an "
              "upper bound")


def header(rate: str) -> list[str]:
    return [h.format(rate=RATE[rate]) for h in HEADER]


def cells(row: Row) -> list[str]:
    """One row's cells, in :data:`HEADER`'s order; a row not run says why in its second cell."""
    if row.status != "ok":
        why = row.note if row.status == "not installed" else f"{row.status}: {row.note}"
        return [row.label, why] + [""] * (len(HEADER) - 2)
    wall = _num(row.wall_s, 1) + (f" ({row.wall_min_s:.1f}–{row.wall_max_s:.1f})" if row.runs > 1 else "")
    acc = row.accuracy
    p = row.paired
    return [row.label + (" (ref)" if row.is_ref else ""), str(row.questions), str(row.runs), wall, _sig(row.rate),
            _num(row.x_ref, 2), _num(row.first_result_s, 1), _num(row.peak_rss_mib, 0), _device_cell(row),
            _num(row.size_mib, 0), f"{acc.estimate:.3f} [{acc.low:.3f}, {acc.high:.3f}]",
            f"{p.flips.correct_to_wrong}/{p.flips.wrong_to_correct}" if p else "—",
            f"{p.mcnemar_p:.3g}" if p else "—", _exp(p.choice_kl) if p else "—",
            f"{p.n - p.flips.answer_changes}/{p.n}" if p else "—", _exp(p.max_abs_dll) if p else "—"]


def _device_cell(row: Row) -> str:
    return "n/a" if row.device_mib is None else _num(row.device_mib, 0)


def _num(x: float | None, digits: int) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _sig(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def _exp(x: float | None) -> str:
    return "—" if x is None else "0" if x == 0 else f"{x:.1e}"


def text_table(rows: list[Row], rate: str) -> str:
    """The table for a terminal: columns padded, numbers right-aligned."""
    grid = [header(rate)] + [cells(r) for r in rows]
    ok = [g for g, r in zip(grid[1:], rows) if r.status == "ok"]
    widths = [max(len(c[i]) for c in [grid[0], *ok]) for i in range(len(HEADER))]
    lines = []
    for line in grid:
        if line[2] == "" and line is not grid[0]:  # a row not run: its label and why
            lines.append(f"{line[0].ljust(widths[0])}  {line[1]}")
            continue
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(lines)


def markdown_table(rows: list[Row], rate: str) -> str:
    head = header(rate)
    lines = [_md_row(head), "|---|" + "---:|" * (len(head) - 1)] + [_md_row(cells(r)) for r in rows]
    return "\n".join(lines)


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def notes(rows: list[Row], rate: str, machine: dict[str, Any]) -> list[str]:
    """What the figures are, under the table."""
    ref = next(r for r in rows if r.is_ref)
    unit = ("requests (lm-eval's: one per choice of a question, one per generation)" if rate == "requests"
            else "generated tokens (each row's texts counted with the reference row's tokenizer)")
    runs = sorted({r.runs for r in rows if r.status == "ok"})
    out = [f"{RATE[rate]}: {unit} over the wall time from launch to exit, each row its own process; timings are "
           f"medians over {' or '.join(map(str, runs)) or 0} run(s) a row (wall: fastest–slowest).",
           f"Against the reference ({ref.label}), on the questions both ran: flips correct→wrong/wrong→correct, "
           "McNemar's exact p, choice-KL = mean KL(ref‖row) over each question's choices (nats), answers equal, "
           "the largest |Δ log-likelihood| of a choice." if ref.status == "ok" else
           f"The reference ({ref.label}) did not run: no row is compared with it."]
    fewer = [r for r in rows if r.status == "ok" and ref.questions and r.questions < ref.questions
             and not r.decision]  # a decided row's questions are its decision's (its own line says so)
    if fewer:
        out.append("On fewer questions (--peer-limit): " + ", ".join(f"{r.label} ({r.questions})" for r in fewer)
                   + "; its rate spreads its start-up over fewer requests.")
    out += [f"{r.label}: {r.note}" for r in rows if r.status == "ok" and r.note]
    out += [decision_note(r) for r in rows if r.status == "ok" and r.decision]
    mfus = [f"{r.label} {r.mfu:.3g}" for r in rows if r.mfu is not None]
    if mfus:
        out.append(f"MFU ({MFU_COUNTS}): " + ", ".join(mfus) + ".")
    measured = sorted({r.device_source for r in rows if r.device_source})
    out.append(f"device MiB: peak, measured by {', '.join(measured)} (docs/bench.md)." if measured else
               "device MiB n/a: no GPU seen through NVML (nvidia-ml-py) and no backend reported its own.")
    out += [f"{r.label}: its later runs gave other answers than its first" for r in rows if r.repeat_same is False]
    gpu = (machine.get("device") or {}).get("name")
    out.append(f"Machine: {machine['cores']} CPU cores{f', {gpu}' if gpu else ''}, load average "
               f"{machine['load_start']:.1f} at the start and {machine['load_end']:.1f} at the end; compare rows "
               "within one invocation.")
    return out


def decision_note(row: Row) -> str:
    """A decided row (``--against RUN --decide M``): its decision, the questions it used, the difference."""
    d, diff = row.decision, row.decision["difference"]
    against = d["reference"].get("run") or d["reference"]["package"]
    said = "not decided at the cap" if d["decision"] == "cap" else d["decision"]
    return (f"{row.label}: {said} at ±{d['margin_points']:g} points against {against} after "
            f"{d['used']} of its {d['reference']['questions']} questions ({d['order']} order), difference "
            f"{100 * diff['estimate']:+.2f} points [{100 * diff['low']:+.2f}, {100 * diff['high']:+.2f}] "
            f"({1 - d['alpha']:.0%} anytime-valid); questions, wall time and rate count the decision's run")


def to_json(rows: list[Row], records: dict[str, list[RunRecord]], meta: dict[str, Any]) -> dict[str, Any]:
    runs = {label: [{"round": r.round, "exit_code": r.watched.exit_code, "wall_s": r.watched.wall_s,
                     "first_result_s": r.watched.first_result_s, "peak_rss_mib": r.watched.peak_rss_mib,
                     "device_mib": r.watched.device_mib, "device_source": r.watched.device_source,
                     "failure": r.failure, "output": str(r.folder)} for r in recs] for label, recs in records.items()}
    return {**meta, "rows": [asdict(r) for r in rows], "runs": runs}


def plot(rows: list[Row], rate: str) -> bytes:
    """Two panels, one bar per row that ran: its rate (log scale) and its accuracy with the 95% interval."""
    ok = [r for r in rows if r.status == "ok"]
    plt, fig, (left, right) = figure(10.0, 0.5 * len(ok) + 1.5, 1, 2, sharey=True)
    names = [r.label for r in ok]
    colors = ["#1f77b4" if r.backend == "ortevals" else "#999999" for r in ok]
    left.barh(names, [r.rate for r in ok], color=colors)
    positive = [r.rate for r in ok if r.rate]
    span = (min(positive) / 2, max(positive) * 4) if positive else ()  # room for the bars' own labels
    log_ticks(left, span)  # labelled ticks that never run into each other (minor ticks unlabelled)
    if span:
        left.set_xlim(*span)
    left.set_xlabel(f"{RATE[rate]} (log scale, launch to exit)")
    for i, r in enumerate(ok):
        left.text(r.rate, i, f" {_sig(r.rate)}", va="center", fontsize=8)
    acc = [r.accuracy for r in ok]
    right.errorbar([a.estimate for a in acc], range(len(ok)), fmt="o", color="black",
                   xerr=[[a.estimate - a.low for a in acc], [a.high - a.estimate for a in acc]])
    right.set_xlabel("accuracy, Wilson 95% interval")
    right.set_xlim(0, 1)
    left.invert_yaxis()
    return png(plt, fig)
