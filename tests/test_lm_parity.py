"""The ortevals lm-eval model against lm-eval's own hf backend on the same weights."""

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM

PAIRS = [
    ("The capital of France is", " paris"),
    ("The capital of France is", " berlin"),
    ("The capital of France is", " rome."),
    ("Question: one two three. Answer:", " B"),
    ("Question: one two three. Answer:", " C"),
    ("", "The river of the city"),  # empty context: the prefix token conditions
    ("Nine ten ", "eleven twelve"),  # trailing space moves into the continuation
]
DOCS = ["The mountain of the city is a number. " * 3, "Paris france berlin germany rome italy " * 40]


def instances(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


@pytest.fixture(scope="module")
def hflm(tiny):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=128)


@pytest.fixture(scope="module")
def ortlm(tiny):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=128, batch_size=1))


def test_tokenization_matches_hf(hflm, ortlm):
    for ctx, cont in PAIRS:
        assert ortlm.tok_encode(ctx + cont) == hflm.tok_encode(ctx + cont)
    assert ortlm.prefix_token_id == hflm.prefix_token_id
    assert ortlm.eot_token_id == hflm.eot_token_id


def test_loglikelihood_equals_hf_backend(hflm, ortlm):
    ours = ortlm.loglikelihood(instances("loglikelihood", PAIRS))
    ref = hflm.loglikelihood(instances("loglikelihood", PAIRS))
    for (lp, greedy), (rlp, rgreedy) in zip(ours, ref):
        assert abs(lp - rlp) <= 1e-4
        assert greedy == rgreedy
    assert len({round(lp, 3) for lp, _ in ours}) == len(PAIRS)  # the model is not uniform


def test_rolling_loglikelihood_equals_hf_backend(hflm, ortlm):
    ours = ortlm.loglikelihood_rolling(instances("loglikelihood_rolling", [(d,) for d in DOCS]))
    ref = hflm.loglikelihood_rolling(instances("loglikelihood_rolling", [(d,) for d in DOCS]))
    # the second document is longer than max_length=128: several rolling windows
    assert len(ortlm.tok_encode(DOCS[1])) > 128
    np.testing.assert_allclose(ours, ref, atol=1e-4 * len(ortlm.tok_encode(DOCS[1])) ** 0.5)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_batched_and_grouped_equal_unbatched(tiny, ortlm, batch_size):
    batched = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=128, batch_size=batch_size))
    reqs = instances("loglikelihood", PAIRS)
    one = ortlm.loglikelihood(reqs)
    many = batched.loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(one, many):
        assert abs(a - b) <= 1e-5 and ga == gb


def test_ungrouped_equals_grouped(tiny, ortlm):
    from dataclasses import replace

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=128, batch_size=1))
    lm.engine.settings = replace(lm.engine.settings, group_by_context=False)
    reqs = instances("loglikelihood", PAIRS)
    ortlm.loglikelihood(reqs)  # the invariance canary runs before the first batched run: not counted below
    passes_before = ortlm.engine.forward_passes
    grouped = ortlm.loglikelihood(reqs)
    # paris/berlin share the context; " B"/" C" are [space, letter] so their inputs
    # (context + space) are identical too: 7 requests, 5 distinct inputs
    assert ortlm.engine.forward_passes - passes_before == 5
    for (a, _), (b, _) in zip(grouped, lm.loglikelihood(reqs)):
        assert abs(a - b) <= 1e-5


def test_cache_hook_receives_every_answer(ortlm):
    class Hook:
        def __init__(self):
            self.calls = []

        def add_partial(self, attr, req, res):
            self.calls.append((attr, req, res))

    hook = Hook()
    ortlm.set_cache_hook(hook)
    try:
        res = ortlm.loglikelihood(instances("loglikelihood", PAIRS[:3]))
    finally:
        from lm_eval.api.model import CacheHook

        ortlm.set_cache_hook(CacheHook(None))
    assert [c[0] for c in hook.calls] == ["loglikelihood"] * 3
    assert sorted(c[2] for c in hook.calls) == sorted(res)


def test_io_binding_and_prefix_reuse_equal_plain_runs(tiny):
    """Long shared contexts: prefix KV reused (and kept as OrtValues under IOBinding) changes nothing."""
    from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.sessions import DecoderRunner

    pkg = ModelPackage.load(tiny[1])
    rng = np.random.default_rng(5)
    header = tuple(int(t) for t in rng.integers(3, 500, 120))
    reqs = [TokenRequest(header + tuple(int(t) for t in rng.integers(3, 500, 10 + q)), (int(c),))
            for q in range(4) for c in rng.integers(3, 500, 3)]
    scores = {}
    for name, bind, prefix in (("plain", False, False), ("reuse", False, True), ("bound", True, True)):
        runner = DecoderRunner.open(pkg, from_package({}), io_binding=bind)
        engine = PrefillEngine(runner, EngineSettings(max_length=512, vocab_size=512, batch_size=1,
                                                      prefix_cache=prefix, check=False))  # count reuse alone
        scores[name] = [s.logprob for s in engine.score(reqs)]
        if prefix:
            assert engine.tokens_run < 4 * 120  # the header ran once
    np.testing.assert_allclose(scores["reuse"], scores["plain"], atol=1e-4)
    np.testing.assert_allclose(scores["bound"], scores["plain"], atol=1e-4)


def test_each_text_is_tokenized_once_and_the_ids_are_the_tokenizers(tiny):
    """lm-eval's ``_encode_pair`` encodes a multiple-choice context once per choice; the run keeps the ids of
    its last texts, so each distinct text reaches the tokenizer once, with the ids HF ``tokenizers`` gives."""
    from tokenizers import Tokenizer

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=128, batch_size=1))
    calls, encode, encode_many = [], lm.run.tokenizer.encode, lm.run.tokenizer.encode_many

    def counted(text, add_special_tokens=None):
        calls.append(text)
        return encode(text, add_special_tokens)

    def counted_many(texts, add_special_tokens=None):
        calls.extend(texts)
        return encode_many(texts, add_special_tokens)

    lm.run.tokenizer.encode, lm.run.tokenizer.encode_many = counted, counted_many
    choices = [("Question: one two three. Answer:", f" {c}") for c in "ABCDEFGHIJ"]
    lm.loglikelihood(instances("loglikelihood", choices), disable_tqdm=True)
    assert sorted(calls) == sorted({*(c + x for c, x in choices), choices[0][0]})  # 11 texts, each once
    ref = Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))
    for text in {*calls, "Nine ten eleven"}:
        assert lm.tok_encode(text) == ref.encode(text).ids
    ids = lm.tok_encode(choices[0][0])
    ids.append(-1)  # a caller's change to its list is not remembered
    assert lm.tok_encode(choices[0][0]) == ref.encode(choices[0][0]).ids
