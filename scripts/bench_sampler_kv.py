"""Issue 20 §1, measured on CPU in one invocation: the sampler's device KV kept in place against a new
cache per pass (the same OrtValue/IOBinding code a GPU takes, on device 'cpu'), and top-p by partial
sort against the full-vocabulary sort.

    PYTHONPATH=. python scripts/bench_sampler_kv.py [--pkg DIR] [--rows 8] [--tokens 128] [--prompt 256]

Prints one JSON object: seconds per decode (median of 3) for each KV kind, bytes allocated for KV
during the decode, the ratio, and top-p seconds on [16, 262144] peaked logits. Default package: the
SmolLM2-135M fp32 example (ortevals/package/examples.py). Times are wall clock on whatever else the
machine runs: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def decode_seconds(sampler, settings, prompt, rows: int) -> tuple[float, list]:
    logits, past = sampler.prompt(tuple(prompt), settings.max_gen_toks)
    start = time.perf_counter()
    out = sampler.decode(logits, past, settings, [np.random.default_rng(i) for i in range(rows)], ["r"] * rows)
    return time.perf_counter() - start, [o.ids for o in out]


def kv_bytes(counting, sampler, settings, prompt, rows):
    """KV bytes onnxruntime allocated during one decode (present outputs bound by device, new buffers)."""
    counting["bytes"] = 0
    decode_seconds(sampler, settings, prompt, rows)
    return counting["bytes"]


def spy_allocations(logits_name: str) -> dict:
    """Counts the bytes of new OrtValues and of outputs bound by device alone (onnxruntime allocates
    those at run time; outputs bound to a buffer by pointer are not allocations). Logits are not KV."""
    import onnxruntime as ort

    counting = {"bytes": 0}
    make, bind, run = (ort.OrtValue.ortvalue_from_shape_and_type, ort.IOBinding.bind_output,
                       ort.InferenceSession.run_with_iobinding)
    fresh: dict[int, set] = {}  # binding id -> output names onnxruntime allocates

    def counted_make(shape, *args, **kwargs):
        value = make(shape, *args, **kwargs)
        counting["bytes"] += int(value.tensor_size_in_bytes())
        return value

    def counted_bind(binding, name, device_type="cpu", device_id=0, element_type=None, shape=None,
                     buffer_ptr=None):
        if buffer_ptr is None and name != logits_name:
            fresh.setdefault(id(binding), set()).add(name)
        return bind(binding, name, device_type, device_id, element_type, shape, buffer_ptr)

    def counted_run(session, binding, *args, **kwargs):
        result = run(session, binding, *args, **kwargs)
        names = fresh.pop(id(binding), set())
        if names:
            bound = [n for n in binding._bound_outputs]  # in binding order, as get_outputs returns them
            for name, value in zip(bound, binding.get_outputs(), strict=True):
                if name in names:
                    counting["bytes"] += int(value.tensor_size_in_bytes())
        return result

    ort.OrtValue.ortvalue_from_shape_and_type = staticmethod(counted_make)
    ort.IOBinding.bind_output = counted_bind
    ort.InferenceSession.run_with_iobinding = counted_run
    return counting


def bench_kv(pkg: str, rows: int, tokens: int, prompt_len: int) -> dict:
    from ortevals.engine.generate.choice.settings import parse_gen_kwargs
    from ortevals.engine.generate.rows.kv import CopyKV
    from ortevals.engine.generate.rows.sampler import SharedPromptSampler
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    package = ModelPackage.load(pkg)
    runner = DecoderRunner.open(package, ProviderConfig("cpu", intra_op_threads=2), io_binding=True)
    prompt = list(np.random.default_rng(0).integers(10, package.vocab_size - 10, prompt_len))
    settings = parse_gen_kwargs({"until": [], "max_gen_toks": tokens, "do_sample": True,
                                 "temperature": 1.0}, tokens)
    kinds = {}
    for name in ("in-place", "copy"):
        s = SharedPromptSampler(runner, _NoText(), set())
        if name == "copy":
            s._kv_rows = CopyKV(runner)
        times, ids = [], None
        for _ in range(3):
            t, ids = decode_seconds(s, settings, prompt, rows)
            times.append(t)
        kinds[name] = {"kv": s.kv_rows.name, "decode_s": statistics.median(times), "ids": ids, "sampler": s}
    counting = spy_allocations(package.logits_name)
    for k in kinds.values():
        k["kv_bytes_allocated"] = kv_bytes(counting, k.pop("sampler"), settings, prompt, rows)
    same = kinds["in-place"].pop("ids") == kinds["copy"].pop("ids")
    return {"package": pkg, "rows": rows, "tokens": tokens, "prompt": prompt_len, "token_equal": same,
            **kinds, "copy_over_inplace_time": kinds["copy"]["decode_s"] / kinds["in-place"]["decode_s"]}


class _NoText:
    """Token ids only: the benchmark has no stop strings to check."""

    def decode(self, ids, skip_special_tokens=False):
        return ""


def bench_top_p(rows: int = 16, vocab: int = 262_144, p: float = 0.9) -> dict:
    from ortevals.engine.generate.choice import logits as sampling

    out = {}
    for scale in (4.0, 6.0):
        x = np.random.default_rng(1).standard_normal((rows, vocab)) * scale
        t0 = time.perf_counter()
        full = sampling._top_p_sorted(x, p)
        t1 = time.perf_counter()
        part = sampling.top_p(x, p)
        t2 = time.perf_counter()
        out[f"scale {scale:g}"] = {"full_sort_s": t1 - t0, "partial_s": t2 - t1, "ratio": (t1 - t0) / (t2 - t1),
                                   "equal": bool(np.array_equal(full, part)),
                                   "kept_max": int(np.isfinite(part).sum(axis=-1).max())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pkg", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    a = ap.parse_args()
    if a.pkg is None:
        from ortevals.package.examples import smollm2_package

        a.pkg = str(smollm2_package("fp32"))
    print(json.dumps({"kv": bench_kv(a.pkg, a.rows, a.tokens, a.prompt), "top_p": bench_top_p()}, indent=1))


if __name__ == "__main__":
    main()
