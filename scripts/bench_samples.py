"""Benchmark (issue 14 acceptance): K samples per question, ortevals vs lm-eval hf vs lm-eval onnxruntime-genai.

One invocation runs every backend, one after the other, on the same task configs through
``lm_eval.simple_evaluate``: chain-of-thought MMLU-Pro (``mmlu_pro``, the data bundled with
ortevals, offline), one question per subject (``limit`` 1 per subtask), ``repeats: K`` at
temperature T, ``max_gen_toks`` M, stop "Question:".

* ortevals: the package on the raw shared-prompt path (engine/generate/rows/sampler.py): one prompt pass per
  question, K rows decoded together, each stopping on its own.
* lm-eval ``hf``: the same weights in PyTorch (the example's transformers folder), batch_size K
  (the K repeats of a question are one batch: the strongest setting of that backend here).
* lm-eval ``onnxruntime-genai``: the same package; batch 1, a new Generator per request, each
  generation runs to max_gen_toks before the stop string is applied.

Generated tokens = the returned texts re-tokenized with the package's tokenizer (the same count
for every backend; og computes more than it returns). tokens/s = generated tokens / wall time of
the evaluation (model loading apart); each question is its own timed ``simple_evaluate`` call, so
with ``--hf-questions N`` (hf takes minutes a question) the ratio to hf is taken over the same N
questions. Also maj@k / pass@k (/ best@k for ortevals, which keeps
each sample's log-prob) over the K samples (report/scaling.py).

    python scripts/bench_samples.py                                  # 14 questions, K=16, M=128
    python scripts/bench_samples.py --hf-questions 2                 # hf on the first 2 of them only
    python scripts/bench_samples.py --questions 2 --samples 4 --max-gen-toks 32 --out /tmp/short
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BACKENDS = ("ortevals", "hf", "og")


def task_configs(questions: int, k: int, max_gen: int, temperature: float) -> list[dict]:
    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro-cot"]
    configs = task_specs(preset, resolve_data(preset, "bundled"))[:questions]  # one question per subject
    for c in configs:
        c["repeats"] = k
        c["generation_kwargs"] = {"until": ["Question:"], "max_gen_toks": max_gen, "do_sample": True,
                                  "temperature": temperature}
    return configs


def model_paths(args) -> tuple[str, str]:
    """(package, transformers folder): ``args.pkg`` / ``args.hf`` where given (scripts/bench_gpu.py), else
    the SmolLM2-135M example at ``args.precision``."""
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    pkg, hf = getattr(args, "pkg", None), getattr(args, "hf", None)
    return str(pkg or smollm2_package(args.precision)), str(hf or smollm2_hf_dir())


def load(backend: str, args):
    """The backend's lm-eval model on ``args.ep`` (default cpu); hf in ``args.hf_dtype`` (default float32),
    batch size K (``args.samples``)."""
    pkg, hf = model_paths(args)
    ep = getattr(args, "ep", "cpu")
    if backend == "ortevals":
        from ortevals.integrations.lm import ModelArgs, OrtLM

        return OrtLM.from_package(ModelArgs(pkg=pkg, threads=args.threads, ep=ep))
    if backend == "hf":
        import torch
        from lm_eval.models.huggingface import HFLM

        torch.set_num_threads(args.threads)
        return HFLM(pretrained=hf, device="cuda" if ep == "cuda" else "cpu", batch_size=args.samples,
                    dtype=getattr(args, "hf_dtype", "float32"), max_length=2048)
    from lm_eval.models.onnxruntime_genai import ONNXRuntimeGenAILM

    return ONNXRuntimeGenAILM(pretrained=pkg, execution_provider=ep)


def run_backend(backend: str, args, configs: list[dict]) -> dict:
    """Each question in its own ``simple_evaluate`` call, timed alone: per-question wall times let a
    backend that runs fewer questions (``--hf-questions``) be compared on the same ones."""
    import lm_eval

    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer
    from ortevals.report.samples import SampleFacts, task_questions
    from ortevals.report.scaling import scaling_curves
    from ortevals.tasks import task_manager

    t0 = time.perf_counter()
    lm = load(backend, args)
    loaded = time.perf_counter() - t0
    tok = Tokenizer.load(ModelPackage.load(model_paths(args)[0]))
    counter = SampleFacts({}, {}, None, lambda t: len(tok.encode(t, False)), 0)  # a peer: token counts only
    questions, per_question = [], []
    for cfg in configs:
        t0 = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=[copy.deepcopy(cfg)], limit=1, log_samples=True,
                                          task_manager=task_manager(None, defaults=False))
        wall = time.perf_counter() - t0
        texts = [t for e in results["samples"][cfg["task"]] for t in e["resps"][0]]
        tokens = sum(len(tok.encode(t, False)) for t in texts)
        questions += next(iter(task_questions(cfg, results["samples"][cfg["task"]],
                                              lm.sample_facts() if backend == "ortevals" else counter).values()))
        per_question.append({"task": cfg["task"], "wall_s": wall, "samples": len(texts), "generated_tokens": tokens,
                             "exact_match": results["results"][cfg["task"]].get("exact_match,custom-extract")})
        print(f"  {cfg['task']}: {tokens} tokens in {wall:.1f} s", flush=True)
    wall = sum(q["wall_s"] for q in per_question)
    tokens = sum(q["generated_tokens"] for q in per_question)
    out = {"load_s": loaded, "wall_s": wall, "questions": len(per_question), "samples": len(questions) and
           sum(q["samples"] for q in per_question), "generated_tokens": tokens, "tokens_per_s": tokens / wall,
           "curve": [p.__dict__ for p in scaling_curves([q.samples for q in questions])], "per_question": per_question}
    if backend == "ortevals":
        out["engine"] = dict(lm.run.generation.sampler().stats)
        out["engine"]["kv"] = lm.run.generation.sampler().kv_rows.name
    return out


def ratios(backends: dict) -> dict:
    """ortevals' tokens/s over each peer's, on the questions both ran (the peer's first n)."""
    ours = backends.get("ortevals")
    out = {}
    for name, r in backends.items():
        if name == "ortevals" or ours is None:
            continue
        n = r["questions"]
        mine = ours["per_question"][:n]
        rate = sum(q["generated_tokens"] for q in mine) / sum(q["wall_s"] for q in mine)
        out[f"ortevals/{name}"] = {"questions": n, "ratio": rate / r["tokens_per_s"],
                                   "ortevals_tokens_per_s": rate, "peer_tokens_per_s": r["tokens_per_s"]}
    return out


def plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ortevals.report.scaling import CurvePoint, curve_plot

    done = {b: r for b, r in report["backends"].items() if "tokens_per_s" in r}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(done), [r["tokens_per_s"] for r in done.values()], color=["C0", "C1", "C2"][:len(done)])
    for i, r in enumerate(done.values()):
        ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.1f}\n{r['wall_s']:.0f} s, {r['questions']} q",
                ha="center", va="bottom")
    cfg = report["config"]
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"MMLU-Pro CoT, {cfg['questions']} questions x K={cfg['samples']}, T={cfg['temperature']}, "
                 f"{cfg['max_gen_toks']} tokens", fontsize=9)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    plt.close(fig)
    if "ortevals" in done:
        points = [CurvePoint(**p) for p in done["ortevals"]["curve"]]
        curve_plot(points, out / "scaling.png", f"ortevals, SmolLM2-135M {cfg['precision']}: maj@k / pass@k / "
                   f"best@k over {cfg['questions']} questions")


def table(report: dict) -> str:
    """Markdown: per question, each backend's tokens and seconds; then the totals and ortevals' ratio
    to each peer on the questions that peer ran."""
    b = report["backends"]
    names = list(b)
    head = "| question | " + " | ".join(f"{n} tokens | {n} s" for n in names) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(names))]
    for i, q in enumerate(b[names[0]]["per_question"]):
        cells = []
        for n in names:
            pq = b[n]["per_question"]
            cells += [str(pq[i]["generated_tokens"]), f"{pq[i]['wall_s']:.1f}"] if i < len(pq) else ["—", "—"]
        lines.append(f"| {q['task'].removeprefix('mmlu_pro_')} | " + " | ".join(cells) + " |")
    lines += ["", "| backend | questions | samples | tokens | seconds | tokens/s | ortevals × (same questions) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for n, r in b.items():
        ratio = report.get("ratios", {}).get(f"ortevals/{n}")
        lines.append(f"| {n} | {r['questions']} | {r['samples']} | {r['generated_tokens']} | {r['wall_s']:.1f} | "
                     f"{r['tokens_per_s']:.2f} | " + (f"**{ratio['ratio']:.1f}×**" if ratio else "—") + " |")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "bench_samples.json").write_text(json.dumps(report, indent=2))
    (out / "bench_samples.md").write_text(table(report))
    plots(report, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=14)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--hf-questions", type=int, default=None,
                    help="run lm-eval hf on the first N questions only (about 8 min a question on 2 cores)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench-samples")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="only redraw the plots and the markdown table of a finished run's bench_samples.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json is not None:
        return write(json.loads(args.from_json.read_text()), args.out)
    configs = task_configs(args.questions, args.samples, args.max_gen_toks, args.temperature)
    report = {"config": {"questions": len(configs), "samples": args.samples, "max_gen_toks": args.max_gen_toks,
                         "temperature": args.temperature, "precision": args.precision, "threads": args.threads,
                         "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
              "backends": {}}
    import torch  # noqa: F401 - simple_evaluate imports torch to seed it: once here, in no backend's time

    for backend in args.backends.split(","):
        print(f"== {backend}", flush=True)
        mine = configs[:args.hf_questions] if backend == "hf" and args.hf_questions else configs
        report["backends"][backend] = run_backend(backend, args, mine)
        r = report["backends"][backend]
        print(f"{backend}: {r['generated_tokens']} tokens in {r['wall_s']:.1f} s = {r['tokens_per_s']:.2f} tok/s "
              f"(load {r['load_s']:.1f} s)", flush=True)
        report["ratios"] = ratios(report["backends"])
        report["config"]["load_avg_end"] = os.getloadavg()
        write(report, args.out)
    print(json.dumps(report.get("ratios", {}), indent=2))


if __name__ == "__main__":
    main()
