"""Comparing runs against a reference, question by question.

Owns the alignment (per task on doc_id, with the documents, prompts and choices
checked equal: another data revision, few-shot setting or chat template is a
one-line error, never a comparison of different questions), the comparison
result as frozen dataclasses (per run and task: accuracy, paired Δ, flips,
McNemar, KL on the choice distribution, margins; Holm across tasks), the
questions that changed (most different first), the run-by-run agreement
matrix, and the CI gates. The statistics themselves live in
:mod:`ortevals.report.stats`.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.report import stats
from ortevals.report.calibration_delta import CalibrationDelta, calibration_delta
from ortevals.report.drift import Drift, drift
from ortevals.report.lengths import LengthBreakdown, LengthOptions, for_runs, task_breakdown
from ortevals.report.ptrue_delta import PTrueDelta, ptrue_delta
from ortevals.report.runs import Run, TaskRun


@dataclass(frozen=True)
class CategoryDelta:
    category: str
    n: int
    ref_accuracy: float
    accuracy: float
    delta: stats.Interval  # paired, questions independent within the category


@dataclass(frozen=True)
class ChoiceStats:
    """Log-likelihood tasks: distances between the softmax over each question's choices."""

    kl: stats.Distribution  # KL(ref‖run), nats
    kl_reverse: stats.Distribution  # KL(run‖ref)
    dp_gold: stats.Distribution | None  # p_run(gold) − p_ref(gold), questions with a known gold
    margin_bins: tuple[stats.MarginBin, ...]  # by the reference's top-1 probability margin
    kl_values: np.ndarray = field(repr=False, compare=False)  # [N] KL(ref‖run), for the plot


@dataclass(frozen=True)
class GenerationStats:
    text_agreement: float  # share of identical raw outputs
    first_divergence: stats.Distribution | None  # character where differing outputs first differ


@dataclass(frozen=True)
class TaskComparison:
    run: str
    ref: str
    task: str
    kind: str
    n: int
    accuracy: stats.Interval  # Wilson
    ref_accuracy: stats.Interval
    delta: stats.Interval  # run − ref, cluster-robust by category where the task has categories
    delta_bootstrap: stats.Interval  # scipy paired bootstrap, questions independent: a check
    clusters: int  # categories the interval is clustered on (0: none)
    flips: stats.Flips
    mcnemar_p: float
    mcnemar_p_holm: float  # Holm-adjusted over this run's tasks
    min_detectable: float
    power: str
    categories: tuple[CategoryDelta, ...]
    choice: ChoiceStats | None
    generation: GenerationStats | None
    calibration: CalibrationDelta | None = None  # issue 24: choice tasks with a known gold
    p_true: PTrueDelta | None = None  # both runs with --self-eval: P(True) drift
    by_length: LengthBreakdown | None = None  # --by-length: by prompt length
    drift: Drift | None = None  # generation tasks: lengths, limits, loops, extraction failures

    @property
    def flip_rate(self) -> float:
        """Questions whose correctness changed (either way), over all questions."""
        return (self.flips.correct_to_wrong + self.flips.wrong_to_correct) / self.n


@dataclass(frozen=True)
class ChangedQuestion:
    run: str
    task: str
    doc_id: int
    category: str | None
    gold: str | None
    ref_answer: str
    run_answer: str
    ref_correct: bool
    run_correct: bool
    difference: float  # KL(ref‖run) for choice tasks; 1 − text similarity for generations
    ref_probs: dict[str, float] | None
    run_probs: dict[str, float] | None
    ref_text: str | None = None
    run_text: str | None = None


@dataclass(frozen=True)
class Comparison:
    ref: str
    runs: tuple[str, ...]
    tasks: tuple[TaskComparison, ...]
    changed: tuple[ChangedQuestion, ...]  # most different first
    agreement_labels: tuple[str, ...]  # ref first
    agreement: np.ndarray = field(repr=False, compare=False)  # [R+1, R+1] share of identical answers
    skipped: tuple[str, ...] = ()  # tasks not compared, with why
    models: tuple[tuple[str, str], ...] = ()  # (label, what was scored) for the ref and each run that says


GATE_RANGES = {  # flag -> (lowest, highest, what the threshold is): a value outside can never fire or always does
    "--max-flip-rate": (0.0, 1.0, "a share of the questions in [0, 1]"),
    "--max-kl": (0.0, math.inf, "a finite KL divergence >= 0 in nats"),
    "--margin": (0.0, math.inf, "a finite non-inferiority margin >= 0 in accuracy (0.02: two points)"),
}


@dataclass(frozen=True)
class Gates:
    """The CI gates; a threshold that is not finite or outside its range is a one-line error here."""

    max_flip_rate: float | None = None
    max_kl: float | None = None
    margin: float | None = None  # non-inferiority δ: pass when the Δ interval's lower bound > −δ

    def __post_init__(self) -> None:
        given = zip(GATE_RANGES.items(), (self.max_flip_rate, self.max_kl, self.margin))
        for (flag, (low, high, what)), value in given:
            if value is not None and not (math.isfinite(value) and low <= value <= high):
                raise OrtEvalsError(f"{flag} {value:g}: expected {what}")


@dataclass(frozen=True)
class Verdict:
    """One gate on one run and task: passed or not, and the line saying so."""

    passed: bool
    line: str


def compare(ref: Run, runs: list[Run], lengths: LengthOptions | None = None) -> Comparison:
    """Every run against ``ref`` on the tasks they share; misaligned runs raise OrtEvalsError. ``lengths``: how
    lengths are counted and whether to break the comparison down by prompt length (checked against the runs'
    tokenizers, :func:`~ortevals.report.lengths.for_runs`)."""
    names = [ref.name] + [r.name for r in runs]
    if len(set(names)) != len(names):  # two folders with one name: label by position
        runs = [replace(r, name=f"{r.name}#{i + 1}") for i, r in enumerate(runs)]
    common = [t for t in ref.tasks if all(t in r.tasks for r in runs)]
    skipped = [f"{t}: not in every run" for t in ref.tasks if t not in common]
    skipped += [f"{t}: in {r.name} only" for r in runs for t in r.tasks if t not in ref.tasks]
    if not common:
        raise OrtEvalsError(f"runs {ref.path} and {', '.join(r.path for r in runs)} share no task")
    unscored = [t for t in common if ref.tasks[t].kind == "other" or np.isnan(ref.tasks[t].correct).all()]
    skipped += [f"{t}: no per-question 0/1 score (acc or exact_match) to compare" for t in unscored]
    tasks = [t for t in common if t not in unscored]
    for t in tasks:
        for r in runs:
            align(ref, r, t)
    results, changed = [], []
    if not tasks:
        raise OrtEvalsError(f"no comparable task: {'; '.join(skipped)}")
    needed = bool(lengths and lengths.by_length) or any(ref.tasks[t].kind == "generation" for t in tasks)
    lengths = for_runs(lengths, [(r.name, r.tokenizer) for r in [ref, *runs]], needed)
    for r in runs:
        per_run = [compare_task(ref.tasks[t], r.tasks[t], ref.name, r.name, lengths) for t in tasks]
        adjusted = stats.holm([c.mcnemar_p for c in per_run])
        results += [replace(c, mcnemar_p_holm=float(p)) for c, p in zip(per_run, adjusted)]
        for t in tasks:
            changed += changed_questions(ref.tasks[t], r.tasks[t], r.name)
    changed.sort(key=lambda q: -q.difference)
    labels, matrix = agreement_matrix([ref, *runs], tasks)
    return Comparison(ref.name, tuple(r.name for r in runs), tuple(results), tuple(changed), labels, matrix,
                      tuple(skipped), tuple((r.name, r.model) for r in [ref, *runs] if r.model))


def align(ref: Run, run: Run, task: str) -> None:
    """Same doc_ids, documents, prompts and choices in both runs, or a one-line error naming both."""
    a, b = ref.tasks[task], run.tasks[task]
    where = f"runs {ref.path} and {run.path}, task {task}"
    if not np.array_equal(a.doc_id, b.doc_id):
        only_a = np.setdiff1d(a.doc_id, b.doc_id)
        only_b = np.setdiff1d(b.doc_id, a.doc_id)
        first, side = (only_a[0], ref.name) if len(only_a) and (not len(only_b) or only_a[0] < only_b[0]) \
            else (only_b[0], run.name)
        raise OrtEvalsError(f"{where}: different questions ({a.n} vs {b.n}); doc_id {first} is only in {side} "
                            "(run both with the same --limit and data)")
    if a.kind != b.kind:
        raise OrtEvalsError(f"{where}: one is a {a.kind} task, the other a {b.kind} task")
    for side, t in ((ref, a), (run, b)):
        unscored = np.flatnonzero(np.isnan(t.correct))
        if len(unscored):
            raise OrtEvalsError(f"{where}: {side.path} has no 0/1 score (acc or exact_match) at doc_id "
                                f"{t.doc_id[unscored[0]]}")
    for what, x, y in (("document", a.doc_key, b.doc_key), ("prompt", a.prompt_key, b.prompt_key),
                       ("choices", a.labels, b.labels)):
        bad = next((i for i in range(a.n) if x[i] != y[i]), None)
        if bad is not None:
            hint = {"document": "another data revision?", "prompt": "another prompt format, few-shot setting "
                    "or chat template?", "choices": "another task version?"}[what]
            raise OrtEvalsError(f"{where}: the {what} differs at doc_id {a.doc_id[bad]} ({hint})")


def compare_task(a: TaskRun, b: TaskRun, ref_name: str, run_name: str,
                 lengths: LengthOptions | None = None) -> TaskComparison:
    """One aligned task: ``a`` the reference, ``b`` the run."""
    n = a.n
    ra, rb = np.nan_to_num(a.correct), np.nan_to_num(b.correct)
    cats = np.array([c or "" for c in a.category], dtype=object)
    clustered = all(a.category) and len(set(a.category)) > 1
    fl = stats.flips(ra, rb, a.answer, b.answer)
    mde = stats.min_detectable(ra, rb)
    choice = _choice_stats(a, b) if a.kind == "choice" else None
    counter = lengths.counter if lengths and lengths.counter.unit == "tokens" else None
    return TaskComparison(
        run=run_name, ref=ref_name, task=a.task, kind=a.kind, n=n,
        accuracy=stats.wilson(int(rb.sum()), n), ref_accuracy=stats.wilson(int(ra.sum()), n),
        delta=stats.paired_delta(ra, rb, cats if clustered else None),
        delta_bootstrap=stats.bootstrap_delta(ra, rb), clusters=len(set(a.category)) if clustered else 0,
        flips=fl, mcnemar_p=stats.mcnemar_p(fl.correct_to_wrong, fl.wrong_to_correct), mcnemar_p_holm=float("nan"),
        min_detectable=mde, power=stats.power_line(n, mde),
        categories=_categories(cats, ra, rb) if all(a.category) else (),
        choice=choice,
        generation=_generation_stats(a, b) if a.kind == "generation" else None,
        calibration=calibration_delta(a.loglik, b.loglik, a.gold) if a.kind == "choice" and (a.gold >= 0).any()
        else None,
        p_true=ptrue_delta(a.p_true, a.correct, b.p_true, b.correct) if a.p_true is not None and b.p_true is not None
        else None,
        by_length=task_breakdown(a, b, choice.kl_values if choice else None, lengths)
        if lengths and lengths.by_length else None,
        drift=drift(a, b, counter) if a.kind == "generation" else None)


def _categories(cats: np.ndarray, ra: np.ndarray, rb: np.ndarray) -> tuple[CategoryDelta, ...]:
    out = []
    for c in sorted(set(cats)):
        m = cats == c
        out.append(CategoryDelta(str(c), int(m.sum()), float(ra[m].mean()), float(rb[m].mean()),
                                 stats.paired_delta(ra[m], rb[m])))
    return tuple(out)


def _choice_stats(a: TaskRun, b: TaskRun) -> ChoiceStats:
    lp, lq = log_softmax(a.loglik, np.float64), log_softmax(b.loglik, np.float64)
    forward, reverse = stats.kl(lp, lq), stats.kl(lq, lp)
    known = a.gold >= 0
    rows = np.flatnonzero(known)
    dp = np.exp(lq[rows, a.gold[rows]]) - np.exp(lp[rows, a.gold[rows]])
    changed = np.array([x != y for x, y in zip(a.answer, b.answer)])
    flipped = np.nan_to_num(a.correct) != np.nan_to_num(b.correct)
    return ChoiceStats(stats.distribution(forward), stats.distribution(reverse),
                       stats.distribution(dp) if len(dp) else None,
                       stats.margin_bins(stats.top1_margin(lp), changed, flipped), forward)


def _generation_stats(a: TaskRun, b: TaskRun) -> GenerationStats:
    same = [x == y for x, y in zip(a.text, b.text)]
    firsts = [_first_difference(x, y) for x, y, s in zip(a.text, b.text, same) if not s]
    return GenerationStats(float(np.mean(same)), stats.distribution(np.array(firsts, float)) if firsts else None)


def _first_difference(x: str, y: str) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def changed_questions(a: TaskRun, b: TaskRun, run_name: str) -> list[ChangedQuestion]:
    """Questions whose answer or correctness differs from the reference's."""
    lp = log_softmax(a.loglik, np.float64) if a.kind == "choice" else None
    lq = log_softmax(b.loglik, np.float64) if a.kind == "choice" else None
    div = stats.kl(lp, lq) if lp is not None else None
    out = []
    for i in range(a.n):
        if a.answer[i] == b.answer[i] and a.correct[i] == b.correct[i]:
            continue
        probs = None if lp is None else [
            {lab: round(float(np.exp(v[i, j])), 6) for j, lab in enumerate(a.labels[i])} for v in (lp, lq)]
        gold = a.labels[i][a.gold[i]] if a.gold[i] >= 0 else None
        diff = float(div[i]) if div is not None else 1 - difflib.SequenceMatcher(None, a.text[i], b.text[i]).ratio()
        gen = a.kind == "generation"
        out.append(ChangedQuestion(
            run_name, a.task, int(a.doc_id[i]), a.category[i], gold, a.answer[i], b.answer[i],
            bool(a.correct[i] == 1), bool(b.correct[i] == 1), diff, probs[0] if probs else None,
            probs[1] if probs else None, a.text[i] if gen else None, b.text[i] if gen else None))
    return out


def agreement_matrix(runs: list[Run], tasks: list[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """[R, R] share of questions (all tasks pooled) on which two runs give the same answer."""
    answers = [[x for t in tasks for x in r.tasks[t].answer] for r in runs]
    m = np.array([[np.mean([x == y for x, y in zip(p, q)]) for q in answers] for p in answers])
    return tuple(r.name for r in runs), m


def check_gates(cmp: Comparison, gates: Gates) -> list[Verdict]:
    """Each gate's verdict on each run and task it applies to, passing or not; a gate that applies to no task
    is a user error."""
    out = []
    for c in cmp.tasks:
        if gates.max_flip_rate is not None:
            ok = c.flip_rate <= gates.max_flip_rate
            out.append(_verdict("--max-flip-rate", ok, f"{c.run} {c.task} flip_rate {c.flip_rate:.4f} "
                                f"{'<=' if ok else '>'} {gates.max_flip_rate:g}"))
        if gates.max_kl is not None and c.choice is not None:
            ok = c.choice.kl.mean <= gates.max_kl
            out.append(_verdict("--max-kl", ok, f"{c.run} {c.task} kl_mean {c.choice.kl.mean:.3g} "
                                f"{'<=' if ok else '>'} {gates.max_kl:g}"))
        if gates.margin is not None:
            ok = bool(c.delta.low > -gates.margin)
            out.append(_verdict("--margin", ok, f"{c.run} {c.task} delta {c.delta.estimate:+.4f}, 95% lower bound "
                                f"{c.delta.low:+.4f} is {'' if ok else 'not '}above -{gates.margin:g}"))
    if gates.max_kl is not None and not any(c.choice for c in cmp.tasks):
        raise OrtEvalsError("--max-kl: no log-likelihood (multiple-choice) task to gate on")
    return out


def _verdict(flag: str, passed: bool, text: str) -> Verdict:
    return Verdict(passed, f"gate {flag} {'passed' if passed else 'failed'}: {text}")
