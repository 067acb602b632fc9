#!/usr/bin/env python
"""``ortevals compare`` on SmolLM2-135M fp32 / int8 / int4 packages against PyTorch (docs/compare.md).

    python scripts/bench_compare.py --limit 300 --out docs/bench-compare

``--out`` (docs) gets the summary: compare.json, timings.json, report.md and its plots. ``--raw``
(default ``bench-data/<the --out folder's name>``, not tracked) gets the raw data: the runs' folders
(``runs/``), changed.jsonl, the self-contained report (``report/report.html``) and ``bench.log``.

1. lm-eval ``hf`` (PyTorch, fp32) on the SmolLM2 HF folder, written by lm-eval's own
   EvaluationTracker (``--log_samples`` layout): the reference.
2. ``ortevals mmlu-pro`` on the fp32, int8 and int4 packages (built once with the
   onnxruntime-genai builder, as ``ortevals example --precision`` does).
3. ``ortevals compare --ref hf fp32 int8 int4`` with --json, --changed and --report.

All on the first ``--limit`` questions of ``leaderboard_mmlu_pro`` (5-shot, bundled data), each
step in its own process; wall times are printed and saved in ``timings.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

HF_SCRIPT = """
import sys
import lm_eval
from lm_eval.loggers import EvaluationTracker
from ortevals.presets import PRESETS, resolve_data, task_specs
hf, out, limit, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
preset = PRESETS["mmlu-pro"]
tracker = EvaluationTracker(output_path=out)
res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", device="cpu",
                              batch_size=batch, tasks=task_specs(preset, resolve_data(preset, "bundled")),
                              limit=limit, log_samples=True, evaluation_tracker=tracker)
samples = res.pop("samples")
tracker.save_results_aggregated(results=res, samples=samples)
for task, rows in samples.items():
    tracker.save_results_samples(task_name=task, samples=rows)
print("acc", res["results"]["leaderboard_mmlu_pro"]["acc,none"])
"""


def step(name: str, cmd: list[str], timings: dict, log: Path) -> None:
    print(f"{name} …", flush=True)
    start = time.perf_counter()
    with open(log, "a") as fh:
        fh.write(f"\n=== {name}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=ENV, text=True)
    timings[name] = round(time.perf_counter() - start, 1)
    print(f"  exit {proc.returncode} in {timings[name]} s", flush=True)
    if proc.returncode not in (0, 1):  # 1: a gate failed (none is set here, but keep the files)
        sys.exit(f"{name} failed; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench-compare")
    p.add_argument("--raw", type=Path, default=None, help="folder for the runs and per-question files "
                   "(default: bench-data/<--out's name>)")
    p.add_argument("--precisions", default="fp32,int8,int4")
    p.add_argument("--hf-batch-size", type=int, default=4)
    p.add_argument("--skip-existing", action="store_true", help="keep runs already in --out")
    p.add_argument("--ortevals-args", default="", help="more `ortevals mmlu-pro` flags, e.g. --self-eval")
    args = p.parse_args()
    from ortevals.package.examples import smollm2_hf_dir, smollm2_package

    raw = args.raw or REPO / "bench-data" / args.out.name
    runs, timings, log = raw / "runs", {}, raw / "bench.log"
    runs.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    hf = smollm2_hf_dir()
    if not (args.skip_existing and any((runs / "hf").rglob("samples_*.jsonl"))):
        step("hf", [sys.executable, "-c", HF_SCRIPT, str(hf), str(runs / "hf"), str(args.limit),
                    str(args.hf_batch_size)], timings, log)
    names = args.precisions.split(",")
    for prec in names:
        start = time.perf_counter()
        pkg = smollm2_package(prec)  # built once (~1 min for int8/int4)
        timings[f"build-{prec}"] = round(time.perf_counter() - start, 1)
        if args.skip_existing and (runs / prec / "results.json").is_file():
            continue
        step(prec, [sys.executable, "-m", "ortevals.cli", "mmlu-pro", "--pkg", str(pkg), "--data", "bundled",
                    "--limit", str(args.limit), "--output", str(runs / prec), "--no-resume",
                    *shlex.split(args.ortevals_args)], timings, log)
    step("compare", [sys.executable, "-m", "ortevals.cli", "compare", "--ref", str(runs / "hf"),
                     *(str(runs / n) for n in names), "--json", str(args.out / "compare.json"),
                     "--changed", str(raw / "changed.jsonl"), "--report", str(raw / "report")],
         timings, log)
    for made in [raw / "report" / "report.md", *(raw / "report").glob("*.png")]:  # report.html stays in --raw
        shutil.copyfile(made, args.out / made.name)
    (args.out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(log.read_text().split("=== compare")[-1])


if __name__ == "__main__":
    main()
