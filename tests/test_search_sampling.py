"""Token choice in step-level search (issue 25): the request's processors, as the sampler applies them.

``ProcessorChooser`` (engine/generate/search/steps.py) is what ``--search`` draws tokens with. Each draw is
reproduced independently: transformers' own processors (RepetitionPenalty, Temperature, TopK, TopP,
MinP) on the same logits and the row's history as a model wrapper saw it fed, then ``rng.choice`` from
the same generator state. Dropping any processor changes the draws (checked in the report by hand)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.search.guided import SearchSettings, dvts, particle_filter, prm_beam_search
from ortevals.engine.generate.search.steps import ProcessorChooser, StepRules

V = 40


class HashModel:
    """A RowModel whose logits are a seeded function of each row's whole history (prompt + fed tokens);
    it keeps those histories itself, from what it is fed."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def _logits(self, rows) -> np.ndarray:
        return np.stack([np.random.default_rng([len(self.rows[r]), *self.rows[r]]).normal(0, 2.0, V) for r in rows])

    def start(self, prompt, rows):
        self.rows = [list(prompt) for _ in range(rows)]
        return self._logits(range(rows))

    def fork(self, parents):
        self.rows = [list(self.rows[int(p)]) for p in parents]

    def step(self, tokens, rows):
        for t, r in zip(tokens, rows, strict=True):
            self.rows[int(r)].append(int(t))
        return self._logits(rows)


class Recorder:
    """Wraps the chooser under test: each call's logits, the model's own histories of the rows, the
    generator's state before the draw, and the tokens chosen."""

    def __init__(self, chooser, model) -> None:
        self.chooser, self.model, self.calls = chooser, model, []

    def choose(self, logits, rows, histories=None):
        state = copy.deepcopy(self.chooser.rng.bit_generator.state)
        seen = [list(self.model.rows[int(r)]) for r in rows]
        out = self.chooser.choose(logits, rows, histories)
        self.calls.append((np.array(logits), seen, state, np.array(out)))
        return out

    def fork(self, parents):
        self.chooser.fork(parents)


def transformers_draws(logits, histories, state, s: GenSettings) -> list[int]:
    """The tokens transformers' processors allow, drawn as the sampler draws (one generator, rows in order)."""
    import torch
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = state
    out = []
    for x, hist in zip(logits, histories, strict=True):
        ids, t = torch.tensor([hist]), torch.tensor(x[None], dtype=torch.float64)
        t = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, t)
        t = TemperatureLogitsWarper(s.temperature)(ids, t)
        if s.top_k:
            t = TopKLogitsWarper(s.top_k)(ids, t)
        t = TopPLogitsWarper(s.top_p)(ids, t)
        if s.min_p:
            t = MinPLogitsWarper(s.min_p)(ids, t)
        out.append(int(rng.choice(V, p=torch.softmax(t, -1)[0].numpy())))
    return out


SETTINGS = [
    GenSettings(do_sample=True, temperature=0.7, top_k=6, top_p=0.8),
    GenSettings(do_sample=True, temperature=1.3, top_p=0.5, repetition_penalty=1.8),
    GenSettings(do_sample=True, temperature=1.0, top_k=12, min_p=0.2, repetition_penalty=0.7),
]


class Prm:
    def score(self, prompt, solutions):
        return [[((sum(step) * 31 + 7 * i) % 97 + 1) / 99 for i, step in enumerate(steps)] for steps in solutions]


@pytest.mark.parametrize("method", ["beam", "dvts", "particles"])
@pytest.mark.parametrize("s", SETTINGS, ids=["topk-topp", "topp-penalty", "topk-minp-penalty"])
def test_search_draws_what_the_processors_allow(method, s):
    model = HashModel()
    rec = Recorder(ProcessorChooser(s, np.random.default_rng(5)), model)
    rules = StepRules(frozenset({0}), lambda step: step[-1] % 7 == 3, max_step_tokens=5, max_tokens=20)
    search = SearchSettings(n=4, width=2, max_steps=4, aggregation="min")
    prompt = [11, 12, 13, 12]
    if method == "particles":
        particle_filter(model, prompt, Prm(), rules, rec, search, np.random.default_rng(9))
    else:
        (prm_beam_search if method == "beam" else dvts)(model, prompt, Prm(), rules, rec, search)
    draws = sum(len(c[3]) for c in rec.calls)
    assert draws > 40 and any(len(set(map(tuple, c[1]))) > 1 for c in rec.calls)  # rows with different histories
    for logits, histories, state, chosen in rec.calls:
        assert chosen.tolist() == transformers_draws(logits, histories, state, s)


def test_mirostat_state_follows_the_forks():
    """Mirostat's mu is per row: after a fork row i carries former row parents[i]'s mu."""
    s = GenSettings(do_sample=True, mirostat_tau=3.0, mirostat_eta=0.5)
    c = ProcessorChooser(s, np.random.default_rng(0))
    logits = np.random.default_rng(1).normal(0, 2, (3, V))
    c.choose(logits, np.arange(3), [[1]] * 3)
    before = c.mu.copy()
    assert not np.allclose(before, 6.0)  # each row's draw moved its mu from 2 tau
    c.fork(np.array([2, 2, 0]))
    np.testing.assert_array_equal(c.mu, before[[2, 2, 0]])
