"""One ``ortevals diagnose`` run: checks, the per-layer stage, the sensitivity stage, the recommendation.

Owns the order of the work and what it hands from stage to stage: the inputs checked first
(:mod:`ortevals.diagnose.inputs`), the windows of text (``ortevals fidelity``'s own functions and
defaults, so every stage reads the same tokens), the per-layer stage
(:mod:`ortevals.diagnose.layers`), the candidate's token KL with the reference saved once as
``<output>/reference.npz``, the sensitivity stage (:mod:`ortevals.diagnose.sensitivity`), the choice
sample, the recommendation and its build commands (:mod:`ortevals.diagnose.recommend`),
``--verify`` (:mod:`ortevals.diagnose.verify`), and the files: ``diagnose.json`` and ``diagnose.png``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ortevals.diagnose.inputs import DEFAULT_TOKENS, DiagnoseOptions, Inputs, check_inputs, check_pair
from ortevals.diagnose.int8 import check_donor
from ortevals.diagnose.layers import LayerStage, measure_layers, open_runners
from ortevals.diagnose.measure import ChoiceKL, TokenKL, choice_kl, choice_run, save_reference
from ortevals.diagnose.recommend import BuildSettings, build_settings
from ortevals.diagnose.sensitivity import Bench, Candidate, Skipped, best, choose, with_choices
from ortevals.diagnose.stats import ranked
from ortevals.diagnose.verify import Verified, package_size, verify, with_choice
from ortevals.fidelity.windows import WindowPlan
from ortevals.package.loader import ModelPackage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiagnoseReport:
    cand: ModelPackage
    ref: ModelPackage
    cand_size: int
    budget_bytes: float
    plan: WindowPlan
    layers: LayerStage
    baseline: TokenKL
    settings: BuildSettings
    checkpoint: Path | None
    options: DiagnoseOptions
    singles: tuple[Candidate, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    steps: tuple[Candidate, ...] = ()
    recommended: Candidate | None = None
    baseline_choice: ChoiceKL | None = None
    verified: Verified | None = None
    notes: tuple[str, ...] = ()
    files: tuple[Path, ...] = field(default=())
    int8: ModelPackage | None = None  # --int8: the builder's int8 export (diagnose/int8.py)


def windows(cand: ModelPackage, ref: ModelPackage, o: DiagnoseOptions):
    """The text's token ids and ``ortevals fidelity``'s window plan over them (its defaults)."""
    from ortevals.fidelity.run import FidelityOptions, text_windows
    from ortevals.package.tokenizer import Tokenizer

    limits = [n for n in (cand.context_length, ref.context_length) if n]
    fo = FidelityOptions(pkg=cand.root, ref=str(ref.root), text=o.text, data=o.data)
    return text_windows(Tokenizer.load(cand), fo, limits, o.ctx, o.tokens or DEFAULT_TOKENS)


def run_diagnose(o: DiagnoseOptions, say: Callable[[str], None] = log.info) -> DiagnoseReport:
    """Diagnose ``o.pkg`` against ``o.ref``; write ``diagnose.json`` and ``diagnose.png`` into ``o.output``."""
    from ortevals.files import cache_root

    inputs = check_inputs(o)
    int8 = check_donor(inputs.cand, o.int8) if o.int8 is not None else None
    cache = cache_root()
    ref = _reference(inputs, cache, say)
    cand, out = inputs.cand, Path(o.output).expanduser()
    ids, plan = windows(cand, ref, o)
    say(f"per-layer stage: {plan.n_windows} windows of {plan.n_ctx} tokens through both packages")
    runners = open_runners(cand, ref, o.ep, cache)
    stage = measure_layers(*runners, ids, plan, len(cand.kv))
    del runners
    say(f"token KL of the candidate ({plan.n_scored} tokens), the reference saved to {out / 'reference.npz'}")
    baseline = save_reference(cand.root, ref.root, out / "reference.npz",
                              replace(o, ctx=plan.n_ctx, tokens=plan.n_scored))
    size = package_size(cand)
    report = DiagnoseReport(cand, ref, size, size * o.budget / 100, plan, stage, baseline, build_settings(cand),
                            inputs.checkpoint, o, files=(out / "reference.npz",), int8=int8)
    report = _sensitivity(report, cache, say)
    if o.questions:
        report = _choices(report, say)
    if o.verify and report.recommended is not None:
        report = _verify(report, say)
    return _write(report)


def _reference(inputs: Inputs, cache: Path, say) -> ModelPackage:
    from ortevals.diagnose.inputs import reference_package

    if inputs.ref is not None:
        return inputs.ref
    say(f"building the fp32 reference package of {inputs.ref_checkpoint} (once, into the cache)")
    ref = reference_package(inputs.ref_checkpoint, cache)
    check_pair(inputs.cand, ref)
    return ref


def _sensitivity(r: DiagnoseReport, cache: Path, say) -> DiagnoseReport:
    from ortevals.diagnose.inputs import decoder_graph
    from ortevals.runtime.roles import weight_units

    units = weight_units(decoder_graph(r.cand))
    todo, skipped = choose(r.cand, r.ref, ranked(list(r.layers.rows)), units, r.options.candidates, r.budget_bytes,
                           r.int8)
    bench = Bench(r.cand, r.ref, r.baseline, r.files[0], cache, r.options.ep, say, r.int8)
    say(f"sensitivity stage: {len(todo)} groups, each alone at the reference's precision"
        + (" or at int8" if r.int8 is not None else ""))
    singles = bench.singles(todo)
    say("greedy: cumulative sets by KL recovered per MB, each measured")
    steps = bench.steps(singles, r.budget_bytes)
    notes = () if steps else ("no group within the budget lowers the token KL: nothing to recommend",)
    return replace(r, singles=tuple(singles), skipped=tuple(skipped), steps=tuple(steps), recommended=best(steps),
                   notes=r.notes + notes)


def _choices(r: DiagnoseReport, say) -> DiagnoseReport:
    o = r.options
    say(f"choice sample: the first {o.questions} MMLU-Pro questions through lm-eval (reference, candidate, steps)")
    ref_run = choice_run(r.ref.root, o.questions, o.data, o.ep, "reference")
    base = choice_kl(ref_run, choice_run(r.cand.root, o.questions, o.data, o.ep, "candidate"))
    steps = tuple(with_choices(list(r.steps), ref_run, o.questions, o.data, o.ep, say))
    rec = next((s for s in steps if r.recommended is not None and s.label == r.recommended.label), None)
    return replace(r, baseline_choice=base, steps=steps, recommended=rec or r.recommended)


def _verify(r: DiagnoseReport, say) -> DiagnoseReport:
    from ortevals.files import cache_root

    o, out = r.options, Path(r.options.output).expanduser() / "recommended"
    say(f"--verify: building the recommended package into {out} with the onnxruntime-genai builder")
    bench = Bench(r.cand, r.ref, r.baseline, r.files[0], cache_root(), o.ep, say, r.int8)
    v = verify(bench, r.settings, r.recommended.nodes, r.checkpoint, out)
    if o.questions:
        ref_run = choice_run(r.ref.root, o.questions, o.data, o.ep, "reference")  # answers from the result store
        v = with_choice(v, ref_run, o.questions, o.data, o.ep)
    return replace(r, verified=v)


def _write(r: DiagnoseReport) -> DiagnoseReport:
    from ortevals.diagnose.plot import diagnose_png
    from ortevals.diagnose.report import summary
    from ortevals.files import atomic_write, atomic_write_bytes, json_text

    out = Path(r.options.output).expanduser()
    s = summary(r)
    atomic_write(out / "diagnose.json", json_text(s, indent=2) + "\n")
    atomic_write_bytes(out / "diagnose.png", diagnose_png(s))
    return replace(r, files=r.files + (out / "diagnose.json", out / "diagnose.png"))
