"""Calibration of multiple-choice answers: pure numpy over per-question arrays (issue 24).

Owns the numbers that say whether a model's probabilities match its accuracy
(Kadavath et al. 2022, "Language Models (Mostly) Know What They Know"):

* the choice distribution: softmax of the raw per-choice log-likelihoods ``[N, C]``
  (``-inf`` pads a question with fewer choices); confidence = its largest
  probability, correct = its argmax (first on ties, as lm-eval's ``acc``) is the gold;
* ECE over 10 equal-width bins and over 10 equal-mass bins, the multi-class Brier
  score Σ_c (p − y)², NLL of the gold choice, the risk-coverage curve, its area
  (AURC) and the accuracy at 50% coverage, AUROC of confidence for right vs wrong;
* temperature scaling: the T minimising NLL (scipy.optimize), fitted on a separate
  split where the caller has one, else K-fold cross-validated, and the ECE after it;
* P(True) (the model asked whether its own answer is true): AUROC, ECE, Brier;
* paired differences between two runs of the same questions (Δ ECE, Δ Brier).

Bins follow scikit-learn's ``calibration_curve``: ``np.searchsorted(edges[1:-1], p)``
(side left), so a value on an inner edge goes to the bin *below* it (bins are
``[0, e1], (e1, e2], …``); equal-mass edges are ``np.percentile`` of the
confidences (its ``strategy="quantile"``). Intervals come from scipy's bootstrap
over questions (percentile, 95%, fixed seed); the temperature's is a one-step
bootstrap (each resample's β = 1/T is one Newton step from the full-data fit),
which a full refit per resample agrees with to O(1/N) (tests/test_calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.engine.score.scoring import log_softmax
from ortevals.report import calibration_boot as boot
from ortevals.report.stats import Interval

N_BINS = 10
RESAMPLES = boot.RESAMPLES  # report/stats.py: the one bootstrap convention
FOLDS = 10
T_BOUNDS = (0.02, 50.0)  # temperatures searched; a fit on a bound is reported as such
SEED = boot.SEED


@dataclass(frozen=True)
class Reliability:
    """One reliability diagram: B bins."""

    edges: np.ndarray  # [B+1]
    count: np.ndarray  # [B] questions per bin
    accuracy: np.ndarray  # [B] share correct, NaN where empty
    confidence: np.ndarray  # [B] mean confidence, NaN where empty


@dataclass(frozen=True)
class Temperature:
    value: Interval  # the NLL-minimising T with its one-step bootstrap interval
    fitted_on: str  # "validation split (70 questions)" or "10-fold cross-validation"
    ece: Interval  # equal-width ECE of the scaled probabilities (held-out ones under cross-validation)
    at_bound: bool  # the fit stopped on a bound of T_BOUNDS: no finite optimum on this data


@dataclass(frozen=True)
class Calibration:
    """The calibration of one task's choice distribution over N questions."""

    n: int
    accuracy: float
    ece: Interval
    ece_mass: Interval
    brier: Interval
    nll: Interval
    aurc: Interval
    acc_at_half: Interval  # accuracy on the most confident 50% of the questions
    auroc: Interval  # confidence as a score for right (1) vs wrong (0)
    temperature: Temperature | None  # None with fewer than 2 questions


@dataclass(frozen=True)
class SelfEval:
    """P(True) of the proposed answers against whether they were right."""

    n: int
    mean: float  # mean P(True)
    auroc: Interval
    ece: Interval
    brier: Interval  # binary: mean (P(True) − correct)², sklearn's brier_score_loss


# --- the choice distribution -------------------------------------------------------------------------

def confidence(loglik: np.ndarray, gold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, C] log-likelihoods and [N] gold indices -> ([N] top probability, [N] 1.0 where argmax is gold)."""
    logp = log_softmax(loglik, np.float64)
    return np.exp(logp.max(axis=1)), (np.argmax(loglik, axis=1) == np.asarray(gold)).astype(np.float64)


def brier_values(logp: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """Multi-class Brier per question, Σ_c (p_c − y_c)²: [N, C] log-probabilities -> [N] in [0, 2]."""
    p = np.exp(logp)
    p[np.arange(len(gold)), gold] -= 1.0
    return np.sum(p * p, axis=1)


def nll_values(logp: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """−log p(gold) per question: [N, C] log-probabilities -> [N]."""
    return -logp[np.arange(len(gold)), gold]


# --- binning -------------------------------------------------------------------------------------------

def bin_edges(conf: np.ndarray, n_bins: int = N_BINS, strategy: str = "uniform") -> np.ndarray:
    """Edges ``[..., B+1]``: 0, 0.1, …, 1 ("uniform"), or the confidences' percentiles ("mass")."""
    if strategy == "uniform":
        return np.linspace(0.0, 1.0, n_bins + 1)
    if strategy == "mass":
        return np.moveaxis(np.percentile(conf, np.linspace(0, 100, n_bins + 1), axis=-1), 0, -1)
    raise ValueError(f"strategy must be uniform or mass, got {strategy!r}")


def bin_ids(conf: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of each confidence ``[..., N]`` -> ``[..., N]`` ints: how many inner edges lie strictly below it."""
    inner = edges[..., 1:-1]
    if inner.ndim == 1:
        return np.searchsorted(inner, conf, side="left")
    return np.sum(conf[..., :, None] > inner[..., None, :], axis=-1)


def _bin_sums(ids: np.ndarray, weights: np.ndarray, n_bins: int) -> np.ndarray:
    """Σ weights per bin, row by row: ``[..., N]`` -> ``[..., B]`` (one bincount over offset ids)."""
    lead = ids.shape[:-1]
    rows = int(np.prod(lead))
    flat = (ids.reshape(rows, -1) + n_bins * np.arange(rows)[:, None]).ravel()
    sums = np.bincount(flat, weights=np.broadcast_to(weights, ids.shape).reshape(-1), minlength=rows * n_bins)
    return sums.reshape(*lead, n_bins)


def ece(conf: np.ndarray, correct: np.ndarray, n_bins: int = N_BINS, strategy: str = "uniform") -> np.ndarray:
    """Expected calibration error Σ_b (n_b/N)·|acc_b − conf_b| over ``[..., N]`` -> ``[...]``.

    n_b·|acc_b − conf_b| = |Σ_{i∈b} (correct_i − conf_i)|, so empty bins add nothing.
    """
    conf, correct = np.asarray(conf, np.float64), np.asarray(correct, np.float64)
    ids = bin_ids(conf, bin_edges(conf, n_bins, strategy))
    return np.abs(_bin_sums(ids, correct - conf, n_bins)).sum(axis=-1) / conf.shape[-1]


def reliability(conf: np.ndarray, correct: np.ndarray, n_bins: int = N_BINS,
                strategy: str = "uniform") -> Reliability:
    """[N] confidences and 0/1 outcomes -> the per-bin counts, accuracy and mean confidence."""
    conf, correct = np.asarray(conf, np.float64), np.asarray(correct, np.float64)
    edges = bin_edges(conf, n_bins, strategy)
    ids = bin_ids(conf, edges)
    count = np.bincount(ids, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.bincount(ids, weights=correct, minlength=n_bins) / count
        mean = np.bincount(ids, weights=conf, minlength=n_bins) / count
    return Reliability(edges, count, acc, mean)


# --- selective prediction ----------------------------------------------------------------------------

def risk_curve(conf: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Risk (error rate) of answering only the k most confident questions, k = 1…N: ``[..., N]`` -> ``[..., N]``.

    Questions of equal confidence have no order, so within a tie the errors are spread evenly
    (the expected risk over every order of the tie): the curve is a function of the values only.
    """
    conf, correct = np.asarray(conf, np.float64), np.asarray(correct, np.float64)
    order = np.argsort(-conf, axis=-1, kind="stable")
    c = np.take_along_axis(conf, order, -1)
    errors = np.cumsum(1.0 - np.take_along_axis(correct, order, -1), axis=-1)  # [.., N] errors among the first k
    n = c.shape[-1]
    pos = np.broadcast_to(np.arange(n), c.shape)
    starts = np.ones(c.shape, bool)
    starts[..., 1:] = c[..., 1:] != c[..., :-1]
    ends = np.ones(c.shape, bool)
    ends[..., :-1] = starts[..., 1:]
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=-1)  # where each one's tie starts
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends, pos, n - 1), -1), axis=-1), -1)
    before = np.where(first > 0, np.take_along_axis(errors, np.maximum(first - 1, 0), -1), 0.0)
    in_tie = np.take_along_axis(errors, last, -1) - before
    expected = before + (pos - first + 1) * in_tie / (last - first + 1)
    return expected / np.arange(1, n + 1)


def aurc(conf: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Area under the risk-coverage curve: the mean of :func:`risk_curve` over k = 1…N. ``[..., N]`` -> ``[...]``."""
    return risk_curve(conf, correct).mean(axis=-1)


def selective_accuracy(conf: np.ndarray, correct: np.ndarray, coverage: float = 0.5) -> np.ndarray:
    """Accuracy on the ⌈coverage·N⌉ most confident questions (ties spread evenly). ``[..., N]`` -> ``[...]``."""
    k = max(1, int(np.ceil(coverage * np.shape(conf)[-1])))
    return 1.0 - risk_curve(conf, correct)[..., k - 1]


def auroc(score: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """P(score of a right answer > a wrong one's), ties counting ½ (Mann-Whitney): ``[..., N]`` -> ``[...]``.

    Equal to sklearn's ``roc_auc_score(correct, score)``; NaN where all answers are right or all wrong.
    """
    from scipy.stats import rankdata

    correct = np.asarray(correct, np.float64)
    ranks = rankdata(score, axis=-1)
    pos = correct.sum(axis=-1)
    neg = correct.shape[-1] - pos
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((ranks * correct).sum(axis=-1) - pos * (pos + 1) / 2) / (pos * neg)


# --- statistics of resample counts, for the bootstrap -------------------------------------------------------

def ece_statistic(conf: np.ndarray, correct: np.ndarray, strategy: str = "uniform",
                  n_bins: int = N_BINS) -> boot.Statistic:
    """:func:`ece` of [N] confidences and outcomes as a function of resample counts (calibration_boot)."""
    conf, correct = np.asarray(conf, np.float64), np.asarray(correct, np.float64)
    if strategy == "uniform":
        return boot.ece_fixed(conf, correct, bin_ids(conf, bin_edges(conf, n_bins)), n_bins)
    return boot.ece_mass(conf, correct, n_bins)


def _around(estimate: float, found: Interval) -> Interval:
    """The plain definition's value with the bootstrap's interval and standard error."""
    return Interval(estimate, found.low, found.high, found.se)


def _nan_interval(estimate: float) -> Interval:
    return Interval(estimate, float("nan"), float("nan"), float("nan"))


# --- temperature scaling -------------------------------------------------------------------------------

def scaled_logp(loglik: np.ndarray, t: float | np.ndarray) -> np.ndarray:
    """[N, C] log-likelihoods -> log-softmax(loglik / T); ``t`` a scalar or [N] (one per question)."""
    t = np.asarray(t, np.float64)
    return log_softmax(np.asarray(loglik, np.float64) / (t[:, None] if t.ndim else t), np.float64)


def fit_temperature(loglik: np.ndarray, gold: np.ndarray) -> float:
    """The T in ``T_BOUNDS`` minimising the mean NLL of softmax(loglik / T) for the gold choices.

    NLL is convex in β = 1/T: where its slope at a bound already points outside (separable data: the
    NLL keeps falling as T → 0), the optimum lies beyond and that bound is returned; otherwise scipy's
    bounded Brent search over log T finds the unique minimum inside.
    """
    from scipy.optimize import minimize_scalar

    rows, gold = np.arange(len(gold)), np.asarray(gold)
    low, high = T_BOUNDS
    if np.mean(newton_terms(loglik, gold, low)[0]) <= 0:  # still falling at the largest β
        return low
    if np.mean(newton_terms(loglik, gold, high)[0]) >= 0:  # still rising at the smallest β
        return high

    def nll(log_t: float) -> float:
        return float(-scaled_logp(loglik, np.exp(log_t))[rows, gold].mean())

    res = minimize_scalar(nll, bounds=np.log(T_BOUNDS), method="bounded", options={"xatol": 1e-7})
    return float(np.exp(res.x))


def at_bound(t: float) -> bool:
    """Whether a fitted T is a bound of ``T_BOUNDS`` (the optimum lies beyond it)."""
    return t in T_BOUNDS


def newton_terms(loglik: np.ndarray, gold: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Per question, the first and second derivative of its NLL in β = 1/T at ``t``: ([N], [N]).

    NLL_i(β) = −β z_ig + logsumexp(β z_i), so d/dβ = E_p[z] − z_g and d²/dβ² = Var_p[z] under p = softmax(β z).
    """
    z = np.asarray(loglik, np.float64)
    p = np.exp(scaled_logp(z, t))
    zs = np.where(p > 0, z - np.max(z, axis=1, keepdims=True), 0.0)  # shifted: no 0·(−inf), same derivatives
    mean = np.sum(p * zs, axis=1)
    return mean - zs[np.arange(len(gold)), gold], np.sum(p * zs * zs, axis=1) - mean**2


def one_step_temperature(loglik: np.ndarray, gold: np.ndarray, t: float) -> boot.Statistic:
    """A resample's T as one Newton step in β = 1/T from the full-data fit ``t``: 1 / (1/t − Σwg / Σwh)."""
    g, h = newton_terms(loglik, gold, t)

    def stat(w: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return 1.0 / (1.0 / t - (w @ g) / (w @ h))

    return stat


def temperature_interval(loglik: np.ndarray, gold: np.ndarray, t: float, resamples: int = RESAMPLES) -> Interval:
    """The fitted ``t`` with its one-step bootstrap interval (NaN when ``t`` is on a bound)."""
    if at_bound(t):
        return _nan_interval(t)
    return _around(t, boot.interval(one_step_temperature(loglik, gold, t), len(gold), resamples))


def heldout_temperatures(loglik: np.ndarray, gold: np.ndarray, folds: int = FOLDS, seed: int = SEED) -> np.ndarray:
    """K-fold cross-validation: [N] the T fitted on the other folds' questions (K = min(folds, N), N ≥ 2)."""
    n = len(gold)
    k = min(folds, n)
    fold = np.empty(n, dtype=np.int64)
    fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % k
    out = np.empty(n)
    for f in range(k):
        train = fold != f
        out[~train] = fit_temperature(loglik[train], gold[train])
    return out


# --- reports -------------------------------------------------------------------------------------------

def calibrate(loglik: np.ndarray, gold: np.ndarray, fit: tuple[np.ndarray, np.ndarray] | None = None,
              fit_label: str = "validation split", resamples: int = RESAMPLES) -> Calibration:
    """Every calibration number of one task from [N, C] log-likelihoods and [N] gold indices (questions
    whose gold is unknown, −1, are left out; at least one must remain).

    Temperature: fitted on ``fit`` = ([M, C'] log-likelihoods, [M] gold) of a separate split when given
    (M ≥ 2), else on these questions, with the ECE after scaling from K-fold held-out temperatures.
    All intervals but a separate split's T come from one set of bootstrap resamples.
    """
    loglik, gold = known(loglik, gold)
    if not len(gold):
        raise ValueError("calibration needs at least one question with a known gold choice")
    logp = log_softmax(loglik, np.float64)
    conf, correct = np.exp(logp.max(axis=1)), (np.argmax(loglik, axis=1) == gold).astype(np.float64)
    area, accuracy_at = boot.risk(conf, correct)
    brier, nll = brier_values(logp, gold), nll_values(logp, gold)
    stats = {"ece": ece_statistic(conf, correct), "ece_mass": ece_statistic(conf, correct, "mass"),
             "brier": boot.mean(brier), "nll": boot.mean(nll), "aurc": area, "acc_at_half": accuracy_at(0.5),
             "auroc": boot.auroc(conf, correct)}
    values = {"ece": ece(conf, correct), "ece_mass": ece(conf, correct, N_BINS, "mass"), "brier": brier.mean(),
              "nll": nll.mean(), "aurc": aurc(conf, correct), "acc_at_half": selective_accuracy(conf, correct),
              "auroc": auroc(conf, correct)}
    fit = known(*fit) if fit is not None and len(known(*fit)[1]) >= 2 else None
    t, label = None, ""
    if fit is not None:
        t, label = fit_temperature(*fit), f"{fit_label} ({len(fit[1])} questions)"
        held = np.exp(scaled_logp(loglik, t).max(axis=1))
    elif len(gold) >= 2:
        t, label = fit_temperature(loglik, gold), f"{min(FOLDS, len(gold))}-fold cross-validation"
        held = np.exp(scaled_logp(loglik, heldout_temperatures(loglik, gold)).max(axis=1))
        stats["temperature"], values["temperature"] = one_step_temperature(loglik, gold, t), t
    if t is not None:  # a temperature keeps every argmax: the same outcomes, rescaled confidences
        stats["ece_scaled"], values["ece_scaled"] = ece_statistic(held, correct), ece(held, correct)
    found = {k: _around(float(values[k]), v) for k, v in boot.intervals(stats, len(gold), resamples).items()}
    scaled = None
    if t is not None:
        value = found["temperature"] if fit is None else temperature_interval(*fit, t, resamples)
        scaled = Temperature(_nan_interval(t) if at_bound(t) else value, label, found["ece_scaled"], at_bound(t))
    return Calibration(len(gold), float(correct.mean()), found["ece"], found["ece_mass"], found["brier"],
                       found["nll"], found["aurc"], found["acc_at_half"], found["auroc"], scaled)


def known(loglik: np.ndarray, gold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The questions whose gold is known (≥ 0): ([M, C], [M])."""
    gold = np.asarray(gold, dtype=np.int64)
    keep = gold >= 0
    return np.asarray(loglik, np.float64)[keep], gold[keep]


# --- P(True) -------------------------------------------------------------------------------------------

def p_true(ll_true: np.ndarray, ll_false: np.ndarray) -> np.ndarray:
    """P(True) from the log-likelihoods of " (A)" (True) and " (B)" (False), normalised over the two: [N] -> [N]."""
    from scipy.special import expit

    return expit(np.asarray(ll_true, np.float64) - np.asarray(ll_false, np.float64))


def self_eval(ptrue: np.ndarray, correct: np.ndarray, resamples: int = RESAMPLES) -> SelfEval:
    """P(True) [N] of each proposed answer against its correctness [N] (0/1): AUROC and Brier as
    scikit-learn computes them (``roc_auc_score``, ``brier_score_loss``), ECE; bootstrap intervals."""
    from sklearn.metrics import brier_score_loss, roc_auc_score

    ptrue, correct = np.asarray(ptrue, np.float64), np.asarray(correct, np.float64)
    n = len(ptrue)
    auc = float(roc_auc_score(correct, ptrue)) if 0 < correct.sum() < n else float("nan")
    found = boot.intervals({"auroc": boot.auroc(ptrue, correct), "ece": ece_statistic(ptrue, correct),
                            "brier": boot.mean((ptrue - correct) ** 2)}, n, resamples)
    return SelfEval(n, float(ptrue.mean()), _around(auc, found["auroc"]), _around(float(ece(ptrue, correct)),
                    found["ece"]), _around(float(brier_score_loss(correct, ptrue, labels=[0, 1])), found["brier"]))
