"""The GPU equality check of scripts/bench_gpu.py: ortevals against onnxruntime-genai's own Generator on the
same package and device, request by request.

The ortevals child records the token ids and log-likelihood of its first requests (:func:`capture`);
the oracle child (:func:`run_oracle`) feeds each request's context to an ``og.Generator`` on the same
package and provider, then the continuation one token at a time, reading ``get_logits()`` (float32 of the
package's logits) before each, and sums the log-softmax (float64) of the continuation's tokens. Same graph,
same kernels: what differs is only the shapes ortevals runs them at (rows batched and padded, a prefix's
KV reused, its log-softmax inside the graph in float32), so the two differ only by the order of their sums.

:data:`TOLERANCE` states the bound each request is held to; :func:`compare` lists the requests past it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ortevals.runtime.providers import CUDA_DEFAULTS

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}  # by the package's KV type
ULPS = 16
TOLERANCE = (
    "|ortevals - oracle| <= 2 * n * 16 * u * max(1, max|z|) per request: n continuation tokens, z the oracle's "
    "logits at the scored positions, u the unit roundoff of the package's activations, read from its KV type "
    "(float16 2^-11, as in the CUDA int4 package; bfloat16 2^-8; float32 2^-24). A log-softmax moves by at most "
    "2 max_i |dz_i| when the logits move by dz, so n tokens move by at most 2n max|dz|; the same graph on the "
    "same kernels at other shapes differs only by the order of its sums, each rounding worth at most u of the "
    "value rounded, and 16 units at the scale of the largest logit is the room allowed for those roundings to "
    "accumulate through the layers (max_ratio below says how much of it was used)")


def tolerance(n: int, zmax: float, dtype: str) -> float:
    """The bound of one request: ``n`` tokens, largest logit ``zmax``, activations of ``dtype``."""
    return 2 * n * ULPS * UNIT_ROUNDOFF[dtype] * max(1.0, zmax)


def capture(lm, path: Path, limit: int) -> None:
    """Record the first ``limit`` requests ortevals scores (token ids and log-likelihood) to ``path``."""
    inner, kept = lm._loglikelihood_tokens, []

    def recorded(requests, *a, **k):
        out = inner(requests, *a, **k)
        for (_, ctx, cont), (ll, _greedy) in zip(requests, out):
            if len(kept) < limit:
                kept.append({"ctx": list(ctx), "cont": list(cont), "ll": float(ll)})
        Path(path).write_text(json.dumps(kept))
        return out

    lm._loglikelihood_tokens = recorded


def run_oracle(pkg: str, ep: str, path: Path) -> dict:
    """Each recorded request through onnxruntime-genai's Generator on ``pkg`` and ``ep``."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(pkg)
    config.clear_providers()
    if ep != "cpu":
        config.append_provider(ep)
        if ep == "cuda":  # as ortevals' sessions: full float32 MatMuls, flash attention (runtime/providers.py)
            for key, value in CUDA_DEFAULTS.items():
                config.set_provider_option(ep, key, value)
    model = og.Model(config)
    out = []
    for r in json.loads(Path(path).read_text()):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(r["ctx"]) + len(r["cont"]), do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([r["ctx"]], dtype=np.int32))
        ll, zmax = 0.0, 0.0
        for i, token in enumerate(r["cont"]):
            z = np.asarray(gen.get_logits(), dtype=np.float64).reshape(-1)
            zmax = max(zmax, float(np.abs(z).max()))
            top = z.max()
            ll += float(z[token] - top - np.log(np.exp(z - top).sum()))
            if i + 1 < len(r["cont"]):
                gen.append_tokens(np.asarray([[token]], dtype=np.int32))
        out.append({"ours": r["ll"], "oracle": ll, "n": len(r["cont"]), "zmax": zmax})
    return {"requests": out}


def compare(rows: list[dict], dtype: str) -> dict:
    """Per request |Δ| against its tolerance; the requests past it (index, Δ, tolerance), at most 50."""
    checked = [(i, abs(r["ours"] - r["oracle"]), tolerance(r["n"], r["zmax"], dtype)) for i, r in enumerate(rows)]
    outside = [{"request": i, "delta": d, "tolerance": t} for i, d, t in checked if not d <= t]
    return {"requests": len(checked), "within_tolerance": len(checked) - len(outside),
            "max_abs_delta": max((d for _, d, _ in checked), default=None),
            "max_ratio": max((d / t for _, d, t in checked), default=None), "outside": outside[:50],
            "activations": dtype, "unit_roundoff": UNIT_ROUNDOFF[dtype], "ulps": ULPS}
