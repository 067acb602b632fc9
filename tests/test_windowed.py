"""Sliding-window packages keep the prefix sharing (issue 40): a tiny Gemma-3-shaped model, 16-token windows.

A prefix's KV on a sliding-window layer is the same in any longer sequence, as on a full-attention layer; the
builder's default windowed cache (GroupQueryAttention ``sliding_window_cache=1``) only decides where it sits in
the buffer. The prefill plan computes each shared prefix to its own depth, so its buffer is reused as it is,
never cut. Scores equal transformers, and the windowed package runs as few tokens as its full-past twin.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.reuse import ReusePolicy, reuse_policy
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner
from tests.fixtures.gemma3 import SLIDING_WINDOW
from tests.fixtures.tiny import WORDS

_rng = random.Random(1)
HEADER = "Question: " + " ".join(_rng.choice(WORDS) for _ in range(25)) + ". Answer: B\n"
PAIRS = [(HEADER + "Question: " + " ".join(_rng.choice(WORDS) for _ in range(20 + 4 * q)) + ". Answer:", c)
         for q in range(5) for c in (" A", " B", " C")]


def test_windowed_buffer_holds_what_the_policy_says(gemma3):
    """onnxruntime's windowed layout, run: after T tokens a buffer of C = 20 rows with a 16-token window holds the
    last L(T) positions (``ReusePolicy.resident``: L sawtooths between 16 and 20) in rows [0, L(T)), the keys
    the full-past package computes at those positions (same weights); one token a pass and a 7-token pass."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    win, full = (ort.InferenceSession(str(p / "model.onnx"), opts, providers=["CPUExecutionProvider"])
                 for p in gemma3[1:])
    policy = ReusePolicy(window=SLIDING_WINDOW, capacity=20)
    ids = np.random.default_rng(0).integers(10, 500, 45).astype(np.int64)
    past_w = {f"past_key_values.{i}.{kv}": np.zeros((1, 1, 20 if i < 2 else 0, 32), np.float32)
              for i in range(3) for kv in ("key", "value")}
    empty = {f"past_key_values.{i}.{kv}": np.zeros((1, 1, 0, 32), np.float32)
             for i in range(3) for kv in ("key", "value")}
    steps = [7] + [1] * 38
    done = 0
    for n in steps:
        feeds = {"input_ids": ids[None, done:done + n], "attention_mask": np.ones((1, done + n), np.int64)}
        outs = win.run(None, feeds | past_w)
        names = [o.name for o in win.get_outputs()]
        past_w = {n_.replace("present", "past_key_values"): o for n_, o in zip(names, outs) if n_ != "logits"}
        done += n
        ref = full.run(["present.0.key"], {"input_ids": ids[None, :done],
                                           "attention_mask": np.ones((1, done), np.int64)} | empty)[0]
        rows = policy.resident(done)
        np.testing.assert_allclose(past_w["past_key_values.0.key"][0, 0, :rows], ref[0, 0, done - rows:done], atol=1e-5)
    assert {policy.resident(t) for t in range(21, 46)} == set(range(16, 21))  # the sawtooth was walked


def test_a_windowed_past_is_cut_only_where_exact(gemma3):
    """Cut back before anything was evicted, a windowed past continues as one pass does; after, it is refused."""
    pkg = ModelPackage.load(gemma3[1])
    runner = DecoderRunner.open(pkg, from_package({}))
    ids = np.random.default_rng(1).integers(10, 500, (1, 30)).astype(np.int64)
    one_pass, _ = runner.forward(ids, np.ones_like(ids))
    _, held = runner.forward(ids[:, :14], np.ones((1, 14), np.int64), want_present=True)
    cut = runner.narrow_past(held, 9)
    logits, _ = runner.forward(ids[:, 9:], np.ones((1, 30), np.int64), cut)
    np.testing.assert_allclose(logits[0], one_pass[0, 9:], atol=1e-5)
    _, held = runner.forward(ids[:, :20], np.ones((1, 20), np.int64), want_present=True)
    assert not reuse_policy(pkg).cut_exact(20, 9)
    with pytest.raises(PackageError, match="cannot be cut to 9"):
        runner.narrow_past(held, 9)


@pytest.fixture(scope="module")
def hf_scores(gemma3) -> list[float]:
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=str(gemma3[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)
    return [lp for lp, _ in hflm.loglikelihood(_instances(PAIRS))]


def _instances(pairs) -> list[Instance]:
    return [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i) for i, a in enumerate(pairs)]


def test_windowed_package_shares_prefixes_and_equals_hf(gemma3, hf_scores):
    """Both layouts equal transformers and run the same tokens: the shared header (longer than the window) once
    (before the fix the windowed package ran every prompt in full: 1050 tokens against 532)."""
    run = {}
    for name, pkg, reuse in (("windowed", gemma3[1], True), ("full past", gemma3[2], True),
                             ("no reuse", gemma3[1], False)):
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, prefix_cache=reuse))
        ours = [lp for lp, _ in lm.loglikelihood(_instances(PAIRS))]
        assert max(abs(a - b) for a, b in zip(ours, hf_scores)) <= 1e-4, name
        engine = lm.backends.prefill
        run[name] = engine.tokens_run - engine.canary_tokens
    assert len(OrtLM.from_package(ModelArgs(pkg=str(gemma3[1]))).tok_encode(HEADER)) > SLIDING_WINDOW
    assert run["windowed"] == run["full past"] < run["no reuse"] * 0.6
