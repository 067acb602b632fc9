"""The decision's statistics (report/decide.py, report/guided.py): the without-replacement confidence sequence covers
the whole-set difference at the time the stopping rule stops, on simulated test sets with known differences, in a
uniform and in a reference-guided order; the miss rate is computed here with numpy and judged with scipy's exact
binomial test, never by the code under test. A naive procedure (a fixed-n normal interval looked at after every
part) fails the same check, so the check has power. The guided sets are simulated as real flips arise: per-choice
log-likelihoods of a reference, and a candidate that adds noise to them, so flips concentrate where the reference's
top two choices are close."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest, chisquare, norm

from ortevals.errors import OrtEvalsError
from ortevals.report.decide import ConfidenceSequence, paired, replay, run_rule, verdict
from ortevals.report.guided import choice_margins, guided_order, guided_weights

ALPHA = 0.05


def simulated_set(sizes, flips, deltas, seed):
    """Two runs' 0/1 correctness on a set of categories of ``sizes``; in each, questions disagree at rate
    ``flips[h]`` and the candidate is ``deltas[h]`` better on average. Returns (candidate, reference)."""
    rng = np.random.default_rng(seed)
    cand, ref = [], []
    for n, f, delta in zip(sizes, flips, deltas):
        u = rng.random(n)
        d = np.where(u < (f + delta) / 2, 1, np.where(u < f, -1, 0))  # P(+1) = (f+Δ)/2, P(-1) = (f-Δ)/2
        same = (rng.random(n) < 0.35).astype(int)
        cand.append(np.where(d == 0, same, d == 1).astype(int))
        ref.append(np.where(d == 0, same, d == -1).astype(int))
    return np.concatenate(cand), np.concatenate(ref)


def misses_of(d, margin, orders, seed, part=50, rule=None):
    """Final intervals of ``orders`` random orders (numpy permutations) against the whole-set difference."""
    rng = np.random.default_rng(seed)
    truth = d.sum() / len(d)
    misses, used = 0, []
    for _ in range(orders):
        order = d[rng.permutation(len(d))]
        low, high, n = (rule or _sequence_rule)(order, len(d), margin, part)
        misses += not (low <= truth <= high)
        used.append(n)
    return misses, np.array(used)


def _sequence_rule(order, population, margin, part):
    out = run_rule(order, population, margin, ALPHA, part)
    return out.low, out.high, out.used


def _naive_rule(order, population, margin, part):
    """Peeking at a fixed-n 95% normal interval (with its finite-population correction) after every part."""
    for n in range(part, population + 1, part):
        seen = order[:n]
        se = seen.std(ddof=1) / np.sqrt(n) * np.sqrt(1 - n / population)
        low, high = seen.mean() - norm.ppf(0.975) * se, seen.mean() + norm.ppf(0.975) * se
        if verdict(low, high, margin):
            return low, high, n
    return low, high, population


SETS = [  # (category sizes, flip rate per category, difference per category, margin): unequal categories
    ((600, 300, 100), (0.01, 0.01, 0.01), (0.0, 0.0, 0.0), 0.02),
    ((500, 300, 200), (0.05, 0.02, 0.10), (0.02, 0.0, 0.03), 0.04),
    ((500, 300, 200), (0.15, 0.15, 0.15), (0.0, 0.03, 0.0), 0.05),
    ((700, 300), (0.30, 0.10), (0.05, 0.0), 0.02),
    ((600, 400), (0.20, 0.30), (-0.05, 0.02), 0.05),
]


@pytest.mark.parametrize("sizes,flips,deltas,margin", SETS)
def test_final_interval_misses_at_most_alpha_over_random_orders(sizes, flips, deltas, margin):
    cand, ref = simulated_set(sizes, flips, deltas, seed=len(sizes) + int(100 * margin))
    d = cand - ref
    orders = 200
    misses, used = misses_of(d, margin, orders, seed=1)
    # H0: the miss rate is at most alpha; a valid sequence must not reject it
    assert binomtest(misses, orders, ALPHA, alternative="greater").pvalue > 1e-3, (misses, orders)
    assert used.min() >= 50 and used.max() <= len(d)


def test_the_check_catches_a_procedure_that_is_not_anytime_valid():
    """Peeking at an ordinary interval after every part stops on a lucky stretch: the same check rejects it."""
    cand, ref = simulated_set((400, 200), (0.2, 0.2), (0.02, 0.02), seed=7)
    d = cand - ref
    misses, _ = misses_of(d, 0.02, 300, seed=2, part=10, rule=_naive_rule)
    assert binomtest(misses, 300, ALPHA, alternative="greater").pvalue < 1e-3, misses


def test_sequence_is_the_truth_once_every_question_is_seen_and_holds_it_throughout():
    cand, ref = simulated_set((120, 80), (0.2, 0.05), (0.03, 0.0), seed=3)
    d = cand - ref
    cs = ConfidenceSequence(len(d), ALPHA)
    widths = []
    for start in range(0, len(d), 20):
        cs.update(d[start:start + 20])
        widths.append(cs.high - cs.low)
        assert cs.low <= d.mean() <= cs.high or cs.t < len(d)
    assert cs.low == cs.high == pytest.approx(d.sum() / len(d))  # all seen: the difference itself
    assert widths[0] < 2 and all(b <= a for a, b in zip(widths, widths[1:]))  # a running intersection narrows
    assert cs.estimate == pytest.approx(d.mean())


def test_decides_equivalence_with_a_few_hundred_questions_when_runs_rarely_disagree():
    cand, ref = simulated_set((3000,), (0.01,), (0.0,), seed=5)
    out = run_rule(paired(cand, ref)[np.random.default_rng(0).permutation(3000)], 3000, 0.02, ALPHA, 100)
    assert out.decision == "equivalent" and out.used < 1500
    assert -0.02 <= out.low <= out.high <= 0.02


def test_verdict_reads_the_interval_against_the_margin():
    assert verdict(-0.009, 0.009, 0.01) == "equivalent"
    assert verdict(-0.05, -0.02, 0.01) == "worse"
    assert verdict(0.02, 0.05, 0.01) == "better"
    assert verdict(-0.02, 0.005, 0.01) is None


def test_replay_reports_the_orders_it_ran():
    cand, ref = simulated_set((300, 100), (0.1, 0.3), (0.02, 0.0), seed=9)
    r = replay(cand, ref, 0.03, ALPHA, orders=40, part=50, seed=4)
    truth = (cand.sum() - ref.sum()) / len(cand)
    assert r.full == pytest.approx(truth) and r.flips == int(np.sum(cand != ref))
    assert r.misses == int(np.sum((r.low > truth) | (r.high < truth)))
    assert len(r.used) == 40 and set(r.decisions) <= {"equivalent", "worse", "better", "cap"}


def test_bad_outcomes_are_refused():
    with pytest.raises(OrtEvalsError):
        ConfidenceSequence(10).update(np.array([2]))
    with pytest.raises(OrtEvalsError):
        paired([1, 0], [1])
    with pytest.raises(OrtEvalsError):
        run_rule(np.zeros(5, int), 5, 0.0)


def test_compare_replay_decide_reads_two_runs(tmp_path):
    """``ortevals compare --replay-decide``: the whole-set difference and flips of two run folders, counted here."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_compare import loglik, record, write_ortevals_run

    cand, ref = simulated_set((250, 150), (0.1, 0.3), (0.02, 0.0), seed=11)
    cats = ["math"] * 250 + ["law"] * 150
    for name, correct in (("ref", ref), ("cand", cand)):
        write_ortevals_run(tmp_path / name, [record(i, loglik("A" if c else "B"), category=k)
                                             for i, (c, k) in enumerate(zip(correct, cats))])
    out = CliRunner().invoke(cli, ["compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "cand"),
                                   "--replay-decide", "5", "--replay-orders", "30"])
    assert out.exit_code == 0, out.output
    diff, flips = 100 * (cand.sum() - ref.sum()) / 400, int(np.sum(cand != ref))
    assert f"whole-set difference {diff:+.2f} points, {flips} flips" in out.output
    assert "over 30 uniform random orders" in out.output and "questions used: median" in out.output
    bad = CliRunner().invoke(cli, ["compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "cand"),
                                   "--replay-decide", "0"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        "Error: --replay-decide 0: expected a margin in points, above 0 and below 100"]


def choice_set(sizes, skills, sigmas, shifts, seed, choices=10):
    """Per category: a reference's per-choice log-likelihoods (normal, the gold raised by ``skills[h]``) and a
    candidate's (the reference's plus normal noise of ``sigmas[h]``, the gold moved by ``shifts[h]``). A question
    flips where the noise changes whether the top choice is the gold: mostly where the reference's top two are
    close. Returns (candidate 0/1, reference 0/1, reference log-likelihoods [N, choices])."""
    rng = np.random.default_rng(seed)
    cand, ref, ll = [], [], []
    for n, skill, sigma, shift in zip(sizes, skills, sigmas, shifts):
        gold = rng.integers(0, choices, n)
        r = rng.normal(0, 1, (n, choices))
        r[np.arange(n), gold] += skill
        c = r + rng.normal(0, sigma, (n, choices))
        c[np.arange(n), gold] += shift
        cand.append((c.argmax(1) == gold).astype(int))
        ref.append((r.argmax(1) == gold).astype(int))
        ll.append(r)
    return np.concatenate(cand), np.concatenate(ref), np.concatenate(ll)


GUIDED_SETS = [  # (sizes, skill, noise, shift per category, margin): flips 1% to 29%, differences 0 to 5 points
    ((600, 300, 100), (0.3, 0.3, 0.3), (0.06, 0.06, 0.06), (0, 0, 0), 0.02),
    ((500, 300, 200), (0.3, 0.3, 1.0), (0.3, 0.2, 0.5), (0.2, 0, 0.2), 0.04),
    ((500, 300, 200), (0.3, 0.3, 0.3), (1.0, 1.0, 1.0), (0, 0.3, 0), 0.05),
    ((700, 300), (1.5, 0.3), (1.5, 1.0), (1.6, 0.3), 0.03),
    ((600, 400), (0.3, 0.3), (1.5, 2.5), (-0.5, 0.2), 0.05),
]


def top_two_gap(ll):
    """The oracle for the reference's margin: sorted with numpy, top minus second."""
    s = np.sort(ll, axis=1)
    return s[:, -1] - s[:, -2]


@pytest.mark.parametrize("sizes,skills,sigmas,shifts,margin", GUIDED_SETS)
def test_guided_order_final_interval_misses_at_most_alpha(sizes, skills, sigmas, shifts, margin):
    cand, ref, ll = choice_set(sizes, skills, sigmas, shifts, seed=len(sizes) + int(100 * margin))
    d = cand - ref
    weights, orders = guided_weights(top_two_gap(ll)), 200
    rng = np.random.default_rng(1)
    misses, used = 0, []
    for _ in range(orders):
        drawn = guided_order(weights, rng)
        out = run_rule(d[drawn], len(d), margin, ALPHA, 50, weights=weights, drawn=drawn)
        misses += not (out.low <= d.sum() / len(d) <= out.high)
        used.append(out.used)
    assert binomtest(misses, orders, ALPHA, alternative="greater").pvalue > 1e-3, (misses, orders)
    assert min(used) >= 50 and max(used) <= len(d)


def test_guided_order_draws_in_proportion_to_the_weights():
    """Successive sampling: the first question drawn is question i with probability w_i / sum(w), the second
    (given the first) w_j / (sum(w) - w_first); checked by scipy's chi-square test against those frequencies."""
    w = np.array([8.0, 4.0, 2.0, 1.0, 1.0])
    rng = np.random.default_rng(0)
    firsts = np.array([guided_order(w, rng)[:2] for _ in range(20000)])
    assert chisquare(np.bincount(firsts[:, 0], minlength=5), 20000 * w / w.sum()).pvalue > 1e-3
    after0 = firsts[firsts[:, 0] == 0, 1]
    rest = np.where(np.arange(5) == 0, 0, w)
    counts = np.bincount(after0, minlength=5)[1:]
    assert chisquare(counts, len(after0) * rest[1:] / rest.sum()).pvalue > 1e-3


def test_guided_weights_grow_as_the_margin_shrinks():
    m = np.array([0.5, 0.01, 3.0, np.nan, 0.2])
    w = guided_weights(m)
    assert np.argsort(-w[[0, 1, 2, 4]]).tolist() == [1, 3, 0, 2]  # smallest margin heaviest, largest lightest
    assert w.min() == pytest.approx(1.0) and w[3] == pytest.approx(((2 + 0.5) / 5) ** -0.3 / (4.5 / 5) ** -0.3)
    ll = np.array([[-1.0, -3.0, -1.5], [-2.0, -np.inf, -2.25], [-1.0, -np.inf, -np.inf]])
    np.testing.assert_allclose(choice_margins(ll), [0.5, 0.25, np.nan])


def test_guided_estimate_is_unbiased():
    """Des Raj's estimate after 40 weighted draws, averaged over 2000 orders, is the whole-set difference up to
    its Monte Carlo error (numpy's standard error of the mean)."""
    cand, ref, ll = choice_set((150, 50), (0.3, 1.0), (0.5, 0.3), (0.2, 0), seed=12)
    d, weights = cand - ref, guided_weights(top_two_gap(ll))
    rng = np.random.default_rng(3)
    est = []
    for _ in range(2000):
        drawn = guided_order(weights, rng)[:40]
        cs = ConfidenceSequence(len(d), ALPHA, weights)
        cs.update(d[drawn], drawn)
        est.append(cs.estimate)
    est = np.array(est)
    assert abs(est.mean() - d.mean()) < 4 * est.std(ddof=1) / np.sqrt(len(est)), (est.mean(), d.mean())


def test_equal_weights_are_the_uniform_sequence():
    cand, ref = simulated_set((200, 100), (0.1, 0.3), (0.02, 0.0), seed=13)
    d = cand - ref
    drawn = np.random.default_rng(5).permutation(len(d))
    plain, weighted = ConfidenceSequence(len(d)), ConfidenceSequence(len(d), weights=np.full(len(d), 2.5))
    for start in range(0, 150, 30):
        plain.update(d[drawn[start:start + 30]])
        weighted.update(d[drawn[start:start + 30]], drawn[start:start + 30])
        assert (plain.low, plain.high) == (weighted.low, weighted.high)


def test_guided_order_needs_fewer_questions_where_flips_sit_on_small_margins():
    """3,000 questions, 1% flips, all on questions the reference barely decided: the guided order decides ±1 point
    with fewer questions than a uniform one: at the median, and by a third at p90 (30 orders each)."""
    cand, ref, ll = choice_set((3000,), (0.3,), (0.06,), (0,), seed=0)
    assert np.count_nonzero(cand != ref)[()] == pytest.approx(30, abs=8)
    guided = replay(cand, ref, 0.01, ALPHA, orders=30, seed=1, order="guided", reference_margin=top_two_gap(ll))
    uniform = replay(cand, ref, 0.01, ALPHA, orders=30, seed=1)
    assert np.median(guided.used) < np.median(uniform.used), (np.median(guided.used), np.median(uniform.used))
    assert np.percentile(guided.used, 90) * 1.3 < np.percentile(uniform.used, 90)
    assert guided.order == "guided" and set(guided.decisions) == {"equivalent"}


def test_uniform_order_decides_one_point_in_under_a_third_of_3000_questions():
    """1% flips, ±1 point: the mixed tuned bets decide at a median under 1,000 questions (WSR's all-times plug-in
    alone needed 1,200)."""
    cand, ref = simulated_set((3000,), (0.01,), (0.0,), seed=5)
    r = replay(cand, ref, 0.01, ALPHA, orders=30, seed=2)
    assert np.median(r.used) < 1000 and set(r.decisions) == {"equivalent"}, np.median(r.used)


def test_guided_needs_each_question_s_margin():
    cand, ref = simulated_set((50,), (0.1,), (0.0,), seed=1)
    with pytest.raises(OrtEvalsError):
        replay(cand, ref, 0.05, order="guided")
    with pytest.raises(OrtEvalsError):
        replay(cand, ref, 0.05, order="sorted")
    with pytest.raises(OrtEvalsError):
        guided_weights(np.full(5, np.nan))
    with pytest.raises(OrtEvalsError):
        ConfidenceSequence(3, weights=[1.0, 1.0, 1.0]).update(np.array([0, 1]), np.array([0, 0]))


def test_compare_replay_decide_guided_reports_both_orders(tmp_path):
    """``--order guided``: the uniform and the guided replays, the guided one drawn by the reference's margins as
    written in its samples (the top two log-likelihoods' gap, computed here with numpy), and the saving."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_compare import record, write_ortevals_run

    cand, ref, ll = choice_set((300, 100), (0.3, 0.3), (0.3, 0.3), (0, 0), seed=21, choices=3)
    rng = np.random.default_rng(22)
    gold = ["A" if r else "B" for r in ref]  # the reference's logliks relabelled so its correctness is ref's
    lls = np.sort(ll, axis=1)[:, ::-1]  # top first: label A is the reference's choice
    cand_ll = lls + rng.normal(0, 1e-9, lls.shape)
    cand_ll[:, [0, 1]] = np.where((cand == ref)[:, None], cand_ll[:, [0, 1]], cand_ll[:, [1, 0]])
    for name, rows in (("ref", lls), ("cand", cand_ll)):
        write_ortevals_run(tmp_path / name, [record(i, [float(v) for v in row], gold=g)
                                             for i, (row, g) in enumerate(zip(rows, gold))])
    args = ["compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "cand"), "--replay-decide", "5",
            "--replay-orders", "20"]
    out = CliRunner().invoke(cli, [*args, "--order", "guided"])
    assert out.exit_code == 0, out.output
    margins = lls[:, 0] - lls[:, 1]
    guided = replay(cand, ref, 0.05, ALPHA, orders=20, seed=0, order="guided", reference_margin=margins)
    uniform = replay(cand, ref, 0.05, ALPHA, orders=20, seed=0)
    assert "over 20 uniform random orders" in out.output and "over 20 guided random orders" in out.output
    assert (f"guided order: median {np.median(guided.used):.0f} questions against "
            f"{np.median(uniform.used):.0f} in a uniform order") in out.output
    bad = CliRunner().invoke(cli, [*args[:4], "--order", "guided"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        "Error: --order applies to --replay-decide; give --replay-decide MARGIN with it"]
    for name in ("ref1", "cand1"):  # one choice a question: no margin anywhere
        write_ortevals_run(tmp_path / name, [record(i, [-1.0], gold="A") for i in range(40)])
    bad = CliRunner().invoke(cli, ["compare", "--ref", str(tmp_path / "ref1"), str(tmp_path / "cand1"),
                                   "--replay-decide", "5", "--order", "guided"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        f"Error: --order guided: the reference {tmp_path / 'ref1'} holds no per-choice log-likelihoods on the "
        f"questions it shares with {tmp_path / 'cand1'}"], bad.output
