"""``--samples K``: inference-time scaling as an evaluation mode, scored after the run.

The task configs were rewritten before the run (``repeats: K`` and sampling settings:
:func:`ortevals.tasks.with_samples`). Owns what the samples score after it: each sample's answer
through the task's own filter chain (``take_first`` and ``majority_vote`` left out, so every sample
keeps its own answer; ``take_first_k`` kept, and every per-sample number of that filter cut to the
same first k samples: each filter is scored on exactly the samples it keeps), its correctness by the
task's ``exact_match`` settings, its log-prob per scored token (the whole sequence, EOS included:
:func:`best_of_k_score`) and token count (stored by the model, resumed runs included), then maj@k /
pass@k / best-of-k for k = 1, 2, 4, … K (:mod:`ortevals.report.scaling`), and where a verifier ran
(integrations/verify.py) or generation kept self-certainty (raw and og paths, Ray workers) the
selectors of :mod:`ortevals.report.selection` (``bon@k``, ``weighted_maj@k``, PRM variants,
``bon_certainty@k``, each with its ``_avg`` twin), into results.json's per-task results in lm-eval's
layout (``maj@4,custom-extract``, ``maj@4_stderr,custom-extract``), and the plots (``scaling.png``,
``compute.png``). Each question's samples-file record gains ``sample_tokens``, ``verifier_scores`` and
``filtered_resps``.

What it knows of the run that generated the samples comes in a :class:`SampleFacts` (built by the run's
owner: ``OrtLM.sample_facts``), never from the model object itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.report.store import ResultStore

log = logging.getLogger(__name__)
Verdicts = tuple[dict, dict]  # a verifier's (task, doc_id) -> K scores, and -> K step-score lists (PRM)
SELECTORS = ("take_first", "majority_vote")  # filters that collapse the K samples to one answer


@dataclass(frozen=True)
class SampleFacts:
    """What the scaling report reads of the run that generated the samples, keyed by a sample's store key
    (the JSON of its request arguments and its occurrence index)."""

    logprobs: Mapping[str, Sequence]  # this process's samples: (log-prob, tokens generated, tokens scored)
    certainty: Mapping[str, float]  # this process's samples' self-certainty
    store: ResultStore | None  # the result store: samples of an earlier, resumed run
    count_tokens: Callable[[str], int]  # a text's tokens, where no count was kept (the og path)
    parameters: int  # the package's weights (compute.png's FLOPs)


def sample_answers(cfg: dict, texts: Sequence[str], doc: dict) -> dict[str, list]:
    """Per filter of the task: the answer of each sample it keeps (all K, or the first k of its ``take_first_k``),
    ``None`` where nothing was extracted."""
    import lm_eval.filters  # noqa: F401  (registers the filters)
    from lm_eval.api.registry import get_filter

    out: dict[str, list] = {}
    for entry in cfg.get("filter_list") or [{"name": "none", "filter": []}]:
        resps: list = [list(texts)]
        fallback = None
        for step in entry.get("filter", []):
            kwargs = {k: v for k, v in step.items() if k != "function"}
            if step["function"] in SELECTORS:
                continue
            applied = get_filter(step["function"])(**kwargs)
            # what an extracting filter (regex, multi_choice_regex: "[invalid]" by default) leaves where it
            # found no answer: no answer, not a vote
            own = getattr(applied, "fallback", None)
            fallback = own if isinstance(own, str) else fallback
            resps = [list(r) for r in applied.apply(resps, [doc])]
        out[entry["name"]] = [None if a == fallback else a for a in resps[0]]
    return out


def is_correct(cfg: dict, answers: Sequence, target) -> list[bool]:
    """The task's exact_match settings (ignore_case, ignore_punctuation, regexes_to_ignore) per answer."""
    from lm_eval.api.metrics import exact_match_hf_evaluate

    metric = next((m for m in cfg.get("metric_list", []) if m.get("metric") == "exact_match"), None)
    if metric is None:
        raise OrtEvalsError(f"task {cfg.get('task')}: --samples reports maj@k/pass@k from exact_match; "
                            "this task has no exact_match metric")
    opts = {k: v for k, v in metric.items() if k in ("ignore_case", "ignore_punctuation", "ignore_numbers",
                                                      "regexes_to_ignore")}
    return [a is not None and bool(exact_match_hf_evaluate([str(a)], [str(target)], **opts)["exact_match"])
            for a in answers]


def sample_meta(facts: SampleFacts, args: tuple, occurrence: int) -> tuple[float, int, int] | None:
    """(log-prob of the whole sequence, EOS included; tokens generated; tokens scored = generated + the
    ending EOS) of one sample from this run or the store; None when unknown (og path)."""
    key = [*args, occurrence]
    found = facts.logprobs.get(json.dumps(key, default=str))
    if found is None and facts.store is not None:
        found = facts.store.get("generate_until/logprob", key)
    return tuple(found) if found is not None and len(found) == 3 else None


def best_of_k_score(meta: tuple[float, int, int]) -> float:
    """Best-of-k's score of a sample: its whole sequence's log-prob (the EOS that ended it included) per
    scored token (docs/decoding.md). A sample that ends at once scores log p(EOS), not 0."""
    logprob, _, scored = meta
    return logprob / max(scored, 1)


def sample_certainty(facts: SampleFacts, args: tuple, occurrence: int) -> float | None:
    """One sample's self-certainty (raw and og paths) from this run or the store; None when unknown."""
    key = [*args, occurrence]
    found = facts.certainty.get(json.dumps(key, default=str))
    if found is None and facts.store is not None:
        found = facts.store.get("generate_until/certainty", key)
    return None if found is None else float(found)


def task_questions(cfg: dict, samples: Sequence[dict], facts: SampleFacts,
                   verified: Verdicts | None = None) -> dict[str, list]:
    """ScoredQuestions per filter for one task's logged samples (each with K responses); each record gets
    ``sample_tokens`` (K), ``verifier_scores`` (K, when a verifier ran) and ``filtered_resps`` (its filter's
    K extracted answers, lm-eval's field)."""
    seen: dict[str, int] = {}
    by_filter: dict[str, list] = {}
    per_doc: dict[int, tuple] = {}
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        if s["doc_id"] in per_doc:
            continue  # lm-eval logs a record per filter: the question is scored once
        texts = list(s["resps"][0])
        args = tuple(s["arguments"][0]) if "arguments" in s else None
        ident = json.dumps(args, sort_keys=True, default=str)
        first = seen.get(ident, 0)
        seen[ident] = first + len(texts)
        questions, tokens, verifier = _question(cfg, s, facts, args, first, verified)
        for name, q in questions.items():
            by_filter.setdefault(name, []).append(q)
        per_doc[s["doc_id"]] = (tokens, verifier, {n: list(q.samples.answers) for n, q in questions.items()})
    for s in samples:  # the samples file's per-question fields
        tokens, verifier, answers = per_doc[s["doc_id"]]
        s["sample_tokens"] = list(tokens)
        if verifier is not None:
            s["verifier_scores"] = list(verifier)
        s["filtered_resps"] = answers.get(s.get("filter"), next(iter(answers.values())))
    return by_filter


def _question(cfg: dict, s: dict, facts: SampleFacts, args: tuple | None, first: int, verified: Verdicts | None):
    """One record's ScoredQuestion per filter, its K token counts and its K verifier scores (or None)."""
    from ortevals.report.scaling import QuestionSamples
    from ortevals.report.selection import ScoredQuestion

    texts = list(s["resps"][0])
    scores, steps = verified or ({}, {})
    metas = [sample_meta(facts, args, first + j) for j in range(len(texts))] if args else [None] * len(texts)
    tokens = tuple(m[1] if m else facts.count_tokens(t) for m, t in zip(metas, texts, strict=True))
    mean_lp = None if any(m is None for m in metas) else tuple(best_of_k_score(m) for m in metas)
    certainty = [sample_certainty(facts, args, first + j) for j in range(len(texts))] if args else [None]
    key = (cfg.get("task"), int(s["doc_id"]))
    verifier = _tuple(scores.get(key))
    extra = {"verifier": verifier, "certainty": None if None in certainty else tuple(certainty),
             "steps": None if key not in steps else tuple(tuple(x) for x in steps[key])}
    questions = {}
    for name, answers in sample_answers(cfg, texts, s["doc"]).items():
        n = len(answers)  # the samples this filter keeps: every per-sample number cut to the same first n
        kept = {k: None if v is None else v[:n] for k, v in extra.items()}
        questions[name] = ScoredQuestion(QuestionSamples(tuple(answers), tuple(is_correct(cfg, answers, s["target"])),
                                                         None if mean_lp is None else mean_lp[:n], tokens[:n]), **kept)
    return questions, tokens, verifier


def _tuple(values) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def add_sample_tokens(results: dict, configs: Sequence[dict], facts: SampleFacts) -> None:
    """Each generation record of a one-sample run gains ``sample_tokens`` (its output's own token count, as a
    ``--samples`` run's records have), where the run kept every count (raw path or the store; not the og path),
    so ``compare`` counts lengths and outputs at ``max_gen_toks`` by the run's own tokens."""
    for cfg in configs:
        if cfg.get("output_type") != "generate_until":
            continue
        seen: dict[str, int] = {}
        for s in sorted(results.get("samples", {}).get(cfg.get("task"), ()), key=lambda s: s["doc_id"]):
            if "arguments" not in s:
                continue
            args = tuple(s["arguments"][0])
            ident = json.dumps(args, sort_keys=True, default=str)
            first, texts = seen.get(ident, 0), list(s["resps"][0])
            seen[ident] = first + len(texts)
            metas = [sample_meta(facts, args, first + j) for j in range(len(texts))]
            if all(m is not None for m in metas):
                s["sample_tokens"] = [m[1] for m in metas]


def add_scaling(results: dict, configs: Sequence[dict], facts: SampleFacts, output: Path | None,
                verified: Verdicts | None = None) -> list:
    """maj@k / pass@k / best@k, and the selectors the run has scores for (bon@k, weighted_maj@k, the PRM
    variants with ``verified``; bon_certainty where every sample has its self-certainty: report/selection.py)
    into ``results["results"][task]`` (every filter, each on the samples it keeps), and over all tasks' questions
    pooled (of each task the first filter that keeps every sample) into ``results["scaling"]`` with Brown et
    al.'s coverage fit, pooled and per task (that filter), plotted to ``output/scaling.png`` and
    ``output/compute.png``. Returns the pooled curve points."""
    from ortevals.report.compute import coverage_record
    from ortevals.report.results import DEFINITIONS
    from ortevals.report.scaling import lm_eval_metrics, scaling_curves
    from ortevals.report.selection import selection_curves

    pooled: list = []
    fits: dict[str, dict] = {}
    for cfg in configs:
        name = cfg.get("task")
        samples = results.get("samples", {}).get(name)
        if not cfg.get("repeats") or not samples:
            continue
        by_filter = task_questions(cfg, samples, facts, verified)
        widest = max(by_filter, key=lambda f: len(by_filter[f][0].samples.answers))  # the first keeping all K
        for filt, questions in by_filter.items():
            points = scaling_curves([q.samples for q in questions]) + selection_curves(questions)
            results["results"].setdefault(name, {}).update(lm_eval_metrics(points, filt))
            if filt == widest:  # the task's first filter that keeps every sample, as pooled
                pooled.extend(questions)
                fits[name] = coverage_record(points)
    if len({len(q.samples.answers) for q in pooled}) > 1:
        log.warning("--samples: the tasks keep different numbers of samples; no pooled scaling table")
        return []
    if not pooled:
        return []
    points = scaling_curves([q.samples for q in pooled]) + selection_curves(pooled)
    results["scaling"] = {"questions": len(pooled), "samples": len(pooled[0].samples.answers),
                          "points": [p.__dict__ for p in points], "coverage_fit": coverage_record(points),
                          "coverage_fit_by_task": fits,
                          "estimators": {n: d for n, d in DEFINITIONS.items() if any(p.estimator == n for p in points)}}
    if unknown := sum(q.certainty is None for q in pooled):  # bon_certainty needs every sample's
        results["scaling"]["bon_certainty_missing"] = (
            f"{unknown} of {len(pooled)} questions have a sample without self-certainty (generated on the media "
            "path, or stored by an ortevals that did not keep it): bon_certainty@k is left out")
    if output is not None:
        _scaling_plots(results, points, facts.parameters, output)
    return points


def _scaling_plots(results: dict, points: list, parameters: int, output: Path) -> None:
    """``scaling.png`` (maj, pass, best against k and tokens) and ``compute.png`` (every estimator and selector
    against generated tokens and estimated FLOPs, report/compute.py; the cost in ``results["scaling"]["cost"]``)."""
    from ortevals.report.compute import compute_plot, compute_points, fit_pass_curve, run_cost
    from ortevals.report.scaling import curve_plot

    scaling = results["scaling"]
    title = f"{scaling['questions']} questions, K={scaling['samples']}"
    output.mkdir(parents=True, exist_ok=True)
    curve_plot(points, output / "scaling.png", title)
    cost = run_cost(parameters, results.get("verifier"))
    scaling["cost"] = cost.__dict__
    fit = fit_pass_curve(points) if scaling["coverage_fit"]["a"] is not None else None
    standard = [p for p in points if not p.estimator.endswith("_avg")]  # one line per method, the names' own
    compute_plot(compute_points(standard, cost), output / "compute.png", title, fit)
