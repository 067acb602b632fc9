"""``--report DIR``: report.md (with its plots as PNG files beside it) and a self-contained report.html.

The four plots (Δ accuracy per category with intervals, answer-change and flip
rate by the reference's margin, the KL distribution, the run-by-run agreement
matrix) are drawn with matplotlib, imported here only (Agg backend); in the
HTML they are embedded as base64 PNG, so the file has no external reference.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

from ortevals.files import atomic_write, atomic_write_bytes
from ortevals.report import plots
from ortevals.report.compare import Comparison

PLOTS = ("delta_by_category", "flips_by_margin", "kl_distribution", "agreement", "reliability", "risk_coverage")
TITLES = {"delta_by_category": "Δ accuracy per category (95% interval)",
          "flips_by_margin": "Answer changes by the reference's top-1 margin",
          "kl_distribution": "KL(ref‖run) per question", "agreement": "Answer agreement, run by run",
          "reliability": "Reliability diagram", "risk_coverage": "Risk against coverage"}
MAX_CHANGED = 25  # questions listed in the report (all of them go to --changed)


def write_report(cmp: Comparison, out_dir: Path) -> list[Path]:
    """Write report.md, its PNGs and report.html into ``out_dir``; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = {name: fn(cmp) for name, fn in zip(PLOTS, (plot_delta, plot_margin, plot_kl, plot_agreement,
                                                      plot_reliability, plot_risk_coverage))}
    written = []
    for name, data in pngs.items():
        atomic_write_bytes(out_dir / f"{name}.png", data)
        written.append(out_dir / f"{name}.png")
    tables = report_tables(cmp)
    md = _markdown(cmp, tables)
    atomic_write(out_dir / "report.md", md)
    atomic_write(out_dir / "report.html", _html(cmp, tables, pngs))
    return [out_dir / "report.md", out_dir / "report.html", *written]


def report_tables(cmp: Comparison) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Named tables (header, rows) shared by the markdown and the HTML."""
    summary = (["run", "task", "n", "accuracy", "ref", "Δ [95%]", "c→w", "w→c", "flip rate", "changes",
                "McNemar p", "KL mean"],
               [[c.run, c.task, str(c.n), f"{c.accuracy.estimate:.4f}", f"{c.ref_accuracy.estimate:.4f}",
                 f"{c.delta.estimate:+.4f} [{c.delta.low:+.4f}, {c.delta.high:+.4f}]", str(c.flips.correct_to_wrong),
                 str(c.flips.wrong_to_correct), f"{c.flip_rate:.4f}", str(c.flips.answer_changes),
                 f"{c.mcnemar_p:.3g}", f"{c.choice.kl.mean:.3g}" if c.choice else "–"] for c in cmp.tasks])
    cats = (["run", "task", "category", "n", "ref", "accuracy", "Δ [95%]"],
            [[c.run, c.task, k.category, str(k.n), f"{k.ref_accuracy:.4f}", f"{k.accuracy:.4f}",
              f"{k.delta.estimate:+.4f} [{k.delta.low:+.4f}, {k.delta.high:+.4f}]"]
             for c in cmp.tasks for k in c.categories])
    changed = (["run", "task", "doc_id", "category", "gold", "ref answer", "run answer", "difference",
                "p_ref(ref answer)", "p_run(run answer)"],
               [[q.run, q.task, str(q.doc_id), q.category or "", q.gold or "", q.ref_answer[:40], q.run_answer[:40],
                 f"{q.difference:.3g}", _prob(q.ref_probs, q.ref_answer), _prob(q.run_probs, q.run_answer)]
                for q in cmp.changed[:MAX_CHANGED]])
    calibration = (["run", "task", "ECE", "ref", "Δ ECE [95%]", "Brier (multi-class, 0–2)", "ref", "Δ Brier [95%]",
                    "conf − acc", "T needed [95%]", "ref T"],
                   [[c.run, c.task, f"{d.ece:.4f}", f"{d.ref_ece:.4f}", _delta(d.delta_ece), f"{d.brier:.4f}",
                     f"{d.ref_brier:.4f}", _delta(d.delta_brier), f"{d.overconfidence:+.4f}",
                     f"{d.temperature.estimate:.3g} [{d.temperature.low:.3g}, {d.temperature.high:.3g}]"
                     if d.temperature.low == d.temperature.low else f"{d.temperature.estimate:.3g} (bound)",
                     f"{d.ref_temperature.estimate:.3g}"] for c in cmp.tasks if (d := c.calibration) is not None])
    ptrue = (["run", "task", "n", "P(True) mean", "ref", "Δ [95%]", "AUROC", "ref", "Δ AUROC [95%]", "ECE", "ref",
              "Δ ECE [95%]", "mean |change|"],
             [[c.run, c.task, str(d.n), f"{d.mean:.4f}", f"{d.ref_mean:.4f}", _delta(d.delta_mean), f"{d.auroc:.4f}",
               f"{d.ref_auroc:.4f}", _delta(d.delta_auroc), f"{d.ece:.4f}", f"{d.ref_ece:.4f}", _delta(d.delta_ece),
               f"{d.change.estimate:.4f}"] for c in cmp.tasks if (d := c.p_true) is not None])
    return {"Summary": summary, "Per category": cats, "Calibration (paired 95% intervals)": calibration,
            "P(True) drift (--self-eval, paired 95% intervals)": ptrue,
            "Questions that changed (most different first)": changed}


def _delta(x) -> str:
    return f"{x.estimate:+.4f} [{x.low:+.4f}, {x.high:+.4f}]"


def _prob(probs: dict[str, float] | None, label: str) -> str:
    return f"{probs[label]:.4f}" if probs and label in probs else ""


def _notes(cmp: Comparison) -> list[str]:
    notes = [f"{c.run} · {c.task}: {c.power}" for c in cmp.tasks]
    notes += [f"{c.run} · {c.task}: clustered by {c.clusters} categories (Miller 2024)" for c in cmp.tasks
              if c.clusters]
    return notes + [f"not compared: {s}" for s in cmp.skipped]


def _markdown(cmp: Comparison, tables) -> str:
    lines = [f"# Comparison against {cmp.ref}", "", f"Runs: {', '.join(cmp.runs)}.", ""]
    lines += [f"- {label}: {model}" for label, model in cmp.models] + ([""] if cmp.models else [])
    for title, (header, rows) in tables.items():
        if not rows:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |"
                  for row in rows]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{TITLES[n]}]({n}.png)" for n in PLOTS] + ["", "## Notes", ""]
    lines += [f"- {n}" for n in _notes(cmp)]
    return "\n".join(lines) + "\n"


def _html(cmp: Comparison, tables, pngs: dict[str, bytes]) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>ortevals compare</title><style>"
             "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px}th{background:#eee}img{max-width:100%}</style></head><body>",
             f"<h1>Comparison against {e(cmp.ref)}</h1><p>Runs: {e(', '.join(cmp.runs))}.</p>",
             "<ul>" + "".join(f"<li>{e(label)}: {e(model)}</li>" for label, model in cmp.models) + "</ul>"]
    for title, (header, rows) in tables.items():
        if rows:
            parts.append(f"<h2>{e(title)}</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
            parts.append("</table>")
    parts.append("<h2>Plots</h2>")
    for name in PLOTS:
        data = base64.b64encode(pngs[name]).decode("ascii")
        parts.append(f"<h3>{e(TITLES[name])}</h3><img alt='{name}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in _notes(cmp)) + "</ul></body></html>")
    return "\n".join(parts)


def plot_delta(cmp: Comparison) -> bytes:
    """Per run, Δ accuracy per category (or per task where a task has no categories) with its interval.

    Categories read top to bottom; each category's runs sit in a band of fixed height around its row, so
    one category does not push the runs to the edges of the axes."""
    rows = [(c.run, k.category, k.delta) for c in cmp.tasks for k in c.categories] or \
           [(c.run, c.task, c.delta) for c in cmp.tasks]
    labels = sorted({r[1] for r in rows})
    runs = list(dict.fromkeys(r[0] for r in rows))
    plt, fig, ax = plots.figure(7.5, max(2.4, 0.32 * len(labels) * max(1, len(runs) / 3) + 1.4))
    step = min(0.25, 0.7 / max(len(runs), 1))  # between runs of one row, in rows
    for j, run in enumerate(runs):
        pts = [(labels.index(lab), d) for r, lab, d in rows if r == run]
        y = np.array([p[0] for p in pts]) + (j - (len(runs) - 1) / 2) * step
        est = np.array([p[1].estimate for p in pts])
        err = np.array([[p[1].estimate - p[1].low for p in pts], [p[1].high - p[1].estimate for p in pts]])
        ax.errorbar(est, y, xerr=err, fmt="o", capsize=3, label=run)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # first label on top; a row is one unit tall whatever the count
    ax.set_xlabel("Δ accuracy (run − reference)")
    ax.legend(fontsize=8, loc="best")
    return plots.png(plt, fig)


def _choice_series(cmp: Comparison, ax) -> list:
    """The log-likelihood task comparisons (they have choice statistics); a note on the axes if none."""
    series = [c for c in cmp.tasks if c.choice is not None]
    if not series:
        ax.text(0.5, 0.5, "no log-likelihood task", ha="center", va="center")
    return series


def plot_margin(cmp: Comparison) -> bytes:
    """Answer-change rate per bin of the reference's top-1 probability margin, per run and task."""
    plt, fig, ax = plots.figure()
    series = _choice_series(cmp, ax)
    for j, c in enumerate(series):
        bins = c.choice.margin_bins
        x = np.arange(len(bins)) + (j - (len(series) - 1) / 2) * 0.8 / len(series)
        ax.bar(x, [b.change_rate if b.n else 0.0 for b in bins], width=0.8 / len(series), label=f"{c.run} {c.task}")
        if j == 0:
            ax.set_xticks(range(len(bins)), [f"{b.low:g}–{b.high:g}\n(n={b.n})" for b in bins], fontsize=7)
    ax.set_xlabel("reference top-1 margin p1 − p2")
    ax.set_ylabel("share of answers that changed")
    if series:
        ax.legend(fontsize=8)
    return plots.png(plt, fig)


def plot_kl(cmp: Comparison) -> bytes:
    """Histogram of log10 KL(ref‖run) per question (KL below 1e-16 shown at −16), every run on the same bins.

    One set of bin edges over all runs (about 40 over the whole range, fewer for few questions), so runs far
    apart on the axis keep bars one can see; question counts are whole numbers on the y axis."""
    from matplotlib.ticker import MaxNLocator

    plt, fig, ax = plots.figure()
    series = _choice_series(cmp, ax)
    values = [np.log10(np.maximum(c.choice.kl_values[np.isfinite(c.choice.kl_values)], 1e-16)) for c in series]
    edges = _bin_edges(values)
    for c, x in zip(series, values):
        ax.hist(x, bins=edges, alpha=0.6, edgecolor="white", linewidth=0.4,
                label=f"{c.run} {c.task} (mean {c.choice.kl.mean:.2g})")
    ax.set_xlabel("log10 KL(ref‖run), nats")
    ax.set_ylabel("questions")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if series:
        ax.legend(fontsize=8, loc="best")
    return plots.png(plt, fig)


def _bin_edges(values: list[np.ndarray]) -> np.ndarray:
    """Shared edges: 40 bins over all the data, or 2·sqrt(n) (at least 5) when the largest run has few questions."""
    data = np.concatenate(values) if values else np.zeros(0)
    if data.size == 0:
        return np.linspace(-1.0, 0.0, 6)
    low, high = float(data.min()), float(data.max())
    if high - low < 1e-9:
        return np.linspace(low - 0.5, high + 0.5, 6)
    count = min(40, max(5, int(2 * np.sqrt(max(len(v) for v in values)))))
    return np.linspace(low, high, count + 1)


def plot_agreement(cmp: Comparison) -> bytes:
    labels = cmp.agreement_labels
    plt, fig, ax = plots.figure(1.2 * len(labels) + 2.5, 1.0 * len(labels) + 1.8)
    im = ax.imshow(cmp.agreement, vmin=min(0.5, float(np.min(cmp.agreement))), vmax=1.0, cmap="viridis")
    for i in range(len(labels)):
        for j in range(len(labels)):
            r, g, b, _ = im.cmap(im.norm(cmp.agreement[i, j]))
            ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"  # readable on its cell
            ax.text(j, i, f"{cmp.agreement[i, j]:.3f}", ha="center", va="center", color=ink, fontsize=9)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    fig.colorbar(im, ax=ax)
    return plots.png(plt, fig)


def _calibration_series(cmp: Comparison, pick) -> list:
    """(label, data) per run and task with calibration, the reference first for each task."""
    out, seen = [], set()
    for c in cmp.tasks:
        if c.calibration is None:
            continue
        if c.task not in seen:
            seen.add(c.task)
            out.append((f"{c.ref} (ref) · {c.task}", pick(c.calibration, True)))
        out.append((f"{c.run} · {c.task}", pick(c.calibration, False)))
    return out


def plot_reliability(cmp: Comparison) -> bytes:
    """Every run's reliability diagram over the reference's (choice tasks)."""
    from ortevals.report.calibration_plots import reliability_png

    series = _calibration_series(cmp, lambda d, ref: d.ref_reliability if ref else d.reliability)
    return reliability_png(series, "accuracy against confidence, 10 equal-width bins")


def plot_risk_coverage(cmp: Comparison) -> bytes:
    from ortevals.report.calibration_plots import risk_coverage_png

    series = _calibration_series(cmp, lambda d, ref: d.ref_risk if ref else d.risk)
    return risk_coverage_png(series, "risk of answering only the most confident questions")
