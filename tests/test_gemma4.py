"""Gemma-4 layout: embedding model + decoder, different head sizes per layer, sliding window."""

import numpy as np
import pytest

from ortevals.engine.score.scoring import log_softmax
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner


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
    assert np.abs(log_softmax(logits, np.float32) - ref).max() <= 1e-4
    # right padding: the valid positions of a shorter row are unchanged
    mask = np.ones_like(ids)
    mask[1, 25:] = 0
    padded, _ = runner.forward(ids, mask)
    short_ref = reference_logprobs(hf_dir, ids[1:, :25].tolist())
    assert np.abs(log_softmax(padded[1, :25], np.float32) - short_ref[0]).max() <= 1e-4


SHARED = "the city of the river paris berlin rome madrid france germany italy spain capital mountain " * 2
PAIRS = [("the city of the river", " number"), ("the city of the river", " one two three four five six seven"),
         # a shared context of ~50 tokens, past the 16-token sliding window, with several continuations
         (SHARED, " number"), (SHARED, " one two three"), (SHARED, " river city of the capital four five six"),
         (SHARED + "answer", " the question of the model"), (SHARED, "the")]


def hf_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval hf's encoding, with transformers' own tokenizer: whole text minus the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok(context + continuation)["input_ids"], tok(context)["input_ids"]
    return ctx, whole[len(ctx):]


@pytest.mark.parametrize("which", ["plain", "windowed"])
def test_lm_loglikelihood_on_gemma4_equals_pytorch(gemma4, windowed, which):
    """Reference: transformers' tokenizer and model, each request alone; ortevals batches and reuses prefixes."""
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    from tests.fixtures.gemma4 import SLIDING_WINDOW, reference_logprobs

    hf_dir, pkg_dir = gemma4 if which == "plain" else windowed
    tok = AutoTokenizer.from_pretrained(hf_dir)
    # check=False: the canary would score these few requests one row each too (tests/test_invariance.py covers it)
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg_dir), batch_size=2, check=False))
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    assert len(hf_pair(tok, *PAIRS[2])[0]) > 2 * SLIDING_WINDOW
    for (ctx, cont), (lp, greedy) in zip(PAIRS, got):
        c, w = hf_pair(tok, ctx, cont)
        assert (c, w) == lm._encode_pair(ctx, cont)  # the same token ids as transformers' tokenizer
        ref = reference_logprobs(hf_dir, [(c + w)[:-1]])[0]
        rows = ref[len(c) - 1:]
        assert lp == pytest.approx(float(sum(rows[j, t] for j, t in enumerate(w))), abs=1e-4)
        assert greedy == all(rows[j].argmax() == t for j, t in enumerate(w))
    if which == "plain":  # the shared context ran once, its KV reused past the window
        fed = sum(len(sum(hf_pair(tok, *p), [])) - 1 for p in PAIRS)
        assert lm.engine.tokens_run < fed - 2 * len(hf_pair(tok, *PAIRS[2])[0])
