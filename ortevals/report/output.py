"""A comparison as text, as ``--json`` records and as the changed-questions JSONL.

The ``--json`` schema (one object per run and task) is documented in
``docs/compare.md``; its field names are a public interface.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ortevals.files import atomic_write, check_writable_file, check_writable_folder, publish, staged
from ortevals.report import drift, lengths
from ortevals.report.compare import Comparison, TaskComparison

REPORT_FILES = ("report.md", "report.html", "*.png")  # what --report writes (report/html.py)


def task_record(c: TaskComparison) -> dict[str, Any]:
    """The ``--json`` object of one run and task."""
    rec: dict[str, Any] = {
        "run": c.run, "ref": c.ref, "task": c.task, "kind": c.kind, "n": c.n,
        "accuracy": c.accuracy.estimate, "accuracy_ci": [c.accuracy.low, c.accuracy.high],
        "ref_accuracy": c.ref_accuracy.estimate, "ref_accuracy_ci": [c.ref_accuracy.low, c.ref_accuracy.high],
        "delta": c.delta.estimate, "delta_se": c.delta.se, "delta_ci": [c.delta.low, c.delta.high],
        "delta_clusters": c.clusters, "delta_bootstrap_ci": [c.delta_bootstrap.low, c.delta_bootstrap.high],
        "correct_to_wrong": c.flips.correct_to_wrong, "wrong_to_correct": c.flips.wrong_to_correct,
        "flip_rate": c.flip_rate, "answer_changes": c.flips.answer_changes, "agreement": c.flips.agreement,
        "mcnemar_p": c.mcnemar_p, "mcnemar_p_holm": c.mcnemar_p_holm, "min_detectable_delta": c.min_detectable,
        "categories": [{"category": k.category, "n": k.n, "ref_accuracy": k.ref_accuracy, "accuracy": k.accuracy,
                        "delta": k.delta.estimate, "delta_ci": [k.delta.low, k.delta.high]} for k in c.categories],
    }
    if c.choice is not None:
        ch = c.choice
        rec.update({"kl_mean": ch.kl.mean, "kl": asdict(ch.kl), "kl_reverse": asdict(ch.kl_reverse),
                    "dp_gold": asdict(ch.dp_gold) if ch.dp_gold else None,
                    "margin_bins": [{"low": b.low, "high": b.high, "n": b.n, "answer_changes": b.answer_changes,
                                     "flips": b.flips} for b in ch.margin_bins]})
    if c.calibration is not None:
        rec.update(calibration_record(c.calibration))
    if c.p_true is not None:
        rec.update(ptrue_record(c.p_true))
    if c.generation is not None:
        g = c.generation
        rec.update({"text_agreement": g.text_agreement,
                    "first_divergence_char": asdict(g.first_divergence) if g.first_divergence else None})
    if c.drift is not None:
        rec["drift"] = drift.record(c.drift)
    if c.by_length is not None:
        rec["by_length"] = lengths.record(c.by_length)
    return _finite(rec)


def calibration_record(d) -> dict[str, Any]:
    """Issue 24's ``--json`` fields of a :class:`~ortevals.report.calibration_delta.CalibrationDelta`."""
    def ci(x) -> list[float]:
        return [x.low, x.high]

    return {"ece": d.ece, "ref_ece": d.ref_ece, "delta_ece": d.delta_ece.estimate, "delta_ece_ci": ci(d.delta_ece),
            "brier_multiclass": d.brier, "ref_brier_multiclass": d.ref_brier,
            "delta_brier_multiclass": d.delta_brier.estimate, "delta_brier_multiclass_ci": ci(d.delta_brier),
            "overconfidence": d.overconfidence,
            "ref_overconfidence": d.ref_overconfidence, "delta_overconfidence": d.delta_overconfidence.estimate,
            "delta_overconfidence_ci": ci(d.delta_overconfidence), "temperature": d.temperature.estimate,
            "temperature_ci": ci(d.temperature), "ref_temperature": d.ref_temperature.estimate,
            "ref_temperature_ci": ci(d.ref_temperature)}


def ptrue_record(d) -> dict[str, Any]:
    """The ``--json`` fields of a :class:`~ortevals.report.ptrue_delta.PTrueDelta` (both runs with --self-eval)."""
    out: dict[str, Any] = {"ptrue_n": d.n}
    for name, ref, run, delta in (("ptrue_mean", d.ref_mean, d.mean, d.delta_mean),
                                  ("ptrue_auroc", d.ref_auroc, d.auroc, d.delta_auroc),
                                  ("ptrue_ece", d.ref_ece, d.ece, d.delta_ece)):
        out.update({name: run, f"ref_{name}": ref, f"delta_{name}": delta.estimate,
                    f"delta_{name}_ci": [delta.low, delta.high]})
    return out | {"ptrue_change": d.change.estimate, "ptrue_change_ci": [d.change.low, d.change.high]}


def write_json(cmp: Comparison, path: Path) -> None:
    atomic_write(Path(path), json.dumps([task_record(c) for c in cmp.tasks], indent=2, ensure_ascii=False) + "\n")


def write_changed(cmp: Comparison, path: Path) -> None:
    lines = (json.dumps(_finite(asdict(q)), ensure_ascii=False) + "\n" for q in cmp.changed)
    atomic_write(Path(path), "".join(lines))


def _finite(x: Any) -> Any:
    """NaN/inf are not JSON: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def format_text(cmp: Comparison) -> str:
    """What ``ortevals compare`` prints: one block per run and task, then the agreement matrix."""
    lines = [f"reference: {cmp.ref}"]
    lines += [f"  {label}: {model}" for label, model in cmp.models]  # which run is which (report/model_info.py)
    for c in cmp.tasks:
        lines += [""] + task_lines(c)
    if len(cmp.agreement_labels) > 2:
        lines += ["", "answer agreement: " + "  ".join(
            f"{a}~{b} {cmp.agreement[i, j]:.3f}" for i, a in enumerate(cmp.agreement_labels)
            for j, b in enumerate(cmp.agreement_labels) if j > i)]
    for s in cmp.skipped:
        lines.append(f"not compared: {s}")
    return "\n".join(lines)


def task_lines(c: TaskComparison) -> list[str]:
    f = c.flips
    clustered = f", clustered by {c.clusters} categories" if c.clusters else ""
    lines = [
        f"{c.run} vs {c.ref} · {c.task} ({c.n} questions)",
        f"  accuracy {c.accuracy.estimate:.4f} [{c.accuracy.low:.4f}, {c.accuracy.high:.4f}]  "
        f"ref {c.ref_accuracy.estimate:.4f} [{c.ref_accuracy.low:.4f}, {c.ref_accuracy.high:.4f}]  (Wilson 95%)",
        f"  delta {c.delta.estimate:+.4f} [{c.delta.low:+.4f}, {c.delta.high:+.4f}] (paired 95%{clustered}; "
        f"bootstrap [{c.delta_bootstrap.low:+.4f}, {c.delta_bootstrap.high:+.4f}])",
        f"  flips: correct->wrong {f.correct_to_wrong}, wrong->correct {f.wrong_to_correct} "
        f"(flip rate {c.flip_rate:.4f}); answer changes {f.answer_changes}; agreement {f.agreement:.4f}; "
        f"McNemar exact p {c.mcnemar_p:.3g}" + (f" (Holm {c.mcnemar_p_holm:.3g})" if c.mcnemar_p_holm != c.mcnemar_p
                                                 else ""),
    ]
    if c.choice is not None:
        k, r = c.choice.kl, c.choice.kl_reverse
        lines.append(f"  KL(ref||run) mean {k.mean:.3g} ± {k.se:.2g} nats, p50 {k.p50:.3g}, p90 {k.p90:.3g}, "
                     f"p99 {k.p99:.3g}, max {k.max:.3g}; KL(run||ref) mean {r.mean:.3g} ± {r.se:.2g}")
        if c.choice.dp_gold is not None:
            d = c.choice.dp_gold
            lines.append(f"  dp(gold) mean {d.mean:+.3g} ± {d.se:.2g}, rms {d.rms:.3g}, max {d.max:+.3g}")
        bins = [b for b in c.choice.margin_bins if b.n]
        lines.append("  answer changes by ref margin: " + ", ".join(
            f"[{b.low:g},{b.high:g}) {b.answer_changes}/{b.n}" for b in bins))
    if c.calibration is not None:
        lines += calibration_lines(c.calibration)
    if c.p_true is not None:
        lines.append(ptrue_line(c.p_true))
    if c.generation is not None:
        g = c.generation
        lines.append(f"  identical text {g.text_agreement:.4f}; extracted-answer agreement {f.agreement:.4f}"
                     + (f"; first differing character median {g.first_divergence.p50:.0f}"
                        if g.first_divergence else ""))
    if c.drift is not None:
        lines += drift.format_lines(c.drift)
    if c.by_length is not None:
        lines += lengths.format_lines(c.by_length)
    lines.append(f"  power: {c.power}")
    return lines


def calibration_lines(d) -> list[str]:
    """Issue 24: the calibration of the run against the reference's, paired 95% intervals."""
    def delta(x) -> str:
        return f"{x.estimate:+.4f} [{x.low:+.4f}, {x.high:+.4f}]"

    def temp(x) -> str:
        if math.isnan(x.low):  # fitted on a bound of the search: the NLL keeps falling beyond it
            return f"{x.estimate:.3g} (a bound: no finite optimum)"
        return f"{x.estimate:.3g} [{x.low:.3g}, {x.high:.3g}]"

    gap = d.overconfidence
    word = "over-confident" if gap > 0 else "under-confident"
    return [f"  calibration: {word} by {abs(gap):.4f} (mean confidence - accuracy; ref {d.ref_overconfidence:+.4f}, "
            f"delta {delta(d.delta_overconfidence)})",
            f"  ECE {d.ece:.4f} (ref {d.ref_ece:.4f}, delta {delta(d.delta_ece)}); "
            f"Brier (multi-class, 0-2) {d.brier:.4f} (ref {d.ref_brier:.4f}, delta {delta(d.delta_brier)}); "
            f"temperature needed {temp(d.temperature)} (ref {temp(d.ref_temperature)})"]


def ptrue_line(d) -> str:
    """P(True) drift: each statistic of the run, the reference's, and Δ with its paired 95% interval."""
    def part(name: str, run: float, ref: float, delta) -> str:
        return f"{name} {run:.4f} (ref {ref:.4f}, delta {delta.estimate:+.4f} [{delta.low:+.4f}, {delta.high:+.4f}])"

    return (f"  P(True) on {d.n} questions: " + "; ".join([part("mean", d.mean, d.ref_mean, d.delta_mean),
                                                           part("AUROC", d.auroc, d.ref_auroc, d.delta_auroc),
                                                           part("ECE", d.ece, d.ref_ece, d.delta_ece)])
            + f"; a question's P(True) moved by {d.change.estimate:.4f} on average "
              f"[{d.change.low:.4f}, {d.change.high:.4f}]")


def compare_paths(ref: str | Path, runs: list[str | Path], echo, json_path: Path | None = None,
                  report_dir: Path | None = None, changed_path: Path | None = None, gates=None,
                  loaded: list | None = None, length_options=None) -> list[str]:
    """What ``ortevals compare`` does: load, compare, print with ``echo``, write the files asked for.

    ``loaded``: runs already in memory (``--compare-to``), compared after ``runs``; ``length_options``:
    :class:`~ortevals.report.lengths.LengthOptions` (``--by-length``, ``--tokenizer``). Returns each gate's
    verdict (report/compare.py ``Verdict``: passing ones too; empty without gates).
    """
    from ortevals.report.compare import Gates, check_gates, compare
    from ortevals.report.runs import load_run

    for path, flag in ((json_path, "--json"), (changed_path, "--changed")):  # before any run is read
        if path is not None:
            check_writable_file(Path(path), flag)
    if report_dir is not None:
        check_writable_folder(Path(report_dir), "--report", REPORT_FILES)
    cmp = compare(load_run(ref), [load_run(r) for r in runs] + list(loaded or []), length_options)
    verdicts = check_gates(cmp, gates or Gates())
    echo(format_text(cmp))
    if json_path is not None:
        write_json(cmp, json_path)
        echo(f"wrote {json_path}")
    if changed_path is not None:
        write_changed(cmp, changed_path)
        echo(f"wrote {changed_path} ({len(cmp.changed)} questions)")
    if report_dir is not None:
        from ortevals.report.html import write_report

        with staged(Path(report_dir), "--report") as stage:  # report.md, report.html and the PNGs as one set
            names = [p.name for p in write_report(cmp, stage)]
            publish(stage, Path(report_dir), "--report", last="report.html")
        for name in names[:2]:
            echo(f"wrote {Path(report_dir) / name}")
    return verdicts
