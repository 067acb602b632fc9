"""The Generator oracle: an ortevals run's first N requests, each through onnxruntime-genai's own Generator on
the same package and device, held to a stated rounding bound.

    python scripts/gpu/oracle.py RUN PKG --ep cuda --requests 100   # RUN: an ortevals --output (an ortevals
                                                                    # bench row's runs/NN-LABEL/run1)

Each request of RUN's samples is encoded as ortevals encodes it (``OrtLM._encode_pair``); its context goes to a
new ``og.Generator``, then its continuation one token at a time, ``get_logits()`` (float32 of the package's
logits) read before each and the log-softmax summed in float64. Same graph, same kernels: ortevals runs them
at other shapes (rows batched and padded, a prefix's KV reused, its log-softmax inside the graph in float32),
so the two differ only by the order of their sums. Prints one JSON line (also RUN/oracle.json); exit 1 when a
request is past :data:`TOLERANCE`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ortevals.install import import_og  # noqa: E402
from ortevals.integrations.lm import ModelArgs, OrtLM  # noqa: E402
from ortevals.report.runs import arguments, read_jsonl  # noqa: E402
from ortevals.runtime.genai import TEXT_SECTIONS, og_config  # noqa: E402

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}  # by the package's KV type
ULPS = 16
TOLERANCE = (
    "|ortevals - oracle| <= 2 * n * 16 * u * max(1, max|z|) per request: n continuation tokens, z the oracle's "
    "logits at the scored positions, u the unit roundoff of the package's activations, read from its KV type. A "
    "log-softmax moves by at most 2 max_i |dz_i| when the logits move by dz, so n tokens by at most 2n max|dz|; "
    "the same kernels at other shapes differ only by the order of their sums, each rounding worth at most u of "
    "the value rounded, and 16 units at the scale of the largest logit is the room left for those roundings to "
    "accumulate through the layers (max_ratio says how much of it was used)")


def tolerance(n: int, zmax: float, dtype: str) -> float:
    """The bound of one request: ``n`` tokens, largest logit ``zmax``, activations of ``dtype``."""
    return 2 * n * ULPS * UNIT_ROUNDOFF[dtype] * max(1.0, zmax)


def requests(run: Path, lm: OrtLM, limit: int) -> list[dict]:
    """The first ``limit`` (context, continuation) requests of ``run``'s samples, as ``lm`` encodes them (token
    ids), with ortevals' log-likelihood."""
    out = []
    for f in sorted(run.glob("samples_*.jsonl")):
        for record in read_jsonl(f):
            for (ctx, cont, *_), resp in zip(arguments(record["arguments"]), record["resps"], strict=True):
                context, continuation = lm._encode_pair(ctx, cont)
                out.append({"ctx": context, "cont": continuation, "ll": float(resp[0][0])})
                if len(out) == limit:
                    return out
    return out


def run_oracle(lm: OrtLM, reqs: list[dict]) -> list[dict]:
    """Each request through onnxruntime-genai's Generator on ``lm``'s package and provider, configured as
    ortevals configures its own Generators (runtime/genai.py ``og_config``: the provider options ortevals' sessions
    get, the CUDA libraries preloaded)."""
    og = import_og()
    model = og.Model(og_config(og, lm.run.package, lm.run.backends.provider, TEXT_SECTIONS))
    for r in reqs:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(r["ctx"]) + len(r["cont"]), do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([r["ctx"]], dtype=np.int32))
        r["oracle"], r["zmax"] = 0.0, 0.0
        for i, token in enumerate(r["cont"]):
            z = np.asarray(gen.get_logits(), dtype=np.float64).reshape(-1)
            r["zmax"] = max(r["zmax"], float(np.abs(z).max()))
            top = z.max()
            r["oracle"] += float(z[token] - top - np.log(np.exp(z - top).sum()))
            if i + 1 < len(r["cont"]):
                gen.append_tokens(np.asarray([[token]], dtype=np.int32))
    return reqs


def compare(rows: list[dict], dtype: str) -> dict:
    """Per request |Δ| against its tolerance; the requests past it (index, Δ, tolerance), at most 50."""
    checked = [(i, abs(r["ll"] - r["oracle"]), tolerance(len(r["cont"]), r["zmax"], dtype)) for i, r in enumerate(rows)]
    outside = [{"request": i, "delta": d, "tolerance": t} for i, d, t in checked if not d <= t]
    return {"requests": len(checked), "within_tolerance": len(checked) - len(outside),
            "max_abs_delta": max((d for _, d, _ in checked), default=None),
            "max_ratio": max((d / t for _, d, t in checked), default=None), "outside": outside[:50],
            "activations": dtype, "tolerance": TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("pkg")
    ap.add_argument("--ep", default="cpu")
    ap.add_argument("--requests", type=int, default=100)
    args = ap.parse_args(argv)
    lm = OrtLM.from_package(ModelArgs(pkg=args.pkg, ep=args.ep, store="none"))  # opens no session
    dtype = lm.run.package.kv[0].dtype  # float16 for the CUDA int4 package, float32 on CPU
    got = compare(run_oracle(lm, requests(args.run, lm, args.requests)), dtype)
    (args.run / "oracle.json").write_text(json.dumps(got, indent=1) + "\n")
    print(json.dumps(got))
    return 0 if not got["outside"] else 1


if __name__ == "__main__":
    sys.exit(main())
