"""``--sample N [--seed S]`` (subset.py, report/sampling.py): a stratified draw in proportion to the categories'
real sizes, the whole-set estimate checked against a hand computation, its interval's coverage simulated on
MMLU-Pro's real category sizes (scipy's binomial test), and the command's record of the draw."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from scipy.stats import binomtest

from ortevals.cli import cli
from ortevals.errors import OrtEvalsError
from ortevals.presets import BUNDLED
from ortevals.report.sampling import allocate, draw, estimate

TEST = BUNDLED / "mmlu_pro" / "data" / "test-00000-of-00001.parquet"


def mmlu_categories() -> np.ndarray:
    return np.array(pq.read_table(TEST, columns=["category"]).column("category").to_pylist())


def test_allocation_is_proportional_by_largest_remainder_with_one_per_stratum():
    assert allocate([5, 3, 2], 5).tolist() == [3, 1, 1]  # quotas 2.5, 1.5, 1.0: the tie goes to the first
    assert allocate([100, 1, 1], 3).tolist() == [1, 1, 1]  # quotas 2.94, .03, .03: one each when N >= strata
    assert allocate([100, 1, 1], 2).tolist() == [2, 0, 0]
    sizes = np.unique(mmlu_categories(), return_counts=True)[1]
    got = allocate(sizes, 1000)
    quota = 1000 * sizes / sizes.sum()  # by hand: each within one of its quota, summing to N
    assert got.sum() == 1000 and np.all(np.abs(got - quota) < 1)
    with pytest.raises(OrtEvalsError, match="--sample 13000: expected 1 to 12032"):
        allocate(sizes, 13000)


def test_draw_is_stratified_without_replacement_and_seeded():
    cats = mmlu_categories()
    names, codes = np.unique(cats, return_inverse=True)
    picked = draw(codes, 100, seed=3)
    assert len(set(picked.tolist())) == 100
    assert np.bincount(codes[picked], minlength=14).tolist() == allocate(np.bincount(codes), 100).tolist()
    assert np.array_equal(picked, draw(codes, 100, seed=3)) and not np.array_equal(picked, draw(codes, 100, seed=4))


def test_estimate_by_hand():
    sizes, taken, right = np.array([100, 50, 10]), np.array([10, 5, 1]), np.array([4, 5, 0])
    w = sizes / sizes.sum()
    p = (w * right / taken).sum()
    s2 = np.array([0.4 * 0.6 * 10 / 9, 0.0, 0.25])  # a stratum sampled once counts with 1/4
    var = (w**2 * (1 - taken / sizes) * s2 / taken).sum()
    e = estimate(sizes, taken, right)
    assert e.value == pytest.approx(p) and e.se == pytest.approx(np.sqrt(var))
    assert e.low < p < e.high and e.effective_n == pytest.approx(p * (1 - p) / var)
    whole = estimate(sizes, sizes, np.array([40, 50, 0]))  # the whole set: the accuracy itself, no width
    assert whole.value == whole.low == whole.high == pytest.approx(90 / 160)


@pytest.mark.parametrize("n", [50, 1000])
def test_interval_covers_the_whole_set_accuracy_on_mmlu_pro_categories(n):
    """A fixed set of 12,032 outcomes with category accuracies from 2% to 40%: the 95% interval of 300 seeds'
    samples holds the set's own accuracy (numpy's mean) at least 95% of the time, up to Monte Carlo error."""
    names, codes = np.unique(mmlu_categories(), return_inverse=True)
    rng = np.random.default_rng(0)
    outcomes = rng.random(len(codes)) < np.linspace(0.02, 0.4, 14)[codes]
    truth = outcomes.mean()
    sizes = np.bincount(codes)
    covered = 0
    for seed in range(300):
        picked = draw(codes, n, seed)
        e = estimate(sizes, np.bincount(codes[picked], minlength=14),
                     np.bincount(codes[picked], weights=outcomes[picked], minlength=14))
        covered += e.low <= truth <= e.high
    assert binomtest(300 - covered, 300, 0.05, alternative="greater").pvalue > 1e-3, covered


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_mmlu_pro_sample_records_the_draw_and_the_whole_set_estimate(tmp_path, tiny_pkg):
    base = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--sample", "20", "--seed", "3",
            "--truncate", "left"]
    out = run(*base, "--output", str(tmp_path / "a"))
    assert out.exit_code == 0, out.output
    record = json.loads((tmp_path / "a" / "results.json").read_text())["sample"]
    lines = [json.loads(x) for x in (tmp_path / "a" / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]
    cats = mmlu_categories()
    names, sizes = np.unique(cats, return_counts=True)
    taken = {n: sum(x["doc"]["category"] == n for x in lines) for n in names}
    right = {n: sum(x["acc"] for x in lines if x["doc"]["category"] == n) for n in names}
    # by hand: largest remainder of 20 * size / 12032, at least one each of the 14
    assert [taken[n] for n in names] == allocate(sizes, 20).tolist()
    assert [(s["name"], s["size"], s["taken"], s["right"]) for s in record["strata"]] == [
        (n, int(s), taken[n], right[n]) for n, s in zip(names, sizes)]
    value = sum(s / sizes.sum() * right[n] / taken[n] for n, s in zip(names, sizes))
    assert record["estimate"]["value"] == pytest.approx(value) and record["seed"] == 3 and record["n"] == 20
    assert len({x["doc"]["question_id"] for x in lines}) == 20
    assert "--sample 20 (seed 3): 20 of the 12032 questions" in out.output
    again = run(*base, "--output", str(tmp_path / "b"))  # the same seed draws the same questions
    ids = [json.loads(x)["doc"]["question_id"] for x in
           (tmp_path / "b" / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]
    assert again.exit_code == 0 and sorted(ids) == sorted(x["doc"]["question_id"] for x in lines)


@pytest.mark.parametrize("args,message", [
    (("--sample", "5", "--limit", "5"), "Error: --sample 5 and --limit 5: give one"),
    (("--seed", "4",), "Error: --seed 4 seeds --sample's draw: add --sample N"),
    (("--sample", "20000"), "Error: --sample 20000: expected 1 to 12032 (the questions in the test set)"),
])
def test_bad_sample_flags_are_one_line_before_the_model(tmp_path, args, message):
    out = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tmp_path / "no-package"), "--data", "bundled", *args])
    assert out.exit_code == 2 and out.output.strip().splitlines()[-1].startswith(message), out.output
    assert len(out.output.strip().splitlines()) == 1


def test_tasks_without_categories_are_the_strata():
    """A group's tasks whose documents carry no category: the draw is stratified by task, in proportion."""
    from types import SimpleNamespace

    from ortevals.subset import apply_sample

    class Manager:
        def load(self, configs):
            return {"tasks": {c["task"]: SimpleNamespace(eval_docs=[{"q": i} for i in range(c["n"])])
                              for c in configs}}

    kept, samples, plan = apply_sample([{"task": "a", "n": 30}, {"task": "b", "n": 10}, {"task": "c", "n": 2}],
                                       8, 5, Manager())
    assert plan.strata_by == "task" and plan.names == ("a", "b", "c") and plan.sizes == (30, 10, 2)
    assert {t: len(v) for t, v in samples.items()} == dict(zip("abc", allocate([30, 10, 2], 8).tolist()))
    assert [c["task"] for c in kept] == ["a", "b", "c"] and all(v == sorted(v) for v in samples.values())


def test_limit_says_it_is_not_a_random_sample():
    from ortevals.presets import PRESETS, apply_limit

    _, _, notes = apply_limit(PRESETS["mmlu-pro"], ["leaderboard_mmlu_pro"], 50)
    assert notes == ("--limit 50: the first 50 questions of the test split; not a random sample (--sample 50 draws "
                     "one that stands for the whole set)",)
