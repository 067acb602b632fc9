"""Compute-aware curves: accuracy against generated tokens and estimated FLOPs, and the coverage fit.

Owns the cost axis of inference-time scaling methods and Brown et al.'s coverage law:

- FLOPs are estimated as ``2 · params · tokens`` (a decoder's forward cost per token, attention
  left out) for the tokens the decoder generates, plus ``2 · verifier params · tokens`` for the
  tokens the verifier runs (:class:`Cost`). A selector that reads a verifier (report/selection.py:
  ``bon``, ``weighted_maj`` and the PRM variants) pays for it on each of its k samples;
  maj/pass/best and self-certainty read nothing more than the samples. :func:`run_cost` builds it
  from a run: the package's parameters and ``results["verifier"]`` (the verifier's own parameters,
  counted from its graph: package/graph.py's ``parameter_count``, and the tokens it ran per sample).
- :func:`search_point`: one search run (beam, DVTS, particles at one budget n) as a point: mean
  accuracy over questions with the same intervals as maj@k, its measured tokens and FLOPs.
- :func:`fit_coverage` (Brown et al. 2024, "Large Language Monkeys"): coverage (pass@k) ≈
  ``exp(a · k^b)``, fitted by least squares on log coverage (scipy ``curve_fit``), and
  :meth:`CoverageFit.k_for`, the k it predicts for a target coverage.

:func:`compute_plot` imports matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.files import atomic_write_bytes
from ortevals.report import plots
from ortevals.report.scaling import CurvePoint, interval
from ortevals.report.selection import SELECTORS


@dataclass(frozen=True)
class Cost:
    """What a generated or verified token costs."""

    params: int  # the decoder's parameters
    verifier_params: int = 0  # the verifier's (the decoder's own for --verifier self)
    verifier_tokens: float = 0.0  # tokens the verifier runs per sample judged


def run_cost(params: int, verifier: dict | None = None) -> Cost:
    """A run's :class:`Cost`: ``params`` the package's (``ModelPackage.parameters``) and, when a verifier ran,
    ``results["verifier"]`` (evaluate.py): its ``params`` and ``tokens_run`` over the ``samples`` it judged."""
    if not verifier:
        return Cost(int(params))
    judged = int(verifier.get("samples") or 0)
    per_sample = float(verifier.get("tokens_run") or 0) / judged if judged else 0.0
    return Cost(int(params), int(verifier.get("params") or 0), per_sample)


def flops(tokens: float, params: int, verifier_tokens: float = 0.0, verifier_params: int = 0) -> float:
    """``2 · params · tokens + 2 · verifier_params · verifier_tokens``."""
    return 2.0 * params * tokens + 2.0 * verifier_params * verifier_tokens


@dataclass(frozen=True)
class ComputePoint:
    method: str
    k: int  # samples, or the search's budget n
    value: float  # mean accuracy over questions
    stderr: float
    low: float  # 95% percentile-bootstrap interval over questions
    high: float
    tokens: float  # generated tokens per question
    flops: float  # estimated FLOPs per question, the verifier's included


def uses_verifier(method: str) -> bool:
    """Whether a selector reads a verifier's scores (those that read self-certainty or nothing: no)."""
    return method in SELECTORS and SELECTORS[method][1] != "certainty"


def compute_points(points: Sequence[CurvePoint], cost: Cost) -> list[ComputePoint]:
    """Estimator points (report/scaling.py, report/selection.py) with their FLOPs per question."""
    out = []
    for p in points:
        judged = p.k * cost.verifier_tokens if uses_verifier(p.estimator) else 0.0
        out.append(ComputePoint(p.estimator, p.k, p.value, p.stderr, p.low, p.high, p.tokens,
                                flops(p.tokens, cost.params, judged, cost.verifier_params)))
    return out


def search_point(method: str, n: int, correct: Sequence[bool], tokens: Sequence[float],
                 verifier_tokens: Sequence[float], cost: Cost) -> ComputePoint:
    """One search at budget n over Q questions: ``correct [Q]``, ``tokens [Q]`` generated (pruned
    rows included), ``verifier_tokens [Q]`` the verifier ran."""
    v = np.asarray(correct, dtype=np.float64)
    if not (len(v) == len(tokens) == len(verifier_tokens)) or not len(v):
        raise OrtEvalsError(f"{method}: correct, tokens and verifier_tokens need one value per question; got "
                            f"{len(v)}, {len(tokens)}, {len(verifier_tokens)}")
    t, vt = float(np.mean(tokens)), float(np.mean(verifier_tokens))
    return ComputePoint(method, n, float(v.mean()), *interval(v), t, flops(t, cost.params, vt, cost.verifier_params))


@dataclass(frozen=True)
class CoverageFit:
    """``coverage(k) = exp(a · k^b)`` (a, b ≤ 0), fitted on log coverage; ``rmse`` in log space."""

    a: float
    b: float
    rmse: float

    def coverage(self, k: np.ndarray | float) -> np.ndarray | float:
        return np.exp(self.a * np.asarray(k, dtype=np.float64) ** self.b)

    def k_for(self, target: float) -> float:
        """The k whose predicted coverage is ``target`` (0 < target < 1): ``(log target / a)^(1/b)``;
        inf when the fit never reaches it, 1 when it starts there."""
        if not 0.0 < target < 1.0:
            raise OrtEvalsError(f"target coverage must be between 0 and 1 (exclusive); got {target}")
        if self.a == 0.0 or self.coverage(1.0) >= target:
            return 1.0
        if self.b == 0.0:
            return float("inf")
        return float((np.log(target) / self.a) ** (1.0 / self.b))


def fit_coverage(ks: Sequence[float], coverage: Sequence[float]) -> CoverageFit:
    """Brown et al.'s exponentiated power law through (k, coverage) points (coverage in (0, 1])."""
    from scipy.optimize import curve_fit

    k = np.asarray(ks, dtype=np.float64)
    c = np.asarray(coverage, dtype=np.float64)
    if len(k) < 2 or len(k) != len(c) or np.any(k < 1):
        raise OrtEvalsError(f"the coverage fit needs two or more points with k >= 1; got k={k.tolist()}")
    if np.any(c <= 0) or np.any(c > 1):
        raise OrtEvalsError(f"the coverage fit needs coverage in (0, 1]; got {c.tolist()}")
    if np.all(c == 1.0):  # already certain at every k: a = 0 exactly (a fit would stop near it)
        return CoverageFit(0.0, 0.0, 0.0)
    y = np.log(c)
    a0 = min(y[0], -1e-6)
    (a, b), _ = curve_fit(lambda x, a, b: a * x ** b, k, y, p0=(a0, -0.5), bounds=([-np.inf, -np.inf], [0.0, 0.0]),
                          maxfev=20000)
    rmse = float(np.sqrt(np.mean((a * k ** b - y) ** 2)))
    return CoverageFit(float(a), float(b), rmse)


def fit_pass_curve(points: Sequence[CurvePoint]) -> CoverageFit:
    """The coverage fit of a run's pass@k points (report/scaling.py)."""
    pts = sorted((p for p in points if p.estimator == "pass"), key=lambda p: p.k)
    return fit_coverage([p.k for p in pts], [p.value for p in pts])


COVERAGE_TARGETS = (0.5, 0.9)


def coverage_record(points: Sequence[CurvePoint]) -> dict:
    """Brown et al.'s fit over pass@k's points as results.json carries it: ``a``, ``b``, ``rmse`` and the k each
    of ``COVERAGE_TARGETS`` needs (``k_for_0.5``, ``k_for_0.9``; inf where the fit never reaches it); where no
    fit exists (no right sample, fewer than two k) the same keys as None and ``why``."""
    keys = ["a", "b", "rmse", *(f"k_for_{t}" for t in COVERAGE_TARGETS)]
    try:
        fit = fit_pass_curve(points)
    except OrtEvalsError as e:
        return {**dict.fromkeys(keys), "why": str(e)}
    return {"a": fit.a, "b": fit.b, "rmse": fit.rmse, **{f"k_for_{t}": fit.k_for(t) for t in COVERAGE_TARGETS}}


def compute_plot(points: Sequence[ComputePoint], path: str | Path, title: str = "",
                 fit: CoverageFit | None = None) -> Path:
    """Accuracy against generated tokens and against FLOPs per question (log axes), one line per
    method with its 95% band; ``fit``: the coverage law over pass@k's points (dashed)."""
    plt, fig, axes = plots.figure(11, 4.2, cols=2, sharey=True)
    markers = "os^vDP*Xh<>"
    for i, method in enumerate(dict.fromkeys(p.method for p in points)):
        pts = sorted((p for p in points if p.method == method), key=lambda p: p.tokens)
        for ax, xs in ((axes[0], [p.tokens for p in pts]), (axes[1], [p.flops for p in pts])):
            ax.plot(xs, [p.value for p in pts], marker=markers[i % len(markers)], markerfacecolor="none",
                    label=method)
            ax.fill_between(xs, [p.low for p in pts], [p.high for p in pts], alpha=0.12)
            if fit is not None and method == "pass":
                ax.plot(xs, fit.coverage([p.k for p in pts]), "k--", linewidth=0.8,
                        label=f"exp({fit.a:.2f}·k^{fit.b:.2f})" if ax is axes[0] else None)
    for ax, label, values in ((axes[0], "generated tokens per question", [p.tokens for p in points]),
                              (axes[1], "estimated FLOPs per question", [p.flops for p in points])):
        plots.log_ticks(ax, values)
        ax.set_xlabel(label)
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    path = Path(path)
    atomic_write_bytes(path, plots.png(plt, fig, dpi=120))
    return path
