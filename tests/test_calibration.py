"""Calibration statistics (issue 24): hand-computed tables, scikit-learn where it overlaps, scipy's bootstrap,
and the resample-count forms of calibration_boot against the plain definitions on expanded resamples."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.special import log_softmax
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, roc_auc_score

from ortevals.report import calibration as cal
from ortevals.report import calibration_boot as boot
from ortevals.report.calibration_delta import calibration_delta


def probs_to_loglik(p: list[list[float]]) -> np.ndarray:
    """Log-likelihoods whose softmax is ``p`` (an arbitrary per-row shift, as real log-likelihoods have)."""
    return np.log(np.asarray(p, float)) - 7.0 * np.arange(len(p))[:, None]


# --- ECE ------------------------------------------------------------------------------------------------

def test_ece_by_hand_with_empty_bins():
    conf = np.array([0.05, 0.15, 0.15, 0.95])
    correct = np.array([0, 1, 0, 1])
    # bins 0, 1, 9 hold questions; 2..8 are empty and add nothing
    expected = 0.25 * abs(0 - 0.05) + 0.5 * abs(0.5 - 0.15) + 0.25 * abs(1 - 0.95)
    assert cal.ece(conf, correct) == pytest.approx(expected, abs=1e-15)
    rel = cal.reliability(conf, correct)
    assert rel.count.tolist() == [1, 1 + 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert np.isnan(rel.accuracy[2:9]).all()


def test_a_value_on_an_edge_goes_to_the_bin_below_as_in_sklearn():
    # 0.5 is exactly the edge between bins 4 and 5 (np.linspace(0, 1, 11)[5] == 0.5): it belongs to (0.4, 0.5]
    conf = np.array([0.5, 0.5, 0.5 + 1e-9, 0.0, 1.0])
    correct = np.array([1, 0, 1, 0, 1])
    rel = cal.reliability(conf, correct)
    assert rel.count[4] == 2 and rel.count[5] == 1 and rel.count[0] == 1 and rel.count[9] == 1
    expected = (2 * abs(0.5 - 0.5) + abs(1 - (0.5 + 1e-9)) + abs(0 - 0.0) + abs(1 - 1.0)) / 5
    assert cal.ece(conf, correct) == pytest.approx(expected, abs=1e-15)
    prob_true, prob_pred = calibration_curve(correct, conf, n_bins=10, strategy="uniform")
    live = rel.count > 0
    np.testing.assert_allclose(rel.accuracy[live], prob_true, atol=1e-15)
    np.testing.assert_allclose(rel.confidence[live], prob_pred, atol=1e-15)


@pytest.mark.parametrize("strategy,sk", [("uniform", "uniform"), ("mass", "quantile")])
def test_reliability_matches_sklearn_calibration_curve(strategy, sk):
    rng = np.random.default_rng(3)
    conf = np.round(rng.uniform(0.1, 1.0, 400), 2)  # rounded: many ties, some exactly on edges
    correct = (rng.uniform(size=400) < conf * 0.8).astype(float)
    rel = cal.reliability(conf, correct, 10, strategy)
    prob_true, prob_pred = calibration_curve(correct, conf, n_bins=10, strategy=sk)
    live = rel.count > 0
    np.testing.assert_allclose(rel.accuracy[live], prob_true, atol=1e-12)
    np.testing.assert_allclose(rel.confidence[live], prob_pred, atol=1e-12)
    weighted = np.sum(rel.count[live] / len(conf) * np.abs(prob_true - prob_pred))
    assert cal.ece(conf, correct, 10, strategy) == pytest.approx(weighted, abs=1e-12)


def test_one_question():
    loglik = probs_to_loglik([[0.7, 0.2, 0.1]])
    c = cal.calibrate(loglik, np.array([1]))
    assert c.n == 1 and c.accuracy == 0.0
    assert c.ece.estimate == pytest.approx(0.7) and c.ece_mass.estimate == pytest.approx(0.7)
    assert c.brier.estimate == pytest.approx(0.7**2 + 0.8**2 + 0.1**2)
    assert c.nll.estimate == pytest.approx(-math.log(0.2))
    assert c.aurc.estimate == 1.0 and c.acc_at_half.estimate == 0.0 and math.isnan(c.auroc.estimate)
    assert math.isnan(c.ece.low) and math.isnan(c.brier.se)  # one question has no spread to resample
    assert c.temperature is None


# --- Brier, NLL ------------------------------------------------------------------------------------------

def test_multiclass_brier_and_nll_by_hand_and_against_sklearn():
    p = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]
    gold = np.array([0, 0, 2])
    logp = log_softmax(np.asarray(probs_to_loglik(p), np.float64), axis=1)
    by_hand = [0.5**2 + 0.3**2 + 0.2**2, 0.9**2 + 0.6**2 + 0.3**2, 0.25**2 + 0.25**2 + 0.5**2]
    np.testing.assert_allclose(cal.brier_values(logp, gold), by_hand, atol=1e-12)
    assert np.mean(by_hand) == pytest.approx(brier_score_loss(gold, np.array(p), labels=[0, 1, 2]), abs=1e-12)
    one_vs_rest = sum(brier_score_loss((gold == c).astype(int), np.array(p)[:, c], pos_label=1) for c in range(3))
    assert np.mean(by_hand) == pytest.approx(one_vs_rest, abs=1e-12)
    np.testing.assert_allclose(cal.nll_values(logp, gold), [-math.log(0.5), -math.log(0.1), -math.log(0.5)])


def test_two_choices_brier_is_twice_sklearns_binary():
    p1 = np.array([0.9, 0.4, 0.2, 0.65])
    gold = np.array([1, 1, 0, 0])
    logp = log_softmax(np.asarray(probs_to_loglik(np.stack([1 - p1, p1], axis=1).tolist()), np.float64), axis=1)
    assert cal.brier_values(logp, gold).mean() == pytest.approx(2 * brier_score_loss(gold, p1), abs=1e-12)


def test_padded_choices_count_nothing():
    loglik = np.array([[-1.0, -2.0, -np.inf], [-3.0, -1.0, -2.0]])
    gold = np.array([0, 2])
    p0 = np.exp([-1.0, -2.0]) / np.exp([-1.0, -2.0]).sum()
    c = cal.calibrate(loglik, gold)
    p1 = np.exp([-3.0, -1.0, -2.0]) / np.exp([-3.0, -1.0, -2.0]).sum()
    assert c.brier.estimate == pytest.approx(((p0[0] - 1) ** 2 + p0[1] ** 2 + (p1 ** 2).sum() - 2 * p1[2] + 1) / 2)


# --- selective prediction ---------------------------------------------------------------------------------

def test_aurc_and_accuracy_at_half_by_hand():
    conf = np.array([0.6, 0.9, 0.7, 0.8])
    correct = np.array([0, 1, 1, 0])  # by confidence: 0.9 right, 0.8 wrong, 0.7 right, 0.6 wrong
    np.testing.assert_allclose(cal.risk_curve(conf, correct), [0, 1 / 2, 1 / 3, 2 / 4])
    assert cal.aurc(conf, correct) == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)
    assert cal.selective_accuracy(conf, correct) == pytest.approx(0.5)


def test_ties_spread_errors_evenly():
    conf, correct = np.array([0.9, 0.9, 0.5]), np.array([1, 0, 1])
    # the two orders of the tie: risks (0, 1/2, 1/3) and (1, 1/2, 1/3); their mean
    assert cal.aurc(conf, correct) == pytest.approx(((0 + 0.5 + 1 / 3) + (1 + 0.5 + 1 / 3)) / 6)


def test_tied_risk_curve_is_the_mean_over_every_order_of_the_ties():
    rng = np.random.default_rng(5)
    for _ in range(20):
        conf = rng.choice([0.2, 0.5, 0.7, 0.9], size=6)
        correct = rng.integers(0, 2, 6).astype(float)
        curves = [np.cumsum(1 - correct[list(p)]) / np.arange(1, 7) for p in itertools.permutations(range(6))
                  if all(conf[p[i]] >= conf[p[i + 1]] for i in range(5))]
        assert curves
        np.testing.assert_allclose(cal.risk_curve(conf, correct), np.mean(curves, axis=0), atol=1e-12)


def test_auroc_against_sklearn_with_ties():
    rng = np.random.default_rng(7)
    score = np.round(rng.uniform(size=300), 1)
    correct = (rng.uniform(size=300) < score).astype(float)
    assert cal.auroc(score, correct) == pytest.approx(roc_auc_score(correct, score), abs=1e-12)
    assert math.isnan(cal.auroc(score, np.ones(300)))


# --- resample counts: every statistic against its plain definition on the expanded resample --------------------

def statistics(conf, correct):
    area, accuracy_at = boot.risk(conf, correct)
    return {
        "ece": (cal.ece_statistic(conf, correct), lambda c, k: cal.ece(c, k)),
        "ece_mass": (cal.ece_statistic(conf, correct, "mass"), lambda c, k: cal.ece(c, k, 10, "mass")),
        "aurc": (area, cal.aurc),
        "acc_at_half": (accuracy_at(0.5), cal.selective_accuracy),
        "acc_at_30": (accuracy_at(0.3), lambda c, k: cal.selective_accuracy(c, k, 0.3)),
        "auroc": (boot.auroc(conf, correct), cal.auroc),
        "mean": (boot.mean(conf), lambda c, k: np.mean(c)),
    }


@pytest.mark.parametrize("n", [2, 7, 150])
def test_count_forms_equal_the_definitions_on_expanded_resamples(n):
    rng = np.random.default_rng(n)
    conf = np.round(rng.uniform(0.05, 1.0, n), 2)  # ties and edge values; draws add duplicates
    correct = (rng.uniform(size=n) < conf).astype(float)
    stats = statistics(conf, correct)
    idx = rng.integers(0, n, size=(25, n))
    w = boot.counts(idx, n)
    for name, (by_counts, plain) in stats.items():
        np.testing.assert_allclose(by_counts(np.ones(n)), plain(conf, correct), atol=1e-12, err_msg=name)
        got = by_counts(w)
        want = [plain(conf[i], correct[i]) for i in idx]
        np.testing.assert_allclose(got, want, atol=1e-12, equal_nan=True, err_msg=name)


def test_interval_is_scipys_paired_bootstrap_of_the_definition():
    from scipy.stats import bootstrap

    rng = np.random.default_rng(11)
    conf = rng.uniform(0.1, 1, 200)
    correct = (rng.uniform(size=200) < conf ** 2).astype(float)
    ours = boot.interval(cal.ece_statistic(conf, correct), 200, resamples=300)
    ref = bootstrap((conf, correct), lambda c, k, axis=-1: cal.ece(c, k), paired=True, vectorized=True,
                    n_resamples=300, method="percentile", rng=np.random.default_rng(boot.SEED))
    assert ours.low == pytest.approx(ref.confidence_interval.low, abs=1e-12)
    assert ours.high == pytest.approx(ref.confidence_interval.high, abs=1e-12)
    assert ours.se == pytest.approx(ref.standard_error, abs=1e-12)


# --- temperature --------------------------------------------------------------------------------------------

def two_choice_questions(d: float, right: int, wrong: int) -> tuple[np.ndarray, np.ndarray]:
    """Every question's log-likelihoods differ by d; the more likely choice is gold in ``right`` of them."""
    loglik = np.tile([0.0, -d], (right + wrong, 1))
    return loglik, np.array([0] * right + [1] * wrong)


def test_temperature_fit_by_hand():
    # NLL(β) = −q log σ(βd) − (1−q) log σ(−βd) is minimal at σ(βd) = q: T = d / logit(q)
    loglik, gold = two_choice_questions(2.0, 75, 25)
    assert cal.fit_temperature(loglik, gold) == pytest.approx(2.0 / math.log(3), rel=1e-6)
    c = cal.calibrate(loglik, gold)
    assert c.temperature.value.estimate == pytest.approx(2.0 / math.log(3), rel=1e-6)
    assert c.temperature.value.low < 2.0 / math.log(3) < c.temperature.value.high
    # after scaling, every confidence is 0.75 (each held-out fit sees 75% right): ECE ≈ 0
    assert c.temperature.ece.estimate < 0.02 and c.ece.estimate == pytest.approx(1 / (1 + math.exp(-2)) - 0.75)


def test_separable_data_runs_to_the_bound():
    loglik, gold = two_choice_questions(1.0, 10, 0)
    c = cal.calibrate(loglik, gold)
    assert c.temperature.at_bound and c.temperature.value.estimate == pytest.approx(cal.T_BOUNDS[0], rel=1e-3)
    assert math.isnan(c.temperature.value.low)


def test_one_step_bootstrap_agrees_with_refitting_each_resample():
    rng = np.random.default_rng(2)
    n = 400
    loglik = rng.normal(size=(n, 4)) * 3
    gold = rng.integers(0, 4, n)
    loglik[np.arange(n), gold] += 1.5
    t = cal.fit_temperature(loglik, gold)
    step = cal.one_step_temperature(loglik, gold, t)
    for idx in rng.integers(0, n, size=(10, n)):
        refit = cal.fit_temperature(loglik[idx], gold[idx])
        assert float(step(boot.counts(idx, n))) == pytest.approx(refit, rel=5e-3)


def test_heldout_temperature_never_sees_its_own_question():
    rng = np.random.default_rng(4)
    loglik = rng.normal(size=(30, 3))
    gold = rng.integers(0, 3, 30)
    before = cal.heldout_temperatures(loglik, gold)
    changed = loglik.copy()
    changed[5] *= 20  # question 5's own scores move; its held-out T must not
    after = cal.heldout_temperatures(changed, gold)
    assert after[5] == before[5] and not np.allclose(after, before)


def test_a_separate_split_fits_the_temperature():
    loglik, gold = two_choice_questions(2.0, 30, 10)
    fit = two_choice_questions(4.0, 9, 1)
    c = cal.calibrate(loglik, gold, fit=fit, fit_label="validation split")
    assert c.temperature.value.estimate == pytest.approx(4.0 / math.log(9), rel=1e-6)
    assert c.temperature.fitted_on == "validation split (10 questions)"
    scaled = 1 / (1 + math.exp(-2.0 / (4.0 / math.log(9))))
    assert c.temperature.ece.estimate == pytest.approx(abs(scaled - 0.75), abs=1e-9)


# --- P(True), deltas -------------------------------------------------------------------------------------------

def test_self_eval_against_sklearn_and_by_hand():
    ll_true = np.log([0.6, 0.2, 0.9, 0.5])
    ll_false = np.log([0.2, 0.6, 0.1, 0.5])
    p = cal.p_true(ll_true, ll_false)
    np.testing.assert_allclose(p, [0.75, 0.25, 0.9, 0.5])
    correct = np.array([1, 0, 0, 1])
    s = cal.self_eval(p, correct)
    assert s.auroc.estimate == pytest.approx(roc_auc_score(correct, p)) == pytest.approx(0.5)
    assert s.brier.estimate == pytest.approx((0.25**2 + 0.25**2 + 0.9**2 + 0.5**2) / 4)
    # one question per bin (2, 4, 7, 8): ECE is the mean |correct − P(True)|
    assert s.ece.estimate == pytest.approx((abs(1 - 0.75) + abs(0 - 0.25) + abs(0 - 0.9) + abs(1 - 0.5)) / 4)
    assert s.mean == pytest.approx(0.6)


def test_calibration_delta_by_hand_and_zero_for_identical_runs():
    # confidences away from bin edges; within a bin all errors have one sign, so ECE = mean |correct − conf|
    ref = probs_to_loglik([[0.62, 0.38], [0.72, 0.28], [0.18, 0.82], [0.56, 0.44]])
    run = probs_to_loglik([[0.88, 0.12], [0.93, 0.07], [0.13, 0.87], [0.78, 0.22]])  # same answers, surer
    gold = np.array([0, 1, 1, 0])
    d = calibration_delta(ref, run, gold, resamples=200)
    ece_ref = (abs(1 - 0.62) + abs(0 - 0.72) + abs(1 - 0.82) + abs(1 - 0.56)) / 4
    ece_run = (abs(1 - 0.88) + abs(0 - 0.93) + abs(1 - 0.87) + abs(1 - 0.78)) / 4
    assert d.ref_ece == pytest.approx(ece_ref) and d.ece == pytest.approx(ece_run)
    assert d.delta_ece.estimate == pytest.approx(ece_run - ece_ref)
    b_ref = np.mean([2 * 0.38**2, 2 * 0.72**2, 2 * 0.18**2, 2 * 0.44**2])
    b_run = np.mean([2 * 0.12**2, 2 * 0.93**2, 2 * 0.13**2, 2 * 0.22**2])
    assert d.delta_brier.estimate == pytest.approx(b_run - b_ref)
    same = calibration_delta(ref, ref, gold, resamples=200)
    assert same.delta_ece.estimate == same.delta_ece.low == same.delta_ece.high == 0.0
    assert same.delta_brier.low == same.delta_brier.high == 0.0


def test_compare_reports_calibration_deltas(tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_compare import CATS, LABELS, record, write_ortevals_run

    # the same answers in both runs (gold A; q4 answers B, q7 C), the run surer of each: over-confidence grows
    answers = "AAAABAAC"
    lls = {m: [[-2.0 + (m if lab == a else 0.0) - 0.1 * i for i, lab in enumerate(LABELS)] for a in answers]
           for m in (1.0, 3.0)}

    def folder(name: str, margin: float):
        return write_ortevals_run(tmp_path / name, [record(i, v, category=c) for i, (v, c) in
                                                    enumerate(zip(lls[margin], CATS))])

    ref, run = folder("ref", 1.0), folder("run", 3.0)
    out = tmp_path / "cmp.json"
    result = CliRunner().invoke(cli, ["compare", "--ref", str(ref), str(run), "--json", str(out), "--report",
                                      str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    (rec,) = __import__("json").loads(out.read_text())
    gold = np.zeros(8, dtype=int)
    by_hand = {m: cal.confidence(np.array(v), gold) for m, v in lls.items()}
    assert rec["ref_ece"] == pytest.approx(float(cal.ece(*by_hand[1.0])))
    assert rec["delta_ece"] == pytest.approx(float(cal.ece(*by_hand[3.0]) - cal.ece(*by_hand[1.0])))
    gap = {m: float(np.mean(c - k)) for m, (c, k) in by_hand.items()}
    assert rec["delta_overconfidence"] == pytest.approx(gap[3.0] - gap[1.0])
    assert rec["delta_overconfidence_ci"][0] > 0  # every question more confident, none more often right
    assert rec["temperature"] > rec["ref_temperature"]
    assert f"over-confident by {gap[3.0]:.4f}" in result.output and "temperature needed" in result.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Calibration (paired 95% intervals)" in md and f"{rec['delta_ece']:+.4f}" in md
    assert "![Reliability diagram](reliability.png)" in md
