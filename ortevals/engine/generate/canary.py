"""Batch and prefix invariance of generation: checked, not assumed (issue 22, item 5).

Generation reuses work across rows and prompts in two places, and each is right only if no op
mixes the rows or tokens of a pass (engine/score/invariance.py):

* the raw path (:mod:`ortevals.engine.generate.rows.sampler`) decodes a prompt's K sample rows in one pass and
  runs a prompt on top of the KV of the prompt before it, cut to their shared prefix;
* the onnxruntime-genai path (:mod:`ortevals.engine.generate.og.schedule`) decodes up to ``gen_batch_size``
  greedy prompts in one batched Generator and rewinds its cursor to the prefix shared with the
  previous prompt.

Owns the canary that checks both before the first generation: a few of the run's own prompts,
cut short (:func:`~ortevals.engine.score.invariance.shorten`) and decoded for a few tokens, the
configured way (as the run decodes them: the rows of several prompts in one pass where it would) and
alone (one row per pass, each prompt from an empty cache). The same tokens,
and (raw path) each row's log-prob within the dtype's tolerance, keep the configured way;
anything else makes the run decode one row per pass with no prefix reuse, and the mode says
so. A verdict is filed like the prefill canary's (:class:`~ortevals.engine.score.invariance.Verdicts`).

Pure orchestration over a sampler / og runner passed in; no runtime import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from ortevals.engine.score.invariance import Verdicts, pick_canary, shorten, tolerance

log = logging.getLogger(__name__)

CANARY_PROMPTS = 3  # prompts decoded both ways
CANARY_ROWS = 4  # sample rows of one prompt decoded together
CANARY_NEW_TOKENS = 8  # tokens decoded per row: a pass that mixes rows moves the first one already


@dataclass(frozen=True)
class GenVerdict:
    """What the generation canary found: ``passed``, the worst |Δ log-prob| and the rows compared."""

    passed: bool
    max_diff: float
    rows: int
    detail: str = ""


def pick_prompts(prompts: Sequence[Sequence[int]], wide: Sequence[int] = (), k: int = CANARY_PROMPTS) -> list[int]:
    """Indices of up to ``k`` prompts: those sharing the longest prefix (prefix reuse), then the first of
    ``wide`` (prompts the configured way decodes several rows of at once) if none was picked."""
    picked = pick_canary([tuple(p) for p in prompts], k)[:k]
    if wide and not set(picked) & set(wide):
        picked = [*picked[:k - 1], wide[0]]
    return picked


def short(settings, cut: Sequence[int]):
    """A canary prompt (``cut``) and its settings: at most :data:`CANARY_NEW_TOKENS` tokens, the rest kept."""
    return tuple(cut), replace(settings, max_gen_toks=min(settings.max_gen_toks, CANARY_NEW_TOKENS))


def _cut(prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Prompts cut to about :data:`~ortevals.engine.score.invariance.CANARY_TOKENS`, shared prefixes kept."""
    return [c + x for c, x in shorten([(tuple(p[:-1]), tuple(p[-1:])) for p in prompts])]


# --- the raw path --------------------------------------------------------------------------------------


def raw_key(sampler) -> dict:
    """What the raw canary's verdict depends on beyond the store's scope: how passes are shaped."""
    return {"canary": "generate/raw", "prefix_cache": sampler.prefix_cache, "prefix_min": sampler.prefix_min,
            "kv_budget": sampler.kv_budget, "exact": sampler.exact}


def check_raw(sampler, jobs: Sequence, rng: Callable, names: Callable[[int], str], dtype: str,
              verdicts: Verdicts | None = None) -> tuple[GenVerdict, bool]:
    """The canary on ``jobs`` (engine/sampler.plan_jobs); ``rng(i)``: request i's generator.

    Returns (verdict, whether it was stored). The sampler is left as the verdict says: on a failure
    ``exact`` (one row per pass) and no prefix reuse."""
    verdicts = verdicts or Verdicts()
    key = raw_key(sampler)
    stored = verdicts.get(key)
    if stored is not None:
        verdict, reused = GenVerdict(**stored), True
    else:
        verdict, reused = _run_raw(sampler, jobs, rng, names, dtype), False
        verdicts.put(key, asdict(verdict))
    if not verdict.passed:
        sampler.exact, sampler.prefix_cache = True, False
    return verdict, reused


def _run_raw(sampler, jobs: Sequence, rng: Callable, names: Callable[[int], str], dtype: str) -> GenVerdict:
    wide = [j for j, job in enumerate(jobs) if job.settings.do_sample and len(job.members) > 1]
    picked = [jobs[j] for j in sorted(pick_prompts([job.prompt for job in jobs], wide))]
    picked = [p for p in picked if p.settings.num_beams == 1 and p.settings.mbr_samples < 2]
    if not picked:
        return GenVerdict(True, 0.0, 0, "nothing to compare (beam search or MBR only)")
    cuts = _cut([p.prompt for p in picked])
    configured, alone = sampler.fresh(), sampler.fresh(exact=True)
    short_jobs = []
    for job, cut in zip(picked, cuts, strict=True):
        prompt, settings = short(job.settings, cut)
        short_jobs.append(replace(job, prompt=prompt, settings=settings,
                                  members=job.members[:CANARY_ROWS] if settings.do_sample else job.members[:1]))
    together: dict = {}
    configured.run(short_jobs, rng, together.__setitem__, names)  # as the run decodes: several prompts a pass
    diffs, detail = [], ""
    for job in short_jobs:
        prompt, settings = job.prompt, job.settings
        for i in job.members:
            got = together[i]
            logits, past = alone.prompt(prompt, settings.max_gen_toks)
            (ref,) = alone.decode(logits, past, settings, [rng(i)], [names(i)], prompt)
            diff, why = compare_rows(got, ref, dtype)
            diffs.append(diff)
            detail = detail or (f"{names(i)}: {why}" if why else "")
    return GenVerdict(not detail, max(diffs), len(diffs), detail)


def compare_rows(got, ref, dtype: str) -> tuple[float, str]:
    """One row decoded the configured way (``got``) and alone (``ref``), engine/sampler.Sample each:
    (|Δ log-prob|, inf where the tokens differ; why they disagree, or "")."""
    if got.ids != ref.ids:
        return float("inf"), "other tokens the configured way than alone"
    diff, tol = abs(got.logprob - ref.logprob), tolerance(dtype, max(len(ref.ids), 1))
    if diff > tol:
        return diff, f"log-prob {got.logprob:.6f} the configured way, {ref.logprob:.6f} alone ({diff:.2g} > {tol:.0e})"
    return diff, ""


# --- the onnxruntime-genai path --------------------------------------------------------------------------


def og_key(width: int, reuse: bool) -> dict:
    return {"canary": "generate/og", "width": width, "prefix_reuse": reuse}


def check_og(run: Callable, alone: Callable, items: Sequence, batchable: Sequence[int], width: int, reuse: bool,
             verdicts: Verdicts | None = None) -> tuple[GenVerdict, bool]:
    """The canary on og's path. ``items[i]`` = (prompt ids, settings); ``run(sub, indices, finish)``
    generates ``sub`` (items cut short; ``indices``: whose they are) the configured way
    (schedule.run_generation, ``finish(j, text, n)``); ``alone(ids, settings, i)`` → (text, n) of item
    i's cut prompt from a fresh Generator. ``batchable``: indices og may batch. Returns (verdict, stored)."""
    verdicts = verdicts or Verdicts()
    key = og_key(width, reuse)
    stored = verdicts.get(key)
    if stored is not None:
        return GenVerdict(**stored), True
    wide = list(batchable)[:min(width, CANARY_ROWS)] if width > 1 else []
    picked = sorted(set(pick_prompts([ids for ids, _ in items], wide)) | set(wide))
    sub = [short(items[i][1], c) for i, c in zip(picked, _cut([items[i][0] for i in picked]), strict=True)]
    got: dict[int, tuple[str, int]] = {}
    run([(list(p), s) for p, s in sub], picked, lambda j, text, n: got.__setitem__(j, (text, n)))
    detail = ""
    for j, (prompt, settings) in enumerate(sub):
        ref = alone(list(prompt), settings, picked[j])
        if tuple(got[j]) != tuple(ref) and not detail:
            detail = f"a prompt of {len(prompt)} tokens gives other text the configured way than alone"
            log.info("generation canary: %r the configured way, %r alone", got[j][0], ref[0])
    verdict = GenVerdict(not detail, 0.0 if not detail else float("inf"), len(sub), detail)
    verdicts.put(key, asdict(verdict))
    return verdict, False


def raw_plan(sampler, items: Sequence, keys: Sequence[list], name: Callable[[int], str], dtype: str, check: bool,
             verdicts: Verdicts | None = None) -> str:
    """Before the raw path's first generation: the canary unless ``sampler`` is exact or ``check`` is off.
    ``items[i]`` = (prompt ids, settings), ``keys[i]`` its store key (seeds). Returns the mode line."""
    from ortevals.engine.generate.choice.seeds import sample_rng
    from ortevals.engine.generate.rows.sampler import plan_jobs

    if sampler.exact:
        return "generate_until: one row per pass, no prefix reuse (exact mode)"
    if not check:
        return "generate_until: rows batched, prefix reuse (check=false: invariance not checked)"
    verdict, reused = check_raw(sampler, plan_jobs(items), lambda i: sample_rng(items[i][1].seed, keys[i]), name,
                                dtype, verdicts)
    _log(verdict, "raw onnxruntime")
    return describe(verdict, reused, "rows batched, prefix reuse")


def og_plan(runner, tokenizer, items: Sequence, keys: Sequence[list], eos: set[int], pad_id: int | None, width: int,
            exact: bool, check: bool, verdicts: Verdicts | None = None,
            name: Callable[[int], str] = lambda i: f"request #{i}") -> tuple[int, bool, str]:
    """(width, prefix reuse, mode line) for og's path: one row and no rewind in exact mode or when the
    canary finds the batched Generator or the rewinding cursor off; else ``width`` and reuse where
    og's rewind is exact."""
    from ortevals.engine.generate.choice.seeds import sample_rng
    from ortevals.engine.generate.og.loops import can_batch, generate
    from ortevals.engine.generate.og.schedule import run_generation

    if exact:
        return 1, False, "generate_until: one row per pass, no prefix reuse (exact mode)"
    reuse = runner.rewind_ok
    width = width if reuse and getattr(runner, "batches_exact", True) else 1  # og batches only where it is exact
    what = f"{width} rows per Generator" + (", prefix reuse" if reuse else "")
    if width == 1 and not reuse:
        return width, reuse, ""
    if not check:
        return width, reuse, f"generate_until: {what} (check=false: invariance not checked)"
    batchable = [i for i, (ids, s) in enumerate(items) if can_batch(ids, s, pad_id)]

    def run(sub, indices, finish) -> None:
        run_generation(runner, tokenizer, sub, [keys[i] for i in indices], eos, width, pad_id, finish,
                       name=lambda j: name(indices[j]), prefix_reuse=reuse)

    def alone(ids, s, i) -> tuple[str, int]:
        return generate(runner.cursor(len(ids) + s.max_gen_toks), tokenizer, ids, s, eos, sample_rng(s.seed, keys[i]),
                        name=name(i))

    verdict, reused = check_og(run, alone, items, batchable, width, reuse, verdicts)
    _log(verdict, "onnxruntime-genai")
    return (width, reuse, describe(verdict, reused, what)) if verdict.passed else \
        (1, False, describe(verdict, reused, what))


def _log(verdict: GenVerdict, where: str) -> None:
    if verdict.passed:
        log.info("generation canary (%s): passed on %d rows", where, verdict.rows)
    else:
        log.warning("generation canary (%s): %s; generating one row per pass with no prefix reuse from now on. "
                    "exact=true (--exact) skips the check; check=false (--no-check) keeps batching", where,
                    verdict.detail)


def describe(verdict: GenVerdict, reused: bool, what: str) -> str:
    """The mode line for generation: what ran and why."""
    tail = "; stored verdict reused" if reused else ""
    if verdict.passed:
        return f"generate_until: {what} (canary passed on {verdict.rows} rows){tail}"
    return f"generate_until: one row per pass, no prefix reuse (canary: {verdict.detail}){tail}"
