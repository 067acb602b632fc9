#!/usr/bin/env python
"""Olive side by side: the same workflow with OrtEvalsEvaluator and with Olive's LMEvaluator.

Runs ``olive run`` on copies of ``configs/evaluate_package.json`` that differ
only in the evaluator: ortevals' ``OrtEvalsEvaluator`` (preset mmlu-pro) and
Olive's ``LMEvaluator`` with ``model_class`` ortgenai (and ort), both on
``leaderboard_mmlu_pro`` over the bundled data (LMEvaluator gets a task YAML
that includes lm-eval's own and re-points ``dataset_path``; it cannot take a
data path otherwise). Wall time is the whole ``olive run``.

    python scripts/bench_olive.py --limit 50 --out docs/bench-olive
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the same for every evaluator: offline data, and no telemetry (offline, Olive waits 10 s at exit
# for an export that cannot happen)
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OLIVE_DISABLE_TELEMETRY": "1"}


def local_task_yaml(folder: Path, data: Path) -> Path:
    """A task YAML for LMEvaluator: lm-eval's leaderboard_mmlu_pro with a local dataset_path."""
    import lm_eval.tasks

    original = Path(lm_eval.tasks.__file__).parent / "leaderboard" / "mmlu_pro" / "mmlu_pro.yaml"
    path = folder / "leaderboard_mmlu_pro_local.yaml"
    path.write_text(f"include: {original}\ntask: leaderboard_mmlu_pro_local\ndataset_path: {data}\n")
    return path


def workflow(pkg: Path, evaluator: dict, work: Path, name: str) -> dict:
    cfg = json.loads((REPO / "configs" / "evaluate_package.json").read_text())
    cfg["input_model"]["model_path"] = str(pkg)
    # Olive's ONNXModel checks that this file exists: name the package's own decoder
    from ortevals.package.loader import ModelPackage

    package = ModelPackage.load(pkg)
    cfg["input_model"]["onnx_file_name"] = str(package.decoder.path.relative_to(package.root))
    cfg["evaluators"] = {name: evaluator}
    cfg["evaluator"] = name
    cfg["cache_dir"] = str(work / f"cache-{name}")
    cfg["output_dir"] = str(work / f"out-{name}")
    return cfg


def run_olive(cfg: dict, work: Path, name: str) -> dict:
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "olive", "run", "--config", str(path)], cwd=work,
                          capture_output=True, text=True, env={**os.environ, **OFFLINE})
    seconds = time.perf_counter() - start
    metrics = read_metrics(Path(cfg["output_dir"]))
    if proc.returncode != 0 or metrics is None:
        # Olive logs many evaluation errors as "Failed to run Olive" and still exits 0
        how = f"exit {proc.returncode}" + (", no metrics" if metrics is None else "")
        return {"name": name, "failed": f"{how}: {failure_line(proc.stderr + proc.stdout)}", "seconds": seconds}
    return {"name": name, "seconds": seconds, "metrics": metrics}


def failure_line(output: str) -> str:
    """The line that says why a run failed: the last exception line, else the last line."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln) or "Error:" in ln]
    return (errors or lines or ["no output"])[-1]


def read_metrics(out: Path) -> dict | None:
    """The input model's metrics from Olive's output folder."""
    for f in sorted(out.rglob("*.json")):
        try:
            body = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        found = _find_metrics(body)
        if found:
            return found
    return None


def _find_metrics(node) -> dict | None:
    if isinstance(node, dict):
        flat = {k: v.get("value") for k, v in node.items()
                if isinstance(v, dict) and isinstance(v.get("value"), (int, float)) and "higher_is_better" in v}
        if flat:
            return flat
        for v in node.values():
            if (hit := _find_metrics(v)) is not None:
                return hit
    elif isinstance(node, list):
        for v in node:
            if (hit := _find_metrics(v)) is not None:
                return hit
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pkg", default=None, help="GenAI package (default: the SmolLM2 example, fp32)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--peers", default="ortgenai", help="LMEvaluator model classes to compare: ortgenai,ort")
    p.add_argument("--out", default=str(REPO / "docs" / "bench-olive"))
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from ortevals.presets import BUNDLED

    if args.pkg is None:
        from ortevals.package.examples import smollm2_package

        args.pkg = str(smollm2_package("fp32"))
    args.pkg = Path(args.pkg).resolve()
    out = Path(args.out).resolve()  # olive runs with cwd=work, so nothing here may be relative
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(REPO / "configs", work / "configs")
    task_yaml = local_task_yaml(work, BUNDLED / "mmlu_pro")
    runs = [("ortevals", {"type": "OrtEvalsEvaluator", "user_script": "configs/ortevals_olive.py",
                          "tasks": ["mmlu-pro"], "limit": args.limit, "data": "bundled"})]
    for peer in args.peers.split(","):
        runs.append((f"LMEvaluator-{peer}", {"type": "LMEvaluator", "model_class": peer, "tasks": [str(task_yaml)],
                                             "limit": args.limit, "batch_size": 1}))
    results = []
    for name, evaluator in runs:
        print(f"olive run with {name} …", flush=True)
        r = run_olive(workflow(args.pkg, evaluator, work, name), work, name)
        print(f"  {r}", flush=True)
        results.append(r)
    (out / "results.json").write_text(json.dumps({"limit": args.limit, "runs": results}, indent=1))
    base = results[0]
    lines = ["| evaluator | olive run wall (s) | speed-up of OrtEvalsEvaluator | accuracy |", "|---|---:|---:|---:|"]
    for r in results:
        acc = next((v for k, v in (r.get("metrics") or {}).items() if k.endswith("acc")), None)
        ratio = f"{r['seconds'] / base['seconds']:.1f}×" if "failed" not in r and r is not base else "—"
        lines.append(f"| {r['name']} | {r['seconds']:.0f} | {ratio} | "
                     f"{acc if acc is not None else 'failed: ' + r.get('failed', '')[:80]} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
