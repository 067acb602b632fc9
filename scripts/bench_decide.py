#!/usr/bin/env python
"""docs/benchmarks.md's decided comparisons: the decision rule (report/decide.py) replayed over random orders of
complete runs of real packages, at several margins, in a uniform order and in the reference-guided order
(report/guided.py).

    python scripts/bench_decide.py --ref runs-dec/fp32 runs-dec/fp32-kv8 runs-dec/int4 --margins 1,2,3,5

(docs/benchmarks.md's section 13 has the commands that made the runs.)

Each RUN is an ortevals ``--output`` folder (or an lm-eval ``--log_samples`` folder) of the same questions as the
reference; they are aligned as ``ortevals compare`` aligns them. Writes ``decide.md`` (the tables), ``decide.json``
(every replay's figures) and ``decide.png`` (questions used against the margin, uniform and guided) to ``--out``
(default docs/bench-decide/).

With ``--sample 1000`` it also replays ``--sample N`` (report/sampling.py's stratified draw and whole-set
estimate, the functions ``ortevals mmlu-pro --sample`` calls) over ``--orders`` seeds on each complete run: how
often the interval holds the run's whole-set accuracy, and how wide it is.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ortevals.report import decide, sampling  # noqa: E402
from ortevals.report.replay import paired_scores, reference_margins  # noqa: E402
from ortevals.report.runs import load_run  # noqa: E402

Z95 = 1.959964


def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name", from /proc/cpuinfo), else the platform's processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fixed_n(d: np.ndarray, margin: float) -> float:
    """Questions a fixed-n 95% interval (normal, finite-population corrected, the whole set's own spread) needs to
    decide at ±margin: to shrink to the distance between the whole-set difference and the nearer of ±margin. The
    yardstick an anytime-valid sequence is above (it is valid at every look; this is valid at one fixed n)."""
    room = abs(margin - abs(d.mean()))
    if room == 0:
        return float("nan")
    n0 = (Z95 * d.std() / room) ** 2
    return float(min(len(d), n0 / (1 + (n0 - 1) / len(d))))


def replay_one(cand, base, margin_points: float, order: str, args, margins) -> dict:
    r = decide.replay(cand, base, margin_points / 100, args.alpha, args.orders, args.part, seed=args.seed,
                      order=order, reference_margin=margins)
    counts = {name: r.decisions.count(name) for name in decide.DECISIONS if name in r.decisions}
    return {"order": order, "margin": margin_points, "decisions": counts,
            "median": float(np.median(r.used)), "p90": float(np.percentile(r.used, 90)),
            "misses": r.misses, "orders": len(r.used), "population": r.population,
            "low_median": float(np.median(r.low)), "high_median": float(np.median(r.high))}


def sample_coverage(run, n: int, seeds: int) -> dict:
    """``--sample n`` replayed over ``seeds`` seeds on a complete run: the stratified draw by category, the whole-set
    estimate and its interval from the drawn questions' own 0/1 scores, against the run's whole-set accuracy."""
    tasks = [t for t in run.tasks.values() if not np.isnan(t.correct).all()]
    correct = np.concatenate([t.correct for t in tasks])
    names = [f"{t.task}/{c}" for t in tasks for c in t.category]  # categories within each task, as --sample does
    _, strata = np.unique(names, return_inverse=True)
    sizes = np.bincount(strata)
    full, hits, half = float(correct.mean()), 0, []
    for seed in range(seeds):
        drawn = sampling.draw(strata, n, seed)
        est = sampling.estimate(sizes, np.bincount(strata[drawn], minlength=len(sizes)),
                                np.bincount(strata[drawn], weights=correct[drawn], minlength=len(sizes)))
        hits += est.low <= full <= est.high
        half.append((est.high - est.low) / 2)
    return {"name": run.name, "questions": len(correct), "strata": len(sizes), "n": n, "seeds": seeds,
            "accuracy": full, "covered": int(hits), "half_width_median": float(np.median(half)),
            "half_width_max": float(np.max(half))}


def sample_table(rows: list[dict]) -> list[str]:
    lines = ["**`--sample` replayed** (report/sampling.py's stratified draw and estimate, on each complete run's own "
             "0/1 scores):", "", "| run | questions (categories) | N | whole-set accuracy | interval held it | "
             "half-width, median (largest) |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['questions']:,} ({r['strata']}) | {r['n']:,} | {r['accuracy']:.4f} | "
              f"{r['covered']} of {r['seeds']} | ±{100 * r['half_width_median']:.2f} (±{100 * r['half_width_max']:.2f})"
              " points |" for r in rows]
    return lines + [""]


def flips_by_margin(d: np.ndarray, margin: np.ndarray, bins: int = 4) -> list[dict]:
    """The flip rate in each quartile of the reference's choice margin: how concentrated the flips are."""
    bins = min(bins, len(margin))
    which = np.argsort(np.argsort(margin, kind="stable")) * bins // len(margin)  # equal-sized groups by rank
    return [{"low": float(margin[which == b].min()), "high": float(margin[which == b].max()),
             "n": int((which == b).sum()), "flips": int(np.count_nonzero(d[which == b]))} for b in range(bins)]


def compare(ref, path: str, margins: list[float], args) -> dict:
    run = load_run(path)
    cand, base = paired_scores(ref, run)
    d = (cand - base).astype(np.int64)
    margin = reference_margins(ref, run)
    rows = [replay_one(cand, base, m, o, args, margin) for m in margins for o in ("uniform", "guided")]
    for row in rows:
        row["fixed_n"] = fixed_n(d, row["margin"] / 100)
    return {"name": run.name, "path": str(path), "questions": len(d), "diff_points": 100 * float(d.mean()),
            "flips": int(np.count_nonzero(d)), "acc": float(cand.mean()), "ref_acc": float(base.mean()),
            "by_margin": flips_by_margin(d, margin), "rows": rows}


def table(result: dict, ref_name: str) -> list[str]:
    n = result["questions"]
    lines = [f"**{result['name']} against {ref_name}**: {n:,} questions, accuracy {result['acc']:.4f} against "
             f"{result['ref_acc']:.4f}, whole-set difference {result['diff_points']:+.2f} points, {result['flips']} "
             f"flips ({result['flips'] / n:.1%}).", "",
             "| margin | order | decisions | questions used, median (p90) | share (median) | uniform / guided "
             "| final interval missed | fixed-n interval would need |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    uniform = {r["margin"]: r["median"] for r in result["rows"] if r["order"] == "uniform"}
    for r in result["rows"]:
        ratio = f"{uniform[r['margin']] / r['median']:.2f}×" if r["order"] == "guided" else ""
        dec = ", ".join(f"{k} {v}" for k, v in r["decisions"].items())
        fixed = "—" if np.isnan(r["fixed_n"]) else f"{r['fixed_n']:,.0f}"
        lines.append(f"| ±{r['margin']:g} | {r['order']} | {dec} | {r['median']:,.0f} ({r['p90']:,.0f}) | "
                     f"{r['median'] / n:.0%} | {ratio} | {r['misses']} of {r['orders']} | {fixed} |")
    lines += ["", "Flips by the reference's choice margin (top-1 minus top-2 log-likelihood), quartiles:", "",
              "| reference margin (nats) | questions | flips | flip rate |", "|---|---:|---:|---:|"]
    lines += [f"| {b['low']:.3f}–{b['high']:.3f} | {b['n']} | {b['flips']} | {b['flips'] / max(b['n'], 1):.1%} |"
              for b in result["by_margin"]]
    return lines + [""]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, res in enumerate(results):
        color = f"C{i}"
        ax.axvline(abs(res["diff_points"]), color=color, lw=0.8, ls=":")  # |Δ|: a margin never decided early
        for order, style in (("uniform", "-o"), ("guided", "--s")):
            rows = [r for r in res["rows"] if r["order"] == order]
            if not rows:
                continue
            x = [r["margin"] for r in rows]
            ax.plot(x, [r["median"] for r in rows], style, color=color, label=f"{res['name']}, {order}")
            ax.fill_between(x, [r["median"] for r in rows], [r["p90"] for r in rows], color=color, alpha=0.12)
    n = max(r["questions"] for r in results)
    ax.axhline(n, color="grey", lw=0.8, ls=":")
    ax.set_ylim(0, 1.05 * n)
    ax.set_xlabel("margin (± points)")
    ax.set_ylabel("questions used (median; shaded to p90)")
    ax.set_title(f"Decision rule replayed over random orders, {n:,} questions\n(dotted: each |Δ|)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the reference run (complete)")
    ap.add_argument("runs", nargs="+", help="candidate runs on the same questions")
    ap.add_argument("--margins", default="1,2,3,5", help="margins in points, comma-separated")
    ap.add_argument("--orders", type=int, default=200)
    ap.add_argument("--part", type=int, default=50)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "docs" / "bench-decide"))
    ap.add_argument("--note", default="", help="a sentence for the head of decide.md: how the runs were made")
    ap.add_argument("--sample", type=int, default=None, help="also replay --sample N over --orders seeds")
    args = ap.parse_args()
    margins = [float(m) for m in args.margins.split(",")]
    ref = load_run(args.ref)
    results = [compare(ref, path, margins, args) for path in args.runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = [f"{args.note} CPU: {cpu_model()}. Reference: {ref.name}. {args.orders} random orders (seed "
            f"{args.seed}), parts of {args.part}, alpha {args.alpha:g}.".strip(), ""]
    samples = [sample_coverage(load_run(p), args.sample, args.orders) for p in (args.ref, *args.runs)] \
        if args.sample else []
    body = [x for r in results for x in table(r, ref.name)] + (sample_table(samples) if samples else [])
    (out / "decide.md").write_text("\n".join(head + body))
    meta = {"note": args.note, "cpu": cpu_model(), "ref": args.ref, "orders": args.orders, "part": args.part,
            "alpha": args.alpha, "seed": args.seed, "results": results, "samples": samples}
    (out / "decide.json").write_text(json.dumps(meta, indent=1) + "\n")
    plot(results, out / "decide.png")
    print((out / "decide.md").read_text())


if __name__ == "__main__":
    main()
