"""Tables and plot for scripts/bench_mmlu_pro.py (kept apart so the runner stays short)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

# passes a backend makes per question, for the tokens-per-question column of the peers
PASSES_PER_QUESTION = {"hf": 1, "onnxruntime-genai": "choices", "onnxruntime": "choices"}


def _rate(r: dict) -> float:
    return r["requests"] / r["seconds"] if r.get("seconds") else 0.0


def _tokens_per_question(r: dict) -> str:
    if r.get("tokens_run") is not None:
        return f"{r['tokens_run'] / r['questions']:.0f}"
    mean = sum(len(p) for p in r["prompts"]) / len(r["prompts"])
    passes = PASSES_PER_QUESTION.get(r["backend"], 1)
    if passes == "choices":
        return f"{mean * r['requests'] / r['questions']:.0f}*"
    return f"{mean:.0f}*"


def _agreement(r: dict, ref: dict | None) -> tuple[str, str]:
    if ref is None or r is ref:
        return "—", "—"
    common = sorted(set(r["answers"]) & set(ref["answers"]))
    same = sum(r["answers"][q] == ref["answers"][q] for q in common)
    delta = max((abs(a - b) for q in common for a, b in zip(r["logprobs"][q], ref["logprobs"][q])), default=0.0)
    return f"{same}/{len(common)}", f"{delta:.1e}"


def add_flops(results: list[dict], args) -> None:
    """Effective GFLOP/s of each backend on the work that must be done, and its share of the peak."""
    from bench_flops import matmul_params, required_flops

    from ortevals.package.loader import ModelPackage

    pkg = ModelPackage.load(args.pkg)
    dec = pkg.config["model"]["decoder"]
    body, head = matmul_params(pkg.decoder.path, pkg.logits_name)
    for r in results:
        if "failed" in r:
            continue
        tokens, flops = required_flops(r["prompts"], body, head, dec["num_hidden_layers"],
                                       dec["num_attention_heads"] * dec["head_size"])
        r["required_tokens"], r["required_gflop"] = tokens, flops / 1e9
        r["effective_gflops"] = flops / 1e9 / r["seconds"]
        r["peak_fraction"] = r["effective_gflops"] / args.peak_gflops


def table(results: list[dict]) -> str:
    ref = next((r for r in results if r["backend"] == "hf" and "failed" not in r), None)
    hf_rate = _rate(ref) if ref else None
    rows = ["| backend | questions | requests | req/s | × hf | accuracy | same answer as hf | max abs Δ log-prob vs hf "
            "| peak RSS (MB) | tokens run / question | effective GFLOP/s | % of peak |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "failed" in r:
            rows.append(f"| {r['backend']} | failed: {r['failed'][:90]} | | | | | | | | | | |")
            continue
        agree, delta = _agreement(r, ref)
        ratio = f"{_rate(r) / hf_rate:.2f}" if hf_rate else "—"
        rows.append(f"| {r['backend']} | {r['questions']} | {r['requests']} | {_rate(r):.2f} | {ratio} | "
                    f"{r['accuracy']:.4f} | {agree} | {delta} | {r['peak_rss_mb']:.0f} | {_tokens_per_question(r)} | "
                    f"{r['effective_gflops']:.1f} | {100 * r['peak_fraction']:.0f}% |")
    return "\n".join(rows)


def ratios(results: list[dict]) -> dict[str, float]:
    by = {r["backend"]: _rate(r) for r in results if "failed" not in r}
    out = {}
    for name, rate in by.items():
        if name.startswith("ortevals"):
            for peer in ("hf", "onnxruntime-genai", "onnxruntime"):
                if by.get(peer):
                    out[f"{name} / {peer}"] = rate / by[peer]
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "failed" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["backend"] for r in ok]
    rates = [_rate(r) for r in ok]
    bars = ax.barh(names, rates, color=["#1f77b4" if n.startswith("ortevals") else "#999999" for n in names])
    ax.set_xscale("log")
    ax.set_xlabel("requests / s (log scale, higher is better)")
    ax.set_title("leaderboard_mmlu_pro, SmolLM2-135M fp32, CPU")
    for bar, rate in zip(bars, rates):
        ax.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2, f"{rate:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def slim(results: list[dict]) -> list[dict]:
    """Each backend's figures without its per-question arrays, with its agreement with hf."""
    ref = next((r for r in results if r["backend"] == "hf" and "failed" not in r), None)
    out = []
    for r in results:
        row = {k: v for k, v in r.items() if k not in ("answers", "logprobs", "prompts")}
        if "failed" not in r and ref is not None and r is not ref:
            row["same_answer_as_hf"], row["max_abs_dlogprob_vs_hf"] = _agreement(r, ref)
        out.append(row)
    return out


def write_report(results: list[dict], args) -> None:
    """``--out`` (docs): results.json (each backend's figures and the ratios), table.md, throughput.png;
    ``--raw`` (an ignored folder): requests.json, every question's answers, log-probs and prompt ids."""
    out, raw = Path(args.out), Path(args.raw)
    out.mkdir(parents=True, exist_ok=True)
    raw.mkdir(parents=True, exist_ok=True)
    add_flops(results, args)
    meta = {"machine": platform.processor() or platform.machine(), "ep": args.ep, "limit": args.limit,
            "slow_limit": args.slow_limit, "slow": args.slow, "matmul_peak_gflops": args.peak_gflops}
    (raw / "requests.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": slim(results),
                                                  "ratios": ratios(results)}, indent=1) + "\n")
    md = table(results)
    (out / "table.md").write_text(md + "\n")
    plot(results, out / "throughput.png")
    print(md)
    print(f"(* estimated from the backend's strategy; MatMul peak {args.peak_gflops:.1f} GFLOP/s)")
    print(json.dumps({"ratios": ratios(results), "runs": slim(results)}, indent=1))
