"""Predict data-parallel MMLU-Pro runs: the REAL sharding plan and dispatcher, a calibrated cost model.

    python scripts/simulate_shards.py [--pkg PKG] [--limit N] [--workers 2,8,64,512] [--out docs/distributed]

1. Requests: lm-eval builds ``leaderboard_mmlu_pro`` (5-shot, first_n from validation) over the
   bundled data (all 12,032 test questions), and ``OrtLM._encode_pair`` tokenizes them exactly as a
   run does (SmolLM2 example package by default). Every choice is checked to be one token, so a
   question is one model input (its context).
2. Calibration: the package's real decoder (the engine's runner, derived scoring graph) times the
   shared-prefix pass (the 5-shot header, KV kept) and one suffix pass per question on top of that KV,
   for a sample of questions; ``t = a + b * suffix_tokens`` is fitted (scipy.stats.linregress).
3. Simulation: ``plan_shards`` + ``Dispatcher`` (ortevals/engine/shard.py) for each worker count; the
   worker that frees up first pulls the next chunk; a chunk of a group the worker did not run last
   pays the group's prefix pass again.

Writes ``distributed.md``-ready markdown to stdout and ``speedup.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ortevals.engine.shard import Dispatcher, plan_shards
from ortevals.tokens import common_prefix


def build_contexts(lm, limit: int | None) -> list[tuple[int, ...]]:
    """One context per question, tokenized as OrtLM does; every choice must be a single token."""
    from lm_eval.tasks import get_task_dict

    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro"]
    tm = preset.task_manager()
    task = get_task_dict(task_specs(preset, resolve_data(preset, "bundled"), tm), tm)["leaderboard_mmlu_pro"]
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    contexts: dict[int, tuple[int, ...]] = {}
    for inst in task.instances:
        ctx, cont = inst.args
        c_enc, x_enc = lm._encode_pair(ctx, cont)
        if len(x_enc) != 1:
            raise SystemExit(f"choice {cont!r} of question {inst.doc_id} is {len(x_enc)} tokens, not 1")
        prev = contexts.setdefault(inst.doc_id, tuple(c_enc))
        if prev != tuple(c_enc):
            raise SystemExit(f"question {inst.doc_id}: choices disagree on the context tokens")
    return [contexts[k] for k in sorted(contexts)]


def calibrate(lm, contexts: list[tuple[int, ...]], header: int, sample: int = 24, repeat: int = 3):
    """Seconds of the header pass, and (a, b) of the suffix pass ``a + b * tokens`` on the header's KV."""
    from scipy.stats import linregress

    runner = lm.engine.runner
    head = np.asarray([contexts[0][:header]], dtype=np.int64)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _, kv = runner.forward(head, np.ones_like(head), None, want_present=True)
        times.append(time.perf_counter() - t0)
    prefix_s = float(np.median(times))
    picks = np.linspace(0, len(contexts) - 1, min(sample, len(contexts))).astype(int)
    lengths, secs = [], []
    for i in picks:
        ids = np.asarray([contexts[i][header:]], dtype=np.int64)
        mask = np.ones((1, contexts[i].__len__()), dtype=np.int64)
        pos = np.asarray([[ids.shape[1] - 1]], dtype=np.int64)
        best = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            if runner.gathers_positions:
                runner.forward(ids, mask, kv, False, pos)
            else:
                runner.forward(ids, mask, kv, False)
            best.append(time.perf_counter() - t0)
        lengths.append(ids.shape[1])
        secs.append(min(best))
    fit = linregress(lengths, secs)
    return prefix_s, float(fit.intercept), float(fit.slope), float(fit.rvalue ** 2)


def simulate(contexts, workers: int, prefix_s: float, a: float, b: float, cpw: int):
    """Makespan, balance, prefix passes and extra prefix seconds for ``workers`` workers."""
    plan = plan_shards(contexts, workers, chunks_per_worker=cpw)
    units = [len({contexts[r] for r in c.requests}) for c in plan.chunks]
    per_token = prefix_s / max(max(plan.prefix.values()), 1)  # prefix pass seconds per prefix token

    def chunk_s(c):
        return units[c.index] * a + b * c.cost

    d = Dispatcher(plan.chunks)
    clock = np.zeros(workers)
    warm = [None] * workers
    passes, prefix_total = 0, 0.0
    while True:
        w = int(np.argmin(clock))
        c = d.next(w)
        if c is None:
            break
        if warm[w] != c.group and c.prefix:
            clock[w] += per_token * c.prefix
            prefix_total += per_token * c.prefix
            passes += 1
        warm[w] = c.group
        clock[w] += chunk_s(c)
    groups = len([g for g in plan.groups if plan.prefix[g]])
    extra = prefix_total - sum(per_token * plan.prefix[g] for g in plan.groups)  # beyond one pass per group
    return {"workers": workers, "chunks": len(plan.chunks), "makespan": float(clock.max()),
            "balance": float(clock[clock > 0].mean() / clock.max()) if workers > 1 else 1.0,
            "busy": float(clock.sum()), "prefix_passes": passes, "extra_s": float(extra), "groups": groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pkg", default=None, help="package (default: the SmolLM2 fp32 example)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions (default: all 12,032)")
    ap.add_argument("--workers", default="2,8,64,512")
    ap.add_argument("--chunks-per-worker", type=int, default=8)
    ap.add_argument("--sample", type=int, default=24, help="questions timed for the suffix-pass fit")
    ap.add_argument("--out", type=Path, default=Path("docs/distributed"))
    args = ap.parse_args()

    from ortevals.integrations.lm import OrtLM
    from ortevals.options import parse_model_args
    from ortevals.package.examples import smollm2_package

    lm = OrtLM.from_package(parse_model_args({"pkg": args.pkg or str(smollm2_package("fp32"))}))
    t0 = time.perf_counter()
    contexts = build_contexts(lm, args.limit)
    header = len(contexts[0])
    for c in contexts:
        header = common_prefix(contexts[0][:header], c)
    print(f"{len(contexts)} questions tokenized in {time.perf_counter() - t0:.0f}s; shared header {header} tokens, "
          f"suffix mean {np.mean([len(c) - header for c in contexts]):.0f} tokens")
    prefix_s, a, b, r2 = calibrate(lm, contexts, header, args.sample)
    print(f"calibration ({lm.backends.provider.name}, threads {lm.args.threads or 'default'}): header pass "
          f"{prefix_s * 1e3:.1f} ms; suffix pass {a * 1e3:.2f} ms + {b * 1e6:.1f} us/token (R^2 {r2:.3f})")
    one = simulate(contexts, 1, prefix_s, a, b, args.chunks_per_worker)
    rows = [simulate(contexts, int(w), prefix_s, a, b, args.chunks_per_worker) for w in args.workers.split(",")]
    print("\n| workers | chunks | makespan (s) | speedup | balance (mean/max) | prefix passes | extra prefix work |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| 1 | {one['chunks']} | {one['makespan']:.1f} | 1.00x | 100% | {one['prefix_passes']} | 0.00% |")
    for r in rows:
        print(f"| {r['workers']} | {r['chunks']} | {r['makespan']:.2f} | {one['makespan'] / r['makespan']:.1f}x | "
              f"{100 * r['balance']:.1f}% | {r['prefix_passes']} | {100 * r['extra_s'] / one['busy']:.2f}% |")
    plot(args.out, one, rows)


def plot(out: Path, one: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    ws = [1] + [r["workers"] for r in rows]
    speed = [1.0] + [one["makespan"] / r["makespan"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.loglog(ws, ws, "--", color="grey", label="ideal")
    ax1.loglog(ws, speed, "o-", label="predicted")
    ax1.set(xlabel="workers", ylabel="speedup over one worker", title="MMLU-Pro (12,032 questions)")
    ax1.legend()
    ax2.semilogx(ws[1:], [100 * r["balance"] for r in rows], "o-", label="balance (mean/max)")
    ax2.semilogx(ws[1:], [100 * r["extra_s"] / one["busy"] for r in rows], "s-", label="extra prefix work")
    ax2.axhline(90, color="grey", ls=":")
    ax2.axhline(5, color="grey", ls=":")
    ax2.set(xlabel="workers", ylabel="%", title="balance and extra prefix work")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    print(f"\nwrote {out / 'speedup.png'}")


if __name__ == "__main__":
    main()
