"""Compute-aware curves (report/compute.py): FLOPs by hand, the coverage fit on curves with known a, b."""

import math
import subprocess
import sys

import numpy as np
import pytest

from ortevals.errors import OrtEvalsError
from ortevals.report.compute import (
    ComputePoint,
    Cost,
    compute_plot,
    compute_points,
    fit_coverage,
    fit_pass_curve,
    flops,
    search_point,
)
from ortevals.report.scaling import CurvePoint, interval

KS = [1, 2, 4, 8, 16, 32, 64]


def test_fit_recovers_a_known_law_and_predicts_k():
    a, b = -1.2, -0.4
    fit = fit_coverage(KS, [math.exp(a * k ** b) for k in KS])
    assert fit.a == pytest.approx(a, rel=1e-6) and fit.b == pytest.approx(b, rel=1e-6)
    assert fit.rmse < 1e-9
    # by hand: a k^b = log 0.9 → k = (log 0.9 / a)^(1/b) = (0.0878004 ...)^(-2.5) ≈ 437.7
    assert fit.k_for(0.9) == pytest.approx((math.log(0.9) / a) ** (1 / b), rel=1e-5)
    assert fit.k_for(0.9) == pytest.approx(437.7, abs=0.1)
    assert fit.coverage(fit.k_for(0.9)) == pytest.approx(0.9, rel=1e-6)
    assert fit.k_for(0.2) == 1.0  # exp(-1.2) = 0.30 at k = 1 already


def test_fit_on_a_noisy_curve_and_pass_points():
    rng = np.random.default_rng(0)
    a, b = -2.0, -0.6
    cov = np.exp(a * np.array(KS, dtype=float) ** b) * np.exp(rng.normal(0, 0.01, len(KS)))
    fit = fit_coverage(KS, np.minimum(cov, 1.0))
    assert fit.a == pytest.approx(a, abs=0.1) and fit.b == pytest.approx(b, abs=0.05)
    points = [CurvePoint("pass", k, float(c), 0, 0, 0, 10 * k) for k, c in zip(KS, cov, strict=True)]
    points += [CurvePoint("maj", k, 0.1, 0, 0, 0, 10 * k) for k in KS]
    assert fit_pass_curve(points) == fit_coverage(KS, cov)


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(OrtEvalsError, match=r"coverage in \(0, 1\]"):
        fit_coverage([1, 2], [0.0, 0.0])
    with pytest.raises(OrtEvalsError, match="two or more points"):
        fit_coverage([1], [0.5])
    fit = fit_coverage([1, 2, 4], [1.0, 1.0, 1.0])
    assert fit.a == 0.0 and fit.k_for(0.99) == 1.0
    with pytest.raises(OrtEvalsError, match="target coverage"):
        fit.k_for(1.0)


def test_flops_by_hand():
    assert flops(100, 135_000_000) == 2.7e10
    assert flops(100, 135_000_000, 50, 10_000_000) == 2.7e10 + 1e9
    pts = [CurvePoint(name, 4, 0.5, 0.1, 0.3, 0.7, 400.0) for name in ("maj", "bon", "bon_certainty",
                                                                         "weighted_maj_prm_min")]
    got = {p.method: p.flops for p in compute_points(pts, Cost(1000, verifier_params=10, verifier_tokens=30))}
    assert got == {"maj": 8e5, "bon": 8e5 + 2 * 10 * 4 * 30, "bon_certainty": 8e5,
                   "weighted_maj_prm_min": 8e5 + 2400}


def test_search_point_intervals_and_cost():
    correct = [True, False, True, True, False, True]
    p = search_point("beam_prm", 8, correct, [100, 120, 80, 90, 110, 100], [30] * 6, Cost(1000, 500, 0))
    se, low, high = interval(np.array(correct, dtype=float))
    assert (p.value, p.stderr, p.low, p.high) == (4 / 6, se, low, high)
    assert p.tokens == 100 and p.flops == 2 * 1000 * 100 + 2 * 500 * 30
    with pytest.raises(OrtEvalsError, match="one value per question"):
        search_point("dvts", 4, [True], [1, 2], [0], Cost(1))


def test_plot_writes_a_png_and_import_stays_light(tmp_path):
    pts = [ComputePoint(m, k, 0.1 * k ** 0.3, 0.01, 0.05, 0.3, 50.0 * k, 1e9 * k)
           for m in ("maj", "pass", "bon") for k in (1, 2, 4)]
    fit = fit_coverage([1, 2, 4], [0.1, 0.1 * 2 ** 0.3, 0.1 * 4 ** 0.3])
    out = compute_plot(pts, tmp_path / "c.png", "toy", fit)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    code = "import sys, ortevals.report.compute, ortevals.report.selection, ortevals.engine.generate.search.guided; " \
           "bad = {'matplotlib', 'torch', 'onnxruntime'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
