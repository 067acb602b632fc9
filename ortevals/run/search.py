"""A run's ``generate_until`` by step-level search (issue 25, ``--search beam|dvts|particles``).

Owns turning each request (prompt ids, decoding settings) into one search on the raw engine
(engine/generate/search/rawrows.py's :class:`RawRowModel`: the prompt run once, rows forked by reference)
guided by the run's step scorer (a PRM from ``--verifier``: engine/generate/search/prm.py, set by the
front door that opened the verifier, with ``search_reward``: how its scores become particle
weights), and the answer's text cut at the request's stops. The answers are stored and resumed
under the run's scope narrowed by :func:`search_scope` (the settings and what the verifier reads). Steps end
at ``step_separator``; a step and a solution are capped at ``max_gen_toks``. Token choice is the
sampler's (engine/generate/search/steps.py's :class:`ProcessorChooser` over engine/generate/choice/logits.py:
the request's penalties over each row's prompt + tokens, temperature, top-k, top-p, min-p, typical,
Mirostat) from one generator per request (seed, request key); a greedy request samples at
temperature 0.8 (search-and-learn's default; greedy rows would all be equal) with its other
settings kept, logged once. What a search run did and cost (:func:`search_record`: method, settings, verifier,
tokens generated, steps, passes, the verifier's tokens and seconds) goes to ``results["search"]``, the summary
and the mode line.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ortevals.engine.generate.choice.seeds import sample_rng
from ortevals.engine.generate.choice.stops import TextStream
from ortevals.engine.generate.search.guided import SearchSettings, dvts, particle_filter, prm_beam_search
from ortevals.engine.generate.search.rawrows import RawRowModel
from ortevals.engine.generate.search.steps import ProcessorChooser, StepRules, text_separator
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)
GREEDY_SEARCH_TEMPERATURE = 0.8
METHODS = {"beam": "PRM beam search", "dvts": "DVTS", "particles": "particle filtering"}


def search_settings(args, reward: str = "logit") -> SearchSettings:
    """The run's SearchSettings; a width that does not divide n is a one-line error. ``reward``: particle
    filtering's log-weight from a probability (``logit``: P(True)) or a score that is already a logit
    (``raw``: an ORM classifier's output, i.e. logit(sigmoid(score)))."""
    s = SearchSettings(n=args.search_n, width=args.search_width, max_steps=args.search_max_steps,
                       aggregation=args.prm_aggregation, reward=reward)
    try:
        s.check("particle_filter" if args.search == "particles" else args.search)
    except ValueError as e:
        raise OrtEvalsError(f"--search {args.search}: {e}") from None
    return s


def search_scope(args, reward: str, verifier) -> tuple[list, dict]:
    """What a search's answers depend on beyond the run's own scope (Run.narrow_scope): what the verifier reads
    (its files, its settings) and the search's settings (method, SearchSettings, separator, verifier kind)."""
    settings = {"method": args.search, **dataclasses.asdict(search_settings(args, reward)),
                "step_separator": args.step_separator, "verifier": verifier.kind}
    return verifier.reads(), {"search": settings}


def search_mode(args) -> str:
    """The mode line's words for a search run: which search, with what budget."""
    width = f", width {args.search_width}" if args.search in ("beam", "dvts") else ""
    return (f"generate_until by step-level search: {METHODS[args.search]} (--search {args.search}, n {args.search_n}"
            f"{width}, at most {args.search_max_steps} steps, step scores folded by {args.prm_aggregation}) guided by "
            f"--verifier {args.verifier}")


def timed_scores(run, verifier):
    """``verifier.score_texts`` with its seconds and tokens added to ``run.stats`` (``search_verifier_seconds``,
    ``search_verifier_tokens``): what guiding the search cost."""
    def score(context, answers):
        before, start = verifier.tokens_run, time.perf_counter()
        try:
            return verifier.score_texts(context, answers)
        finally:
            stats = run.stats
            stats["search_verifier_seconds"] = stats.get("search_verifier_seconds", 0.0) + time.perf_counter() - start
            stats["search_verifier_tokens"] = stats.get("search_verifier_tokens", 0) + verifier.tokens_run - before

    return score


SEARCH_STATS = ("search_tokens", "search_steps", "search_passes", "search_verifier_tokens", "search_verifier_seconds")


def search_record(args, reward: str, verifier, stats: dict, before: dict) -> dict:
    """``results["search"]``: the search, its settings and verifier, and between the ``before`` and ``stats``
    readings the requests searched (and reused), tokens generated (pruned rows included), steps, passes, and the
    verifier's tokens and seconds within the generation's seconds."""
    def ran(key: str):
        return stats.get(key, 0) - before.get(key, 0)

    return {"method": args.search, "name": METHODS[args.search],
            "settings": {**dataclasses.asdict(search_settings(args, reward)), "step_separator": args.step_separator},
            "verifier": {"name": getattr(verifier, "name", args.verifier), "kind": getattr(verifier, "kind", None)},
            "requests": ran("requests"), "reused": ran("reused"), "generated_tokens": ran("search_tokens"),
            "steps": ran("search_steps"), "passes": ran("search_passes"),
            "verifier_tokens": ran("search_verifier_tokens"), "verifier_seconds": ran("search_verifier_seconds"),
            "seconds": ran("seconds")}


def search_sampling(settings):
    """The request's GenSettings as a search samples them: a greedy request at temperature 0.8."""
    if settings.do_sample:
        return settings
    return dataclasses.replace(settings, do_sample=True, temperature=GREEDY_SEARCH_TEMPERATURE)


def run_search(run, runner, items, keys: list[list], finish) -> None:
    """Each request's answer by ``run.args.search``; ``finish(i, text, tokens)``. ``run.step_scorer`` is the PRM."""
    args = run.args
    if run.step_scorer is None:
        raise OrtEvalsError("--search needs --verifier: its step scores guide the search")
    s = search_settings(args, run.search_reward)
    eos = frozenset({run.eot_token_id, *run.package.eos_token_ids})
    ends = text_separator(lambda ids: run.tokenizer.decode(ids), args.step_separator)
    if any(not st.do_sample for _, st in items):
        log.info("--search: greedy requests search at temperature %s", GREEDY_SEARCH_TEMPERATURE)
    for i, (ids, settings) in enumerate(items):
        rules = StepRules(eos, ends, max_step_tokens=settings.max_gen_toks, max_tokens=settings.max_gen_toks)
        rng = sample_rng(settings.seed, keys[i], None)
        chooser = ProcessorChooser(search_sampling(settings), rng)
        model = RawRowModel(runner, run.backends.settings.reuse)
        if args.search == "particles":
            out = particle_filter(model, ids, run.step_scorer, rules, chooser, s, rng)
        else:
            out = (prm_beam_search if args.search == "beam" else dvts)(model, ids, run.step_scorer, rules, chooser, s)
        stream = TextStream(run.tokenizer, settings, set(eos))
        for token in out.solutions[out.best].tokens:
            if stream.push(int(token)):
                break
        # the decoding steps (one pass each if all live rows ran together) against the passes run (one per
        # row length a step; the prompt's included): what an in-place ragged arena would save
        for name, value in (("search_tokens", out.generated_tokens), ("search_steps", out.passes),
                            ("search_passes", model.stats["passes"])):
            run.stats[name] = run.stats.get(name, 0) + value
        finish(i, *stream.result)
