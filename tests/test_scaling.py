"""maj@k, pass@k and best-of-k (report/scaling.py) on hand-made answer tables: the first-k estimators and
ortevals' subset-averaged ones (``_avg``)."""

import itertools
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from ortevals.errors import OrtEvalsError
from ortevals.report.scaling import (
    QuestionSamples,
    curve_plot,
    ks_for,
    lm_eval_metrics,
    maj_at_k,
    maj_avg_at_k,
    pass_at_k,
    scaling_curves,
)

# Question 1: answers A A B C, gold A; mean log-probs: B is the most confident, then A1, A2, C.
Q1 = QuestionSamples(("A", "A", "B", "C"), (True, True, False, False), (-0.5, -1.0, -0.2, -2.0), (10, 20, 30, 40))
# Question 2: nothing right; two samples extracted no answer.
Q2 = QuestionSamples((None, "B", "B", None), (False, False, False, False), (-0.1, -0.2, -0.3, -0.4), (5, 5, 5, 5))


def test_question_1_by_hand():
    """maj_avg@2: 6 pairs: {A1,A2} right (1); 4 pairs A+B or A+C tie 1-1 (1/2 each); {B,C} 0 -> 3/6.
    maj_avg@3: {A1,A2,B}, {A1,A2,C} right; {A1,B,C}, {A2,B,C} a three-way tie (1/3 each) -> (2+2/3)/4.
    pass@2 = 1 - C(2,2)/C(4,2) = 5/6. best_avg@2: the chosen one is the higher log-prob: A1 wins over A2
    and C (2 pairs), A2 over C (1 pair); B wins all its pairs -> 3/6. best_avg@3: only {A1,A2,C} -> 1/4.
    The first k (A A B C): maj@1, @2 A right; maj@4 A (2 votes) right; best@1 A1, best@2 A1 (-0.5 > -1.0),
    best@4 B (-0.2) wrong."""
    want = {("maj_avg", 1): 0.5, ("maj_avg", 2): 0.5, ("maj_avg", 4): 1.0,
            ("pass", 1): 0.5, ("pass", 2): 5 / 6, ("pass", 4): 1.0,
            ("best_avg", 1): 0.5, ("best_avg", 2): 0.5, ("best_avg", 4): 0.0,
            ("maj", 1): 1.0, ("maj", 2): 1.0, ("maj", 4): 1.0,
            ("best", 1): 1.0, ("best", 2): 1.0, ("best", 4): 0.0}
    got = {(p.estimator, p.k): p.value for p in scaling_curves([Q1])}
    assert got == pytest.approx(want)
    assert maj_avg_at_k(Q1, 3) == pytest.approx((2 + 2 / 3) / 4) and maj_at_k(Q1, 3) == 1.0
    from ortevals.report.scaling import best_at_k, best_avg_at_k
    assert best_avg_at_k(Q1.correct, Q1.mean_logprob, 3) == pytest.approx(1 / 4)
    assert best_at_k(Q1.correct, Q1.mean_logprob, 3) == 0.0  # B among the first three


def test_two_questions_mean_interval_and_tokens():
    pts = {(p.estimator, p.k): p for p in scaling_curves([Q1, Q2])}
    assert pts[("maj_avg", 2)].value == pytest.approx(0.25) and pts[("pass", 2)].value == pytest.approx(5 / 12)
    p = pts[("pass", 2)]
    assert p.stderr == pytest.approx(np.std([5 / 6, 0], ddof=1) / np.sqrt(2))
    assert p.low <= p.value <= p.high
    # tokens: mean per sample over questions = (25 + 5) / 2 = 15 -> 15 k
    assert pts[("maj", 4)].tokens == pytest.approx(60.0)
    m = lm_eval_metrics(list(pts.values()), "flexible-extract")
    assert m["maj_avg@2,flexible-extract"] == pytest.approx(0.25) and "pass@4_stderr,flexible-extract" in m
    assert m["maj@2,flexible-extract"] == pytest.approx(0.5)  # Q1's A A right, Q2's [invalid] B wrong


def brute_maj(answers, correct, k):
    """Every k-subset enumerated; ties share the credit equally."""
    total = Fraction(0)
    subsets = list(itertools.combinations(range(len(answers)), k))
    for sub in subsets:
        votes = Counter(answers[i] for i in sub if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        winners = [a for a, v in votes.items() if v == top]
        right = {answers[i] for i in sub if correct[i]}
        total += Fraction(sum(a in right for a in winners), len(winners))
    return float(total / len(subsets))


@pytest.mark.parametrize("seed", range(6))
def test_maj_avg_at_k_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    n = 10
    answers = [None if r < 0.15 else "ABCD"[int(r * 10) % 4] for r in rng.random(n)]
    gold = "AB"[seed % 2]
    correct = [a == gold for a in answers]
    q = QuestionSamples(tuple(answers), tuple(correct))
    for k in range(1, n + 1):
        assert maj_avg_at_k(q, k) == pytest.approx(brute_maj(answers, correct, k), abs=1e-12), k


def test_pass_at_k_formula_and_ks():
    assert pass_at_k(10, 0, 5) == 0 and pass_at_k(10, 10, 1) == 1
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert ks_for(16) == [1, 2, 4, 8, 16] and ks_for(12) == [1, 2, 4, 8, 12] and ks_for(1) == [1]


def test_bad_tables_are_one_line_errors(tmp_path):
    with pytest.raises(OrtEvalsError, match="same number of samples"):
        scaling_curves([Q1, QuestionSamples(("A",), (True,))])
    with pytest.raises(OrtEvalsError, match="both right and wrong"):
        maj_at_k(QuestionSamples(("A", "A"), (True, False)), 2)
    with pytest.raises(OrtEvalsError, match="both right and wrong"):
        maj_avg_at_k(QuestionSamples(("A", "A"), (True, False)), 1)
    out = curve_plot(scaling_curves([Q1, Q2]), tmp_path / "curve.png", "hand-made")
    assert out.stat().st_size > 1000
