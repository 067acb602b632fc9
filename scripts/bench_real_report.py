"""scripts/bench_real.py's report: the table, the summary JSON (no per-question data) and the one plot
(requests/s per backend and model size), from the ``run.json`` files a finished run left."""

from __future__ import annotations

import json
from pathlib import Path

ORDER = ("ortevals", "hf", "onnxruntime", "onnxruntime-genai")
SIZES = {"smollm2-135m": "SmolLM2-135M", "qwen3-0.6b": "Qwen3-0.6B", "gemma-3-1b": "Gemma-3-1B",
         "llama-3.2-1b": "Llama-3.2-1B"}


def load(folder: Path) -> list[dict]:
    """Every run.json under ``folder``, ordered, each compared with hf (the model's float32 weights) and with
    onnxruntime-genai on the same package (``vs_hf``, ``vs_og``)."""
    runs = [json.loads(f.read_text()) for f in sorted(folder.glob("*/run.json"))]
    runs.sort(key=lambda r: (list(SIZES).index(r["model"]), r["precision"], ORDER.index(r["backend"])))
    for r in runs:
        hf = next((h for h in runs if h["model"] == r["model"] and h["backend"] == "hf" and "logprobs" in h), None)
        og = next((o for o in runs if (o["model"], o["precision"]) == (r["model"], r["precision"])
                   and o["backend"] == "onnxruntime-genai" and "logprobs" in o), None)
        r["vs_hf"], r["vs_og"] = against(r, hf), against(r, og)
    return runs


def against(run: dict, ref: dict | None) -> dict:
    """Same answers and max |Δ log-likelihood| of ``run`` against ``ref`` on the questions both have, and how
    many times ``run``'s requests/s ``ref``'s was, whole process (``x``)."""
    if not ref or "logprobs" not in ref or "logprobs" not in run:
        return {}
    common = sorted(set(run["logprobs"]) & set(ref["logprobs"]), key=int)
    same = sum(_answer(run["logprobs"][q]) == _answer(ref["logprobs"][q]) for q in common)
    worst = max((abs(a - b) for q in common for a, b in zip(run["logprobs"][q], ref["logprobs"][q], strict=True)),
                default=None)
    # requests/s over the whole process: the wall-time ratio where both ran the same questions, and still a rate
    # where a slow backend ran fewer of them (start-up then weighs more on its side)
    return {"same": same, "of": len(common), "max_abs_d": worst, "x": run["requests_per_s"] / ref["requests_per_s"]}


def _answer(lps: list[float]) -> int:
    return max(range(len(lps)), key=lps.__getitem__)


def _cmp(c: dict) -> tuple[str, str]:
    if not c:
        return "", ""
    return f"{c['same']}/{c['of']}", (f"{c['max_abs_d']:.1e}" if c["max_abs_d"] is not None else "")


def row(r: dict) -> str:
    name = f"{SIZES[r['model']]} {r['precision']}"
    backend = r["backend"] + (f" (batch {r['batch']})" if r.get("batch") else "")
    if "failed" in r:
        message = r["failed"].split("Status Message: ")[-1]  # onnxruntime's own words, not its prefix
        return f"| {name} | {backend} | fails: {message[:200]} |" + " |" * 10
    hf, og = r.get("vs_hf", {}), r.get("vs_og", {})
    cells = [name, backend, str(r["questions"]), f"{r['wall_s']:.1f} s", f"{r['requests_per_s']:.3f}",
             f"{hf['x']:.1f}×" if hf else "", f"{og['x']:.1f}×" if og else "", f"{r['peak_rss_mib']:.0f}",
             *_cmp(hf), *_cmp(og), f"{r['prefill_tokens'] / r['questions']:.0f}" if r.get("prefill_tokens") else ""]
    return "| " + " | ".join(cells) + " |"


def table(runs: list[dict]) -> str:
    head = ["| model | backend | questions | wall (whole process) | req/s | × hf | × onnxruntime-genai | peak RSS "
            "MiB | same answers as hf | max abs Δ vs hf | same as onnxruntime-genai | max abs Δ vs it | prefilled "
            "tokens / question |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    return "\n".join(head + [row(r) for r in runs])


def plot(runs: list[dict], out: Path, limit: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = list(dict.fromkeys(f"{SIZES[r['model']]}\n{r['precision']}" for r in runs))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(ORDER)
    rates = [r["requests_per_s"] for r in runs if "requests_per_s" in r]
    bottom = 10 ** np.floor(np.log10(min(rates) / 2)) if rates else 0.01
    for i, backend in enumerate(ORDER):
        ys = []
        for g in groups:
            r = next((r for r in runs if f"{SIZES[r['model']]}\n{r['precision']}" == g and r["backend"] == backend
                      and "requests_per_s" in r), None)
            if r is None and backend == "hf":  # hf runs the float32 weights once: the same bar for int4
                r = next((r for r in runs if SIZES[r["model"]] == g.split("\n")[0] and r["backend"] == "hf"
                          and "requests_per_s" in r), None)
            ys.append(r["requests_per_s"] if r else np.nan)
        xs = np.arange(len(groups)) + (i - (len(ORDER) - 1) / 2) * width
        ax.bar(xs, ys, width, label=backend)
        for x, y, g in zip(xs, ys, groups):
            if np.isnan(y):  # a run that failed says so; a backend with no run in the folder was not run
                failed = any(f"{SIZES[r['model']]}\n{r['precision']}" == g and r["backend"] == backend for r in runs)
                ax.text(x, bottom * 1.1, "fails" if failed else "not run", rotation=90, fontsize=6, ha="center",
                        va="bottom")
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom, top=max(rates, default=1.0) * 30)  # room for the legend above the bars
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=8)
    ax.set_ylabel("requests/s, whole process (log)")
    fewer = sorted({f"{r['backend']}: {r['questions']}" for r in runs if r.get("questions") not in (None, limit)})
    ax.set_title(f"leaderboard_mmlu_pro, first {limit} questions" + (f" ({', '.join(fewer)})" if fewer else "")
                 + ", 2 CPU cores", fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)


def report(folder: Path, docs: Path) -> None:
    runs = load(folder)
    docs.mkdir(parents=True, exist_ok=True)
    peaks = sorted({r["invocation"]["peak_fp32_gflops"] for r in runs if "invocation" in r})
    text = table(runs) + (f"\n\nonnxruntime fp32 MatMul peak at each invocation's start: "
                          f"{', '.join(f'{p:.0f}' for p in peaks)} GFLOP/s")
    (docs / "table.md").write_text(text + "\n")
    keep = [{k: v for k, v in r.items() if k != "logprobs"} for r in runs]
    (docs / "results.json").write_text(json.dumps({"runs": keep}, indent=1) + "\n")
    plot(runs, docs, max(r["limit"] for r in runs))
    print(text)
