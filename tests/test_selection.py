"""Selection by verifier or self-certainty (report/selection.py, engine/generate/choice/certainty.py): hand-made tables
with known answers, a brute force over every k-subset (search-and-learn's selection rules), scipy."""

import itertools
from math import comb

import numpy as np
import pytest
from scipy.special import log_softmax
from scipy.stats import entropy

import ortevals.report.selection as sel
from ortevals.engine.generate.choice.certainty import RunningCertainty, certainty_terms, self_certainty
from ortevals.errors import OrtEvalsError
from ortevals.report.scaling import QuestionSamples, lm_eval_metrics
from ortevals.report.selection import (
    ScoredQuestion,
    per_question,
    selection_curves,
    weighted_maj_avg_at_k,
)


def _largest_sum(answers, scores):
    """search-and-learn's find_answer_with_largest_sum (no canonical forms; None does not vote)."""
    groups: dict = {}
    for a, s in zip(answers, scores, strict=True):
        if a is not None:
            groups[a] = groups.get(a, 0.0) + s
    return max(groups, key=groups.get) if groups else None


def _brute(answers, correct, scores, k, rule):
    right = {a for a, c in zip(answers, correct, strict=True) if c and a is not None}
    wins = 0
    for sub in itertools.combinations(range(len(answers)), k):
        if rule == "weighted":
            pick = _largest_sum([answers[i] for i in sub], [scores[i] for i in sub])
            wins += pick in right
        else:
            best = max(sub, key=lambda i: (scores[i], -i))
            wins += bool(correct[best])
    return wins / comb(len(answers), k)


def test_weighted_maj_by_hand():
    # A .9, B .5 + .5, C .2; B right. k=2: only {1,2} {1,3} {2,3} elect B; k=3: {0,1,2} and {1,2,3}
    ans, ok, w = ["A", "B", "B", "C"], [False, True, True, False], [0.9, 0.5, 0.5, 0.2]
    assert [weighted_maj_avg_at_k(ans, ok, w, k) for k in (1, 2, 3, 4)] == [0.5, 0.5, 0.5, 1.0]


def test_weighted_maj_ties_one_sample_all_wrong():
    assert weighted_maj_avg_at_k(["a", "b"], [True, False], [0.5, 0.5], 2) == 1.0  # tie: a seen first
    assert weighted_maj_avg_at_k(["b", "a"], [False, True], [0.5, 0.5], 2) == 0.0
    assert weighted_maj_avg_at_k(["x", "y", "y"], [False, True, True], [0.6, 0.1, 0.5], 3) == 0.0  # 0.1+0.5 == 0.6
    assert weighted_maj_avg_at_k(["x", "y", "y"], [False, True, True], [0.3, 0.1, 0.2], 3) == 1.0  # 0.1+0.2 > 0.3
    # summed in sample order, as search-and-learn adds: (0.1 + 0.2) + 0.3 > 0.6 (0.1 + (0.2 + 0.3) would tie)
    assert weighted_maj_avg_at_k(["x", "y", "y", "y"], [False, True, True, True], [0.6, 0.1, 0.2, 0.3], 4) == 1.0
    assert weighted_maj_avg_at_k(["a"], [True], [0.1], 1) == 1.0
    assert weighted_maj_avg_at_k([None], [False], [0.9], 1) == 0.0
    assert weighted_maj_avg_at_k(["a", "b", None], [False, False, False], [0.9, 0.8, 0.7], 2) == 0.0
    assert weighted_maj_avg_at_k([None, "a", None], [False, True, False], [5.0, 0.1, 5.0], 2) == pytest.approx(2 / 3)


def test_weighted_maj_equals_brute_force_on_random_tables():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        answers = [[None, "a", "b", "c"][i] for i in rng.integers(0, 4, n)]
        right = rng.choice(["a", "b", "c"])
        correct = [a == right for a in answers]
        scores = rng.choice([0.1, 0.2, 0.3, 0.5, 0.7, -0.2], n).tolist() if rng.random() < 0.6 else \
            rng.random(n).tolist()  # few distinct values: sums tie often
        for k in range(1, n + 1):
            want = _brute(answers, correct, scores, k, "weighted")
            assert weighted_maj_avg_at_k(answers, correct, scores, k) == pytest.approx(want, abs=1e-12), \
                (answers, correct, scores, k)


def _q(answers, correct, **scores):
    return ScoredQuestion(QuestionSamples(tuple(answers), tuple(correct), tokens=(10,) * len(answers)), **scores)


def test_bon_and_prm_variants_equal_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(100):
        n = int(rng.integers(1, 8))
        answers = [["a", "b", None][i] for i in rng.integers(0, 3, n)]
        correct = [a == "a" for a in answers]
        steps = tuple(tuple(rng.choice([0.2, 0.5, 0.9], int(rng.integers(1, 4))).tolist()) for _ in range(n))
        verifier = tuple(rng.choice([0.1, 0.4, 0.4, 0.8], n).tolist())
        q = _q(answers, correct, verifier=verifier, steps=steps, certainty=verifier)
        for k in range(1, n + 1):
            assert per_question([q], "bon_avg", k)[0] == pytest.approx(
                _brute(answers, correct, verifier, k, "best"))
            assert per_question([q], "bon_certainty_avg", k)[0] == per_question([q], "bon_avg", k)[0]
            for agg, fold in (("min", min), ("last", lambda s: s[-1]), ("prod", np.prod)):
                folded = [float(fold(s)) for s in steps]
                assert per_question([q], f"bon_prm_{agg}_avg", k)[0] == pytest.approx(
                    _brute(answers, correct, folded, k, "best"))
                assert per_question([q], f"weighted_maj_prm_{agg}_avg", k)[0] == pytest.approx(
                    _brute(answers, correct, folded, k, "weighted"))


def test_bon_by_hand():
    q = _q(["a", "b", "c"], [False, True, False], verifier=(0.3, 0.9, 0.9))  # tie .9: b (index 1) first
    assert [per_question([q], "bon_avg", k)[0] for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [per_question([q], "bon", k)[0] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]  # the first k
    q = _q(["a", "b"], [False, False], verifier=(0.3, 0.9))
    assert per_question([q], "bon", 2)[0] == 0.0 and per_question([q], "bon_avg", 2)[0] == 0.0


def test_curves_intervals_and_lm_eval_names():
    qs = [_q(["a", "b", "a", "b"], [True, False, True, False], verifier=(0.9, 0.1, 0.2, 0.8)),
          _q(["c", "c", "d", "d"], [False, False, True, True], verifier=(0.5, 0.5, 0.4, 0.7))]
    points = selection_curves(qs)
    # no PRM or certainty scores given
    assert {p.estimator for p in points} == {"bon", "weighted_maj", "bon_avg", "weighted_maj_avg"}
    by = {(p.estimator, p.k): p for p in points}
    v = np.array([weighted_maj_avg_at_k(q.samples.answers, q.samples.correct, q.verifier, 2) for q in qs])
    assert by["weighted_maj_avg", 2].value == pytest.approx(v.mean())
    assert by["weighted_maj_avg", 2].stderr == pytest.approx(np.std(v, ddof=1) / np.sqrt(2))
    assert by["weighted_maj", 2].value == 0.5  # q1: a .9 vs b .1; q2: c 1.0 (wrong)
    assert by["bon", 4].tokens == 40
    metrics = lm_eval_metrics(points, "none")
    assert "bon@4,none" in metrics and "weighted_maj@2_stderr,none" in metrics and "bon_avg@4,none" in metrics


def test_bad_tables():
    with pytest.raises(OrtEvalsError, match="one finite verifier score per sample"):
        per_question([_q(["a", "b"], [True, False])], "bon", 1)
    with pytest.raises(OrtEvalsError, match="one finite verifier score per sample"):
        per_question([_q(["a", "b"], [True, False], verifier=(0.1, float("nan")))], "weighted_maj", 1)
    with pytest.raises(OrtEvalsError, match="both right and wrong"):
        weighted_maj_avg_at_k(["a", "a"], [True, False], [0.1, 0.2], 1)
    with pytest.raises(OrtEvalsError, match="unknown selector"):
        per_question([_q(["a"], [True], verifier=(1.0,))], "best_of", 1)
    with pytest.raises(OrtEvalsError, match="same number of samples"):
        selection_curves([_q(["a"], [True], verifier=(1.0,)), _q(["a", "b"], [True, False], verifier=(1.0, 0.0))])


def test_weighted_maj_refuses_too_many_subsets(monkeypatch):
    monkeypatch.setattr(sel, "MAX_SUBSETS", 10)
    with pytest.raises(OrtEvalsError, match=r"weighted_maj_avg@3: one answer has 5 samples \(25 subsets"):
        weighted_maj_avg_at_k(["a"] * 5, [True] * 5, [0.1] * 5, 3)


def test_self_certainty_is_the_mean_kl_from_uniform():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(7, 11)) * 3
    p = np.exp(log_softmax(logits, axis=1))
    kl = np.array([entropy(np.full(11, 1 / 11), row) for row in p])  # scipy: KL(U || p)
    np.testing.assert_allclose(certainty_terms(logits), kl, rtol=1e-12)
    assert self_certainty(log_softmax(logits, axis=1)) == pytest.approx(kl.mean(), rel=1e-12)
    assert self_certainty(np.log(np.full((3, 4), 0.25))) == pytest.approx(0.0, abs=1e-15)


def test_running_certainty_equals_the_pure_function():
    rng = np.random.default_rng(3)
    lengths = [5, 2, 4]
    seqs = [rng.normal(size=(n, 9)) for n in lengths]
    run = RunningCertainty(3)
    for t in range(max(lengths)):
        rows = [r for r in range(3) if t < lengths[r]]  # rows leave as they end
        run.add(np.stack([seqs[r][t] for r in rows]), rows)
    want = [self_certainty(log_softmax(s, axis=1)) for s in seqs]
    np.testing.assert_allclose(run.values(), want, rtol=1e-12)
    assert np.isnan(RunningCertainty(1).values()[0])


def test_self_certainty_of_a_filtered_distribution_is_infinite():
    assert certainty_terms(np.array([[0.0, -np.inf, 1.0]]))[0] == np.inf
    with pytest.raises(ValueError, match=r"log-prob rows \[T, V\]"):
        self_certainty(np.zeros((0, 3)))
