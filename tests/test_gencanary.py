"""Generation is checked for batch and prefix independence (issue 22, item 5).

The references run each prompt alone with no ortevals code: raw onnxruntime (one row: the prompt in
one pass, then one token per pass) for the log-prob of the tokens a sample drew, and
onnxruntime-genai's own Generator (a fresh one per prompt, the whole prompt appended, argmax) for
greedy text. The dynamic-quantization fixture's numbers really depend on the pass: decoded with its
rows batched or on a reused prefix they move; the tiny fp32 package's do not.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.generate import canary as gencanary
from ortevals.engine.generate.canary import raw_plan
from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.rows.sampler import SharedPromptSampler, run_sampling
from ortevals.engine.score import invariance
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.tokenizer import Tokenizer
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner
from tests.fixtures.dynquant import build_dynquant, build_shape_dependent
from tests.fixtures.tiny import WORDS

rng = random.Random(11)
HEADER = " ".join(rng.choice(WORDS) for _ in range(30))
PROMPTS = [f"{HEADER} q{i} " + " ".join(rng.choice(WORDS) for _ in range(3 + i)) for i in range(4)] \
    + [" ".join(rng.choice(WORDS) for _ in range(5 + i)) for i in range(4)]
SAMPLED = GenSettings(until=(), max_gen_toks=8, do_sample=True, temperature=1.0)


@pytest.fixture(scope="module")
def dynquant(tiny_pkg, fixture_cache):
    return build_dynquant(tiny_pkg, fixture_cache)


@pytest.fixture(scope="module")
def shape_dependent(tiny_pkg, tmp_path_factory):
    return build_shape_dependent(tiny_pkg, tmp_path_factory.mktemp("shapedep") / "tiny-shapedep")


@pytest.fixture()
def undetected(monkeypatch):
    """Graph detection finds nothing: the canary is the only guard (a graph detection does not foresee)."""
    monkeypatch.setattr(invariance, "detect", lambda *a, **k: invariance.BatchDependence())


def alone_logprob(pkg, prompt: list[int], drawn: tuple[int, ...]) -> float:
    """Raw onnxruntime, one row: the prompt in one pass, then one token per pass; the summed log-softmax
    of the drawn tokens."""
    import onnxruntime as ort

    dec = json.loads((pkg / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    past = {n: np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32) for n in names}
    ids, total = list(prompt), 0.0
    for token in drawn:
        length = next(iter(past.values())).shape[2] + len(ids)
        outs = sess.run(None, {"input_ids": np.array([ids], np.int64),
                               "attention_mask": np.ones((1, length), np.int64), **past})
        logits = outs[0][0, -1].astype(np.float64)
        total += logits[token] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        past = {n: v for n, v in zip(names, outs[1:])}
        ids = [token]
    return total


def raw_samples(pkg, check: bool) -> tuple[str, dict, SharedPromptSampler, list]:
    """K=4 sampled rows of each prompt on the raw path (no derived graph), with or without the canary."""
    package = ModelPackage.load(pkg)
    tokenizer = Tokenizer.load(package)
    sampler = SharedPromptSampler(DecoderRunner.open(package, from_package({})), tokenizer, {2})
    items = [(tokenizer.encode(p), SAMPLED) for p in PROMPTS for _ in range(4)]
    keys = [[PROMPTS[i // 4], "sampled", i % 4] for i in range(len(items))]
    name = lambda i: f"request {i}"  # noqa: E731
    mode = raw_plan(sampler, items, keys, name, "float32", True) if check else ""
    samples: dict = {}
    run_sampling(sampler, items, keys, samples.__setitem__, name)
    return mode, samples, sampler, items


def test_raw_rows_of_a_batch_dependent_graph_fall_back_to_one_row(dynquant):
    mode, samples, sampler, items = raw_samples(dynquant, check=True)
    assert mode.startswith("generate_until: one row per pass, no prefix reuse (canary: request ")
    assert sampler.exact and not sampler.prefix_cache
    got = np.array([samples[i].logprob for i in range(len(items))])
    ref = np.array([alone_logprob(dynquant, items[i][0], samples[i].ids) for i in range(len(items))])
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_raw_rows_of_an_invariant_graph_stay_batched(tiny_pkg):
    mode, samples, sampler, items = raw_samples(tiny_pkg, check=True)
    assert mode.startswith("generate_until: rows batched, prefix reuse (canary passed on ")
    assert not sampler.exact and sampler.stats["reused_tokens"] > 0 and sampler.stats["decode_passes"] < 8 * 8
    got = np.array([samples[i].logprob for i in range(len(items))])
    ref = np.array([alone_logprob(tiny_pkg, items[i][0], samples[i].ids) for i in range(len(items))])
    np.testing.assert_allclose(got, ref, atol=1e-4)


def og_alone(lm: OrtLM, prompts: list[str], max_new: int) -> list[str]:
    """onnxruntime-genai's own API: a fresh Generator per prompt, the whole prompt appended, argmax."""
    og = lm.backends.genai.og
    out = []
    for p in prompts:
        ids = lm.tok_encode(p)
        params = og.GeneratorParams(lm.backends.genai.model)
        params.set_search_options(max_length=len(ids) + max_new + 1, batch_size=1)
        gen = og.Generator(lm.backends.genai.model, params)
        gen.append_tokens(np.array([ids], np.int32))
        toks = []
        for _ in range(max_new):
            toks.append(int(np.argmax(np.asarray(gen.get_logits())[0, -1])))
            if toks[-1] in lm.package.eos_token_ids:
                break
            gen.append_tokens(np.array([[toks[-1]]], np.int32))
        out.append(lm.tok_decode(toks, skip_special_tokens=True))
    return out


def og_greedy(pkg, **kw) -> tuple[list[str], list[str], OrtLM]:
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), gen_path="og", **kw))
    gen = {"until": [], "max_gen_toks": 16}
    got = lm.generate_until([Instance("generate_until", {}, (p, gen), i) for i, p in enumerate(PROMPTS)],
                            disable_tqdm=True)
    return got, og_alone(lm, PROMPTS, 16), lm


@pytest.mark.parametrize("width", [1, 4])
def test_og_path_honours_detected_exact_mode(dynquant, width):
    """Detected dynamic quantization: one Generator per prompt, no rewind, no batch (before: 4 of 8 texts
    differed from alone with the rewinding cursor, 5 of 8 with gen_batch_size=4)."""
    got, ref, lm = og_greedy(dynquant, gen_batch_size=width)
    assert got == ref
    assert lm.stats["mode"] == "generate_until: one row per pass, no prefix reuse (exact mode)"


def test_og_batch_canary_trips_on_a_graph_detection_misses(shape_dependent):
    got, ref, lm = og_greedy(shape_dependent, gen_batch_size=4)
    assert got == ref
    assert lm.stats["mode"].startswith("generate_until: one row per pass, no prefix reuse (canary: ")


def test_og_canary_passes_on_an_invariant_graph(tiny_pkg):
    got, ref, lm = og_greedy(tiny_pkg, gen_batch_size=4)
    assert got == ref
    assert lm.stats["mode"].startswith("generate_until: 4 rows per Generator, prefix reuse (canary passed on ")


def test_the_run_says_it_fell_back_and_a_stored_verdict_is_reused(dynquant, undetected, tmp_path, monkeypatch):
    """Through OrtLM with a store: the mode says so, and a second run (other prompts) pays no canary."""
    calls = []
    real = gencanary._run_raw
    monkeypatch.setattr(gencanary, "_run_raw", lambda *a: calls.append(1) or real(*a))
    gen = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0}

    def run(prompts):
        lm = OrtLM.from_package(ModelArgs(pkg=str(dynquant), store=str(tmp_path / "s.sqlite")))
        lm.generate_until([Instance("generate_until", {}, (p, gen), i) for i, p in enumerate(prompts)
                           for _ in range(3)], disable_tqdm=True)
        lm.store.close()
        return lm

    first = run(PROMPTS[:4])
    assert "one row per pass, no prefix reuse (canary: " in first.stats["mode"] and calls == [1]
    second = run(PROMPTS[4:])
    assert second.stats["mode"].endswith("stored verdict reused") and calls == [1]
    assert second.run.generation._sampler.exact
