#!/usr/bin/env python
"""Calibration of SmolLM2-135M fp32 / int8 / int4 against lm-eval hf (docs/calibration.md, Measured).

    nice -n 19 python scripts/bench_calibration.py --limit 300 --out docs/bench-calibration
    python scripts/bench_calibration.py --from-json bench-data/bench-calibration/questions.json   # redraw, no model
    python scripts/bench_calibration.py --from-samples bench-data/bench-calibration/runs          # the same

``--out`` (docs) gets the summary: calibration.md (the table), compare.json, costs.json and the plots.
``--runs`` (default ``bench-data/bench-calibration``, not tracked) gets the raw data: the four runs'
folders with their samples files and ``questions.json``.

1. ``scripts/bench_compare.py`` (not copied: called) runs lm-eval ``hf`` and ``ortevals mmlu-pro --self-eval``
   on the three packages over the first ``--limit`` questions of leaderboard_mmlu_pro into ``--runs``.
2. Per run, from its samples file: ECE (equal-width, equal-mass), Brier, NLL, AURC, accuracy at 50%
   coverage, AUROC, the fitted temperature and the ECE after it, each with its 95% bootstrap interval;
   P(True) AUROC/ECE/Brier for the ortevals runs; paired Δ against hf and int4 against fp32.
   The per-question arrays go to ``questions.json`` (log-likelihoods, gold, P(True)), from which
   ``--from-json`` redraws everything.
3. What calibration costs a run that asks for nothing: the hook on the fp32 run's samples, timed in a
   fresh process (imports included) and warm; and what --self-eval costs in tokens run through the
   decoder, counted on the first ``--probe`` questions with and without it (``probe.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RUNS = ("hf", "fp32", "int8", "int4")
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_models(args) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_compare.py"), "--limit", str(args.limit), "--out",
           str(args.runs), "--raw", str(args.runs), "--ortevals-args=--self-eval",
           *(["--skip-existing"] if args.skip_existing else [])]
    subprocess.run(cmd, env=ENV, check=True)


def extract(runs: Path) -> dict[str, dict]:
    """Per run: doc_id, gold, per-choice log-likelihoods, P(True) per choice (ortevals runs)."""
    from ortevals.report.runs import load_run, read_jsonl

    out = {}
    for name in RUNS:
        task = load_run(runs / "runs" / name).tasks["leaderboard_mmlu_pro"]
        ptrue = {}
        for f in (runs / "runs" / name).rglob("samples_*.jsonl"):
            ptrue.update({int(r["doc_id"]): r["p_true"] for r in read_jsonl(f) if r.get("p_true") is not None})
        out[name] = {"doc_id": task.doc_id.tolist(), "gold": task.gold.tolist(),
                     "loglik": [[float(x) if np.isfinite(x) else None for x in row] for row in task.loglik],
                     "p_true": [ptrue.get(int(d)) for d in task.doc_id] if ptrue else None}
    return out


def from_samples(folder: Path) -> dict[str, dict]:
    """:func:`extract` on saved runs whose samples files may be gzipped (unpacked into a temporary folder)."""
    import gzip
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            for f in (folder / name).glob("samples_*.jsonl*"):
                (Path(tmp) / "runs" / name).mkdir(parents=True, exist_ok=True)
                with (gzip.open(f) if f.suffix == ".gz" else open(f, "rb")) as src, \
                        open(Path(tmp) / "runs" / name / f.name.removesuffix(".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return extract(Path(tmp))


def arrays(run: dict) -> tuple[np.ndarray, np.ndarray]:
    ll = np.array([[-np.inf if x is None else x for x in row] for row in run["loglik"]])
    return ll, np.array(run["gold"])


def summarize(data: dict[str, dict]) -> dict:
    """The numbers of the table: calibration per run, P(True) per ortevals run, paired deltas."""
    from ortevals.report import calibration as cal
    from ortevals.report.calibration_delta import calibration_delta

    out: dict = {"runs": {}, "ptrue": {}, "delta": {}}
    for name, run in data.items():
        ll, gold = arrays(run)
        out["runs"][name] = cal.calibrate(ll, gold)
        if run["p_true"]:
            conf, correct = cal.confidence(ll, gold)
            pick = np.argmax(ll, axis=1)
            p = np.array([row[k] for row, k in zip(run["p_true"], pick)])
            out["ptrue"][name] = cal.self_eval(p, correct)
    ref_ll, gold = arrays(data["hf"])
    for name in RUNS[1:]:
        out["delta"][f"{name} vs hf"] = calibration_delta(ref_ll, arrays(data[name])[0], gold)
    out["delta"]["int4 vs fp32"] = calibration_delta(arrays(data["fp32"])[0], arrays(data["int4"])[0], gold)
    return out


def ci(x, fmt: str = ".4f") -> str:
    if x.low != x.low:  # NaN: no interval (a temperature fitted on a bound of its search)
        return f"{x.estimate:{fmt}} (bound: no finite optimum)"
    return f"{x.estimate:{fmt}} [{x.low:{fmt}}, {x.high:{fmt}}]"


def markdown(s: dict, n: int) -> str:
    from ortevals.report.stats import RESAMPLES

    lines = [f"First {n} questions of leaderboard_mmlu_pro (5-shot), 95% bootstrap intervals over questions "
             f"({RESAMPLES} resamples; the temperature's is a one-step bootstrap).", "",
             "| run | accuracy | ECE | ECE equal-mass | Brier (multi-class, 0–2) | NLL | AURC | acc @ 50% coverage "
             "| AUROC | temperature | ECE after T |", "|" + "---|" * 11]
    for name, c in s["runs"].items():
        t = c.temperature
        lines.append(f"| {name} | {c.accuracy:.4f} | {ci(c.ece)} | {ci(c.ece_mass)} | {ci(c.brier)} | "
                     f"{ci(c.nll, '.3f')} | {ci(c.aurc)} | {ci(c.acc_at_half)} | {ci(c.auroc)} | "
                     f"{ci(t.value, '.3f')} | {ci(t.ece)} |")
    lines += ["", "| pair | Δ ECE | Δ Brier (multi-class) | Δ (confidence − accuracy) | T needed (run / ref) |",
              "|---|---|---|---|---|"]
    for pair, d in s["delta"].items():
        lines.append(f"| {pair} | {ci(d.delta_ece, '+.4f')} | {ci(d.delta_brier, '+.4f')} | "
                     f"{ci(d.delta_overconfidence, '+.4f')} | {ci(d.temperature, '.3f')} / "
                     f"{ci(d.ref_temperature, '.3f')} |")
    if s["ptrue"]:
        lines += ["", "| run | mean P(True) | P(True) AUROC | P(True) ECE | P(True) Brier (binary, 0–1) |",
                  "|---|---|---|---|---|"]
        for name, p in s["ptrue"].items():
            lines.append(f"| {name} | {p.mean:.4f} | {ci(p.auroc)} | {ci(p.ece)} | {ci(p.brier)} |")
    return "\n".join(lines) + "\n"


def plots(data: dict[str, dict], out: Path) -> None:
    from ortevals.report import calibration as cal
    from ortevals.report.calibration_plots import reliability_png, risk_coverage_png

    rel, risk = [], []
    for name, run in data.items():
        conf, correct = cal.confidence(*arrays(run))
        rel.append((f"{name} (ECE {float(cal.ece(conf, correct)):.3f})", cal.reliability(conf, correct)))
        risk.append((f"{name} (AURC {float(cal.aurc(conf, correct)):.3f})", cal.risk_curve(conf, correct)))
    n = len(data["hf"]["gold"])
    (out / "reliability.png").write_bytes(reliability_png(rel, f"SmolLM2-135M, first {n} MMLU-Pro questions"))
    (out / "risk_coverage.png").write_bytes(risk_coverage_png(risk, f"SmolLM2-135M, first {n} MMLU-Pro questions"))
    ptrue = [(name, run) for name, run in data.items() if run["p_true"]]
    series = []
    for name, run in ptrue:
        ll, gold = arrays(run)
        conf, correct = cal.confidence(ll, gold)
        p = np.array([row[k] for row, k in zip(run["p_true"], np.argmax(ll, axis=1))])
        series.append((f"{name} P(True) (ECE {float(cal.ece(p, correct)):.3f})", cal.reliability(p, correct)))
    if series:
        (out / "reliability_ptrue.png").write_bytes(reliability_png(series, f"P(True), first {n} questions"))


HOOK = """
import json, sys, time
t0 = time.perf_counter()
from ortevals.report.runs import read_jsonl
from pathlib import Path
samples = {"leaderboard_mmlu_pro": read_jsonl(Path(sys.argv[1]))}
for r in samples["leaderboard_mmlu_pro"]:
    r.pop("p_true", None)  # as a run without --self-eval holds it
t1 = time.perf_counter()
from ortevals.report.calibration_results import add_calibration
add_calibration({"results": {"leaderboard_mmlu_pro": {}}, "samples": samples})
t2 = time.perf_counter()
add_calibration({"results": {"leaderboard_mmlu_pro": {}}, "samples": samples})
t3 = time.perf_counter()
print(json.dumps({"read_s": t1 - t0, "first_call_s": t2 - t1, "warm_call_s": t3 - t2}))
"""


def hook_cost(runs: Path) -> dict:
    """The calibration hook on the fp32 run's samples in a fresh process: first call (imports of
    scipy.stats/optimize included), then warm; no plots (those need --output)."""
    samples = next((runs / "runs" / "fp32").glob("samples_*.jsonl"))
    out = subprocess.run([sys.executable, "-c", HOOK, str(samples)], env=ENV, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def recorder(score, seen: list):
    """``score`` (an OrtLM's loglikelihood) that also keeps the requests it was given in ``seen``."""
    def wrapped(requests, disable_tqdm: bool = False):
        seen.extend(requests)
        return score(requests, disable_tqdm)
    return wrapped


def probe(questions: int) -> dict:
    """Tokens run through the decoder (canary excluded) on the first ``questions`` questions, fp32,
    without and with --self-eval, and the P(True) inputs' own new tokens counted from the tokenizer."""
    import lm_eval

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from ortevals.integrations.self_eval import choice_requests
    from ortevals.package.examples import smollm2_package
    from ortevals.presets import PRESETS, resolve_data, task_specs
    from ortevals.tasks import task_manager

    preset = PRESETS["mmlu-pro"]
    tasks = task_specs(preset, resolve_data(preset, "bundled"))
    out: dict = {"questions": questions}
    for self_eval in (False, True):
        lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2_package("fp32")), self_eval=self_eval))
        seen: list = []
        lm.loglikelihood = recorder(lm.loglikelihood, seen)
        start = time.perf_counter()
        lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=questions, task_manager=task_manager(None, False))
        key = "with" if self_eval else "without"
        out[f"tokens_{key}"] = lm.engine.tokens_run - lm.engine.canary_tokens
        out[f"scoring_s_{key}"] = round(time.perf_counter() - start, 1)
        contexts = {r.args[0] for r in seen}
        out["prompt_tokens"] = sum(len(lm.tok_encode(c)) for c in contexts)
        if self_eval:
            extra = choice_requests(seen)
            prompt_len = {c: len(lm.tok_encode(c)) for c in contexts}
            by_q = {(r.task_name, r.doc_id): prompt_len[r.args[0]] for r in seen}
            out["ptrue_inputs"] = len(extra)
            out["ptrue_new_tokens"] = sum(len(lm.tok_encode(r.args[0] + r.args[1])) - 1
                                          - by_q[(r.task_name, r.doc_id)] for r in extra)
    out["extra_tokens"] = out["tokens_with"] - out["tokens_without"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--runs", type=Path, default=REPO / "bench-data" / "bench-calibration",
                   help="where bench_compare.py leaves the runs and questions.json goes (large: not tracked)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench-calibration")
    p.add_argument("--skip-existing", action="store_true", help="keep runs already in --runs")
    p.add_argument("--from-json", type=Path, help="redraw the table and plots from a questions.json")
    p.add_argument("--from-samples", type=Path, help="redraw from saved runs: <DIR>/{hf,fp32,int8,int4}/ holding "
                   "samples_*.jsonl or .jsonl.gz")
    p.add_argument("--probe", type=int, default=20, help="questions for the token probe (0: skip)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra: dict = {}
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    elif args.from_samples:
        data = from_samples(args.from_samples)
    else:
        run_models(args)
        (args.out / "compare.json").write_bytes((args.runs / "compare.json").read_bytes())  # ortevals compare's
        data = extract(args.runs)
        (args.runs / "questions.json").write_text(json.dumps(data) + "\n")
        extra["hook"] = hook_cost(args.runs)
        extra["timings"] = json.loads((args.runs / "timings.json").read_text())
        if args.probe:
            extra["probe"] = probe(args.probe)
        (args.out / "costs.json").write_text(json.dumps(extra, indent=2) + "\n")
    table = markdown(summarize(data), len(data["hf"]["gold"]))
    (args.out / "calibration.md").write_text(table)
    plots(data, args.out)
    print(table)
    if extra:
        print(json.dumps(extra, indent=2))


if __name__ == "__main__":
    main()
