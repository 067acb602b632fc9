#!/usr/bin/env python
"""The CPU speed tables of docs/benchmarks.md, each one ``ortevals bench`` (``ortevals.bench.run``).

    ortevals example && ortevals example --precision int4      # the SmolLM2-135M packages, once
    python scripts/bench_docs.py accept honest startup verdict checks modes paths shared cot samples

Each name is a table (:data:`TABLES`); it runs in the examples folder of the ortevals cache (so the printed
command names the packages by their folder names and the same ``--output bench-data/<name>`` on every machine),
its runs go to ``bench-data/<name>/`` there, and its ``bench.md``, ``bench.json`` and ``bench.png`` to
``docs/bench-<name>/``. One table at a time: they time
processes.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ortevals.bench import BenchOptions, run  # noqa: E402

FP32, INT4, HF = "smollm2-135m-instruct-fp32", "smollm2-135m-instruct-int4", "smollm2-135m-instruct-hf"
TABLES = {
    "accept": BenchOptions(pkgs=(FP32, INT4), hf=HF, backends=("ortevals", "hf", "onnxruntime-genai"), limit=20),
    "honest": BenchOptions(pkgs=(FP32, FP32), hf=HF, limit=20, repeat=2),
    "startup": BenchOptions(pkgs=(FP32,), hf=HF, cache=("cold", "warm", "stored"), limit=20),
    "verdict": BenchOptions(pkgs=(FP32, f"nocheck={FP32}:check=false"), cache=("cold", "warm"), limit=20, repeat=3),
    "checks": BenchOptions(pkgs=(FP32, f"nocheck={FP32}:check=false", f"exact={FP32}:exact=true"), limit=30),
    "modes": BenchOptions(pkgs=(FP32, f"nocache={FP32}:prefix_cache=false",
                                f"plain={FP32}:prefix_cache=false,scoring_graph=false,batch_size=1",
                                f"incremental={FP32}:path=incremental"), hf=HF,
                          backends=("ortevals", "hf", "onnxruntime-genai", "onnxruntime"), limit=30),
    "paths": BenchOptions(pkgs=(FP32, f"incremental={FP32}:path=incremental"), limit=30, repeat=3),
    "shared": BenchOptions(pkgs=(f"one-a-pass={FP32}:shared_prefix_batch=off",
                                 f"shared-batches={FP32}:shared_prefix_batch=on"), limit=100, repeat=2,
                           ref="one-a-pass"),
    "cot": BenchOptions(pkgs=(FP32, f"og={FP32}:gen_path=og"),
                        hf=HF, backends=("ortevals", "hf", "onnxruntime-genai"), cot=True, max_gen_toks=64, limit=14,
                        peer_limit=14),
    "samples": BenchOptions(pkgs=(FP32,), hf=f"{HF}:batch_size=16", backends=("ortevals", "hf", "onnxruntime-genai"),
                            cot=True, samples=16, max_gen_toks=128, limit=4, peer_limit=4),
}


def main(names: list[str]) -> None:
    from ortevals.files import cache_root

    unknown = [n for n in names if n not in TABLES]
    if unknown or not names:
        raise SystemExit(f"expected some of {', '.join(TABLES)}; got {', '.join(unknown) or 'none'}")
    os.chdir(cache_root() / "examples")
    for name in names:
        result = run(replace(TABLES[name], output=Path("bench-data") / name), progress=print)  # in the examples folder
        print("\n".join([result.meta["command"], "", result.table, "", *result.notes]), flush=True)
        docs = REPO / "docs" / f"bench-{name}"
        docs.mkdir(exist_ok=True)
        for f in result.files:
            shutil.copy(f, docs / f.name)


if __name__ == "__main__":
    main(sys.argv[1:])
