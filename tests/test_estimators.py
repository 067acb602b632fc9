"""The @k metrics equal the definitions their names promise: ``maj@k`` against lm-eval's own filter chain
(``take_first_k`` → ``regex`` → ``majority_vote`` → ``take_first``, then its ``exact_match``), ``bon@k`` /
``weighted_maj@k`` (and the PRM and certainty variants) against a port of search-and-learn's scoring
(``src/sal/utils/score.py``, ``math.py``), on hand-made samples; ortevals' subset-averaged estimators keep
their own ``_avg`` names."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.metrics import exact_match_hf_evaluate
from lm_eval.filters import build_filter_ensemble

from ortevals.report.samples import is_correct, sample_answers
from ortevals.report.scaling import QuestionSamples, maj_at_k, maj_avg_at_k, per_question, scaling_curves
from ortevals.report.selection import ScoredQuestion, selection_curves
from ortevals.report.selection import per_question as select

REGEX = r"answer is \(?([A-J])\)?"
CFG = {"task": "t", "filter_list": [{"name": "x", "filter": [{"function": "regex", "regex_pattern": REGEX},
                                                             {"function": "take_first"}]}],
       "metric_list": [{"metric": "exact_match"}]}


# --- lm-eval's maj@k: its own filters and metric ------------------------------------------------------------

def lm_eval_maj(texts: list[str], target: str, k: int) -> float:
    """lm-eval's gsm8k_cot_self_consistency ``maj@k`` filter chain on one doc, then its exact_match."""
    chain = build_filter_ensemble("maj", [("take_first_k", {"k": k}), ("regex", {"regex_pattern": REGEX}),
                                          ("majority_vote", None), ("take_first", None)])
    inst = Instance("generate_until", {}, ("", {}), 0)
    inst.resps = list(texts)
    chain.apply([inst])
    return float(exact_match_hf_evaluate([inst.filtered_resps["maj"]], [target])["exact_match"])


def ours_maj(texts: list[str], target: str, k: int) -> float:
    """ortevals' maj@k from the same texts: each sample's answer through the task's filters (report/samples.py)."""
    answers = sample_answers(CFG, texts, {})["x"]
    return maj_at_k(QuestionSamples(tuple(answers), tuple(is_correct(CFG, answers, target))), k)


def text(answer: str | None) -> str:
    return "I do not know" if answer is None else f"so the answer is ({answer})"


def test_the_issues_example_invalid_votes():
    """Samples [none, none, none, A], A right: lm-eval's maj@4 elects [invalid] (0); ortevals' own estimator, which
    drops the samples with no answer, stays under maj_avg (1.0)."""
    texts = [text(None)] * 3 + [text("A")]
    assert lm_eval_maj(texts, "A", 4) == 0.0
    assert ours_maj(texts, "A", 4) == 0.0
    answers = sample_answers(CFG, texts, {})["x"]
    assert maj_avg_at_k(QuestionSamples(tuple(answers), (False, False, False, True)), 4) == 1.0


def test_ties_go_to_the_first_seen_and_only_the_first_k_vote():
    assert lm_eval_maj([text("B"), text("A"), text("A"), text("B")], "B", 4) == 1.0  # 2-2: B seen first
    assert ours_maj([text("B"), text("A"), text("A"), text("B")], "B", 4) == 1.0
    assert ours_maj([text("A"), text("B"), text("B"), text("B")], "A", 2) == 1.0  # the first two: A, B: A first
    assert ours_maj([text("A"), text("B"), text("B"), text("B")], "A", 4) == 0.0


def test_maj_at_k_equals_lm_evals_filters_on_random_samples():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        texts = [text([None, "A", "B", "C"][i]) for i in rng.integers(0, 4, n)]
        target = "ABC"[int(rng.integers(0, 3))]
        for k in range(1, n + 1):
            assert ours_maj(texts, target, k) == lm_eval_maj(texts, target, k), (texts, target, k)


# --- search-and-learn's bon@k and weighted_maj@k: its scoring functions, ported ----------------------------
# search-and-learn compares answers by a canonical form (sympy); the answers here are letters, so the
# canonical form is the answer itself. extract_answer returns "" where nothing is extracted: None here.

def sal_aggregate_scores(scores, agg_strategy):
    if agg_strategy == "min":
        return min(scores)
    if agg_strategy == "prod":
        return math.prod(scores)
    if agg_strategy == "last":
        return scores[-1]
    raise ValueError(agg_strategy)


def sal_subsample_completions(x, n):
    return {f"completions@{n}": x["completions"][:n], f"agg_scores@{n}": x["agg_scores"][:n]}


def sal_find_answer_with_largest_sum(answers, scores):
    canonical_groups = defaultdict(float)
    canonical_to_original = {}
    for answer, score in zip(answers, scores):
        canonical_groups[answer] += score
        if answer not in canonical_to_original:
            canonical_to_original[answer] = answer
    max_canonical = max(canonical_groups, key=canonical_groups.get)
    return canonical_to_original[max_canonical]


def sal_find_majority_answer(answers):
    canonical_groups = defaultdict(int)
    canonical_to_original = {}
    for answer in answers:
        canonical_groups[answer] += 1
        if answer not in canonical_to_original:
            canonical_to_original[answer] = answer
    max_count = max(canonical_groups.values())
    for canonical_form, count in canonical_groups.items():
        if count == max_count:
            return canonical_to_original[canonical_form]


def sal_preds(x, n):
    """compute_naive_pred, compute_weighted_pred and compute_maj_pred at n, as score() chains them."""
    x = {**x, **sal_subsample_completions(x, n)}
    preds, scores = x[f"completions@{n}"], x[f"agg_scores@{n}"]  # the completions are the extracted answers
    naive = [p for p, s in sorted(zip(preds, scores), key=lambda x: x[1], reverse=True)][0]
    return {"naive": naive, "weighted": sal_find_answer_with_largest_sum(preds, scores),
            "maj": sal_find_majority_answer(preds)}


def test_selectors_equal_search_and_learns_scoring_on_random_samples():
    rng = np.random.default_rng(1)
    for _ in range(150):
        n = int(rng.integers(1, 9))
        answers = [[None, "a", "b", "c"][i] for i in rng.integers(0, 4, n)]
        gold = "abc"[int(rng.integers(0, 3))]
        correct = tuple(a == gold for a in answers)
        values = [0.1, 0.25, 0.5, 0.75, 0.9]  # few distinct values: sums and scores tie often
        steps = tuple(tuple(rng.choice(values, int(rng.integers(1, 4))).tolist()) for _ in range(n))
        verifier = tuple(rng.choice(values, n).tolist())
        q = ScoredQuestion(QuestionSamples(tuple(answers), correct), verifier=verifier, steps=steps,
                           certainty=verifier)
        sal_answers = ["" if a is None else a for a in answers]
        for k in range(1, n + 1):
            want = sal_preds({"completions": sal_answers, "agg_scores": list(verifier)}, k)
            assert select([q], "bon", k)[0] == (want["naive"] == gold)
            assert select([q], "bon_certainty", k)[0] == (want["naive"] == gold)
            assert select([q], "weighted_maj", k)[0] == (want["weighted"] == gold)
            assert per_question([q.samples], "maj", k)[0] == (want["maj"] == gold)
            for agg in ("last", "min", "prod"):
                folded = [sal_aggregate_scores(list(s), agg) for s in steps]
                want = sal_preds({"completions": sal_answers, "agg_scores": folded}, k)
                assert select([q], f"bon_prm_{agg}", k)[0] == (want["naive"] == gold)
                assert select([q], f"weighted_maj_prm_{agg}", k)[0] == (want["weighted"] == gold)


def test_the_issues_example_logits_are_refused_probabilities_elect_the_right_answer():
    """right×3, wrong×1: the classifier's logits [-1, -1, -1, -2] summed elect the wrong answer (-2 > -3); their
    sigmoids (what a verifier scores now) elect the right one; raw logits are refused in one line."""
    from scipy.special import expit

    from ortevals.errors import OrtEvalsError

    samples = QuestionSamples(("r", "r", "r", "w"), (True, True, True, False))
    logits = (-1.0, -1.0, -1.0, -2.0)
    assert select([ScoredQuestion(samples, verifier=tuple(expit(logits)))], "weighted_maj", 4)[0] == 1.0
    with pytest.raises(OrtEvalsError, match=r"^weighted_maj@k sums verifier scores as probabilities"):
        select([ScoredQuestion(samples, verifier=logits)], "weighted_maj", 4)
    with pytest.raises(OrtEvalsError, match=r"^weighted_maj_avg@k sums verifier scores as probabilities"):
        select([ScoredQuestion(samples, verifier=logits)], "weighted_maj_avg", 4)
    from ortevals.engine.generate.search.steps import aggregate

    with pytest.raises(ValueError, match=r"^prm_aggregation=prod multiplies step scores as probabilities"):
        aggregate([-1.0, -2.0], "prod")  # two negative logits multiplied: 2.0, the best score of all
    assert aggregate(list(expit([-1.0, -2.0])), "prod") == pytest.approx(expit(-1.0) * expit(-2.0))


def test_curves_carry_both_conventions_under_their_own_names():
    qs = [ScoredQuestion(QuestionSamples((None, None, "a", "a"), (False, False, True, True), (-1.0,) * 4),
                         verifier=(0.9, 0.9, 0.2, 0.2))]
    points = {(p.estimator, p.k): p.value for p in scaling_curves([q.samples for q in qs]) + selection_curves(qs)}
    assert points["maj", 4] == 0.0 and points["maj", 2] == 0.0  # 2-2 tie: [invalid], seen first, wins
    assert points["maj_avg", 4] == 1.0  # the samples with no answer do not vote
    assert points["weighted_maj", 4] == 0.0 and points["weighted_maj_avg", 4] == 1.0  # no answer votes 1.8
    assert points["bon", 4] == 0.0 and points["bon_avg", 4] == 0.0


def test_multi_choice_regex_fallback_is_no_answer_not_a_vote():
    """Issue 49 item 2: gpqa's and mmlu flan-cot's flexible-extract (`multi_choice_regex`) leaves "[invalid]" where
    it finds nothing. That is no answer: maj_avg@4 of [none, none, none, (A)] with (A) right is 1.0 by its
    definition (samples with no answer do not vote), and lm-eval's maj@4 still elects [invalid] (0.0)."""
    cfg = {"task": "gpqa", "filter_list": [{"name": "flexible-extract", "filter": [
        {"function": "multi_choice_regex", "group_select": -1, "ignore_case": True, "ignore_punctuation": True,
         "regex_pattern": r"(\([A-Z]\))"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}]}
    doc = {"choices": ["red", "green", "blue", "black"]}
    texts = ["I do not know"] * 3 + ["so it is (A)"]
    answers = sample_answers(cfg, texts, doc)["flexible-extract"]
    assert answers == [None, None, None, "(A)"]
    samples = QuestionSamples(tuple(answers), tuple(is_correct(cfg, answers, "(A)")))
    assert maj_avg_at_k(samples, 4) == 1.0
    assert maj_at_k(samples, 4) == 0.0  # lm-eval's convention: no answer is a vote, and it is the majority
