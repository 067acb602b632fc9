"""generate_until and the incremental path: pure decoding rules, then against lm-eval's hf backend."""

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.generate.choice.logits import choose_token
from ortevals.engine.generate.choice.settings import GenSettings, parse_gen_kwargs
from ortevals.engine.generate.choice.stops import first_stop
from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM


def test_gen_kwargs_aliases_and_defaults():
    s = parse_gen_kwargs({"until": "Question:", "max_new_tokens": 7}, 256, "</s>")
    assert s.until == ("Question:", "</s>") and s.max_gen_toks == 7 and not s.do_sample
    s = parse_gen_kwargs({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, 256)
    assert (s.do_sample, s.temperature, s.top_p, s.top_k) == (True, 0.7, 0.9, 5)
    assert not parse_gen_kwargs({"temperature": 0.0}, 256).do_sample
    with pytest.raises(OrtEvalsError, match="unknown gen_kwargs"):
        parse_gen_kwargs({"frobnicate": 1}, 256)
    with pytest.raises(OrtEvalsError, match="num_beams"):  # num_beams is supported since SEARCH_POLICY v2
        parse_gen_kwargs({"num_beams": 0}, 256)
    assert parse_gen_kwargs({"num_beams": 4}, 256).num_beams == 4


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
    # check=false: the count below is of the run's own Generators (the generation canary's: test_gencanary.py)
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256, gen_batch_size=4, gen_path="og", check=False))
    prompts = PROMPTS + ["one", "Question: what is the river of the city? Answer: the river"]
    free = gen(lm, prompts, {"until": [], "max_gen_toks": 20})
    assert free == gen(hflm, prompts, {"until": [], "max_gen_toks": 20})
    assert lm.backends.genai.generators_created == 2  # 5 requests in batches of up to 4
    stops = [f[len(f) // 3: len(f) // 3 + 2] for f in free]  # a different stop for every row
    cut = [gen(lm, [p], {"until": [s], "max_gen_toks": 20})[0] for p, s in zip(prompts, stops, strict=True)]
    batched = lm.generate_until([Instance("generate_until", {}, (p, {"until": [s], "max_gen_toks": 20}), i)
                                 for i, (p, s) in enumerate(zip(prompts, stops, strict=True))], disable_tqdm=True)
    assert batched == cut == [f[:f.index(s)] for f, s in zip(free, stops, strict=True)]


def with_search_options(pkg_dir, **options):
    """The package with non-neutral `search` options in its genai_config.json."""
    import json

    cfg_path = pkg_dir / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["search"].update(options)
    cfg_path.write_text(json.dumps(cfg))
    return pkg_dir


NON_NEUTRAL = {"repetition_penalty": 1.5, "min_length": 30, "no_repeat_ngram_size": 2}


def test_package_search_options_never_decide_a_token(hflm, tiny, copy_pkg):
    """SEARCH_POLICY: gen_kwargs alone decide. og's search on the batched path used to apply the
    package's repetition_penalty / min_length / no_repeat_ngram_size, the single-row path not."""
    pkg = with_search_options(copy_pkg(tiny[1]), **NON_NEUTRAL)
    prompts = PROMPTS + ["one", "Question: what is the river of the city? Answer: the river"]
    kwargs = {"until": [], "max_gen_toks": 20}
    batched_lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, gen_batch_size=4, gen_path="og",
                                              check=False))  # the count is of the run's own Generators
    batched = gen(batched_lm, prompts, kwargs)
    assert batched_lm.backends.genai.generators_created == 2  # really batched
    single = gen(OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, gen_path="og")), prompts, kwargs)
    raw = gen(OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, gen_path="raw")), prompts, kwargs)
    plain = gen(OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256, gen_batch_size=4, gen_path="og")),
                prompts, kwargs)
    assert batched == single == raw == plain == gen(hflm, prompts, kwargs)


def test_batched_tokens_are_checked_against_the_logits(tiny, copy_pkg, monkeypatch):
    """The safety net: had og's search kept a package option, the batched run stops, naming the row."""
    import ortevals.runtime.genai as genai

    monkeypatch.setattr(genai, "NEUTRAL_SEARCH", {"do_sample": False})  # og keeps the package's options
    pkg = with_search_options(copy_pkg(tiny[1]), repetition_penalty=1.5)
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, gen_batch_size=4, gen_path="og"))
    with pytest.raises(OrtEvalsError, match=r"search chose token .* for request #\d \(prompt .*gen_batch_size=1"):
        gen(lm, PROMPTS, {"until": [], "max_gen_toks": 20})


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
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.genai import rewind_is_exact
    from tests.fixtures.gemma4 import build_gemma4

    windowed = ModelPackage.load(build_gemma4(fixture_cache / "gemma4", windowed=True)[1])
    ok, why = rewind_is_exact(windowed)
    assert not ok and "windowed" in why
    ok, why = rewind_is_exact(ModelPackage.load(gemma4[1]))
    assert not ok and "multimodal" in why


def fresh_logits(runner, tokens):
    """Logits ``[V]`` after ``tokens`` from a new Generator that ran them all (no rewind)."""
    gen = runner._generator(128)
    gen.append_tokens(np.asarray([tokens], dtype=np.int32))
    return np.asarray(gen.get_logits())[0, -1]


def open_runner(pkg_dir):
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.genai import GenaiRunner
    from ortevals.runtime.providers import from_package

    package = ModelPackage.load(pkg_dir)
    return GenaiRunner.open(package, from_package(package.decoder.session_options))


# a 20-token header, then tails that move the cursor back past the 16-token sliding window
_rng = np.random.default_rng(0)
HEADER = [2] + _rng.integers(10, 500, 19).tolist()
LONG, SHORT = _rng.integers(10, 500, 40).tolist(), _rng.integers(10, 500, 5).tolist()
MOVES = (LONG, SHORT, SHORT[:2], LONG[:30])


def cursor_errors(runner, oracle=None):
    """Drive a real og cursor through MOVES; max |logits - a fresh Generator's| (and the oracle's) per move."""
    cursor = runner.cursor(128)
    errors = []
    for tail in MOVES:
        got = cursor.move_to(HEADER + tail)
        errors.append(float(np.abs(got - fresh_logits(runner, HEADER + tail)).max()))
        if oracle is not None:
            errors.append(float(np.abs(got - oracle(HEADER + tail)[-1]).max()))
    return cursor, errors


def test_cursor_rewinds_only_where_exact(tiny, fixture_cache):
    """Real og rewinds: reused on a text package, refused on a windowed one (where they are wrong)."""
    from tests.fixtures.gemma4 import build_gemma4, ort_logits

    text = open_runner(tiny[1])
    cursor, errors = cursor_errors(text)
    assert text.rewind_ok and max(errors) <= 1e-5
    assert text.generators_created == 1 + len(MOVES)  # one cursor Generator; the rest are the references
    # the header ran once: then only each move's suffix past the common prefix (at least two tokens:
    # package/reuse.py's MIN_PASS_TOKENS, so the move back to SHORT[:2] runs its last two)
    assert cursor.tokens_run == 60 + 5 + 2 + 30

    windowed_dir = build_gemma4(fixture_cache / "gemma4", windowed=True)[1]
    windowed = open_runner(windowed_dir)
    cursor, errors = cursor_errors(windowed, lambda ids: ort_logits(windowed_dir, ids))
    assert not windowed.rewind_ok and max(errors) <= 1e-5
    assert windowed.generators_created == 2 * len(MOVES)  # a fresh Generator per move
    assert cursor.tokens_run == sum(len(HEADER + t) for t in MOVES)

    # the refusal is needed: og's rewind_to past the window IS silently wrong on this package
    windowed.rewind_ok = True
    _, errors = cursor_errors(windowed)
    assert max(errors) > 0.1
