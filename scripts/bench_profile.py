#!/usr/bin/env python
"""`ortevals profile` against onnxruntime-genai's own benchmark on the same settings (docs/benchmarks.md §9).

Runs ``--rounds`` rounds in ABBA order (profile, script; script, profile; ...), each side in its own
process under ``flock /work/bench.lock`` (the machine is shared: 2 cores, other jobs beside):

1. ``ortevals profile`` (raw path and og's Generator, one invocation);
2. ``--og-script``: a port of the timing loop of ``benchmark/python/benchmark_e2e.py`` in
   microsoft/onnxruntime-genai (MIT; read at commit a0c04eb13 of its main branch, 0.16.0-dev, the newest
   stored copy; its loop uses only calls og 0.18 has). Rewritten here, not copied, so that it runs
   offline without the script's ``metrics.py``/pandas; what it keeps from the script: a new ``og.Model``
   per setting from ``og.Config`` with ``search.batch_size`` overlaid and the providers cleared (CPU);
   ``warmup`` untimed full generations; per repetition a new Generator (untimed), the prompt timer around
   ``append_tokens``, the sampling timer around the first ``generate_next_token`` + ``is_done``, TTFT their
   sum, then one timer per later ``generate_next_token`` + ``is_done`` until prompt + gen tokens; means;
   peak memory from a thread reading ``psutil.virtual_memory().used`` every 0.1 s over the whole setting
   (model load included). What it changes, so that both sides run the same work: greedy (the script's
   ``-k 1``), the same prompt ids as ``ortevals profile`` (random ids below 100, each row its own: the
   script's ``--use_random_tokens``, here seeded), the same intra-op threads, and prompt tokens/s
   counted as batch × prompt length (on its ``--use_random_tokens`` path the script sets
   ``prompt_length = batch_size * prompt_length``, divides the prompt time by it and then multiplies by
   the batch again: its printed prompt tokens/s is batch× too high for batch > 1; kept beside it as
   ``script_printed_prefill_tok_s``).

Per round each side's mean over its repeats; the table is the median over rounds. Then writes the summary
to ``--out`` (docs/bench-profile/): ``compare.json`` (median rows, pooled means, every round), ``compare.md``
and ``compare.png``; and the raw data to ``--raw`` (default ``bench-data/bench-profile``, not tracked):
``profile/roundN/`` (the command's JSON and plot), ``og_script.json`` (the script's figures per setting, its
timer lists joined over rounds).

    python scripts/bench_profile.py --batch 1,4 --prompt-len 128 --gen-len 64 --rounds 3 --out docs/bench-profile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
LOCK = ["flock", "/work/bench.lock"] if Path("/work").is_dir() else []
METRICS = (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"), ("ttft_ms", "TTFT ms"),
           ("tpot_ms", "TPOT ms"))


def og_script(pkg: str, batch: int, plen: int, glen: int, repeats: int, warmup: int, threads: int) -> dict:
    """One setting of benchmark_e2e.py's run_benchmark_memory, ported (see the module docstring)."""
    import onnxruntime_genai as og
    import psutil

    from ortevals.engine.profile import prompt_ids
    from ortevals.package.loader import ModelPackage

    peak, stop = [0.0], threading.Event()

    def monitor():  # the script's CPU monitor: the machine's used memory, GiB, every 0.1 s
        while not stop.is_set():
            peak[0] = max(peak[0], round(psutil.virtual_memory().used / 1024**3, 2))
            time.sleep(0.1)

    watcher = threading.Thread(target=monitor)
    watcher.start()
    config = og.Config(pkg)
    config.overlay(json.dumps({"search": {"batch_size": batch}, "model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads}}}}))
    config.clear_providers()
    model = og.Model(config)
    # the script's --use_random_tokens ids (randint(100), each row its own); these are profile's, seeded
    tokens = prompt_ids(batch, plen, ModelPackage.load(pkg).vocab_size).astype(np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, top_k=1, top_p=1.0, temperature=1.0, max_length=plen + glen,
                              min_length=plen + glen, batch_size=batch)
    for _ in range(warmup):
        gen = og.Generator(model, params)
        gen.append_tokens(tokens)
        while not gen.is_done() and gen.token_count() < plen + glen:
            gen.generate_next_token()
        del gen
    prompt_t, sampling_t, gen_t, wall_t = [], [], [], []
    for _ in range(repeats):
        wall0 = time.time()
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(tokens)
        prompt_t.append(time.perf_counter() - t0)
        target = gen.token_count() + glen
        t0 = time.perf_counter()
        gen.generate_next_token()
        done = gen.is_done()
        sampling_t.append(time.perf_counter() - t0)
        while not done and gen.token_count() < target:
            t0 = time.perf_counter()
            gen.generate_next_token()
            done = gen.is_done()
            gen_t.append(time.perf_counter() - t0)
        wall_t.append(time.time() - wall0)
        del gen
    stop.set()
    watcher.join()
    return {"batch": batch, "prompt_len": plen, "gen_len": glen, "prompt_s": prompt_t, "sampling_s": sampling_t,
            "gen_s": gen_t, "wall_each_s": wall_t, "peak_machine_used_gib": peak[0]}


def script_metrics(r: dict) -> dict:
    """The script's figures from its timer lists (its default aggregation, the mean); see the docstring for
    the one formula kept apart (``script_printed_prefill_tok_s``)."""
    b, p = r["batch"], r["prompt_len"]
    prompt_s, tpot_s = float(np.mean(r["prompt_s"])), float(np.mean(r["gen_s"]))
    return {**r, "prefill_tok_s": b * p / prompt_s, "script_printed_prefill_tok_s": b * (b * p) / prompt_s,
            "ttft_ms": 1e3 * float(np.mean(np.add(r["prompt_s"], r["sampling_s"]))), "tpot_ms": 1e3 * tpot_s,
            "decode_tok_s": b / tpot_s, "sampling_ms": 1e3 * float(np.mean(r["sampling_s"])),
            "wall_s": float(np.mean(r["wall_each_s"])), "decode_steps": len(r["gen_s"])}


def pool(rounds: list[list[dict]], keys: tuple[str, ...], lists: tuple[str, ...]) -> list[dict]:
    """Each round's rows for one side, their timer lists joined per ``keys`` (the repeats of every round)."""
    out: dict[tuple, dict] = {}
    for rows in rounds:
        for r in rows:
            k = tuple(r[x] for x in keys)
            if k not in out:
                out[k] = {**{x: r[x] for x in keys}, **{x: [] for x in lists}}
            for x in lists:
                out[k][x] = out[k][x] + list(r[x])
            for x in (x for x in r if x.startswith("peak") and r[x] is not None):  # the most of any round
                out[k][x] = max(out[k].get(x, r[x]), r[x])
    return list(out.values())


def profile_metrics(r: dict) -> dict:
    from ortevals.engine.profile import Setting, Trial

    t = Trial(r["backend"], Setting(r["batch"], r["prompt_len"], r["gen_len"]), prefill_s=r["prefill_s"],
              first_token_s=r["first_token_s"], decode_s=r["decode_s"], wall_s=r["wall_each_s"],
              peak_mib=r.get("peak_mib"))
    return t.summary()


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    subprocess.run([*LOCK, *cmd], check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    return time.perf_counter() - t0


def compare(prof: dict, script: list[dict]) -> list[dict]:
    """Per setting and metric: profile's og and raw against the script's, as ratios."""
    out = []
    for s in script:
        key = (s["batch"], s["prompt_len"], s["gen_len"])
        mine = {t["backend"]: t for t in prof["trials"] if (t["batch"], t["prompt_len"], t["gen_len"]) == key}
        for metric, label in METRICS:
            out.append({"batch": key[0], "prompt_len": key[1], "gen_len": key[2], "metric": label,
                        "script": s[metric], "profile_og": mine["og"][metric], "profile_raw": mine["raw"][metric],
                        "og_vs_script": mine["og"][metric] / s[metric] - 1,
                        "raw_vs_script": mine["raw"][metric] / s[metric]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| batch | prompt | gen | metric | og script (port) | profile og | Δ og vs script | profile raw | "
             "raw / script |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['gen_len']} | {r['metric']} | {r['script']:.4g} | "
                     f"{r['profile_og']:.4g} | {100 * r['og_vs_script']:+.1f}% | {r['profile_raw']:.4g} | "
                     f"{r['raw_vs_script']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from ortevals.report.plots import figure, png

    keys = list(dict.fromkeys((r["batch"], r["prompt_len"], r["gen_len"]) for r in rows))
    plt, fig, axes = figure(width=10, height=4, cols=2)
    for ax, label in zip(axes, ("prefill tok/s", "decode tok/s"), strict=True):
        got = [r for r in rows if r["metric"] == label]
        for j, (col, name) in enumerate((("script", "og benchmark_e2e (port)"), ("profile_og", "profile: og"),
                                         ("profile_raw", "profile: raw"))):
            ax.bar([i + 0.27 * j for i in range(len(keys))], [r[col] for r in got], 0.27, label=name)
        ax.set_xticks([i + 0.27 for i in range(len(keys))])
        ax.set_xticklabels([f"b{b} p{p}\ng{g}" for b, p, g in keys], fontsize=8)
        ax.set_title(label)
        ax.set_ylim(0, 1.3 * max(r[c] for r in got for c in ("script", "profile_og", "profile_raw")))
        ax.legend(fontsize=7, loc="upper left", ncol=3)  # above the bars: the headroom is set just before
    path.write_bytes(png(plt, fig))


def side_profile(a, out: Path) -> list[dict]:
    """``ortevals profile`` in its own process under the lock: its trials (profile.json)."""
    run([sys.executable, "-m", "ortevals.cli", "profile", "--pkg", a.pkg, "--batch", a.batch, "--prompt-len",
         a.prompt_len, "--gen-len", a.gen_len, "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--threads",
         str(a.threads), "--output", str(out)])
    return json.loads((out / "profile.json").read_text())["trials"]


def side_script(a) -> list[dict]:
    """The ported script in its own process under the lock: per setting its timer lists."""
    res = subprocess.run([*LOCK, sys.executable, __file__, "--og-script", "--pkg", a.pkg, "--batch", a.batch,
                          "--prompt-len", a.prompt_len, "--gen-len", a.gen_len, "--repeats", str(a.repeats),
                          "--warmup", str(a.warmup), "--threads", str(a.threads)], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    return json.loads(res.stdout.strip().splitlines()[-1])


def rounds(a) -> tuple[list[list[dict]], list[list[dict]]]:
    """``a.rounds`` rounds in ABBA order (profile first, then the script first, ...), so that a machine
    growing busier or quieter weighs on both sides alike."""
    prof, script = [], []
    for i in range(a.rounds):
        for side in (("profile", "script") if i % 2 == 0 else ("script", "profile")):
            if side == "profile":
                prof.append(side_profile(a, a.raw / "profile" / f"round{i + 1}"))
            else:
                script.append(side_script(a))
    return prof, script


def medians(per_round: list[list[dict]]) -> list[dict]:
    """Per setting and metric, the median over rounds of each side's round mean (the script's
    ``--aggregation median``, over rounds): one round slowed by a neighbour's burst moves it little."""
    out = []
    for rows in zip(*per_round, strict=True):
        med = {k: float(np.median([r[k] for r in rows])) for k in ("script", "profile_og", "profile_raw")}
        out.append({**rows[0], **med, "og_vs_script": med["profile_og"] / med["script"] - 1,
                    "raw_vs_script": med["profile_raw"] / med["script"],
                    "og_vs_script_each_round": [r["og_vs_script"] for r in rows]})
    return out


def write_outputs(a, rows: list[dict], script: list[dict], per_round: list[list[dict]], pooled: list[dict]) -> str:
    (a.raw / "og_script.json").write_text(json.dumps(script, indent=1) + "\n")
    machine = {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(), "shared": "yes: other jobs ran beside"
               " it; each timed process held /work/bench.lock, but untimed work of others did not"}
    (a.out / "compare.json").write_text(json.dumps(
        {"rows": rows, "pooled_means": pooled, "per_round": per_round, "pkg": a.pkg, "threads": a.threads,
         "repeats": a.repeats,
         "warmup": a.warmup, "rounds": a.rounds, "machine": machine}, indent=1) + "\n")
    text = (f"{Path(a.pkg).name}, {a.threads} intra-op threads; {a.rounds} rounds (ABBA), each {a.repeats} timed "
            f"repeats after {a.warmup} warm-up; per round each side's mean, then the median over rounds; "
            f"{os.cpu_count()} CPU cores shared with other jobs (load average at the end "
            f"{os.getloadavg()[0]:.1f}).\n\n" + table(rows) + "\n\nΔ og vs script, each round: "
            + "; ".join(f"b{r['batch']} p{r['prompt_len']} {r['metric']}: "
                        + " ".join(f"{100 * x:+.1f}%" for x in r["og_vs_script_each_round"]) for r in rows))
    (a.out / "compare.md").write_text(text + "\n")
    plot(rows, a.out / "compare.png")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pkg", default=None, help="default: the SmolLM2-135M fp32 example package")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--gen-len", default="64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both sides, in ABBA order")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench-profile", help="the summary")
    ap.add_argument("--raw", type=Path, default=HERE.parent / "bench-data" / "bench-profile",
                    help="each round's profile.json and the script's timer lists (not tracked)")
    ap.add_argument("--og-script", action="store_true", help="(internal) run the ported og script, print JSON")
    a = ap.parse_args()
    if a.pkg is None:
        from ortevals.package.examples import smollm2_package

        a.pkg = str(smollm2_package("fp32"))
    grid = [(int(b), int(p), int(g)) for b in a.batch.split(",") for p in a.prompt_len.split(",")
            for g in a.gen_len.split(",")]
    if a.og_script:
        print(json.dumps([og_script(a.pkg, *s, a.repeats, a.warmup, a.threads) for s in grid]))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    a.raw.mkdir(parents=True, exist_ok=True)
    prof_rounds, script_rounds = rounds(a)
    per_round = [compare({"trials": [profile_metrics(t) for t in p]}, [script_metrics(x) for x in sc])
                 for p, sc in zip(prof_rounds, script_rounds, strict=True)]
    setting = ("batch", "prompt_len", "gen_len")
    prof = {"trials": [profile_metrics(t) for t in pool(prof_rounds, ("backend", *setting),
                                                        ("prefill_s", "first_token_s", "decode_s", "wall_each_s"))]}
    script = [script_metrics(r) for r in pool(script_rounds, setting, ("prompt_s", "sampling_s", "gen_s",
                                                                        "wall_each_s"))]
    print(write_outputs(a, medians(per_round), script, per_round, compare(prof, script)))


if __name__ == "__main__":
    main()
