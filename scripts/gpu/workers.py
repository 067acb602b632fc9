"""What runs in each child process of scripts/bench_gpu.py: one backend, one task, one JSON line.

``worker_main(kind, spec)`` builds the backend's lm-eval model (ortevals, lm-eval ``hf``, lm-eval
``onnxruntime-genai``), runs it (``ll``: leaderboard_mmlu_pro through scripts/bench_mmlu_pro.score_mmlu_pro;
``cot``: K chain-of-thought samples through scripts/bench_samples.run_backend; ``profile``: ortevals under
onnxruntime's profiler; ``oracle``: onnxruntime-genai's Generator on the requests ortevals recorded) and
prints ``BENCH {json}`` with its figures, the versions it imported and its peak host RSS. The parent
measures device memory from outside.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path


def build(spec: dict):
    """The backend's lm-eval model (``spec``: backend, pkg, hf, ep, hf_dtype, hf_batch, threads, ortevals_args)."""
    ep, backend = spec["ep"], spec["backend"]
    if backend != "hf" and ep == "cuda":
        import onnxruntime

        onnxruntime.preload_dlls()  # CUDA/cuDNN from the nvidia packages (kit.py links them beside onnxruntime)
    if backend == "ortevals":
        from ortevals.integrations.lm import OrtLM

        extra = dict(kv.split("=", 1) for kv in spec["ortevals_args"].split(",") if kv)
        threads = {"threads": spec["threads"]} if spec["threads"] else {}
        # timed: no answers resumed from the result store (the lm-eval route opens it by default)
        return OrtLM.create_from_arg_obj({"pkg": spec["pkg"], "ep": ep, "store": "none", **threads, **extra})
    if backend == "hf":
        import torch
        from lm_eval.models.huggingface import HFLM

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        batch = spec["hf_batch"] if spec["hf_batch"] == "auto" else int(spec["hf_batch"])
        return HFLM(pretrained=spec["hf"], device="cuda:0" if ep == "cuda" else "cpu", dtype=spec["hf_dtype"],
                    batch_size=batch)
    if backend == "ort":  # lm-eval's raw onnxruntime backend (0.4.13): one session, a full pass per request
        from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM

        return ONNXRuntimeLM(pretrained=spec["pkg"], execution_provider=ep)
    from lm_eval.models.onnxruntime_genai import ONNXRuntimeGenAILM

    return ONNXRuntimeGenAILM(pretrained=spec["pkg"], execution_provider=ep)


def call_counter(lm, backend: str):
    """A callable giving the model calls (forward passes) the backend made so far."""
    if backend == "ortevals":
        return lambda: getattr(lm.engine, "forward_passes", None)
    name = "_model_call" if backend == "hf" else "_forward_logits"
    count, inner = [0], getattr(lm, name)

    def counted(*a, **k):
        count[0] += 1
        return inner(*a, **k)

    setattr(lm, name, counted)
    return lambda: count[0]


def versions() -> dict:
    """Versions of the runtimes this process imported (and where onnxruntime came from)."""
    out = {"python": platform.python_version()}
    for mod in ("onnxruntime", "onnxruntime_genai", "torch", "transformers", "lm_eval", "numpy"):
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", None)
    if "onnxruntime" in sys.modules:
        out["onnxruntime_from"] = str(Path(sys.modules["onnxruntime"].__file__).parent.parent)
    return out


def worker_ll(spec: dict) -> dict:
    from bench_mmlu_pro import score_mmlu_pro

    t0 = time.perf_counter()
    lm = build(spec)
    calls = call_counter(lm, spec["backend"])
    load_s = time.perf_counter() - t0
    if spec.get("capture"):  # the oracle's requests: ortevals' own token ids (scripts/gpu/oracle.py)
        from oracle import capture

        capture(lm, spec["capture"], spec["capture_limit"])
    scores, _ = score_mmlu_pro(lm, spec["limit"], "bundled")
    out = {**scores, "load_s": load_s, "model_calls": calls(), "versions": versions()}
    if spec["backend"] == "ortevals":  # how it scored: the mode line, the tokens run, the passes' shapes
        engine = lm.engine
        package = lm.run.package
        hidden = json.loads((package.root / "genai_config.json").read_text())["model"]["decoder"].get("hidden_size")
        out.update(mode=lm.run.stats.get("mode"), tokens_run=getattr(engine, "tokens_run", None),
                   shared=getattr(engine, "shared_stats", None),
                   parameters=package.parameters - package.vocab_size * (hidden or 0))  # the table is gathered
    if spec["backend"] == "hf" and spec["ep"] == "cuda":
        import torch

        out["torch_max_reserved_mib"] = torch.cuda.max_memory_reserved() / (1 << 20)
        out["hf_batch_sizes"] = getattr(lm, "batch_sizes", None)
    return out


def worker_cot(spec: dict) -> dict:
    import bench_samples

    args = argparse.Namespace(pkg=spec["pkg"], hf=spec["hf"], ep=spec["ep"], hf_dtype=spec["hf_dtype"],
                              samples=spec["samples"], threads=spec["threads"] or 0, precision=None)
    configs = bench_samples.task_configs(spec["questions"], spec["samples"], spec["max_gen_toks"], 0.7)
    import torch  # noqa: F401 - simple_evaluate imports torch to seed it: once here, in no backend's time

    out = bench_samples.run_backend(spec["backend"], args, configs)
    return {**out, "versions": versions()}


def worker_profile(spec: dict) -> dict:
    from bench_mmlu_pro import score_mmlu_pro
    from ortprofile import enable, kernel_time, summarize

    folder = Path(tempfile.mkdtemp(prefix="ort-profile-"))
    if spec["ep"] == "cuda":
        import onnxruntime

        onnxruntime.preload_dlls()
    sessions = enable(folder)
    t0 = time.perf_counter()  # the sessions' own runs start here (opening checks, the canary): all inside the split
    lm = build(spec)
    prof = None
    try:
        import torch

        if spec["ep"] == "cuda" and torch.cuda.is_available():
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    except ImportError:
        pass
    if prof:
        prof.__enter__()
    scores, _ = score_mmlu_pro(lm, spec["limit"], "bundled")
    if prof:
        prof.__exit__(None, None, None)
    files = [s.end_profiling() for s in sessions]
    out = {"questions": scores["questions"], "requests": scores["requests"],
           **summarize([f for f in files if f], scores["seconds"], time.perf_counter() - t0), "versions": versions()}
    return {**out, **(kernel_time(prof) if prof else {"gpu_kernel_s": None})}


def worker_oracle(spec: dict) -> dict:
    """onnxruntime-genai's Generator on the requests the ortevals child recorded (scripts/gpu/oracle.py)."""
    from oracle import run_oracle

    if spec["ep"] == "cuda":
        import onnxruntime

        onnxruntime.preload_dlls()
    t0 = time.perf_counter()
    out = run_oracle(spec["pkg"], spec["ep"], spec["capture"])
    import onnxruntime_genai  # noqa: F401 - for versions()

    return {**out, "seconds": time.perf_counter() - t0, "versions": versions()}


def worker_main(kind: str, spec: dict) -> None:
    out = {"ll": worker_ll, "cot": worker_cot, "profile": worker_profile, "oracle": worker_oracle}[kind](spec)
    out["peak_host_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("BENCH " + json.dumps(out), flush=True)
