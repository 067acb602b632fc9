#!/usr/bin/env python
"""The whole MMLU-Pro benchmark on one machine: wall time, rate over time, RSS through the run, the ETA's
error at half way, the store's size, and a run killed at half way then resumed against an uninterrupted one.

    python scripts/bench_whole.py --out bench-data/whole                # all 12,032 test questions
    python scripts/bench_whole.py --limit 300 --out bench-data/whole-300

Two ``ortevals mmlu-pro`` runs (the SmolLM2 example package unless ``--pkg``; bundled data), each a whole
process from an **empty cache** (a new ``$ORTEVALS_CACHE`` holding only the package: no result store, no
canary verdict, no derived graph):

* **A, uninterrupted**: the process tree's RSS (psutil, children included) sampled every ``--every``
  seconds with the questions done at that moment (read from the progress bar on stderr); the bar's ETA
  when it first shows half the questions done, against the time the scoring actually took from there;
* **B, killed and resumed**: the same command in another empty cache, SIGKILL once the bar shows
  ``--kill-at`` of the questions done, then the same command again (it resumes from the result store).

Then B's ``results.json`` and samples are compared with A's: every sample's log-likelihoods and flags,
answers, metrics, and each result and calibration figure (timings and the reused-answer counts differ by
nature and are left out). Writes ``summary.json``, ``summary.md`` and ``whole.png`` (questions/s and RSS
over time) under ``--out``, the runs' own outputs in ``--out/A``, ``--out/B``. Each run holds
``/work/bench.lock`` when that folder exists, the clock starting once it is held.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from procwatch import Watched

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BAR = re.compile(r"ortevals:\s+(\d+)%\|[^|]*\| (\d+)/(\d+) questions \[([\d:]+)<([\d:?]+)\]")
VOLATILE = {"date", "efficiency", "ortevals", "config", "pretty_env_info", "git_hash", "upper_git_hash",
            "transformers_version", "model_source", "start_time", "end_time", "total_evaluation_time_seconds"}


def seconds(clock: str) -> float | None:
    """tqdm's ``[H:]MM:SS`` as seconds (None for ``?``)."""
    if "?" in clock:
        return None
    parts = [int(p) for p in clock.split(":")]
    return float(sum(p * 60 ** i for i, p in enumerate(reversed(parts))))


class Run:
    """One ``ortevals`` process (procwatch.Watched) with its progress bar read: (t, done, total, ETA) per line;
    killed once ``kill_at`` of the questions are done."""

    def __init__(self, name: str, cmd: list[str], env: dict, every: float, kill_at: float | None = None) -> None:
        print(f"{name}: {' '.join(cmd)}", flush=True)
        self.bar: list[tuple[float, int, int, float | None]] = []
        self.kill_at = kill_at
        self.w = Watched(cmd, env, every, self._line)
        if kill_at is None and self.w.code != 0:
            raise SystemExit(f"{name} failed (exit {self.w.code}):\n" + "\n".join(self.w.tail))
        self.wall, self.out = self.w.wall, self.w.out
        self.killed_at = (self.w.killed_at, *self.bar[-1][1:3]) if self.w.killed_at is not None else None
        # RSS samples with the questions done when each was taken
        self.rss = [(t, max((b[1] for b in self.bar if b[0] <= t), default=0), m) for t, m in self.w.rss]
        last = self.bar[-1] if self.bar else (0, 0, 0, None)
        print(f"  exit {self.w.code}, {self.wall:.1f} s, {last[1]}/{last[2]} questions, peak RSS "
              f"{self.w.peak_mib:.0f} MiB", flush=True)

    def _line(self, now: float, text: str) -> bool:
        found = BAR.search(text)
        if not found:
            return False
        done, total = int(found[2]), int(found[3])
        self.bar.append((now, done, total, seconds(found[5])))
        return self.kill_at is not None and done >= self.kill_at * total


def fresh_cache(root: Path, package: Path) -> Path:
    """An empty ortevals cache holding only ``package`` (linked, as ``examples/<name>``)."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "examples").mkdir(parents=True)
    (root / "examples" / package.name).symlink_to(package.resolve())
    return root


def eta_check(w: Run) -> dict:
    """The bar's ETA when it first shows half the questions done, against the scoring time actually left
    (to the bar's last line, 100%)."""
    end = w.bar[-1][0]
    half = next(b for b in w.bar if b[1] >= b[2] / 2)
    actual = end - half[0]
    return {"at_s": half[0], "questions": half[1], "eta_s": half[3], "actual_s": actual,
            "error": (half[3] - actual) / actual if half[3] is not None and actual > 0 else None}


def rss_check(w: Run, after: int) -> dict:
    """Peak RSS, RSS when ``after`` questions were done, the most it grew from there to the end of scoring
    (the bar's last line), and the peak after scoring (lm-eval's metrics and samples, the report)."""
    rss = [r for r in w.rss if r[2] > 0]  # a sample of the exiting process reads 0
    end = w.bar[-1][0]
    base = next((r for r in rss if r[1] >= after), None)
    later = [r[2] for r in rss if base is not None and base[0] <= r[0] <= end]
    return {"peak_mib": max(r[2] for r in rss), "after_questions": after,
            "at_mark_mib": base[2] if base else None, "growth_after_mib": (max(later) - base[2]) if base else None,
            "peak_after_scoring_mib": max((r[2] for r in rss if r[0] > end), default=None)}


def compare(a: Path, b: Path) -> dict:
    """B's results.json and samples against A's: every field but timings and reuse counts."""
    # task configs name their functions with memory addresses: those differ between processes
    ra, rb = (json.loads(re.sub(r" at 0x[0-9a-f]+", "", (d / "results.json").read_text())) for d in (a, b))
    keys = sorted(set(ra) - VOLATILE)
    differ = [k for k in keys if ra.get(k) != rb.get(k)]
    worst, answers, lines, fields = 0.0, 0, 0, set()
    for fa in sorted(a.glob("samples_*.jsonl")):
        fb = b / fa.name
        for la, lb in zip(fa.open(), fb.open(), strict=True):
            sa, sb = json.loads(la), json.loads(lb)
            lines += 1
            fields |= {k for k in sa if sa[k] != sb.get(k)}
            lpa = [r[0][0] for r in sa["resps"]]
            lpb = [r[0][0] for r in sb["resps"]]
            worst = max(worst, max(abs(x - y) for x, y in zip(lpa, lpb, strict=True)))
            answers += lpa.index(max(lpa)) == lpb.index(max(lpb))
    return {"results_fields_compared": keys, "results_fields_differing": differ, "samples": lines,
            "sample_fields_differing": sorted(fields), "same_answers": answers, "max_abs_dlogprob": worst}


def rate_series(w: Run, window: float) -> list[tuple[float, float]]:
    """(time, questions/s over the last ``window`` seconds) from the bar's lines."""
    out = []
    for t, done, _, _ in w.bar[::max(1, len(w.bar) // 400)]:
        past = [b for b in w.bar if t - window <= b[0] <= t]
        if past and t > past[0][0]:
            out.append((t, (done - past[0][1]) / (t - past[0][0])))
    return out


def plot(a: Run, out: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    series = rate_series(a, window)
    ax.plot([t / 60 for t, _ in series], [r for _, r in series], color="#4c72b0", label="questions/s")
    ax.set_xlabel("minutes since launch")
    ax.set_ylabel(f"questions/s ({window:.0f} s window)")
    twin = ax.twinx()
    twin.plot([t / 60 for t, _, _ in a.rss], [m / 1024 for _, _, m in a.rss], color="#dd8452", label="RSS")
    twin.set_ylabel("RSS, GiB")
    fig.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "whole.png", dpi=110)


def summary_md(s: dict) -> str:
    a, e, r = s["A"], s["eta"], s["rss"]
    lines = ["| run | wall | questions | requests/s | peak RSS | store |", "|---|---:|---:|---:|---:|---:|",
             f"| A, uninterrupted, empty cache | {a['wall_s']:.0f} s | {a['questions']} | {a['requests_per_s']:.2f} | "
             f"{r['peak_mib']:.0f} MiB | {s['store_mib']:.1f} MiB |"]
    if "B" in s:
        b = s["B"]
        lines += [f"| B, killed at {b['killed_at'][1]}/{b['killed_at'][2]} questions ({b['killed_at'][0]:.0f} s) "
                  f"| {b['first_wall_s']:.0f} s | | | | |",
                  f"| B, resumed | {b['resume_wall_s']:.0f} s | {b['resume_questions']} | | "
                  f"{b['resume_peak_mib']:.0f} MiB | |"]
    lines += ["", f"- ETA at half way ({e['questions']} questions, {e['at_s']:.0f} s): {e['eta_s']:.0f} s shown, "
              f"{e['actual_s']:.0f} s taken: error {e['error']:+.1%}",
              f"- RSS: {r['at_mark_mib']:.0f} MiB at {r['after_questions']} questions, at most "
              f"{r['growth_after_mib']:+.0f} MiB after that to the end of scoring; peak {r['peak_mib']:.0f} MiB "
              f"({r['peak_after_scoring_mib'] or 0:.0f} MiB after scoring: metrics, samples, report)"]
    if "compare" in s:
        c = s["compare"]
        lines.append(f"- B (killed + resumed) against A: {c['same_answers']}/{c['samples']} same answers, max "
                     f"|Δ log-likelihood| {c['max_abs_dlogprob']:.1e}; results.json fields differing: "
                     f"{c['results_fields_differing'] or 'none'}; sample fields differing: "
                     f"{c['sample_fields_differing'] or 'none'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pkg", type=Path, default=None, help="GenAI package (default: the SmolLM2 example, fp32)")
    p.add_argument("--limit", type=int, default=None, help="the first N test questions (default: all)")
    p.add_argument("--kill-at", type=float, default=0.5, help="fraction of the questions done at the SIGKILL")
    p.add_argument("--no-kill", action="store_true", help="run A only (no killed-and-resumed run B)")
    p.add_argument("--every", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--rss-after", type=int, default=1000, help="RSS must not grow after this many questions")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("extra", nargs="*", help="more ortevals mmlu-pro arguments (after --)")
    args = p.parse_args()
    target = ["--pkg", str(args.pkg.resolve())] if args.pkg else ["--example"]
    if args.pkg is None:
        from ortevals.package.examples import smollm2_package

        args.pkg = smollm2_package("fp32")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "ortevals.cli", "mmlu-pro", *target, "--data", "bundled",
            *(["--limit", str(args.limit)] if args.limit else []), *args.extra]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    runs = {}
    for name, kill in (("A", None), *(() if args.no_kill else (("B", args.kill_at),))):
        cache = fresh_cache(out / f"cache-{name}", Path(args.pkg))
        cmd = [*base, "--output", str(out / name)]
        runs[name] = Run(f"{name}{' (killed at half way)' if kill else ''}", cmd, {**env, "ORTEVALS_CACHE": str(cache)},
                         args.every, kill)
        if kill is not None:
            runs["B2"] = Run("B resumed", cmd, {**env, "ORTEVALS_CACHE": str(cache)}, args.every)
    a = runs["A"]
    questions = a.bar[-1][2]
    store = sum(f.stat().st_size for f in (out / "cache-A" / "runs").glob("*")) / 2**20
    requests = int(re.search(r"requests (\d+)", a.out)[1]) if re.search(r"requests (\d+)", a.out) else None
    s = {"command": base, "questions": questions, "cores": os.cpu_count(),
         "A": {"wall_s": a.wall, "questions": questions, "requests": requests,
               "requests_per_s": (requests or 0) / a.wall, "summary": [ln for ln in a.out.splitlines()
                                                                    if ln.startswith(("questions ", "efficiency"))]},
         "eta": eta_check(a), "rss": rss_check(a, min(args.rss_after, questions // 10)), "store_mib": store,
         "series": {"rss": a.rss, "bar": [(t, d) for t, d, _, _ in a.bar[::max(1, len(a.bar) // 2000)]]}}
    if "B" in runs:
        b, b2 = runs["B"], runs["B2"]
        s["B"] = {"killed_at": b.killed_at, "first_wall_s": b.wall, "resume_wall_s": b2.wall,
                  "resume_questions": b2.bar[-1][2] if b2.bar else 0,
                  "resume_peak_mib": max((r[2] for r in b2.rss), default=math.nan)}
        s["compare"] = compare(out / "A", out / "B")
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(s) + "\n")
    plot(a, out, max(30.0, a.wall / 40))
    print(summary_md(s))


if __name__ == "__main__":
    main()
