"""Measure prefix-continuation passes: one row per pass vs a batch with the prefix KV replicated.

Usage: python scripts/prefix_batch_probe.py PACKAGE [--prefix 786] [--suffix 140] [--rows 10] [--repeat 3]

Runs raw onnxruntime (through ortevals' DecoderRunner) on CPU: computes the KV of a
random shared prefix once, then scores ``rows`` right-padded random suffixes (lengths
suffix-20 .. suffix) either one row per pass or all rows in one pass with the past
repeated across the batch (attention_mask [B, past+S], zeros on the pads). Prints
whether ORT accepts the batched pass, the max |Δ logit| over valid positions, and
the time of each mode (best of ``repeat``). A quick measurement, not a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ortevals.package.loader import ModelPackage
from ortevals.runtime.buffers import KVCache
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--prefix", type=int, default=786)
    ap.add_argument("--suffix", type=int, default=140)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    pkg = ModelPackage.load(a.package)
    runner = DecoderRunner.open(pkg, from_package(pkg.decoder.session_options, "cpu"))
    rng = np.random.default_rng(0)
    vocab = min(pkg.vocab_size, 500)
    prefix = rng.integers(3, vocab, (1, a.prefix)).astype(np.int64)
    _, kv = runner.forward(prefix, np.ones_like(prefix), want_present=True)
    lens = [int(n) for n in np.linspace(max(1, a.suffix - 20), a.suffix, a.rows)]
    suffixes = [rng.integers(3, vocab, n).astype(np.int64) for n in lens]

    def one_row():
        out = []
        for s in suffixes:
            logits, _ = runner.forward(s[None], np.ones((1, a.prefix + len(s)), np.int64), kv)
            out.append(logits[0])
        return out

    def batched():
        width = max(lens)
        ids = np.zeros((len(lens), width), np.int64)
        mask = np.zeros((len(lens), a.prefix + width), np.int64)
        mask[:, :a.prefix] = 1
        for b, s in enumerate(suffixes):
            ids[b, :len(s)] = s
            mask[b, a.prefix:a.prefix + len(s)] = 1
        past = KVCache(tuple((np.repeat(k, len(lens), 0), np.repeat(v, len(lens), 0)) for k, v in kv.layers),
                       kv.length)
        logits, _ = runner.forward(ids, mask, past)
        return [logits[b, :n] for b, n in enumerate(lens)]

    ref = one_row()
    try:
        got = batched()
    except Exception as e:  # report ORT's own words
        print(f"batched pass refused: {e}")
        got = None
    if got is not None:
        diff = max(float(np.abs(r - g).max()) for r, g in zip(ref, got))
        same = all((r.argmax(-1) == g.argmax(-1)).all() for r, g in zip(ref, got))
        print(f"batched accepted: max |Δ logit| {diff:.2e}, same argmax {same}")
    for name, fn in (("one row per pass", one_row), ("batched", batched if got is not None else None)):
        if fn is None:
            continue
        best = min(_timed(fn) for _ in range(a.repeat))
        print(f"{name}: {best * 1000:.0f} ms for {len(lens)} suffixes of {lens[0]}-{lens[-1]} tokens "
              f"after a {a.prefix}-token prefix")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
