"""Calibration metrics say what they are in results.json and the summary: each Brier score names its scale
(scikit-learn's ``brier_score_loss`` is the reference for both), and a temperature fitted on a bound of its
search is reported as a bound, never as a fitted value."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import brier_score_loss

from ortevals.report.calibration_results import add_calibration
from ortevals.report.results import format_table, summarize


def records(lls: list[list[float]], gold: list[int]) -> list[dict]:
    """lm-eval's logged multiple-choice samples: one per question, its choices' log-likelihoods."""
    return [{"doc_id": i, "doc": {}, "target": g, "arguments": [["Q?", f" {c}"] for c in "abc"[:len(row)]],
             "resps": [[[v, False]] for v in row], "filtered_resps": [[v, False] for v in row], "filter": "none",
             "acc": float(np.argmax(row) == g)} for i, (row, g) in enumerate(zip(lls, gold))]


def test_each_brier_names_its_scale_and_equals_sklearns():
    lls = [[-0.2, -2.0, -3.0], [-1.0, -0.5, -2.5], [-3.0, -0.3, -1.5], [-0.7, -0.9, -1.0]]
    gold = [0, 2, 1, 1]
    # P(True) of each question's chosen choice: (log p " (A)", log p " (B)")
    ptrue = {("t", i): {int(np.argmax(row)): (np.log(p), np.log(1 - p))} for i, (row, p)
             in enumerate(zip(lls, [0.9, 0.4, 0.7, 0.2]))}
    results = {"results": {"t": {}}, "samples": {"t": records(lls, gold)}, "configs": {"t": {}}}
    add_calibration(results, None, ptrue)
    got = results["results"]["t"]
    assert "brier,none" not in got and "ptrue_brier,none" not in got
    p = np.exp(lls) / np.exp(lls).sum(axis=1, keepdims=True)
    # the multi-class sum over the choices, in [0, 2]: sklearn's scale for several classes (scale_by_half=False)
    assert got["brier_multiclass,none"] == pytest.approx(brier_score_loss(gold, p, labels=[0, 1, 2],
                                                                          scale_by_half=False), abs=1e-12)
    # P(True) against whether the chosen answer was right: the binary mean, in [0, 1], sklearn's default
    right = [float(np.argmax(row) == g) for row, g in zip(lls, gold)]
    assert got["ptrue_brier_binary,none"] == pytest.approx(brier_score_loss(right, [0.9, 0.4, 0.7, 0.2]), abs=1e-12)
    assert results["higher_is_better"]["t"]["brier_multiclass"] is False


def test_a_temperature_on_its_search_bound_is_reported_as_a_bound():
    """Every question right with a margin: the NLL keeps falling as T -> 0, the fit stops at the search's bound
    0.02. results.json and the summary's table say so; no `temperature` or `ece_scaled` looks fitted."""
    results = {"results": {"t": {}}, "samples": {"t": records([[0.0, -1.0]] * 10, [0] * 10)}, "configs": {"t": {}}}
    add_calibration(results)
    got = results["results"]["t"]
    assert "temperature,none" not in got and "ece_scaled,none" not in got
    assert got["temperature_at_bound,none"] == pytest.approx(0.02) and "ece_at_temperature_bound,none" in got
    block = results["calibration"]["t"]
    assert block["temperature_at_bound"] is True
    assert "T = 0.02: no finite temperature fits" in block["temperature_bound"]
    table = format_table(summarize(results, 20, 1.0, 1.0))
    assert "temperature_at_bound" in table and "no finite temperature fits" in table
    fitted = {"results": {"t": {}}, "samples": {"t": records([[0.0, -1.0]] * 7 + [[-1.0, 0.0]] * 3, [0] * 10)},
              "configs": {"t": {}}}
    add_calibration(fitted)  # 7 right, 3 wrong: a finite optimum, the plain names
    assert "temperature,none" in fitted["results"]["t"] and "ece_scaled,none" in fitted["results"]["t"]
    assert "temperature_bound" not in fitted["calibration"]["t"]
