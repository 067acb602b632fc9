"""One row of a benchmark that is not ortevals: lm-eval's own model in a process of its own.

``python -m ortevals.bench.child SPEC.json`` builds the row's lm-eval model (hf, onnxruntime-genai,
onnxruntime, vllm) with lm-eval's registry, runs ``lm_eval.simple_evaluate`` on the same task configs and
documents as the ortevals command (workload.py), and writes lm-eval's samples (``samples_<task>.jsonl``)
and results (``results.json``, with the peak device memory where torch reports it) into the spec's output
folder, the layout ``ortevals --output`` writes, so one reader serves every row. A failure is one line on
stderr and exit 1: the row says it (one whose cause is known, :data:`KNOWN_CAUSES`, says the cause).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ortevals.bench.spec import ONNX_PEERS
from ortevals.bench.workload import Work, lm_eval_model, lm_eval_tasks
from ortevals.errors import first_line
from ortevals.files import atomic_write, json_text
from ortevals.install import load_cuda_libraries


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out = Path(spec["output"])
    try:
        import lm_eval

        work = Work(**{**spec["work"], "tasks": tuple(spec["work"]["tasks"])})
        if work.ep == "cuda" and spec["backend"] in ONNX_PEERS:  # as ortevals' own sessions find CUDA
            load_cuda_libraries()
        lm = lm_eval_model(spec["backend"], spec["target"], spec["args"], work.ep)
        results = lm_eval.simple_evaluate(model=lm, log_samples=True, **lm_eval_tasks(work, spec["limit"]))
    except Exception as e:  # the row's one line; lm-eval's backends raise many kinds
        said = first_line(e)
        print(f"Error: {known_cause(spec['backend'], said) or f'{type(e).__name__}: {said}'}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for task, samples in results.get("samples", {}).items():
        atomic_write(out / f"samples_{task}.jsonl", "".join(json_text(s) + "\n" for s in samples))
    body = {k: v for k, v in results.items() if k != "samples"}
    body["bench"] = {"peak_device_mib": _device_mib()}
    atomic_write(out / "results.json", json_text(body, indent=1))
    return 0


# failures whose cause is known (docs/bench.md, Limits): (backend, what onnxruntime says, the cause in words)
KNOWN_CAUSES = (
    ("onnxruntime", "should match the packed KV head dimension, got 1",
     "lm-eval's onnxruntime backend binds graph dimensions it does not know (the builder's kv_cache_dim: the past "
     "KV's head size) to 1, and GroupQueryAttention refuses that past at the first request"),
)


def known_cause(backend: str, said: str) -> str | None:
    """The known cause of a failure, in one line with onnxruntime's own words after it; None for any other."""
    for name, needle, cause in KNOWN_CAUSES:
        if backend == name and needle in said:
            return f"{cause} (onnxruntime: {said.split('Status Message: ')[-1].strip()})"
    return None


def _device_mib() -> float | None:
    """torch's peak reserved CUDA memory (hf, vllm on a GPU); None where torch holds none."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_reserved() / 2**20


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
