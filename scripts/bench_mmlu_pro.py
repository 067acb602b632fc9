"""``leaderboard_mmlu_pro`` on an lm-eval model in this process, for the GPU kit's children.

scripts/gpu/workers.py and scripts/bench_gpu.py score each backend with :func:`score_mmlu_pro`. The side-by-side
benchmark on a CPU (packages, settings and lm-eval's backends, each its own process, one table) is
``ortevals bench`` (docs/bench.md).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def time_method(lm, name: str) -> dict:
    """Wrap ``lm.<name>`` so the seconds spent in it and the requests it served are counted."""
    timing = {"seconds": 0.0, "requests": 0}
    inner = getattr(lm, name)

    def timed(requests, *a, **k):
        start = time.perf_counter()
        out = inner(requests, *a, **k)
        timing["seconds"] += time.perf_counter() - start
        timing["requests"] += len(requests)
        return out

    setattr(lm, name, timed)
    return timing


def score_mmlu_pro(lm, limit: int, data: str) -> tuple[dict, list[dict]]:
    """Run ``leaderboard_mmlu_pro`` on ``lm``: (its figures, lm-eval's samples). Seconds are those spent
    inside ``lm.loglikelihood``; answers and log-probs are keyed by doc_id."""
    import lm_eval

    from ortevals.presets import PRESETS, resolve_data, task_specs

    preset = PRESETS["mmlu-pro"]
    tasks = task_specs(preset, resolve_data(preset, data))
    timing = time_method(lm, "loglikelihood")
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True)
    samples = res["samples"]["leaderboard_mmlu_pro"]
    answers = {s["doc_id"]: int(max(range(len(s["resps"])), key=lambda i: float(s["resps"][i][0][0])))
               for s in samples}
    logprobs = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    out = {"questions": len(samples), "requests": timing["requests"], "seconds": timing["seconds"],
           "accuracy": res["results"]["leaderboard_mmlu_pro"]["acc,none"], "answers": answers, "logprobs": logprobs}
    return out, samples
