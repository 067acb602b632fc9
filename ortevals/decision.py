"""``--against RUN --decide MARGIN``: a candidate scored against a finished run, part by part, until decided.

Owns the live decision of ``ortevals mmlu-pro`` (docs/decide.md). ``--against`` names a finished run, or a GenAI
package scored alongside the candidate in the same order (:func:`plan_alongside`: the set is every document of this
command's tasks, and each part is scored on both). Before any model work, :func:`check_decide`
refuses a bad flag in one line and :func:`plan_decision` reads the reference run (report/runs.py), keeps its
questions with a 0/1 score in the tasks this command scores, checks each is the same document in this data (its
``doc_hash``, as lm-eval logs it) and draws the order: the questions sorted by (task, doc_id), permuted by
numpy's PCG64 from ``--seed``, uniformly or (``--decide-order guided``) with report/guided.py's weights from the
reference's choice margins (a pure function of the seed and the reference's questions either way, so the same
command after Ctrl-C walks the same order, and the result store answers the parts already scored).

:func:`decide` keeps one model open (the caller's ``OrtLM``) and scores the order a part at a time, one lm-eval
evaluation per part (its ``samples``: the part's documents), each question's paired difference d = candidate −
reference fed in the order drawn to report/decide.py's :class:`ConfidenceSequence` for the whole-set difference
(population: the reference's questions; in a guided order the weighted sequence, told each question's
position); it stops at the first part after which :func:`verdict` decides, or at
the cap. A last evaluation over the questions used (every answer read from the result store) gives the table and
the files, ``results.json``'s ``decide`` recording the decision (report/decision.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError, did_you_mean
from ortevals.evaluate import RunOutcome, RunSpec, evaluate
from ortevals.files import store_path
from ortevals.integrations.lm import OrtLM
from ortevals.report.decide import ORDERS, ConfidenceSequence, verdict
from ortevals.report.decision import Look, decision_lines, decision_record, part_line
from ortevals.report.guided import choice_margins, guided_order, guided_weights
from ortevals.report.runs import Run, load_run, run_from_results
from ortevals.run.run import open_store
from ortevals.tasks import leaf_configs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecideSpec:
    """The flags of a live decision: the reference run, the margin in points, the order's seed, the part size,
    the cap (questions; None: the reference's count), the sequence's alpha and the order (report/decide.py's
    ORDERS: uniform, or guided by the reference's choice margins)."""

    against: Path
    margin: float
    seed: int = 0
    part: int = 50
    cap: int | None = None
    alpha: float = 0.05
    order: str = "uniform"


@dataclass(frozen=True)
class DecisionPlan:
    """What :func:`decide` scores: ``keys`` [N] (task, doc_id) in the order drawn, the reference's 0/1 outcome
    [N] of each, its prompt hash of each, and the leaf task configs (or names) by task. A package scored alongside
    (``reference`` None) has neither outcome nor prompts: both come from scoring it, part by part. A guided order
    also keeps ``weights`` [N] (the questions sorted by (task, doc_id)) and ``drawn`` [N], each drawn question's
    position in that sorted set; a uniform one keeps None for both."""

    spec: DecideSpec
    reference: Run | None
    keys: tuple[tuple[str, int], ...]
    outcome: np.ndarray | None
    prompt: tuple[str, ...] | None
    tasks: dict[str, object]
    weights: np.ndarray | None = None
    drawn: np.ndarray | None = None


def check_decide(against: Path | None, margin: float | None, part: int | None, cap: int | None,
                 alpha: float | None, seed: int | None, sample: int | None, limit: int | None,
                 order: str | None = None) -> DecideSpec | None:
    """The decision's flags, each wrong one refused in one line before any work; None without --against/--decide."""
    if against is None and margin is None:
        extra = next((f for f, v in (("--decide-part", part), ("--decide-cap", cap), ("--alpha", alpha),
                                     ("--decide-order", order)) if v is not None), None)
        if extra:
            raise OrtEvalsError(f"{extra} sets the decision of --against RUN --decide MARGIN: add both")
        return None
    if margin is None:
        raise OrtEvalsError(f"--against {against}: add --decide MARGIN (points: the candidate is decided within, "
                            "below or above ±MARGIN of the run)")
    if against is None:
        raise OrtEvalsError(f"--decide {margin:g} compares against a finished run: add --against RUN (an ortevals "
                            "--output folder or an lm-eval --log_samples folder)")
    if not 0 < margin < 100:
        raise OrtEvalsError(f"--decide {margin:g}: expected a margin in points, above 0 and below 100")
    if part is not None and part < 1:
        raise OrtEvalsError(f"--decide-part {part}: expected at least 1 question a part")
    if cap is not None and cap < 1:
        raise OrtEvalsError(f"--decide-cap {cap}: expected at least 1 question")
    if alpha is not None and not 0 < alpha < 1:
        raise OrtEvalsError(f"--alpha {alpha:g}: expected a level above 0 and below 1 (0.05: a 95% sequence)")
    if order is not None and order not in ORDERS:
        raise OrtEvalsError(f"--decide-order {order}: expected one of {', '.join(ORDERS)}{did_you_mean(order, ORDERS)}")
    if sample is not None or limit is not None:
        flag = f"--sample {sample}" if sample is not None else f"--limit {limit}"
        raise OrtEvalsError(f"{flag} and --against: the decision scores the run's own questions in a random order "
                            f"(--decide-cap N stops after N); drop {flag.split()[0]}")
    return DecideSpec(Path(against), float(margin), 0 if seed is None else seed, part or 50, cap,
                      0.05 if alpha is None else alpha, order or "uniform")


def is_package(path: Path) -> bool:
    """``--against`` names a GenAI package (scored alongside), not a finished run."""
    return (Path(path).expanduser() / "genai_config.json").is_file()


def plan_decision(spec: DecideSpec, specs: list, task_manager) -> DecisionPlan:
    """The reference run read and checked against this command's tasks and data, and the order drawn (a package
    named by ``--against``: :func:`plan_alongside`)."""
    if is_package(spec.against):
        return plan_alongside(spec, specs, task_manager)
    try:
        ref = load_run(spec.against)
    except OrtEvalsError as e:
        raise OrtEvalsError(f"--against: {e}") from None
    configs = _configs(specs, task_manager)
    names = sorted(t for t in ref.tasks if t in configs)
    if not names:
        raise OrtEvalsError(f"--against {spec.against}: holds task{'s' if len(ref.tasks) > 1 else ''} "
                            f"{', '.join(sorted(ref.tasks))[:200]}; this command scores {', '.join(configs)[:200]}")
    keys = [(t, int(i)) for t in names for i, c in zip(ref.tasks[t].doc_id, ref.tasks[t].correct) if c in (0, 1)]
    if not keys:
        raise OrtEvalsError(f"--against {spec.against}: no question of {', '.join(names)} has a 0/1 score "
                            "(acc or exact_match) to compare")
    _check_documents(spec.against, ref, keys, {t: configs[t] for t in names}, task_manager)
    rows = {t: {int(i): j for j, i in enumerate(ref.tasks[t].doc_id)} for t in names}
    weights = _weights(spec, ref, keys, rows) if spec.order == "guided" else None
    rng = np.random.default_rng(spec.seed)
    order = rng.permutation(len(keys)) if weights is None else guided_order(weights, rng)
    keys = [keys[i] for i in order]
    at = [(ref.tasks[t], rows[t][i]) for t, i in keys]
    return DecisionPlan(spec, ref, tuple(keys), np.array([int(r.correct[j]) for r, j in at], np.int64),
                        tuple(r.prompt_key[j] for r, j in at), {t: configs[t] for t in names}, weights,
                        None if weights is None else order)


def plan_alongside(spec: DecideSpec, specs: list, task_manager) -> DecisionPlan:
    """A package scored alongside: the set is every document of this command's tasks, sorted by (task, doc_id) and
    permuted from ``--seed``; a guided order needs a finished run's margins and is refused."""
    if spec.order == "guided":
        raise OrtEvalsError(f"--decide-order guided draws by a finished run's choice margins; --against {spec.against} "
                            "is a package scored alongside: use --decide-order uniform, or score it once (--output) "
                            "and decide against that run")
    configs = _configs(specs, task_manager)
    built = {str(k): v for k, v in task_manager.load(list(configs.values()))["tasks"].items()}
    keys = [(t, i) for t in sorted(configs) for i in range(len(built[t].eval_docs))]
    order = np.random.default_rng(spec.seed).permutation(len(keys))
    return DecisionPlan(spec, None, tuple(keys[i] for i in order), None, None, dict(sorted(configs.items())))


def _configs(specs: list, task_manager) -> dict[str, object]:
    """This command's leaf task configs (or names) by task name."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return {str(c["task"]): c for t in specs for c in ([t] if isinstance(t, dict)
                                                       else leaf_configs(task_manager, t, load_yaml))}


def _weights(spec: DecideSpec, ref: Run, keys: list, rows: dict) -> np.ndarray:
    """report/guided.py's weights [N] of ``keys`` from the reference's choice margins (one line where it has none)."""
    margins = {t: choice_margins(ref.tasks[t].loglik) for t in rows}
    at = np.array([margins[t][rows[t][i]] for t, i in keys])
    if not np.isfinite(at).any():
        raise OrtEvalsError(f"--decide-order guided: the reference {spec.against} holds no per-choice "
                            "log-likelihoods (a generation task?) to draw a guided order from; use "
                            "--decide-order uniform")
    return guided_weights(at)


def _check_documents(path: Path, ref: Run, keys: list, configs: dict, task_manager) -> None:
    """Each reference question is the same document here: its doc_id in the task's documents, and lm-eval's
    ``doc_hash`` of that document (the JSON of the document where the run kept no hash) equal to the run's."""
    from lm_eval.utils import handle_non_serializable, hash_string

    by_task = defaultdict(list)
    for t, i in keys:
        by_task[t].append(i)
    built = {str(k): v for k, v in task_manager.load(list(configs.values()))["tasks"].items()}
    for task, ids in by_task.items():
        docs = built[task].eval_docs
        beyond = [i for i in ids if i >= len(docs)]
        if beyond:
            raise OrtEvalsError(f"--against {path}: task {task} doc_id {beyond[0]} is beyond this data's "
                                f"{len(docs)} documents (the run was scored on other data: check --data)")
        rows = {int(i): j for j, i in enumerate(ref.tasks[task].doc_id)}
        chosen = docs.select(ids) if hasattr(docs, "select") else [docs[i] for i in ids]
        for i, doc in zip(ids, chosen):
            key = ref.tasks[task].doc_key[rows[i]]
            mine = hash_string(json.dumps(doc, indent=2, default=handle_non_serializable, ensure_ascii=False)) \
                if len(key) == 64 else json.dumps(doc, sort_keys=True, default=str)
            if mine != key:
                raise OrtEvalsError(f"--against {path}: task {task} doc_id {i} is another question in this data "
                                    "(the run was scored on another data revision: check --data)")


def decide(lm, plan: DecisionPlan, spec: RunSpec, echo=log.info, reference_lm=None) -> RunOutcome:
    """:func:`decide_parts` with each model keeping its parts' answers for the last evaluation (:func:`own_answers`)."""
    with own_answers(lm), own_answers(reference_lm):
        return decide_parts(lm, plan, spec, echo, reference_lm)


@contextlib.contextmanager
def own_answers(lm):
    """With resume off (``--no-resume``; the bench's warm and cold rows) a run keeps no answer, so the last evaluation
    over the questions used would score each of them again: the decision keeps its parts' answers in a store of its
    own, under the run's scope, in a temporary folder removed at the end. A run with its store: nothing changes."""
    run = getattr(lm, "run", None)
    if run is None or run.store is not None:
        yield
        return
    verdicts = run.backends.verdicts.store
    with tempfile.TemporaryDirectory(prefix="ortevals-decide-") as folder:
        run.store = open_store(Path(folder) / "answers.sqlite", run.package, run.tokenizer, run.backends, run.args)
        try:
            yield
        finally:
            run.store.close()
            run.store, run.backends.verdicts.store = None, verdicts


def decide_parts(lm, plan: DecisionPlan, spec: RunSpec, echo=log.info, reference_lm=None) -> RunOutcome:
    """Score ``plan``'s order on ``lm`` a part at a time until decided (module docstring); then one evaluation
    over the questions used, with ``spec``'s output, whose results hold ``decide``. A package scored alongside
    (``plan.reference`` None) is scored part by part on ``reference_lm`` too, and its own evaluation of the
    questions used goes to ``reference/`` inside the output folder."""
    d_spec, n = plan.spec, len(plan.keys)
    if plan.reference is None and reference_lm is None:
        raise OrtEvalsError(f"--against {d_spec.against}: a package scored alongside needs its model opened")
    cs, looks = ConfidenceSequence(n, d_spec.alpha, plan.weights), []
    limit = n if d_spec.cap is None else min(d_spec.cap, n)
    base, d, decided = np.zeros(0, np.int64), np.zeros(0, np.int64), None
    while cs.t < limit and decided is None:
        stop = min(cs.t + d_spec.part, limit)
        ref, prompts, ref_summary = (plan.outcome[cs.t:stop], plan.prompt[cs.t:stop], None) if plan.reference \
            else _score(reference_lm, plan, spec, cs.t, stop)
        got, _, summary = _score(lm, plan, spec, cs.t, stop, prompts)
        base, d = np.concatenate([base, ref]), np.concatenate([d, got - ref])
        cs.update(d[cs.t:], None if plan.drawn is None else plan.drawn[cs.t:stop])
        decided = verdict(cs.low, cs.high, d_spec.margin / 100)
        looks.append(Look(cs.t, cs.low, cs.high, cs.estimate, int(np.count_nonzero(d))))
        scored = [summary] + ([ref_summary] if ref_summary else [])
        echo(part_line(looks[-1], n, d_spec.margin, decided, sum(x.requests for x in scored),
                       sum(x.reused for x in scored)))
    source = plan.reference.path if plan.reference else d_spec.against
    record = decision_record(decided or "cap", reference=str(source), outcome=plan.outcome, d=d, looks=looks,
                             margin=d_spec.margin, alpha=d_spec.alpha, seed=d_spec.seed, part=d_spec.part,
                             cap=d_spec.cap, order=d_spec.order, used_reference=base, population=n)
    final = dataclasses.replace(spec, tasks=_tasks(plan, 0, cs.t), samples=_samples(plan, 0, cs.t),
                                notes=(*spec.notes, *decision_lines(record)), record={"decide": record})
    outcome = evaluate(lm, final)
    if plan.reference is None and spec.output is not None:  # the reference's answers kept beside the candidate's
        evaluate(reference_lm, dataclasses.replace(final, output=Path(spec.output) / "reference", notes=()))
    return outcome


def reference_lm(args, plan: DecisionPlan):
    """The model of a package scored alongside (``args``: the candidate's model arguments, with the package, its own
    result store and no adapter); None where the reference is a finished run. Its sessions open on a thread."""
    if plan.reference is not None:
        return None
    pkg = Path(plan.spec.against).expanduser()
    return OrtLM.from_package(dataclasses.replace(args, pkg=str(pkg), store=str(store_path(pkg)), adapter=()),
                              open_soon=True)


def _tasks(plan: DecisionPlan, start: int, stop: int) -> tuple:
    used = {t for t, _ in plan.keys[start:stop]}
    return tuple(c for t, c in plan.tasks.items() if t in used)


def _samples(plan: DecisionPlan, start: int, stop: int) -> dict[str, list[int]]:
    """lm-eval's ``samples`` for the questions ``start:stop`` of the order: each task's doc_ids, ascending."""
    out = defaultdict(list)
    for t, i in plan.keys[start:stop]:
        out[t].append(i)
    return {t: sorted(v) for t, v in out.items()}


def _score(lm, plan: DecisionPlan, spec: RunSpec, start: int, stop: int, prompts=None):
    """The 0/1 outcome [stop - start] on ``lm`` of the questions ``start:stop`` of the order (one lm-eval
    evaluation, nothing written), each checked to have been asked with the reference's prompt ``prompts``
    [stop - start] (None: not checked; the reference's own pass); their prompts and the run's summary."""
    part = dataclasses.replace(spec, tasks=_tasks(plan, start, stop), samples=_samples(plan, start, stop),
                               output=None, notes=(), sample=None, record={})
    outcome = evaluate(lm, part)
    run = run_from_results(outcome.results, "this run")
    rows = {t: {int(i): j for j, i in enumerate(r.doc_id)} for t, r in run.tasks.items()}
    out, asked = np.zeros(stop - start, np.int64), []
    for k, (t, i) in enumerate(plan.keys[start:stop]):
        task = run.tasks.get(t)
        j = rows.get(t, {}).get(i)
        if task is None or j is None or task.correct[j] not in (0, 1):
            raise OrtEvalsError(f"--against {plan.spec.against}: task {t} doc_id {i} has no 0/1 score in this run")
        if prompts is not None and task.prompt_key[j] != prompts[k]:
            raise OrtEvalsError(f"--against {plan.spec.against}: task {t} doc_id {i} was asked with another prompt "
                                "in the run (another prompt format, few-shot setting or chat template?)")
        out[k] = int(task.correct[j])
        asked.append(task.prompt_key[j])
    return out, tuple(asked), outcome.summary
