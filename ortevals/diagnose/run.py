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

from ortevals.diagnose import resume
from ortevals.diagnose.inputs import DEFAULT_TOKENS, DiagnoseOptions, Inputs, check_inputs, check_pair
from ortevals.diagnose.int8 import check_donor
from ortevals.diagnose.layers import LayerStage, measure_layers, open_runners
from ortevals.diagnose.measure import ChoiceKL, TokenKL, choice_kl, choice_run, save_reference, token_kl
from ortevals.diagnose.recommend import BuildSettings, build_settings
from ortevals.diagnose.sensitivity import Bench, Candidate, Skipped, best, choose, with_choices
from ortevals.diagnose.stats import ranked
from ortevals.diagnose.verify import Verified, package_size, verify, with_choice
from ortevals.fidelity.windows import WindowPlan
from ortevals.package.loader import ModelPackage

log = logging.getLogger(__name__)
RESUMES = "interrupted: the measurements finished so far are kept in the cache; the same command resumes from them"
NOT_QUANTIZED = ("the candidate holds no quantized weights, so no group can be kept in higher precision: the "
                 "per-layer stage, the token KL and the choice sample only (no sensitivity stage)")


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
    """Diagnose ``o.pkg`` against ``o.ref``; write ``diagnose.json`` and ``diagnose.png`` into ``o.output``.
    Every measurement is kept in the cache as it is made (diagnose/resume.py): a rerun resumes from them."""
    from ortevals.files import cache_root

    inputs = check_inputs(o)
    int8 = check_donor(inputs.cand, o.int8) if o.int8 is not None else None
    if not inputs.quantized:
        say(NOT_QUANTIZED)
    cache = cache_root()
    try:
        report, capped = _first_stages(inputs, o, cache, say, int8)
    except KeyboardInterrupt:
        say(RESUMES)
        raise
    notes = ((NOT_QUANTIZED,) if not inputs.quantized else ()) + ((capped,) if capped else ())
    report = replace(report, notes=report.notes + notes)
    stages = [("sensitivity", lambda r: _sensitivity(r, cache, say))] if inputs.quantized else []
    stages += [("choice sample", lambda r: _choices(r, say))] if o.questions else []
    stages += [("--verify", lambda r: _verify(r, say) if r.recommended is not None else r)] if o.verify else []
    for name, stage_fn in stages:
        try:
            report = stage_fn(report)
        except (Exception, KeyboardInterrupt) as e:  # keep what was measured, then stop as the error says
            _write_partial(report, name, e, say)
            raise
    return _write(report)


def _first_stages(inputs: Inputs, o: DiagnoseOptions, cache: Path, say,
                  int8=None) -> tuple[DiagnoseReport, str | None]:
    """The reference, the text's windows, the per-layer stage and the candidate's token KL (each kept from an
    earlier run where its scope matches); the report so far and the line saying --tokens was capped."""
    ref = _reference(inputs, cache, say)
    cand, out = inputs.cand, Path(o.output).expanduser()
    ids, plan = windows(cand, ref, o)
    capped = (f"--tokens {o.tokens}: the text holds {plan.n_scored} tokens to score ({plan.n_windows} windows of "
              f"{plan.n_ctx}), so {plan.n_scored} are scored; a longer --text gives more") \
        if o.tokens and plan.n_scored < o.tokens else None
    if capped:
        say(capped)
    say(f"per-layer stage: {plan.n_windows} windows of {plan.n_ctx} tokens through both packages")
    stage, kept = resume.layers(cand.root, ref.root, ids, plan, o.ep, cache, lambda: measure_layers(
        *open_runners(cand, ref, o.ep, cache), ids, plan, len(cand.kv), _bar(plan.n_windows, "per layer")))
    if kept:
        say("  kept from an earlier run (the same packages, text and windows)")
    baseline = _baseline(cand, ref, out / "reference.npz", ids, plan, replace(o, ctx=plan.n_ctx, tokens=plan.n_scored),
                         cache, say)
    size = package_size(cand)
    return DiagnoseReport(cand, ref, size, size * o.budget / 100, plan, stage, baseline, build_settings(cand),
                          inputs.checkpoint, o, files=(out / "reference.npz",), int8=int8), capped


def _baseline(cand: ModelPackage, ref: ModelPackage, path: Path, ids, plan, o: DiagnoseOptions, cache: Path,
              say) -> TokenKL:
    """The candidate's token KL, and the reference saved to ``path`` for every later measurement: an earlier
    run's file and measurement where both were made from the same reference, text and windows."""
    key = resume.reference_key(ref.root, ids, plan, o.ep)
    if resume.reference_kept(path, key):
        say(f"token KL of the candidate ({plan.n_scored} tokens) against the reference kept in {path}")
        return resume.token_kl(cand.root, path, o.ep, cache, lambda: token_kl(cand.root, path, o.ep))
    say(f"token KL of the candidate ({plan.n_scored} tokens), the reference saved to {path}")
    baseline = save_reference(cand.root, ref.root, path, o)
    resume.mark_reference(path, key)
    return resume.token_kl(cand.root, path, o.ep, cache, lambda: baseline)


def _write_partial(r: DiagnoseReport, stage: str, e: BaseException, say) -> None:
    """``diagnose.json`` and ``diagnose.png`` of the stages finished before ``stage`` stopped, with a note
    saying where and why; a failure to write them is said, not raised over ``e``."""
    from ortevals.errors import first_line

    why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed ({first_line(e)})"
    try:
        written = _write(replace(r, notes=r.notes + (f"stopped: the {stage} stage {why}; the stages before it "
                                                     "are complete",)))
    except (Exception, KeyboardInterrupt) as again:
        say(f"the {stage} stage {why}; what was measured could not be written ({first_line(again)})")
        return
    say(f"the {stage} stage {why}: kept what was measured before it in {written.files[-2]}; every measurement "
        "finished is kept in the cache, and the same command resumes from them")


def _bar(total: int, desc: str) -> Callable[[int], None]:
    """A progress bar over ``total`` windows on stderr (tqdm's, as the scoring bar: in a log too), closed after the
    last."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="window", dynamic_ncols=True)

    def step(w: int) -> None:
        bar.update(1)
        if w == total - 1:
            bar.close()

    return step


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
