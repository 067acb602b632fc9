"""The decision's statistics (report/decide.py): the without-replacement confidence sequence covers the whole-set
difference at the time the stopping rule stops, on simulated test sets with known differences; the miss rate is
computed here with numpy and judged with scipy's exact binomial test, never by the code under test. A naive
procedure (a fixed-n normal interval looked at after every part) fails the same check, so the check has power."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from ortevals.errors import OrtEvalsError
from ortevals.report.decide import ConfidenceSequence, paired, replay, run_rule, verdict

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
    assert "over 30 random orders" in out.output and "questions used: median" in out.output
    bad = CliRunner().invoke(cli, ["compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "cand"),
                                   "--replay-decide", "0"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        "Error: --replay-decide 0: expected a margin in points, above 0 and below 100"]
