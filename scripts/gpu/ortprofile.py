"""onnxruntime's profiler on every session one ortevals command opens, and the split of the time it reports.

    python scripts/gpu/ortprofile.py OUT -- mmlu-pro --pkg PKG --ep cuda --limit 20 --data bundled

Runs the ortevals command in this process with each ``onnxruntime.InferenceSession`` created profiling into
OUT (``enable``: ortevals looks the class up at call time, so nothing in ortevals changes), then writes
``OUT/profile.json`` (``summarize``): time inside ``session.run`` (``model_run``) against the command's wall
time (the rest is the host: start-up, tokenizing, Python, numpy, the copies ortevals makes), and inside it the
node time by provider and by op. On CUDA a node's time is what the host spent launching it; ``kernel_time``
(torch.profiler's CUPTI trace of the same process, when torch with CUDA is there) gives the GPU's own kernel
time (scripts/gpu/README.md, call 6).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path


def enable(folder: Path) -> list:
    """Patch ``onnxruntime.InferenceSession``; returns the list the profiled sessions are appended to."""
    import onnxruntime as ort

    sessions, base = [], ort.InferenceSession

    class Profiled(base):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
            opts = sess_options or ort.SessionOptions()
            opts.enable_profiling = True
            opts.profile_file_prefix = str(folder / f"session{len(sessions)}")
            super().__init__(path_or_bytes, opts, providers, provider_options, **kwargs)
            sessions.append(self)

    ort.InferenceSession = Profiled
    return sessions


def summarize(files: list[Path], scored_s: float, worker_s: float | None = None) -> dict:
    """Seconds: scoring (inside the backend's loglikelihood), the worker from the model's opening on
    (``worker_s``: every profiled run falls inside it, the opening checks' too), inside session.run, nodes (by
    provider, top ops), and the rest: outside onnxruntime, of the worker's time where it is given."""
    run_us, node_us, runs = 0, 0, 0
    by_provider, by_op = Counter(), Counter()
    for f in files:
        for e in json.loads(Path(f).read_text()):
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                run_us += e["dur"]
                runs += 1
            elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                node_us += e["dur"]
                by_provider[e.get("args", {}).get("provider", "?")] += e["dur"]
                by_op[e.get("args", {}).get("op_name", "?")] += e["dur"]
    s = 1e-6
    whole = scored_s if worker_s is None else worker_s
    return {"scored_s": scored_s, "worker_s": worker_s, "session_runs": runs, "inside_ort_run_s": run_us * s,
            "nodes_s": node_us * s, "outside_ort_s": whole - run_us * s, "ort_not_in_nodes_s": (run_us - node_us) * s,
            "nodes_by_provider_s": {k: v * s for k, v in by_provider.most_common()},
            "top_ops_s": {k: v * s for k, v in by_op.most_common(10)}}


def kernel_time(prof) -> dict:
    """GPU kernel seconds from a finished ``torch.profiler.profile`` (CUDA activity): total and top kernels."""
    kernels = Counter()
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels[e.name] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    total = sum(kernels.values()) * 1e-6
    return {"gpu_kernel_s": total, "gpu_kernels": len(kernels),
            "top_kernels_s": {k[:80]: v * 1e-6 for k, v in kernels.most_common(8)}}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        print("error: expected OUT -- ORTEVALS-ARGS…", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    from ortevals.cli import cli

    sessions = enable(out)
    prof = None
    try:
        import torch

        if torch.cuda.is_available():
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
    except ImportError:
        pass
    t0 = time.perf_counter()
    try:
        cli.main(args=command, prog_name="ortevals", standalone_mode=False)
        code = 0
    except SystemExit as e:  # the command's own exit (an error is one line already said)
        code = e.code or 0
    seconds = time.perf_counter() - t0
    if prof:
        prof.__exit__(None, None, None)
    files = [f for f in (s.end_profiling() for s in sessions) if f]
    report = {"command": command, **summarize(files, seconds), **(kernel_time(prof) if prof else {})}
    (out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
