"""Beam search and diverse beam search (engine/generate/search/beam.py) against transformers and by hand."""

import numpy as np
import pytest

from ortevals.engine.generate.choice.settings import GenSettings, parse_gen_kwargs
from ortevals.engine.generate.search.beam import beam_search


class TorchStepModel:
    """A StepModel over a transformers model: every step re-runs the full sequences (no KV, so it
    shares nothing with the engine's cache handling)."""

    def __init__(self, model):
        self.model = model
        self.rows: list[list[int]] = []

    def logits(self):
        import torch

        with torch.no_grad():
            return self.model(input_ids=torch.tensor(self.rows)).logits[:, -1, :].float().numpy()

    def start(self, prompt, rows):
        self.rows = [list(prompt) for _ in range(rows)]
        return self.logits()

    def step(self, tokens, parents):
        self.rows = [self.rows[int(p)] + [int(t)] for t, p in zip(tokens, parents, strict=True)]
        return self.logits()


@pytest.fixture(scope="module")
def tiny_model(tiny):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend (20x faster on a shared 2-core box)
    model = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype="float32").eval()
    yield model, AutoTokenizer.from_pretrained(str(tiny[0]))
    torch.set_num_threads(threads)


def hf_beams(model, prompt, eos, **kw):
    """transformers' tokens after the prompt, up to the first EOS (eos: an id or a list of ids)."""
    import torch

    eos_list = eos if isinstance(eos, list) else [eos]
    out = model.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=eos, pad_token_id=eos_list[0],
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
    gen = out[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(gen) if t in eos_list]
    return gen[:ends[0] + 1] if ends else gen  # the padding after the EOS dropped


CASES = [  # (num_beams, max_new_tokens, length_penalty, early_stopping, eos from the greedy run at index)
    (4, 12, 1.0, False, None),
    (4, 12, 1.0, False, 2),
    (4, 10, 0.0, True, 1),
    (4, 10, 2.0, "never", 3),
    (3, 8, -1.0, False, 2),
    (4, 10, 1.0, False, 0),
]


@pytest.mark.parametrize("beams,new,lp,early,eos_at", CASES)
def test_beam_search_equals_transformers(tiny_model, beams, new, lp, early, eos_at):
    """Token equality with generate(num_beams=…, do_sample=False) on the tiny random Llama; EOS is a
    token the model likes here (taken from a greedy run) so hypotheses really finish early."""
    model, tok = tiny_model
    for text in ["The capital of France is", "Question: one two three. Answer:"]:
        prompt = tok(text)["input_ids"]
        eos = 2
        if eos_at is not None:
            eos = hf_beams(model, prompt, 2, num_beams=1, max_new_tokens=eos_at + 1)[eos_at]
        want = hf_beams(model, prompt, eos, num_beams=beams, max_new_tokens=new, length_penalty=lp,
                        early_stopping=early)
        s = GenSettings(max_gen_toks=new, num_beams=beams, length_penalty=lp, early_stopping=early)
        got = beam_search(TorchStepModel(model), prompt, s, {eos})
        assert list(got.best.tokens) == want, (text, eos)
        assert len(got.nbest) == beams and got.nbest[0] == got.best
        assert all(a.score >= b.score for a, b in zip(got.nbest, got.nbest[1:]))


def test_beam_search_early_termination_equals_transformers(tiny_model):
    """64 EOS ids (n_eos > 1: 65 × num_beams continuations a step): hypotheses finish every few steps,
    the finished list fills, and the search stops before max_gen_toks through early_stopping=True
    or the can-no-longer-improve heuristic, exactly where transformers stops."""
    model, tok = tiny_model
    eos = list(range(5, 512, 8))
    early_stops = 0
    for text in ["The capital of France is", "Question: one two three. Answer:"]:
        prompt = tok(text)["input_ids"]
        for lp, early in [(1.0, False), (1.0, True), (0.5, "never"), (0.0, False), (2.0, False)]:
            want = hf_beams(model, prompt, eos, num_beams=4, max_new_tokens=12, length_penalty=lp,
                            early_stopping=early)
            got = beam_search(TorchStepModel(model), prompt,
                              GenSettings(max_gen_toks=12, num_beams=4, length_penalty=lp, early_stopping=early),
                              set(eos))
            assert list(got.best.tokens) == want, (text, lp, early)
            early_stops += got.steps < 11
    assert early_stops >= 4


def test_beam_search_with_repetition_penalty_equals_transformers(tiny_model):
    model, tok = tiny_model
    prompt = tok("one two one two one two")["input_ids"]
    want = hf_beams(model, prompt, 2, num_beams=4, max_new_tokens=10, repetition_penalty=1.7,
                    no_repeat_ngram_size=2)
    s = GenSettings(max_gen_toks=10, num_beams=4, repetition_penalty=1.7, no_repeat_ngram_size=2)
    assert list(beam_search(TorchStepModel(model), prompt, s, {2}).best.tokens) == want


@pytest.mark.slow
def test_beam_search_equals_transformers_smollm2(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2[0]), dtype="float32").eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2[0]))
    prompt = tok("The three primary colors are")["input_ids"]
    eos = tok.eos_token_id
    want = hf_beams(model, prompt, eos, num_beams=4, max_new_tokens=16)
    got = beam_search(TorchStepModel(model), prompt, GenSettings(max_gen_toks=16, num_beams=4), {eos})
    assert list(got.best.tokens) == want


class TableModel:
    """A toy StepModel: the next-token log-probs depend only on the last token (a known table)."""

    def __init__(self, table: dict[int, list[float]]):
        self.table = table
        self.last: list[int] = []

    def start(self, prompt, rows):
        self.last = [prompt[-1]] * rows
        return np.array([self.table[t] for t in self.last])

    def step(self, tokens, parents):
        self.last = [int(t) for t in tokens]
        return np.array([self.table[t] for t in self.last])


def test_diverse_beam_search_one_group_or_no_penalty_is_beam_search(tiny_model):
    model, tok = tiny_model
    prompt = tok("The capital of France is")["input_ids"]
    plain2 = beam_search(TorchStepModel(model), prompt, GenSettings(max_gen_toks=8, num_beams=2), {2})
    plain4 = beam_search(TorchStepModel(model), prompt, GenSettings(max_gen_toks=8, num_beams=4), {2})
    one_group = beam_search(TorchStepModel(model), prompt,
                            GenSettings(max_gen_toks=8, num_beams=4, num_beam_groups=1), {2})
    assert one_group == plain4
    # no penalty: G independent searches of width num_beams / G, all equal to plain beam search
    groups = beam_search(TorchStepModel(model), prompt,
                         GenSettings(max_gen_toks=8, num_beams=4, num_beam_groups=2), {2})
    for g in (0, 1):
        mine = [h for h in groups.nbest if h.group == g]
        assert [h.tokens for h in mine] == [h.tokens for h in plain2.nbest]


def test_diverse_beam_search_groups_differ_as_predicted():
    """Vocabulary {0: EOS, 1: A, 2: B, 3: C}, 2 tokens then stop (max_gen_toks=2); 2 groups of 1 beam.

    From the start token 3: log p(A)=log .6, p(B)=.3, p(C)=.1 (EOS 1e-9). After any token: the
    same table. Group 0 (no penalty) is greedy: A, A. Group 1 at step 1 sees A penalised by λ:
    log .6 - λ vs log .3 → with λ=1: -1.51 < -1.20, so it takes B; step 2: again A penalised
    (group 0 took A) → B. Score of group 1: 2·log .3 = -2.408 (penalised sum: the chosen tokens
    were never penalised); with λ=0.5, log .6 - .5 = -1.01 > -1.20: group 1 also takes A, A.
    """
    p = np.log([1e-9, 0.6, 0.3, 0.1])
    table = {t: list(p) for t in range(4)}
    s = GenSettings(max_gen_toks=2, num_beams=2, num_beam_groups=2, diversity_penalty=1.0, length_penalty=0.0)
    res = beam_search(TableModel(table), [3], s, {0})
    by_group = {h.group: h for h in res.nbest}
    assert by_group[0].tokens == (1, 1) and by_group[1].tokens == (2, 2)
    assert by_group[1].score == pytest.approx(2 * np.log(0.3))
    assert res.best.tokens == (1, 1)
    weak = beam_search(TableModel(table), [3], GenSettings(max_gen_toks=2, num_beams=2, num_beam_groups=2,
                                                           diversity_penalty=0.5, length_penalty=0.0), {0})
    assert {h.group: h.tokens for h in weak.nbest} == {0: (1, 1), 1: (1, 1)}
    # the penalty enters the score where a penalised token is kept: λ=0.5, group 1 = log .6 - .5 twice
    assert [h.score for h in weak.nbest if h.group == 1][0] == pytest.approx(2 * (np.log(0.6) - 0.5))


def test_search_gen_kwargs_errors():
    from ortevals.errors import OrtEvalsError

    for bad, field in [({"num_beams": 4, "num_beam_groups": 3}, "num_beam_groups"),
                       ({"num_beams": 4, "diversity_penalty": 1.0}, "diversity_penalty"),
                       ({"num_beams": 4, "do_sample": True, "temperature": 0.5}, "num_beams"),
                       ({"early_stopping": "sometimes"}, "early_stopping"),
                       ({"length_penalty": "x"}, "length_penalty")]:
        with pytest.raises(OrtEvalsError, match=field):
            parse_gen_kwargs(bad, 64)
