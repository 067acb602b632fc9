"""LongRoPE packages (Phi-3/3.5/4-mini) scored and decoded as transformers does, on both sides of the switch.

The tiny Phi-3 package (tests/fixtures/longrope.py) switches its rotary factors for sequences longer than 64
tokens. Few-shot prompts whose shared header is shorter than that and whose whole prompts are longer are the
case where reusing the header's KV (made short) under a long prompt gave wrong numbers (issue 37).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.score.incremental import IncrementalEngine
from ortevals.engine.score.passes import EngineSettings
from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.reuse import ReusePolicy, reuse_policy
from tests.fixtures.tiny import WORDS

_rng = random.Random(1)
HEADER = "Question: " + " ".join(_rng.choice(WORDS) for _ in range(25)) + ". Answer: B\n"  # 35 tokens
QUESTIONS = ["Question: " + " ".join(_rng.choice(WORDS) for _ in range(20 + 4 * q)) + ". Answer:" for q in range(5)]
PAIRS = [(HEADER + q, c) for q in QUESTIONS for c in (" A", " B", " C")]  # inputs of 63 to 79 tokens
GEN_PROMPTS = [" ".join(_rng.choice(WORDS) for _ in range(n)) for n in (40, 44)]  # 42 and 46 tokens, 24 more


def _instances(kind: str, args: list) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def hf_scores(longrope) -> list[float]:
    """lm-eval's hf backend, one request a pass (at batch size > 1 it pads rows to the batch's longest, and
    transformers then rotates a short row with the long factors)."""
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=str(longrope[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)
    return [lp for lp, _ in hflm.loglikelihood(_instances("loglikelihood", PAIRS))]


def test_the_switch_is_read_from_the_graph(longrope, tiny_pkg):
    config = json.loads((longrope[0] / "config.json").read_text())
    assert reuse_policy(ModelPackage.load(longrope[1])).rope_switch == config["original_max_position_embeddings"]
    assert reuse_policy(ModelPackage.load(tiny_pkg)) == ReusePolicy()


@pytest.mark.parametrize("extra", [{}, {"exact": True}, {"prefix_cache": False}, {"batch_size": 1},
                                   {"path": "incremental"}])
def test_every_path_equals_hf_across_the_switch(longrope, hf_scores, extra):
    """The default path (shared header, padded batches, canary), --exact, no prefix cache, one row a pass and the
    og cursor all equal transformers (the default path was 2.6 nats off and changed 2 of 5 answers before the
    fix, prefix_cache=false 3.1, path=incremental 1.1)."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(longrope[1]), max_length=256, **extra))
    lens = {len(lm.tok_encode(c + x)) for c, x in PAIRS}
    assert min(lens) <= 64 < max(lens) and len(lm.tok_encode(HEADER)) < 64  # the case: header short, prompts both
    ours = [lp for lp, _ in lm.loglikelihood(_instances("loglikelihood", PAIRS))]
    assert max(abs(a - b) for a, b in zip(ours, hf_scores)) <= 1e-4
    if not extra:  # the header still ran once a length class, and the canary ran across the switch
        engine = lm.backends.prefill
        assert engine.mode.startswith("batched (canary passed on 8")
        inputs = sum(len(lm.tok_encode(c + x)) - 1 for c, x in {(c, " A") for c, _ in PAIRS})
        assert engine.tokens_run - engine.canary_tokens < inputs - 35


def test_the_canary_catches_reuse_across_the_switch(longrope, hf_scores, monkeypatch):
    """With the length classes ignored (the reuse before the fix), the canary's straddling inputs trip it and the
    run is scored in exact mode, equal to transformers."""
    monkeypatch.setattr(ReusePolicy, "length_class", lambda self, total: 0)
    lm = OrtLM.from_package(ModelArgs(pkg=str(longrope[1]), max_length=256))
    ours = [lp for lp, _ in lm.loglikelihood(_instances("loglikelihood", PAIRS))]
    assert lm.backends.prefill.mode.startswith("exact (canary")
    assert max(abs(a - b) for a, b in zip(ours, hf_scores)) <= 1e-4


@pytest.mark.parametrize("gen_path,beams", [("raw", 1), ("og", 1), ("raw", 2)])
def test_generation_across_the_switch_equals_transformers(longrope, gen_path, beams):
    """Greedy and beam decoding that crosses the switch: transformers' Phi-3 drops its cache at the crossing and
    runs the whole sequence again; the raw rows, the og cursor and the beams do the same (before the fix the
    first two continued on the short KV: both prompts' texts differed)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(longrope[0], dtype=torch.float32).eval()
    lm = OrtLM.from_package(ModelArgs(pkg=str(longrope[1]), max_length=256, gen_path=gen_path))
    kwargs = {"until": ["zzz"], "do_sample": False, "max_gen_toks": 24, "num_beams": beams}
    outs = lm.generate_until(_instances("generate_until", [(p, kwargs) for p in GEN_PROMPTS]))
    for prompt, out in zip(GEN_PROMPTS, outs):
        ids = lm.tok_encode(prompt)
        assert len(ids) < 64 < len(ids) + 24
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, num_beams=beams,
                                 eos_token_id=None, pad_token_id=2)[0, len(ids):]
        assert out == lm.tokenizer.decode(ref.tolist())


def test_search_rows_cross_the_switch_as_one_pass(longrope):
    """Step-level search's rows (RawRowModel), forked and stepped past the switch, score their next token as a
    one-pass run of their whole sequence does (before the fix: the steps past 64 ran on the short KV)."""
    from ortevals.engine.generate.search.rawrows import RawRowModel
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.sessions import DecoderRunner

    pkg = ModelPackage.load(longrope[1])
    runner = DecoderRunner.open(pkg, from_package({}))
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 500, 60).tolist()
    model = RawRowModel(runner, reuse_policy(pkg))
    model.start(prompt, 2)
    seqs = [list(prompt), list(prompt)]
    for step in range(8):
        if step == 3:
            model.fork(np.array([1, 1, 0]))
            seqs = [list(seqs[1]), list(seqs[1]), list(seqs[0])]
        tokens = rng.integers(3, 500, len(seqs))
        logits = model.step(tokens, np.arange(len(seqs)))
        for row, t in zip(seqs, tokens):
            row.append(int(t))
    for row, got in zip(seqs, logits):
        ids = np.asarray([row], np.int64)
        np.testing.assert_allclose(got, runner.forward(ids, np.ones_like(ids))[0][0, -1], atol=1e-4)


def test_cascade_on_is_refused_in_one_line(longrope):
    lm = OrtLM.from_package(ModelArgs(pkg=str(longrope[1]), max_length=256, gen_path="raw", cascade="on"))
    kwargs = {"until": ["zzz"], "do_sample": True, "max_gen_toks": 4}
    with pytest.raises(OrtEvalsError, match="^cascade=on is impossible for this package: its rotary factors switch"):
        lm.generate_until(_instances("generate_until", [(GEN_PROMPTS[0], kwargs)] * 2))


def test_a_pruned_head_refuses_a_continuation_across_the_switch():
    """Last-position logits cannot score a continuation whose first positions are before the switch and last
    after it exactly: one line naming the cause and the path that serves it."""
    engine = IncrementalEngine(None, EngineSettings(128, 512, reuse=ReusePolicy(rope_switch=64)), full_logits=False)
    with pytest.raises(OrtEvalsError, match="rotary switch at 64 tokens.*path=prefill"):
        engine._rows(None, tuple(range(70)), 10)
    assert np.asarray(engine._rows(_Cursor(), tuple(range(70)), 3)).shape == (3, 1)  # after the switch: served


class _Cursor:
    def move_to(self, tokens):
        return np.zeros(1)


def test_score_requests_of_both_classes_in_one_batch_stay_apart():
    """Right-padded batches never hold inputs of both classes (the pass's width picks the factors)."""
    from ortevals.engine.score.passes import Group, batches

    settings = EngineSettings(256, 512, batch_size=8, reuse=ReusePolicy(rope_switch=64))
    groups = [Group(tuple(range(n)), ((0, 1),)) for n in (80, 70, 65, 64, 60, 30)]
    assert [[len(g.tokens) for g in b] for b in batches(groups, settings)] == [[80, 70, 65], [64, 60, 30]]
