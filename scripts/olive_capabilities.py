#!/usr/bin/env python
"""Checks, by running them, what each Olive evaluator can evaluate (the table in docs/olive.md).

Every cell is one ``olive run`` on a tiny fixture package built by the tests'
builders: OrtEvalsEvaluator against Olive's LMEvaluator with ``model_class``
ort and ortgenai, on a text-only package, the same at batch size 2, a
perplexity (loglikelihood_rolling) task, and the Gemma-4-layout package
(embedding model + decoder with per-layer head sizes).

    python scripts/olive_capabilities.py --out docs/bench-olive/capabilities.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ROLLING_DOCS = ["The river of the city is a number of the mountain.", "Paris france berlin germany rome italy."]


def rolling_task(folder: Path) -> Path:
    """A perplexity task over a local JSON file (lm-eval's loglikelihood_rolling)."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ROLLING_DOCS))
    path = folder / "tiny_perplexity.yaml"
    path.write_text(f"task: tiny_perplexity\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                    "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    return path


def generation_task(folder: Path) -> Path:
    """A greedy generation task over a local JSON file (lm-eval's generate_until)."""
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "target": "x"}) + "\n" for t in ROLLING_DOCS))
    path = folder / "tiny_generation.yaml"
    path.write_text(f"task: tiny_generation\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{text}}'\n"
                    "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n"
                    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return path


def main() -> None:
    from bench_mmlu_pro import REPO
    from bench_olive import local_task_yaml, run_olive, workflow

    from ortevals.presets import BUNDLED
    from tests.fixtures.gemma4 import build_gemma4
    from tests.fixtures.tiny import build_tiny

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs" / "bench-olive" / "capabilities.md"))
    args = p.parse_args()
    cache = REPO / ".fixture-cache"
    tiny = build_tiny(cache)[1]
    gemma = build_gemma4(cache / "gemma4")[1]
    work = Path(tempfile.mkdtemp(prefix="olive-cap-")).resolve()
    shutil.copytree(REPO / "configs", work / "configs")
    mmlu, rolling, gen = local_task_yaml(work, BUNDLED / "mmlu_pro"), rolling_task(work), generation_task(work)
    cases = [("text-only package, MMLU-Pro", tiny, mmlu, 1), ("same, batch size 2", tiny, mmlu, 2),
             ("perplexity (loglikelihood_rolling)", tiny, rolling, 1),
             ("greedy generation (generate_until)", tiny, gen, 1),
             ("Gemma-4 layout (embedding + per-layer head sizes)", gemma, mmlu, 1)]
    evaluators = {
        "OrtEvalsEvaluator": lambda task, bs: {"type": "OrtEvalsEvaluator", "user_script": "configs/ortevals_olive.py",
                                               "tasks": [str(task)], "limit": 2, "batch_size": bs},
        "LMEvaluator ort": lambda task, bs: {"type": "LMEvaluator", "model_class": "ort", "tasks": [str(task)],
                                             "limit": 2, "batch_size": bs},
        "LMEvaluator ortgenai": lambda task, bs: {"type": "LMEvaluator", "model_class": "ortgenai",
                                                  "tasks": [str(task)], "limit": 2, "batch_size": bs},
    }
    rows = ["| case | " + " | ".join(evaluators) + " |", "|---|" + "---|" * len(evaluators)]
    for label, pkg, task, bs in cases:
        cells = []
        for name, make in evaluators.items():
            run_name = f"{abs(hash((label, name))) % 10**8}"
            cfg = workflow(pkg, make(task, bs), work, run_name)
            cfg["log_severity_level"] = 1  # Olive logs swallowed evaluation errors as warnings
            r = run_olive(cfg, work, run_name)
            cells.append("✅ " + ", ".join(f"{k.split('-')[-1]}={v:.3g}" for k, v in r["metrics"].items()
                                           if "stderr" not in k)[:60]
                         if "failed" not in r else f"❌ {r['failed'][:110]}")
            print(label, name, cells[-1], flush=True)
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
