"""Sampling filters and penalties (engine/generate/choice/logits.py) against transformers' logits processors;
Mirostat v2 against a worked example; per-row seeding."""

import numpy as np
import pytest
import torch
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ortevals.engine.generate.choice import logits as sampling
from ortevals.engine.generate.choice.logits import choose_token
from ortevals.engine.generate.choice.seeds import row_rng
from ortevals.engine.generate.choice.settings import GenSettings, parse_gen_kwargs
from ortevals.errors import OrtEvalsError

V = 97


def random_logits(seed: int, rows: int = 6, scale: float = 3.0) -> np.ndarray:
    """float32 logits: rows of different peakedness (scale × 0.3 … 3)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, V)) * scale * rng.uniform(0.1, 1.0, (rows, 1))).astype(np.float32)


def same_distribution(mine: np.ndarray, ref: torch.Tensor) -> None:
    """Same kept tokens, same renormalised probabilities."""
    ref = ref.double().numpy()
    np.testing.assert_array_equal(np.isfinite(mine), np.isfinite(ref))
    np.testing.assert_allclose(sampling.softmax(mine), torch.softmax(torch.from_numpy(ref), -1).numpy(),
                               rtol=1e-5, atol=1e-9)


WARPERS = [
    (sampling.top_k, TopKLogitsWarper, [1, 2, 5, 40, V - 1, V, V + 3]),
    (sampling.top_p, TopPLogitsWarper, [0.01, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0]),
    (sampling.min_p, MinPLogitsWarper, [0.0, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0]),
    (sampling.typical, TypicalLogitsWarper, [0.05, 0.2, 0.5, 0.9, 0.95, 0.999]),
    (sampling.temperature, TemperatureLogitsWarper, [0.1, 0.7, 1.0, 1.5, 4.0]),
]


@pytest.mark.parametrize("mine,theirs,values", WARPERS, ids=[w[1].__name__ for w in WARPERS])
def test_warpers_equal_transformers(mine, theirs, values):
    for seed in range(5):
        x = random_logits(seed)
        for v in values:
            ref = theirs(v)(torch.zeros(x.shape[0], 1, dtype=torch.long), torch.from_numpy(x.copy()))
            same_distribution(mine(x.astype(np.float64), v), ref)


def test_kept_sets_are_not_trivial():
    """The cases above really cut: each filter at a middle value keeps some but not all tokens."""
    x = random_logits(0).astype(np.float64)
    for f, v in [(sampling.top_k, 5), (sampling.top_p, 0.5), (sampling.min_p, 0.2), (sampling.typical, 0.5)]:
        kept = np.isfinite(f(x, v)).sum(axis=-1)
        assert (kept >= 1).all() and (kept < V).all(), f.__name__
        assert f is sampling.top_k or len(set(kept.tolist())) > 1, f.__name__  # mass-based: varies by row


def test_warpers_chained_in_transformers_order():
    """temperature → top-k → top-p → min-p → typical, each seeing the previous one's -inf."""
    s = GenSettings(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, typical_p=0.9)
    chain = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(30), TopPLogitsWarper(0.9),
                                 MinPLogitsWarper(0.02), TypicalLogitsWarper(0.9)])
    for seed in range(5):
        x = random_logits(seed)
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
        same_distribution(sampling.warped(x.astype(np.float64), s), chain(ids, torch.from_numpy(x.copy())))


def histories(seed: int, rows: int, length: int) -> np.ndarray:
    """Histories with repeats (a small alphabet) so n-grams recur."""
    return np.random.default_rng(seed).integers(0, 12, (rows, length))


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.5])
def test_repetition_penalty_equals_transformers(penalty):
    for seed in range(4):
        x, h = random_logits(seed), histories(seed, 6, 15)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(h), torch.from_numpy(x.copy()))
        mine = sampling.repetition_penalty(x.astype(np.float64), penalty, h.tolist())
        np.testing.assert_allclose(mine, ref.double().numpy(), rtol=1e-6)
        assert penalty == 1.0 or not np.allclose(mine, x)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_transformers(n):
    for seed in range(4):
        for length in (n - 1, n, 20):
            x, h = random_logits(seed), histories(seed, 6, max(length, 0))
            if length == 20:  # one row that surely repeats: ... 1 2 3 4 ... 1 2 3 -> 4 banned for every n
                h[0, -7:] = [1, 2, 3, 4, 1, 2, 3]
            ref = NoRepeatNGramLogitsProcessor(n)(torch.from_numpy(h), torch.from_numpy(x.copy()))
            mine = sampling.no_repeat_ngram(x.astype(np.float64), n, h.tolist())
            np.testing.assert_array_equal(np.isfinite(mine), np.isfinite(ref.numpy()))
            if length == 20:
                assert not np.isfinite(mine[0, 4])


class ScriptedRng:
    """Stands in for np.random.Generator in the worked example: records the distribution it is
    asked to draw from and returns the scripted token (the draw itself is numpy's)."""

    def __init__(self, picks):
        self.picks, self.seen = list(picks), []

    def choice(self, n, p):
        self.seen.append(np.asarray(p))
        return self.picks.pop(0)


def test_mirostat_v2_worked_example():
    """Basu et al. 2021, Mirostat v2, by hand: tau=1.4, eta=0.5, mu starts at 2*tau = 2.8.

    p = (.5, .25, .125, .125): surprises (1, 2, 3, 3) bits.
      step 1: mu 2.8 keeps surprise <= 2.8: tokens 0, 1 -> (2/3, 1/3, 0, 0); pick 1 (s=2):
              mu = 2.8 - .5(2 - 1.4) = 2.5
      step 2: mu 2.5 keeps 0, 1; pick 0 (s=1): mu = 2.5 - .5(1 - 1.4) = 2.7
    p = (.4, .3, .2, .1): surprises (1.3219, 1.7370, 2.3219, 3.3219).
      step 3: mu 2.7 keeps 0, 1, 2 -> (4/9, 3/9, 2/9, 0); pick 2: mu = 2.7 - .5(2.3219 - 1.4) = 2.2390
      step 4: mu 2.2390 keeps 0, 1 -> (4/7, 3/7, 0, 0); pick 0: mu = 2.2390 - .5(1.3219 - 1.4) = 2.2781
    A second row, tau=0.1 (mu 0.2), keeps only the top token although its surprise (1) > mu.
    """
    s = GenSettings(do_sample=True, mirostat_tau=1.4, mirostat_eta=0.5)
    rng = ScriptedRng([1, 0, 2, 0])
    sampler = sampling.Sampler(s, [rng])
    assert sampler.mu.tolist() == [2.8]
    a, b = np.log([[0.5, 0.25, 0.125, 0.125]]), np.log([[0.4, 0.3, 0.2, 0.1]])
    picks = [int(sampler.choose(x, [[]])[0]) for x in (a, a, b, b)]
    assert picks == [1, 0, 2, 0]
    want = [[2 / 3, 1 / 3, 0, 0], [2 / 3, 1 / 3, 0, 0], [4 / 9, 3 / 9, 2 / 9, 0], [4 / 7, 3 / 7, 0, 0]]
    np.testing.assert_allclose(np.array(rng.seen), want, atol=1e-12)
    assert sampler.mu[0] == pytest.approx(2.2390 - 0.5 * (np.log2(1 / 0.4) - 1.4), abs=1e-4)
    assert sampler.mu[0] == pytest.approx(2.7781 - 0.5, abs=1e-4)
    low = sampling.Sampler(GenSettings(do_sample=True, mirostat_tau=0.1, mirostat_eta=0.5), [ScriptedRng([0])])
    low.choose(a, [[]])
    assert low.rngs[0].seen[0].tolist() == [1, 0, 0, 0] and low.mu[0] == pytest.approx(0.2 - 0.5 * 0.9)


def test_rows_are_independent_of_their_batch():
    """A row's tokens equal the same (seed, request, sample) run alone: one generator per row."""
    s = GenSettings(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    logits = [random_logits(seed, rows=4) for seed in range(12)]
    batch = sampling.Sampler(s, [row_rng(7, "req-a", i) for i in range(4)])
    hist = [[1, 2, 3] for _ in range(4)]
    together = []
    for x in logits:
        t = batch.choose(x, hist)
        together.append(t)
        hist = [h + [int(v)] for h, v in zip(hist, t, strict=True)]
    together = np.array(together)
    for i in range(4):
        alone = sampling.Sampler(s, [row_rng(7, "req-a", i)])
        h = [1, 2, 3]
        for step, x in enumerate(logits):
            t = int(alone.choose(x[i:i + 1], [h])[0])
            assert t == together[step, i]
            h.append(t)
    assert len({tuple(together[:, i]) for i in range(4)}) == 4  # the samples differ
    # row subsets (finished rows dropped) keep each row's own stream
    sub = sampling.Sampler(s, [row_rng(7, "req-a", i) for i in range(4)])
    assert sub.choose(logits[0][[1, 3]], hist[:2], rows=[1, 3]).tolist() == together[0, [1, 3]].tolist()


def test_row_rng_depends_on_key_and_index_only():
    draw = lambda *a: row_rng(*a).random()  # noqa: E731
    assert draw(1, "q", 0) == draw(1, "q", 0)
    assert len({draw(1, "q", 0), draw(1, "q", 1), draw(1, "r", 0), draw(2, "q", 0)}) == 4


def test_greedy_choose_token_applies_penalties_only_when_asked():
    x = np.array([3.0, 2.9, -1.0, 0.5])
    assert choose_token(x, GenSettings(), np.random.default_rng(0)) == 0
    # token 0 seen before: 3.0 / 1.2 = 2.5 < 2.9, so greedy moves to token 1
    assert choose_token(x, GenSettings(repetition_penalty=1.2), np.random.default_rng(0), [0]) == 1
    assert choose_token(x, GenSettings(no_repeat_ngram_size=2), np.random.default_rng(0), [5, 0, 5]) == 1


@pytest.mark.parametrize("kwargs,field", [
    ({"do_sample": True, "min_p": 1.5}, "min_p"), ({"do_sample": True, "typical_p": 0}, "typical_p"),
    ({"do_sample": True, "top_p": 0}, "top_p"), ({"do_sample": True, "top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"), ({"mirostat": 1}, "mirostat"),
    ({"mirostat_tau": 5.0}, "mirostat_tau"), ({"do_sample": True, "mirostat_eta": 0}, "mirostat_eta"),
    ({"do_sample": True, "mirostat": 2, "top_k": 40}, "mirostat_tau replaces"),
    ({"mbr_samples": 4}, "mbr_samples"), ({"do_sample": True, "mbr_samples": 4, "mbr_metric": "bleu"}, "mbr_metric"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_gen_kwargs_are_one_line_errors(kwargs, field):
    with pytest.raises(OrtEvalsError, match=field) as e:
        parse_gen_kwargs(kwargs, 64)
    assert "\n" not in str(e.value)


def test_new_gen_kwargs_parse():
    s = parse_gen_kwargs({"do_sample": True, "temperature": 0.7, "min_p": 0.05, "typical_p": 0.9,
                          "repetition_penalty": 1.1, "no_repeat_ngram_size": 3, "mbr_samples": 8,
                          "mbr_metric": "rouge"}, 64)
    assert (s.min_p, s.typical_p, s.repetition_penalty, s.no_repeat_ngram_size, s.mbr_samples, s.mbr_metric) == \
        (0.05, 0.9, 1.1, 3, 8, "rouge")
    m = parse_gen_kwargs({"do_sample": True, "mirostat": 2}, 64)
    assert (m.mirostat_tau, m.mirostat_eta) == (5.0, 0.1)
    b = parse_gen_kwargs({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5,
                          "length_penalty": 0.6, "early_stopping": "never"}, 64)
    assert (b.num_beams, b.num_beam_groups, b.diversity_penalty, b.length_penalty, b.early_stopping) == \
        (4, 2, 0.5, 0.6, "never")


def _distributions(seed: int, rows: int = 6, vocab: int = 4099) -> list[np.ndarray]:
    """Row distributions as the sampler makes them: float32 and float64 softmaxes, peaked and flat, with
    tokens masked to probability 0 by top-k / top-p."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)) * rng.choice([0.5, 3.0, 12.0])
    masked = sampling.top_p(sampling.top_k(x, 50), 0.9)
    # nearly flat over a 64k vocabulary in float32: boundaries 1.5e-5 apart, the float32 sum off 1 by
    # ~1e-5, so a draw whose cumulative sum is taken in float32 or not renormalised picks another token
    flat = sampling.softmax((rng.normal(size=(rows, 65536)) * 0.01).astype(np.float32))
    # choice takes a float32 p whose sum is off 1 by up to sqrt(float32 eps) and renormalises its cumulative sum
    off = (flat * np.float32(1 + 2e-4)).astype(np.float32)
    return [sampling.softmax(x.astype(np.float32)), sampling.softmax(x), sampling.softmax(masked),
            sampling.softmax(masked.astype(np.float32)), flat, off]


@pytest.mark.parametrize("shared", [False, True])
def test_draw_equals_generator_choice_draw_for_draw(shared):
    """``draw`` (all rows' cumulative sums at once) gives exactly numpy's ``Generator.choice(V, p=row)`` for
    each row, from generators in the same state, and leaves them in the same state; one generator shared
    by the rows (step search) is consumed in row order, as consecutive ``choice`` calls do."""
    for seed in range(60):
        for probs in _distributions(seed):
            rows = probs.shape[0]
            mine = [np.random.default_rng([seed, 1])] * rows if shared else \
                [np.random.default_rng([seed, r]) for r in range(rows)]
            ref = [np.random.default_rng([seed, 1])] * rows if shared else \
                [np.random.default_rng([seed, r]) for r in range(rows)]
            got = sampling.draw(probs, mine)
            want = [ref[r].choice(probs.shape[1], p=probs[r]) for r in range(rows)]
            assert got.tolist() == want
            assert all(a.random() == b.random() for a, b in zip(mine, ref, strict=True))


def test_draw_lands_on_every_side_of_a_cumulative_boundary():
    """Draws that fall just below, on and just above a cumulative sum boundary pick the tokens
    ``Generator.choice`` picks (its ``searchsorted(side="right")``): u is fixed by a stand-in generator."""

    class Fixed:
        def __init__(self, u):
            self.u = u

        def random(self):
            return self.u

    p = np.array([[0.25, 0.25, 0.0, 0.5]])
    cdf = np.cumsum(p[0])
    for u, want in [(np.nextafter(0.25, 0), 0), (0.25, 1), (0.5, 3), (np.nextafter(0.5, 0), 1), (0.0, 0)]:
        assert sampling.draw(p, [Fixed(u)]).tolist() == [want] == [int(np.searchsorted(cdf, u, side="right"))]


def test_a_workspace_changes_no_token_and_no_logit():
    """The decode loop's kept buffers (``Workspace``: the float64 cast, the division, the softmax and the
    cumulative sums written in place) give the tokens of ``Generator.choice`` on the allocating path's
    distribution (``warped`` then ``softmax``: the transformers warpers' reference above), step after step
    as rows leave (smaller views of a larger buffer), and leave the caller's logits as they were."""
    work = sampling.Workspace()
    for seed, (t, rows) in enumerate([(0.7, 9), (1.0, 9), (0.7, 4), (1.3, 1), (0.7, 12)]):
        s = GenSettings(do_sample=True, temperature=t)
        logits = random_logits(seed, rows).astype(np.float64)
        before = logits.copy()
        ref = [np.random.default_rng([seed, r]) for r in range(rows)]
        want = [g.choice(V, p=row) for g, row in zip(ref, sampling.softmax(sampling.warped(logits, s)), strict=True)]
        got = sampling.choose_tokens(logits, s, [()] * rows, [np.random.default_rng([seed, r]) for r in range(rows)],
                                     work=work)
        assert got.tolist() == want
        np.testing.assert_array_equal(logits, before)
    probs = work.take("probs", (3, V))
    assert np.shares_memory(probs, work.take("probs", (12, V)))  # kept, not a new array a step


def test_draw_weights_equals_generator_choice_draw_for_draw():
    """``draw_weights`` (the draw placed by block sums, the sequential sums only near a boundary) gives exactly
    ``Generator.choice(V, p=z / z.sum())`` for each row, on peaked, flat (64k vocabulary) and masked weights,
    vocabularies that are and are not a multiple of its block, and leaves the generators in the same state."""
    for seed in range(60):
        for probs in _distributions(seed) + [_distributions(seed, vocab=sampling.BLOCK * 7)[0]]:
            z = np.asarray(probs, np.float64) * 3.5  # weights: any positive scale of the probabilities
            mine = [np.random.default_rng([seed, r]) for r in range(z.shape[0])]
            ref = [np.random.default_rng([seed, r]) for r in range(z.shape[0])]
            p = z / z.sum(axis=-1, keepdims=True)
            want = [ref[r].choice(z.shape[1], p=p[r]) for r in range(z.shape[0])]
            assert sampling.draw_weights(z, mine).tolist() == want
            assert all(a.random() == b.random() for a, b in zip(mine, ref, strict=True))


def test_draw_weights_on_a_boundary_takes_choices_own_steps():
    """Draws exactly on, and one float below, each cumulative boundary (where block sums cannot decide) pick
    ``choice``'s token: its sequential sums decide them."""

    class Fixed:
        def __init__(self, u):
            self.u = u

        def random(self):
            return self.u

    rng = np.random.default_rng(3)
    z = rng.random((1, 3 * sampling.BLOCK + 5)) * (rng.random((1, 3 * sampling.BLOCK + 5)) > 0.3)
    cdf = np.cumsum(z[0] / z.sum())
    cdf /= cdf[-1]
    for u in [0.0, *cdf[[0, 5, sampling.BLOCK - 1, sampling.BLOCK, 2 * sampling.BLOCK + 7, -2]]]:
        for v in (u, np.nextafter(u, 0), np.nextafter(u, 1)):
            if 0 <= v < 1:
                assert sampling.draw_weights(z, [Fixed(v)]).tolist() == [int(np.searchsorted(cdf, v, side="right"))]
