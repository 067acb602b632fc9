"""LoRA adapters (issue 57 item 1): ``--adapter FILE[=NAME]`` active on every scoring and generation path.

The fixture (tests/fixtures/lora.py) is the tiny Llama exported by the onnxruntime-genai builder with a peft LoRA
(``adapter_path=DIR``) and run through Olive's ExtractAdapters: the LoRA weights are optional decoder inputs, the
adapters ``.onnx_adapter`` files. The oracle is transformers + peft on the same checkpoint and adapter (the adapter
active, unmerged): log-likelihoods within 1e-5 on the prefill path (the derived scoring graph, batched and exact;
the shared-prefix graph), on onnxruntime-genai (``path=incremental``), and greedy tokens equal on both generation
paths (raw, its cascade graph, og). Without ``--adapter`` the base model is scored, with a warning.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import OrtLM
from ortevals.options import parse_model_args
from tests.fixtures.lora import build_lora, peft_greedy, peft_logprobs

# a few-shot header shared by every context (> 64 tokens: its KV is computed once and shared by the inputs)
HEADER = ("Question: the capital of italy is which city? Answer: rome.\n\nQuestion: the river of the capital of "
          "france is which river? Answer: the river of paris.\n\nQuestion: one two three four, which number is "
          "next? Answer: five.\n\n")
PAIRS = [(HEADER + c, x) for c, x in [
    ("Question: the capital of France is", " paris"),
    ("Question: the capital of France is", " rome. The river of the city"),
    ("Question: one two three. Answer:", " B"),
    ("Question: one two three. Answer:", " C is the answer, four five six seven"),
    ("Nine ten ", "eleven twelve three four"),
    ("A model of the graph", " layer"),
]]


@pytest.fixture(scope="module")
def lora(fixture_cache):
    return build_lora(fixture_cache)


def open_lm(lora, adapter: int | None = 0, **kw) -> OrtLM:
    args = dict(pkg=str(lora.pkg), max_length=256, store="none", **kw)
    if adapter is not None:
        args["adapter"] = (str(lora.adapters[adapter]),)
    return OrtLM.from_package(parse_model_args(args))


def tolerance(lm: OrtLM) -> np.ndarray:
    """1e-5 a continuation token: float32 sums of several log-probs of tens of nats round by a few 1e-6 each."""
    return 1e-5 * np.array([len(lm._encode_pair(c, x)[1]) for c, x in PAIRS])


def oracle(lora, lm: OrtLM, peft_dir) -> list[float]:
    """transformers (+ peft) log-likelihood of each pair's continuation, on the ids ortevals tokenized."""
    out = []
    for context, continuation in PAIRS:
        ctx, cont = lm._encode_pair(context, continuation)
        ids = list(ctx) + list(cont)
        logp = peft_logprobs(lora.hf_dir, peft_dir, [ids])[0]
        out.append(float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))))
    return out


def scores(lm: OrtLM) -> np.ndarray:
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    return np.array([lp for lp, _ in got])


@pytest.mark.parametrize("kw", [dict(path="prefill"), dict(path="prefill", exact=True),
                                dict(path="prefill", shared_prefix_batch="on"), dict(path="incremental")],
                         ids=["prefill", "exact", "shared-prefix", "incremental"])
def test_an_adapter_scores_as_transformers_and_peft(lora, kw, monkeypatch):
    from ortevals.runtime.prefix_runner import PrefixRunner

    passes = []
    score = PrefixRunner.score
    monkeypatch.setattr(PrefixRunner, "score", lambda self, *a: passes.append(1) or score(self, *a))
    lm = open_lm(lora, **kw)
    got = scores(lm)
    want = np.array(oracle(lora, lm, lora.peft_dirs[0]))
    base = np.array(oracle(lora, lm, None))
    assert np.abs(want - base).max() > 1.0  # the adapter moves the numbers: nats, not rounding
    assert (np.abs(got - want) <= tolerance(lm)).all(), (got, want)
    # the shared-prefix graph served the inputs on a shared context, carrying the adapter's inputs; batched passes
    # agree with one row a pass (the canary: a path without the adapter would fail it and fall back to exact)
    assert bool(passes) == (kw.get("shared_prefix_batch") == "on")
    mode = lm.run.stats["mode"]
    assert mode.startswith("exact") == bool(kw.get("exact")) and "canary failed" not in mode, mode


def test_the_second_adapter_is_its_own(lora):
    lm = open_lm(lora, adapter=1)
    assert (np.abs(scores(lm) - np.array(oracle(lora, lm, lora.peft_dirs[1]))) <= tolerance(lm)).all()


def test_without_adapter_the_base_model_is_scored_and_said(lora, caplog):
    with caplog.at_level(logging.WARNING):
        lm = open_lm(lora, adapter=None)
        got = scores(lm)
    said = [r.getMessage() for r in caplog.records if "adapter" in r.getMessage()]
    assert len(said) == 1 and "no --adapter was given: scoring the base model" in said[0], said
    assert (np.abs(got - np.array(oracle(lora, lm, None))) <= tolerance(lm)).all()


@pytest.mark.parametrize("kw", [dict(gen_path="raw", cascade="off"), dict(gen_path="og")], ids=["raw", "og"])
def test_greedy_generation_follows_the_adapter(lora, kw):
    lm = open_lm(lora, max_gen_toks=12, **kw)
    prompt = "The capital of France is"
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "do_sample": False}), 0)],
                                disable_tqdm=True)
    ids = lm.tok_encode(prompt)
    want = peft_greedy(lora.hf_dir, lora.peft_dirs[0], ids, 12)
    assert lm.tok_encode(prompt + text, add_special_tokens=True)[len(ids):] == want or \
        text == lm.tok_decode(want), (text, lm.tok_decode(want))


def test_sampled_rows_on_the_cascade_graph_carry_the_adapter(lora):
    """The cascade graph keeps the decoder's adapter inputs: its rows draw what the plain path (checked above
    against peft) draws, and ``cascade=on`` passes its check against the plain pass (else: one-line error)."""
    from tests.test_sampler import repeats

    reqs = repeats(["The capital of France is", "Question: one two three. Answer:"],
                   {"until": [], "max_gen_toks": 16, "do_sample": True, "temperature": 0.7}, 4)
    on = open_lm(lora, gen_path="raw", cascade="on")
    off = open_lm(lora, gen_path="raw", cascade="off")
    base = open_lm(lora, adapter=None, gen_path="raw", cascade="off")
    texts = on.generate_until(reqs, disable_tqdm=True)
    assert texts == off.generate_until(reqs, disable_tqdm=True)
    assert "cascade" in on.run.stats["mode"]
    assert texts != base.generate_until(reqs, disable_tqdm=True)  # the adapter changed what was drawn
