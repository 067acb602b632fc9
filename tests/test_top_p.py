"""top-p without a full-vocabulary sort (engine/generate/choice/logits.py, issue 20 §1): the kept set equals
transformers' TopPLogitsWarper (ties, p near 1, tiny p, a 262k vocabulary), it is the very set the
full sort keeps (the samples are token-equal with the same seeds), and only the nucleus is sorted."""

import numpy as np
import pytest
import torch
from transformers.generation import TopPLogitsWarper

from ortevals.engine.generate.choice import logits as sampling


def theirs(x: np.ndarray, p: float) -> np.ndarray:
    """transformers' warper on the same float64 logits (its sums at our precision)."""
    return TopPLogitsWarper(p)(torch.zeros(x.shape[0], 1, dtype=torch.long), torch.from_numpy(x.copy())).numpy()


def assert_same_as_transformers(mine: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    """Same kept tokens; where the boundary falls inside a group of equal logits, the same number of
    them (transformers takes them in torch's unstable sort order, ortevals the highest indices)."""
    kept, ref_kept = np.isfinite(mine), np.isfinite(ref)
    for r in range(x.shape[0]):
        assert kept[r].sum() == ref_kept[r].sum()
        edge = x[r][kept[r]].min()
        assert (kept[r] == ref_kept[r])[x[r] != edge].all()
        tied = np.flatnonzero(x[r] == edge)
        assert kept[r][tied].tolist() == sorted(kept[r][tied].tolist())  # the highest indices kept
    np.testing.assert_array_equal(mine[kept], x[kept])


def partial_rows(x: np.ndarray, p: float, first: int) -> int:
    """How many rows the partial path decides (the rest go to the full sort)."""
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return sum(sampling._nucleus(x[r], z[r], float(z[r].sum()), p, first) is not None for r in range(x.shape[0]))


def tied_logits(seed: int, rows: int = 8, v: int = 2000) -> np.ndarray:
    """Logits on a grid of 17 values: each shared by about 120 tokens, so boundaries fall inside tie groups."""
    return np.random.default_rng(seed).integers(-12, 5, (rows, v)) * 1.5


@pytest.mark.parametrize("p", [0.05, 0.2, 0.37, 0.5, 0.61, 0.8, 0.93])
def test_ties_split_at_the_boundary(p):
    decided = 0
    for seed in range(6):
        x = tied_logits(seed)
        mine = sampling.top_p(x, p, first=4)
        assert_same_as_transformers(mine, theirs(x, p), x)
        np.testing.assert_array_equal(mine, sampling._top_p_sorted(x, p))
        decided += partial_rows(x, p, 4)
    assert decided > 0  # the partial path itself ran on tied rows


def test_a_split_tie_group_by_hand():
    """p = 0.65 over probabilities (.4, .1, .1, .1, .1, .2 spread): .4 + .1 + .1 = .6 < .65, so the
    top token and three of the four tied .1 tokens are kept: the three of highest index."""
    probs = np.array([0.1, 0.4, 0.1, 0.05, 0.1, 0.05, 0.1, 0.05, 0.05])
    x = np.log(probs)[None, :]
    kept = np.isfinite(sampling.top_p(x, 0.65, first=2))[0]
    assert np.flatnonzero(kept).tolist() == [1, 2, 4, 6]
    assert np.isfinite(theirs(x, 0.65)).sum() == 4


@pytest.mark.parametrize("p", [0.999, 0.99999, 1 - 1e-9, 1e-6, 1e-12])
def test_p_near_one_and_tiny_p(p):
    rng = np.random.default_rng(3)
    for scale in (0.5, 3.0, 12.0):
        x = rng.standard_normal((6, 97 * 8)) * scale
        mine = sampling.top_p(x, p, first=8)
        assert_same_as_transformers(mine, theirs(x, p), x)
        np.testing.assert_array_equal(mine, sampling._top_p_sorted(x, p))
    if p < 1e-3:  # tiny p keeps the single most likely token
        assert (np.isfinite(mine).sum(axis=-1) == 1).all() and partial_rows(x, p, 8) == 6


@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 0.999])
def test_vocabulary_of_262k(p):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 262_144)) * np.array([[2.0], [4.0], [6.0], [9.0]])
    mine = sampling.top_p(x, p)
    assert_same_as_transformers(mine, theirs(x, p), x)
    np.testing.assert_array_equal(mine, sampling._top_p_sorted(x, p))


def test_samples_are_token_equal_to_the_full_sort():
    """Same seeds, same settings: every drawn token is the one the full-sort top-p gives."""
    from ortevals.engine.generate.choice.settings import GenSettings

    s = GenSettings(do_sample=True, temperature=0.8, top_k=0, top_p=0.9, min_p=0.01)
    rng = np.random.default_rng(5)
    logits = [rng.standard_normal((8, 4096)) * 5 for _ in range(20)]

    def draw(top_p):
        gens = [np.random.default_rng(100 + i) for i in range(8)]
        original = sampling.top_p
        sampling.top_p = top_p
        try:
            return [sampling.choose_tokens(x, s, [()] * 8, gens).tolist() for x in logits]
        finally:
            sampling.top_p = original

    assert draw(sampling.top_p) == draw(sampling._top_p_sorted)


def test_only_the_nucleus_is_sorted(monkeypatch):
    """On peaked rows of a 262k vocabulary, the partial path sorts a few thousand elements where the
    full sort sorts all 4 × 262,144 (argpartition and exp still read every logit once)."""
    counted = {"sort": 0, "argsort": 0}
    for name in counted:
        original = getattr(np, name)

        def counting(a, *args, _name=name, _original=original, **kwargs):
            counted[_name] += np.size(a)
            return _original(a, *args, **kwargs)

        monkeypatch.setattr(np, name, counting)
    x = np.random.default_rng(2).standard_normal((4, 262_144)) * 6.0
    kept = np.isfinite(sampling.top_p(x, 0.9)).sum(axis=-1)
    assert (kept < 300).all()
    assert sum(counted.values()) <= 4 * 2 * 4 * 256  # each row: 64 then 256 candidates, values and masses
    assert counted["argsort"] == 0
