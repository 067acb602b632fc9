"""Measuring one package against the reference, the way ``ortevals fidelity`` and ``ortevals compare`` do.

Owns the two measurements every candidate of ``ortevals diagnose`` gets, each by calling the
command's own library function (nothing re-implemented):

* token KL: :func:`ortevals.fidelity.run.run_fidelity` against the reference saved once with
  ``--save-ref`` (the same windows of the same text for every candidate), keeping each token's KL
  so a recovery's standard error is paired;
* choice-KL and flips: the first N MMLU-Pro questions run through lm-eval
  (:func:`ortevals.evaluate.evaluate`, as ``ortevals mmlu-pro --limit N`` runs them, answers kept in
  the result store) and compared with the reference's run by :func:`ortevals.report.compare.compare`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortevals.report.stats import clustered_mean

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenKL:
    """``ortevals fidelity``'s summary of one package against the saved reference, and each token's KL."""

    kl: float
    kl_se: float
    same_top1: float
    ppl_ratio: float
    per_token: np.ndarray = field(repr=False, compare=False)
    clusters: np.ndarray = field(repr=False, compare=False)
    summary: dict = field(default_factory=dict, repr=False, compare=False)

    def recovered(self, baseline: TokenKL) -> tuple[float, float]:
        """KL removed against ``baseline`` (same tokens) and its paired, window-clustered standard error."""
        return clustered_mean(baseline.per_token - self.per_token, self.clusters)


@dataclass(frozen=True)
class ChoiceKL:
    """``ortevals compare``'s numbers for one run against the reference's run on the same questions."""

    n: int
    kl: float
    kl_se: float
    flips: int  # correct→wrong + wrong→correct
    flip_rate: float
    answer_changes: int
    accuracy: float
    ref_accuracy: float


def token_kl(package: Path, reference_file: Path, ep: str | None) -> TokenKL:
    """``ortevals fidelity --pkg PACKAGE --ref REFERENCE_FILE``."""
    from ortevals.fidelity.run import FidelityOptions, run_fidelity

    report = run_fidelity(FidelityOptions(pkg=Path(package), ref=str(reference_file), ep=ep))
    s = report.summary
    return TokenKL(s["kl"]["mean"], s["kl"]["se"], s["same_top1"]["mean"], s["ppl"]["ratio"], report.stats.kl,
                   report.clusters, s)


def save_reference(candidate: Path, reference: Path, out: Path, options) -> TokenKL:
    """``ortevals fidelity --pkg CANDIDATE --ref REFERENCE --save-ref OUT`` (the text, tokens and window of
    ``options``): the candidate's own KL, and the reference every later measurement reads."""
    from ortevals.fidelity.run import FidelityOptions, run_fidelity

    report = run_fidelity(FidelityOptions(pkg=Path(candidate), ref=str(reference), text=options.text,
                                          data=options.data, tokens=options.tokens, ctx=options.ctx,
                                          save_ref=out, ep=options.ep))
    s = report.summary
    return TokenKL(s["kl"]["mean"], s["kl"]["se"], s["same_top1"]["mean"], s["ppl"]["ratio"], report.stats.kl,
                   report.clusters, s)


def choice_run(package: Path, questions: int, data: str | None, ep: str | None, name: str):
    """``ortevals mmlu-pro --pkg PACKAGE --limit QUESTIONS``: the run, as :mod:`ortevals.report.runs` reads it."""
    from ortevals.evaluate import RunSpec, evaluate
    from ortevals.files import store_path
    from ortevals.integrations.lm import OrtLM
    from ortevals.options import parse_model_args
    from ortevals.presets import PRESETS, apply_limit, resolve_data, task_specs
    from ortevals.report.runs import run_from_results

    preset = PRESETS["mmlu-pro"]
    folder = resolve_data(preset, data or "bundled")
    specs, samples, notes = apply_limit(preset, task_specs(preset, folder), questions)
    args = {"pkg": str(package), "store": str(store_path(str(package)))} | ({"ep": ep} if ep else {})
    lm = OrtLM.from_package(parse_model_args(args))
    outcome = evaluate(lm, RunSpec(tasks=tuple(specs), limit=questions, samples=samples, notes=notes))
    return run_from_results(outcome.results, name)


def choice_kl(ref_run, run) -> ChoiceKL:
    """``ortevals compare --ref REF RUN`` on the one log-likelihood task both ran."""
    from ortevals.report.compare import compare

    task = compare(ref_run, [run]).tasks[0]
    f = task.flips
    return ChoiceKL(task.n, task.choice.kl.mean, task.choice.kl.se, f.correct_to_wrong + f.wrong_to_correct,
                    task.flip_rate, f.answer_changes, task.accuracy.estimate, task.ref_accuracy.estimate)
