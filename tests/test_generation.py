"""generate_until and the incremental path: pure decoding rules, then against lm-eval's hf backend."""

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError
from ortevals.generation import GenSettings, choose_token, first_stop, parse_gen_kwargs
from ortevals.lm import ModelArgs, OrtLM


def test_gen_kwargs_aliases_and_defaults():
    s = parse_gen_kwargs({"until": "Question:", "max_new_tokens": 7}, 256, "</s>")
    assert s.until == ("Question:", "</s>") and s.max_gen_toks == 7 and not s.do_sample
    s = parse_gen_kwargs({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, 256)
    assert (s.do_sample, s.temperature, s.top_p, s.top_k) == (True, 0.7, 0.9, 5)
    assert not parse_gen_kwargs({"temperature": 0.0}, 256).do_sample
    with pytest.raises(OrtEvalsError, match="unknown gen_kwargs"):
        parse_gen_kwargs({"frobnicate": 1}, 256)
    with pytest.raises(OrtEvalsError, match="num_beams"):
        parse_gen_kwargs({"num_beams": 4}, 256)


def test_choose_token_rules():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert choose_token(logits, GenSettings(), rng) == 0
    top1 = GenSettings(do_sample=True, top_k=1)
    assert {choose_token(logits, top1, rng) for _ in range(50)} == {0}
    nucleus = GenSettings(do_sample=True, top_p=0.7)  # 0.5 + 0.3 reach 0.7: tokens 0 and 1 only
    assert {choose_token(logits, nucleus, rng) for _ in range(200)} == {0, 1}
    free = GenSettings(do_sample=True)
    draws = [choose_token(logits, free, np.random.default_rng(s)) for s in range(400)]
    assert abs(draws.count(0) / 400 - 0.5) < 0.08
    a = [choose_token(logits, free, np.random.default_rng(7)) for _ in range(5)]
    assert a == [choose_token(logits, free, np.random.default_rng(7)) for _ in range(5)]


def test_first_stop():
    assert first_stop("abc Question: x", ["Question:", "x"]) == 4
    assert first_stop("abc", ["Q"]) is None


PROMPTS = ["The capital of France is", "Question: one two three. Answer:", "Paris france berlin germany"]


@pytest.fixture(scope="module")
def hflm(tiny):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)


@pytest.fixture(scope="module")
def ortlm(tiny):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256))


def gen(lm, prompts, kwargs):
    return lm.generate_until([Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)],
                             disable_tqdm=True)


def test_greedy_generation_equals_hf_backend(hflm, ortlm):
    kwargs = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
    ours = gen(ortlm, PROMPTS, kwargs)
    assert ours == gen(hflm, PROMPTS, kwargs)
    assert all(len(o) > 10 for o in ours)


def test_batched_greedy_generation_equals_hf_backend(hflm, tiny):
    """Rows of different lengths in one batched Generator (right-padded), each stopping on its own."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256, gen_batch_size=4))
    prompts = PROMPTS + ["one", "Question: what is the river of the city? Answer: the river"]
    free = gen(lm, prompts, {"until": [], "max_gen_toks": 20})
    assert free == gen(hflm, prompts, {"until": [], "max_gen_toks": 20})
    assert lm.backends.genai.generators_created == 2  # 5 requests in batches of up to 4
    stops = [f[len(f) // 3: len(f) // 3 + 2] for f in free]  # a different stop for every row
    cut = [gen(lm, [p], {"until": [s], "max_gen_toks": 20})[0] for p, s in zip(prompts, stops, strict=True)]
    batched = lm.generate_until([Instance("generate_until", {}, (p, {"until": [s], "max_gen_toks": 20}), i)
                                 for i, (p, s) in enumerate(zip(prompts, stops, strict=True))], disable_tqdm=True)
    assert batched == cut == [f[:f.index(s)] for f, s in zip(free, stops, strict=True)]


def test_stop_sequences_cut_exactly(ortlm):
    free = gen(ortlm, PROMPTS[:1], {"until": [], "max_gen_toks": 24})[0]
    stop = free[len(free) // 2: len(free) // 2 + 3]
    cut = gen(ortlm, PROMPTS[:1], {"until": [stop], "max_gen_toks": 24})[0]
    assert cut == free[:free.index(stop)]
    generated_before = ortlm.stats["generated_tokens"]
    gen(ortlm, PROMPTS[:1], {"until": [free[:2]], "max_gen_toks": 24})
    assert ortlm.stats["generated_tokens"] - generated_before <= 3  # stopped at once, not at max_gen_toks


def test_sampling_is_reproducible_by_seed(tiny):
    kwargs = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 16, "until": []}
    a = gen(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), seed=1)), PROMPTS * 2, kwargs)
    b = gen(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), seed=1)), PROMPTS * 2, kwargs)
    c = gen(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), seed=2)), PROMPTS * 2, kwargs)
    assert a == b and a != c
    assert a[:3] != a[3:]  # repeats of a prompt draw different samples


def test_long_prompts_are_an_error_unless_left_truncation_is_asked_for(tiny):
    long = ["one two three four five " * 40]
    with pytest.raises(OrtEvalsError, match=r"generate_until request 'one two.*needs \d+ tokens but the context is "
                                            r"max_length=64; pass the model arg truncate=left") as err:
        gen(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=64)), long, {"max_gen_toks": 8, "until": []})
    assert "\n" not in str(err.value)
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=64, truncate="left"))
    out = gen(lm, long, {"max_gen_toks": 8, "until": []})
    assert lm.stats["truncated"] == 1 and isinstance(out[0], str)


def test_paths_agree_on_loglikelihood(tiny, ortlm):
    from tests.test_lm_parity import PAIRS

    inc = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256, path="incremental"))
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)]
    for (a, ga), (b, gb) in zip(ortlm.loglikelihood(reqs), inc.loglikelihood(reqs)):
        assert abs(a - b) <= 1e-4 and ga == gb
    assert inc.backends.loglikelihood_path == "incremental"
    # shared contexts were appended once, then rewound to: fewer tokens than one pass per input
    assert inc.engine.tokens_run < sum(len(inc.tok_encode(c + x)) for c, x in PAIRS)


def test_chat_template_renders(smollm2):
    lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2[1])))
    text = lm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_pruned_lm_head_goes_incremental_and_matches(tiny, fixture_cache, ortlm):
    from tests.fixtures.tiny import build_tiny_pruned
    from tests.test_lm_parity import PAIRS

    pruned = OrtLM.from_package(ModelArgs(pkg=str(build_tiny_pruned(fixture_cache)), max_length=256))
    assert pruned.backends.loglikelihood_path == "incremental"
    assert "pruned" in pruned.backends.capability.reason
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)]
    for (a, ga), (b, gb) in zip(ortlm.loglikelihood(reqs), pruned.loglikelihood(reqs)):
        assert abs(a - b) <= 1e-4 and ga == gb
    with pytest.raises(OrtEvalsError, match="path=prefill is impossible"):
        OrtLM.from_package(ModelArgs(pkg=str(build_tiny_pruned(fixture_cache)), path="prefill"))


def test_rewind_is_refused_where_it_is_not_exact(gemma4, fixture_cache):
    from ortevals.package import ModelPackage
    from ortevals.runtime.genai import rewind_is_exact
    from tests.fixtures.gemma4 import build_gemma4

    windowed = ModelPackage.load(build_gemma4(fixture_cache / "gemma4", windowed=True)[1])
    ok, why = rewind_is_exact(windowed)
    assert not ok and "windowed" in why
    ok, why = rewind_is_exact(ModelPackage.load(gemma4[1]))
    assert not ok and "multimodal" in why


class FakeGenerator:
    """Records what a Cursor asks of an og.Generator; logits are the token count."""

    def __init__(self, log):
        self.log, self.n = log, 0

    def append_tokens(self, ids):
        self.n += ids.shape[1]
        self.log.append(("append", ids.shape[1]))

    def rewind_to(self, n):
        self.n = n
        self.log.append(("rewind", n))

    def get_logits(self):
        return np.full((1, 1, 4), float(self.n))


class FakeRunner:
    def __init__(self, rewind_ok):
        self.rewind_ok, self.log, self.created = rewind_ok, [], 0

    def _generator(self, max_length):
        self.created += 1
        return FakeGenerator(self.log)


@pytest.mark.parametrize("rewind_ok", [True, False])
def test_cursor_rewinds_only_where_exact(rewind_ok):
    from ortevals.runtime.genai import Cursor

    runner = FakeRunner(rewind_ok)
    cursor = Cursor(runner, max_length=100)
    header = list(range(50))
    for tail in ([60, 61], [70], [70, 71, 72]):
        logits = cursor.move_to(header + tail)
        assert logits[0] == len(header + tail)  # the generator holds exactly the new sequence
    if rewind_ok:
        assert runner.created == 1 and ("rewind", 50) in runner.log
        assert sum(n for op, n in runner.log if op == "append") == 52 + 1 + 2  # the header ran once
    else:  # windowed / multimodal: a fresh Generator per input, never a rewind
        assert runner.created == 3 and not any(op == "rewind" for op, _ in runner.log)
