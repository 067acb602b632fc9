"""The shared-prompt sampling engine (engine/generate/rows/sampler.py, issue 14 §1-2): K rows of one prompt decoded
together give each sample exactly what it gives alone; greedy equals the og path and transformers;
per-row stops; prefix reuse; lm-eval ``repeats`` grouping; the store reuses the first K samples."""

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.generate.choice.settings import parse_gen_kwargs
from ortevals.engine.generate.rows.sampler import SharedPromptSampler, plan_jobs
from ortevals.integrations.lm import ModelArgs, OrtLM

PROMPT = "Question: what is the river of the city? Answer: the river"
SAMPLED = {"until": [], "max_gen_toks": 16, "do_sample": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def raw(tiny_pkg):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw"))


@pytest.fixture(scope="module")
def og(tiny_pkg):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="og"))


def repeats(prompts, kwargs, k):
    """What lm-eval hands the model for ``repeats: k``: each doc's request k times in a row."""
    return [Instance("generate_until", {}, (p, dict(kwargs)), d, repeats=k) for d, p in enumerate(prompts)
            for _ in range(k)]


def sampler(lm, kv: str = "auto", **kw) -> SharedPromptSampler:
    """A fresh sampler on lm's runner; kv: auto (in place where checked), or copy (a new cache per pass)."""
    from ortevals.engine.generate.rows.kv import CopyKV

    base = lm.run.generation.sampler()
    s = SharedPromptSampler(base.runner, lm.tokenizer, base.eos_ids, **kw)
    if kv == "copy":
        s._kv_rows = CopyKV(base.runner)
    return s


def rows(s: SharedPromptSampler, lm, prompt: str, kwargs: dict, seeds: list[int]):
    """The rows of one prompt decoded together, row r drawing from seeds[r] (a seed, or a Generator)."""
    settings = parse_gen_kwargs(kwargs, 16, lm.tok_decode([lm.eot_token_id]))
    logits, past = s.prompt(tuple(lm.tok_encode(prompt)), settings.max_gen_toks)
    rngs = [x if isinstance(x, np.random.Generator) else np.random.default_rng(x) for x in seeds]
    return s.decode(logits, past, settings, rngs, ["r"] * len(seeds))


def oracle_logprob(lm, prompt: str, ids) -> float:
    """Sum of log p(ids | prompt) from one full pass without past (no KV reuse, no replication)."""
    from scipy.special import log_softmax

    ctx = lm.tok_encode(prompt)
    seq = np.asarray([ctx + list(ids)], dtype=np.int64)
    logits, _ = lm.run.generation.sampler().runner.forward(seq, np.ones_like(seq))
    lp = log_softmax(logits[0, len(ctx) - 1:-1].astype(np.float64), axis=-1)
    return float(lp[np.arange(len(ids)), ids].sum())


@pytest.mark.parametrize("kv", ["auto", "copy"])
def test_k_rows_equal_each_sample_run_alone(raw, kv):
    s = sampler(raw, kv)
    assert s.kv_rows.name == ("in-place" if kv == "auto" else "copy")  # the builder's GQA shares the buffer
    together = rows(s, raw, PROMPT, SAMPLED, [11, 12, 13, 14])
    alone = [rows(sampler(raw, other), raw, PROMPT, SAMPLED, [seed])[0] for seed in (11, 12, 13, 14)
             for other in ("auto", "copy")]
    assert [t.ids for t in together] * 1 == [a.ids for a in alone][::2] == [a.ids for a in alone][1::2]
    assert len({t.ids for t in together}) == 4 and all(len(t.ids) == 16 for t in together)  # really sampled
    for t in together:  # the model's own log-prob of each sample, against a pass without KV
        assert abs(t.logprob - oracle_logprob(raw, PROMPT, t.ids)) < 1e-3


def test_repeats_sample_as_the_og_path_does(raw, og):
    """Sample j of a request (occurrence j) draws what og's single-row Generator draws for it: the
    seed is (seed, request, sample index), so the K rows beside it change nothing."""
    prompts = [PROMPT, "The capital of France is"]
    reqs = repeats(prompts, SAMPLED, 4)
    ours = raw.generate_until(reqs, disable_tqdm=True)
    assert ours == og.generate_until(reqs, disable_tqdm=True)
    assert len(ours) == 8 and len(set(ours[:4])) == 4
    # interleaved: results follow the requests' order, sample index = occurrence order
    mixed = [reqs[i] for i in (4, 0, 5, 1, 2, 6, 3, 7)]
    assert raw.generate_until(mixed, disable_tqdm=True) == [ours[i] for i in (4, 0, 5, 1, 2, 6, 3, 7)]


def test_greedy_raw_equals_greedy_og_and_transformers(raw, og, tiny):
    from lm_eval.models.huggingface import HFLM

    prompts = [PROMPT, "The capital of France is", "one"]
    kwargs = {"until": [], "max_gen_toks": 20, "do_sample": False}
    reqs = repeats(prompts, kwargs, 2)
    ours = raw.generate_until(reqs, disable_tqdm=True)
    assert ours == og.generate_until(reqs, disable_tqdm=True)
    hf = HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)
    assert ours[::2] == hf.generate_until(repeats(prompts, kwargs, 1), disable_tqdm=True)
    assert ours[::2] == ours[1::2]


def test_each_row_stops_on_its_own(raw, og):
    from ortevals.engine.generate.og.loops import generate

    seeds = [21, 22, 23, 24]
    free = rows(sampler(raw), raw, PROMPT, SAMPLED, seeds)
    stop = free[0].text[len(free[0].text) // 3:][:2]  # row 0 stops early; the others run on
    cut = {**SAMPLED, "until": [stop]}
    s = sampler(raw)
    ours = rows(s, raw, PROMPT, cut, seeds)
    assert ours[0].text == free[0].text[:free[0].text.index(stop)] and ours[0].tokens < 16
    assert [o.text for o in ours] == [f.text[:f.text.index(stop)] if stop in f.text else f.text for f in free]
    assert sum(o.tokens == 16 for o in ours) >= 1  # at least one row ran to max_gen_toks
    # each row alone on onnxruntime-genai (a cursor, one row) with the same generator
    settings = parse_gen_kwargs(cut, 16, raw.tok_decode([raw.eot_token_id]))
    cursor = og.backends.genai.cursor(64)
    ids = raw.tok_encode(PROMPT)
    alone = [generate(cursor, og.tokenizer, ids, settings, s.eos_ids, np.random.default_rng(x)) for x in seeds]
    assert [(o.text, o.tokens) for o in ours] == alone
    # a finished row leaves the batch: every decode pass ran only rows still going (the first token of
    # each row comes from the prompt pass)
    assert s.stats["row_steps"] == sum(o.tokens - 1 for o in ours) < 4 * 15


def test_prefix_reuse_gives_the_same_tokens(raw):
    header = "Question: one two three. Answer: four five six seven eight nine ten.\n\n"
    prompts = [header + "Question: the city of Paris? Answer:", header + "Question: the river Seine? Answer:"]
    got = {}
    for cache in (True, False):
        s = sampler(raw, prefix_cache=cache)  # in place: the prefix is copied into the next prompt's buffer
        got[cache] = [tuple(r.ids for r in rows(s, raw, p, SAMPLED, [1, 2, 3])) for p in prompts]
        assert (s.stats["reused_tokens"] > 16) == cache
    assert got[True] == got[False]


def test_plan_groups_identical_requests_in_occurrence_order():
    a, b = parse_gen_kwargs({"until": []}, 8), parse_gen_kwargs({"until": ["x"]}, 8)
    jobs = plan_jobs([([5, 6], a), ([5, 6], b), ([5, 6], a), ([1], a), ([5, 6], a)])
    assert [(j.prompt, j.members) for j in jobs] == [((1,), (3,)), ((5, 6), (0, 2, 4)), ((5, 6), (1,))]


def test_store_reuses_the_first_k_samples_when_k_grows(tiny_pkg, tmp_path):
    store = str(tmp_path / "s.sqlite")

    def run(k, store=store):
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, store=store))
        out = lm.generate_until(repeats([PROMPT], SAMPLED, k), disable_tqdm=True)
        return out, lm

    two, _ = run(2)
    four, lm = run(4)
    assert lm.stats["reused"] == 2 and four[:2] == two
    assert four == run(4, store=None)[0]  # the new samples are those a fresh K=4 run draws
    assert lm.store.get("generate_until/logprob", [PROMPT, SAMPLED, 3])[1] == 16  # best-of-k's input kept


def test_beam_search_on_the_raw_runner_equals_transformers(raw, tiny):
    """RawStepModel (prompt KV replicated, rows reordered by parents on the runner) under
    engine/generate/search/beam.py gives transformers' generate(num_beams=4) tokens; generate_until routes it."""
    from transformers import AutoModelForCausalLM

    from ortevals.engine.generate.rows.sampler import RawStepModel
    from ortevals.engine.generate.search.beam import beam_search
    from tests.test_search import hf_beams

    model = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype="float32").eval()
    prompt = raw.tok_encode(PROMPT)
    eos = raw.eot_token_id
    settings = parse_gen_kwargs({"num_beams": 4, "max_gen_toks": 12, "until": []}, 12)
    found = beam_search(RawStepModel(raw.run.generation.sampler().runner), prompt, settings, {eos})
    assert list(found.best.tokens) == hf_beams(model, prompt, eos, num_beams=4, max_new_tokens=12)
    [text] = raw.generate_until(repeats([PROMPT], {"num_beams": 4, "max_gen_toks": 12, "until": []}, 1),
                                disable_tqdm=True)
    assert text == raw.tok_decode([t for t in found.best.tokens if t != eos], skip_special_tokens=True)


def test_mbr_returns_the_candidate_closest_to_the_others(raw):
    """mbr_samples=4: the answer is one of the 4 candidates (the same seeds decoded as plain samples),
    the one engine/generate/search/mbr.py picks from them."""
    from ortevals.engine.generate.choice.seeds import sample_rng
    from ortevals.engine.generate.search.mbr import mbr_select

    kwargs = {**SAMPLED, "mbr_samples": 4, "mbr_metric": "chrf"}
    [text] = raw.generate_until(repeats([PROMPT], kwargs, 1), disable_tqdm=True)
    seed = parse_gen_kwargs(kwargs, 16).seed
    key = [PROMPT, kwargs, 0]
    cands = rows(sampler(raw), raw, PROMPT, SAMPLED,
                 [sample_rng(seed, key, j) for j in range(4)])
    texts = [c.text for c in cands]
    assert len(set(texts)) == 4 and text == texts[mbr_select(texts, "chrf").index]


@pytest.mark.slow
def test_smollm2_greedy_raw_equals_og_and_rows_equal_alone(smollm2):
    pkg = str(smollm2[1])
    prompts = ["The capital of France is a city that", "The three primary colors are"]
    kwargs = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
    raw = OrtLM.from_package(ModelArgs(pkg=pkg, gen_path="raw"))
    og = OrtLM.from_package(ModelArgs(pkg=pkg, gen_path="og"))
    greedy = raw.generate_until(repeats(prompts, kwargs, 1), disable_tqdm=True)
    assert greedy == og.generate_until(repeats(prompts, kwargs, 1), disable_tqdm=True)
    assert all(len(g) > 20 for g in greedy)
    seeds = [1, 2, 3, 4]
    sampled = {**kwargs, "do_sample": True, "temperature": 0.7}
    together = rows(sampler(raw), raw, prompts[1], sampled, seeds)
    assert [t.ids for t in together] == [rows(sampler(raw), raw, prompts[1], sampled, [x])[0].ids for x in seeds]


def test_packages_without_full_logits_generate_on_og(fixture_cache, caplog):
    """auto goes to og (and says so); gen_path=raw is a one-line error naming why."""
    from ortevals.errors import OrtEvalsError
    from tests.fixtures.tiny import build_tiny_pruned

    pkg = str(build_tiny_pruned(fixture_cache))
    with caplog.at_level("INFO", logger="ortevals"):
        [text] = OrtLM.from_package(ModelArgs(pkg=pkg, max_length=256)).generate_until(
            repeats([PROMPT], SAMPLED, 1), disable_tqdm=True)
    assert text and "generate_until goes to the onnxruntime-genai path (the LM head is pruned" in caplog.text
    with pytest.raises(OrtEvalsError, match=r"^gen_path=raw is impossible for this package: the LM head is pruned"):
        OrtLM.from_package(ModelArgs(pkg=pkg, max_length=256, gen_path="raw")).generate_until(
            repeats([PROMPT], SAMPLED, 1), disable_tqdm=True)


def raw_ort_logprobs(pkg, ids: list[int]) -> np.ndarray:
    """log softmax of every position's logits ``[len(ids), V]`` from a plain onnxruntime session on the
    package's decoder (one pass, empty past): the oracle, no ortevals code."""
    import json

    import onnxruntime as ort

    dec = json.loads((pkg / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in (i for i in sess.get_inputs() if i.name.startswith("past_key_values")):
        feeds[i.name] = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
    logits = sess.run(["logits"], feeds)[0][0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("after", [0, 3])
def test_a_sample_ended_by_eos_has_the_eos_log_prob_in_its_sum(raw, tiny_pkg, after):
    """best-of-k scores the whole sequence: a row that ends on EOS after `after` tokens (0: at once) has
    log p(tokens) + log p(EOS) (it was 0 for an immediate EOS, which then beat every real answer), checked
    against a plain onnxruntime pass; the scored tokens count the EOS."""
    prompt = raw.tok_encode(PROMPT)
    greedy = rows(sampler(raw), raw, PROMPT, {"until": [], "max_gen_toks": 8, "do_sample": False}, [0])[0]
    eos = greedy.ids[after]  # make the greedy token at this step the EOS: the row ends there
    assert eos not in greedy.ids[:after]
    s = SharedPromptSampler(raw.run.generation.sampler().runner, raw.tokenizer, {eos})
    settings = parse_gen_kwargs({"until": [], "max_gen_toks": 8, "do_sample": False}, 8)
    logits, past = s.prompt(tuple(prompt), settings.max_gen_toks)
    [got] = s.decode(logits, past, settings, [np.random.default_rng(0)], ["r"], prompt)
    assert (got.ids, got.tokens, got.eos, got.scored) == (greedy.ids[:after], after, True, after + 1)
    seq = [*prompt, *greedy.ids[:after + 1]]  # the generated tokens and the EOS
    logp = raw_ort_logprobs(tiny_pkg, seq[:-1])
    oracle = sum(logp[len(prompt) - 1 + t, seq[len(prompt) + t]] for t in range(after + 1))
    assert got.logprob == pytest.approx(oracle, abs=1e-4) and got.logprob < -1e-3


def test_each_sample_carries_its_self_certainty(raw, tiny_pkg):
    """Issue 25: the sampler's running self-certainty of each row (K rows decoded together, rows ending
    at different steps) equals the mean over the row's chosen tokens of KL(U || p_t) from a plain
    onnxruntime pass (scipy's entropy against the uniform, no ortevals code), the ending EOS included."""
    from scipy.stats import entropy

    prompt = raw.tok_encode(PROMPT)
    eos = rows(sampler(raw), raw, PROMPT, {"until": [], "max_gen_toks": 8, "do_sample": False}, [0])[0].ids[2]
    s = SharedPromptSampler(raw.run.generation.sampler().runner, raw.tokenizer, {eos})
    settings = parse_gen_kwargs(SAMPLED, 16)
    logits, past = s.prompt(tuple(prompt), settings.max_gen_toks)
    got = s.decode(logits, past, settings, [np.random.default_rng(i) for i in range(6)], ["r"] * 6, prompt)
    assert len({g.tokens for g in got}) > 1  # rows left the batch at different steps
    for g in got:
        seq = [*prompt, *g.ids, *([eos] if g.eos else [])]
        logp = raw_ort_logprobs(tiny_pkg, seq[:-1])[len(prompt) - 1:]
        uniform = np.full(logp.shape[1], 1.0 / logp.shape[1])
        oracle = np.mean([entropy(uniform, np.exp(row)) for row in logp])
        assert len(logp) == g.scored and g.certainty == pytest.approx(oracle, rel=1e-6, abs=1e-6)


def test_og_path_keeps_each_samples_self_certainty(raw, tiny_pkg):
    """Issue 25: on onnxruntime-genai's path (the rewinding cursor for samples, batched Generators for greedy
    requests) each request's self-certainty comes from og's logits at each drawn token; the same tokens as the
    raw path (same seeds), so the same values as the raw sampler's (checked against scipy above)."""
    og4 = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="og", gen_batch_size=4))
    reqs = repeats([PROMPT, "one two three"], SAMPLED, 3)
    reqs += repeats(["seven eight", "nine ten eleven"], {"until": [], "max_gen_toks": 8}, 1)  # greedy: batched
    fresh = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw"))
    assert og4.generate_until(reqs, disable_tqdm=True) == fresh.generate_until(reqs, disable_tqdm=True)
    assert og4.stats["gen_path"] == "og" and len(og4.sample_certainty) == len(reqs)
    assert og4.sample_certainty.keys() == fresh.sample_certainty.keys()
    for key, value in fresh.sample_certainty.items():
        assert og4.sample_certainty[key] == pytest.approx(value, rel=1e-5), key
