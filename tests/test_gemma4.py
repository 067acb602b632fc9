"""Gemma-4 layout: embedding model + decoder, different head sizes per layer, sliding window."""

import numpy as np
import pytest

from ortevals.lm import ModelArgs, OrtLM
from ortevals.package import ModelPackage
from ortevals.providers import from_package
from ortevals.runtime.sessions import DecoderRunner
from ortevals.scoring import log_softmax


@pytest.fixture(scope="module")
def windowed(fixture_cache):
    from tests.fixtures.gemma4 import build_gemma4

    return build_gemma4(fixture_cache / "gemma4", windowed=True)


def test_per_layer_kv_specs_come_from_the_graph(gemma4):
    pkg = ModelPackage.load(gemma4[1])
    assert [(s.kv_heads, s.head_size) for s in pkg.kv] == [(1, 32), (1, 32), (1, 64)]
    assert pkg.embedding is not None and "vision" in pkg.skipped_models
    assert not pkg.windowed


def test_windowed_layers_are_detected(windowed):
    pkg = ModelPackage.load(windowed[1])
    assert [s.window for s in pkg.kv] == [16, 16, None]
    assert pkg.windowed


@pytest.mark.parametrize("which", ["plain", "windowed"])
def test_prefill_equals_pytorch_past_the_window(gemma4, windowed, which):
    from tests.fixtures.gemma4 import reference_logprobs

    hf_dir, pkg_dir = gemma4 if which == "plain" else windowed
    pkg = ModelPackage.load(pkg_dir)
    runner = DecoderRunner.open(pkg, from_package(pkg.decoder.session_options))
    rng = np.random.default_rng(1)
    ids = rng.integers(10, 500, size=(2, 40)).astype(np.int64)  # 40 tokens > window 16
    ref = reference_logprobs(hf_dir, ids.tolist())
    logits, _ = runner.forward(ids, np.ones_like(ids))
    assert np.abs(log_softmax(logits) - ref).max() <= 1e-4
    # right padding: the valid positions of a shorter row are unchanged
    mask = np.ones_like(ids)
    mask[1, 25:] = 0
    padded, _ = runner.forward(ids, mask)
    short_ref = reference_logprobs(hf_dir, ids[1:, :25].tolist())
    assert np.abs(log_softmax(padded[1, :25]) - short_ref[0]).max() <= 1e-4


def test_lm_loglikelihood_on_gemma4_equals_pytorch(gemma4):
    from lm_eval.api.instance import Instance

    from tests.fixtures.gemma4 import reference_logprobs

    lm = OrtLM.from_package(ModelArgs(pkg=str(gemma4[1]), batch_size=2))
    pairs = [("the city of the river", " number"), ("the city of the river", " one two three four five six seven")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (ctx, cont), (lp, _) in zip(pairs, got):
        c = lm.tok_encode(ctx)
        full = lm.tok_encode(ctx + cont)
        ref = reference_logprobs(gemma4[0], [full[:-1]])[0]
        want = sum(ref[i - 1, full[i]] for i in range(len(c), len(full)))
        assert abs(lp - want) <= 1e-4
