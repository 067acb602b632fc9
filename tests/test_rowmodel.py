"""RawRowModel (engine/generate/rowmodel.py, issue 25): the step-level searches on the raw engine give the
tokens a transformers model gives when it recomputes every row from scratch (same seeded choices, same
PRM), with the prompt run once and rows of different lengths."""

from __future__ import annotations

import numpy as np
import pytest

from ortevals.engine.generate.rowmodel import RawRowModel
from ortevals.engine.generate.steps import SampleChooser, StepRules
from ortevals.engine.generate.stepsearch import SearchSettings, dvts, particle_filter, prm_beam_search
from ortevals.integrations.lm import ModelArgs, OrtLM

PROMPT = "Question: what is the river of the city? Answer: the river"


class TorchRowModel:
    """A RowModel over transformers: every step re-runs each row's whole sequence (no KV at all)."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []

    def _logits(self, seqs):
        import torch

        with torch.no_grad():
            return np.stack([self.model(input_ids=torch.tensor([s])).logits[0, -1].float().numpy() for s in seqs])

    def start(self, prompt, rows):
        self.rows = [list(prompt) for _ in range(rows)]
        return self._logits(self.rows)

    def fork(self, parents):
        self.rows = [list(self.rows[int(p)]) for p in parents]

    def step(self, tokens, rows):
        for t, r in zip(tokens, rows, strict=True):
            self.rows[int(r)].append(int(t))
        return self._logits([self.rows[int(r)] for r in rows])


class Prm:
    """A deterministic PRM: a step's score from its token ids (and its position), in (0, 1)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, prompt, solutions):
        self.calls += 1
        return [[((sum(step) * 31 + 7 * i) % 97 + 1) / 99 for i, step in enumerate(steps)] for steps in solutions]


@pytest.fixture(scope="module")
def models(tiny, tiny_pkg):
    import torch
    from transformers import AutoModelForCausalLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw"))
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32).eval()
    return lm, hf


RULES = StepRules(eos=frozenset({2}), ends_step=lambda step: step[-1] % 5 == 0, max_step_tokens=6, max_tokens=24)


@pytest.mark.parametrize("method", ["beam", "dvts", "particles"])
def test_searches_on_the_raw_engine_equal_transformers_from_scratch(models, method):
    lm, hf = models
    prompt = lm.tok_encode(PROMPT)
    settings = SearchSettings(n=4, width=2, max_steps=4, aggregation="min")
    outcomes = []
    for model in (RawRowModel(lm.run.generation.sampler().runner), TorchRowModel(hf)):
        chooser = SampleChooser(np.random.default_rng(7), temperature=1.0)
        if method == "beam":
            out = prm_beam_search(model, prompt, Prm(), RULES, chooser, settings)
        elif method == "dvts":
            out = dvts(model, prompt, Prm(), RULES, chooser, settings)
        else:
            out = particle_filter(model, prompt, Prm(), RULES, chooser, settings, np.random.default_rng(3))
        outcomes.append((model, out))
    (raw, a), (_, b) = outcomes
    assert [s.tokens for s in a.solutions] == [s.tokens for s in b.solutions]
    assert a.best == b.best and a.generated_tokens == b.generated_tokens and a.passes == b.passes
    np.testing.assert_allclose([s.logprob for s in a.solutions], [s.logprob for s in b.solutions], atol=1e-3)
    assert len({len(s.tokens) for s in a.solutions}) > 1  # rows of different lengths really ran
    assert raw.stats["prompt_tokens"] == len(prompt)  # the prompt ran once: forks copied KV, never re-ran it
    assert 0 < raw.stats["tokens_run"] <= a.generated_tokens  # each generated token fed once at most
    assert raw.stats["passes"] - 1 > a.passes  # rows of different lengths took a pass per length
