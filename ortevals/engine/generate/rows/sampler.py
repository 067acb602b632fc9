"""The shared-prompt sampling engine: K samples of a prompt for little more than the cost of one.

Owns generate_until on raw onnxruntime (the :class:`~ortevals.runtime.sessions.DecoderRunner`
the log-likelihood path uses), for packages whose decoder returns logits for any position
and keeps a plain (not windowed) KV cache:

* identical requests (lm-eval's ``repeats: K`` hands the model K copies) become one
  :class:`Job` of K rows, sample index = occurrence order (:func:`plan_jobs`);
* each prompt is prefilled once; a prompt that starts like the one before it (the few-shot
  header) runs only its new tokens on top of the previous prompt's KV cut to the shared
  prefix (:meth:`SharedPromptSampler.prompt`). A hybrid decoder's recurrent state cannot be cut:
  there the prompts' shared prefixes are planned as the prefill path plans them
  (engine/score/prefix.py: :func:`branch_points`), a prompt's pass stops at each of its branch points
  to keep the state there, and a later prompt starts from the deepest kept state it begins with;
* consecutive sampled prompts with the same max_gen_toks form a stream on the cascade graph: up to
  GROUPS prompts' rows decode in one pass, and the next prompt joins when one's last row ends
  (:meth:`SharedPromptSampler.streams`; engine/generate/rows/batch.py chooses each prompt's tokens);
* the prompt's KV is replicated across the rows where it lives (engine/generate/rows/kv.py: in place on
  the host or the device where the graph allows it), and all live rows take one token per
  decode pass; each row stops on its own (EOS, stop strings, max_gen_toks:
  :class:`~ortevals.engine.generate.og.loops.TextStream`) and leaves the batch at once (its KV row is
  dropped);
* rows per decode batch: as many as fit the KV budget at the batch's real peak
  (:class:`~ortevals.engine.generate.rows.kv.KVPeak`: prompt + max_gen_toks per row, all layers), the
  budget being a share of the memory free where the KV lives (runtime/memory.py) unless given;
* every row draws from its own generator, seeded by (seed, request, sample index), so a
  sample's tokens do not depend on which rows ran beside it; greedy rows are all equal, so
  greedy runs one row and copies it;
* each sample's log-probability under the model (temperature 1, no filters) of the whole
  sequence, the EOS that ended it included, for best-of-k, and its self-certainty (the mean KL
  from uniform of the raw next-token distributions it drew from: engine/generate/choice/certainty.py's
  running form, two numbers a row) for best-of-N by self-certainty.

:class:`RawStepModel` is the same runner behind engine/generate/search/beam.py's ``StepModel`` protocol
(beam search). Exact mode (a graph whose numbers depend on the pass: engine/score/invariance.py)
decodes one row per pass and never reuses a prefix. Token choice lives in
:mod:`ortevals.engine.generate.og.loops`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.choice.stops import TextStream
from ortevals.engine.generate.rows.batch import Rows, RowSteps, Sample
from ortevals.engine.generate.rows.cascade_kv import CascadeKV
from ortevals.engine.generate.rows.kv import CopyKV, choose_kv
from ortevals.engine.score.prefix import plan_prefixes
from ortevals.errors import OrtEvalsError
from ortevals.package.reuse import MIN_PASS_TOKENS, ReusePolicy
from ortevals.runtime.cascade import GROUPS
from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)
MIN_SPLIT = MIN_PASS_TOKENS  # tokens on each side of a branch point (package/reuse.py: no one-token pass)
FREE_SHARE = 0.8  # of the free memory, for decode KV: the rest for activations, fragmentation, other users
UNKNOWN_BUDGET = 4 * 2**30  # where free memory cannot be read (say DirectML)


@dataclass(frozen=True)
class Job:
    """One prompt and its rows: ``members`` are request indices, one per row, in occurrence order."""

    prompt: tuple[int, ...]
    settings: GenSettings
    members: tuple[int, ...]


def plan_jobs(items: Sequence[tuple[Sequence[int], GenSettings]]) -> list[Job]:
    """Identical (prompt ids, settings) → one Job; jobs sorted by prompt ids, so prompts that share
    a prefix are adjacent (the KV of one is reused by the next)."""
    rows: dict[tuple, list[int]] = {}
    for i, (ids, settings) in enumerate(items):
        rows.setdefault((tuple(ids), settings), []).append(i)
    jobs = [Job(prompt, settings, tuple(members)) for (prompt, settings), members in rows.items()]
    jobs.sort(key=lambda j: j.prompt)
    return jobs


def branch_points(prompts: Sequence[tuple[int, ...]], min_saving: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Per prompt, the depths of its shared prefixes worth keeping (the prefill path's radix plan: a prefix
    shared by prompts that saves ``min_saving`` tokens, each at least :data:`MIN_SPLIT` deeper than the one
    before and leaving every prompt :data:`MIN_SPLIT` tokens of its own). A recurrent state is kept there:
    it cannot be cut later."""
    plan = plan_prefixes(prompts, [MIN_SPLIT] * len(prompts), min_saving, min_depth=MIN_SPLIT, min_step=MIN_SPLIT)
    return {prompt: tuple(plan.nodes[k].depth for k in path) for prompt, path in zip(prompts, plan.paths) if path}


def can_serve(package, capability) -> tuple[bool, str]:
    """Whether the raw path can generate for this package, and why not."""
    if not capability.full_logits:
        return False, capability.reason
    if package.windowed:
        return False, "its sliding layers keep a windowed KV cache"
    return True, ""


class SharedPromptSampler:
    """Runs :class:`Job` s on a DecoderRunner. ``stats`` counts prompt tokens run and reused,
    decode passes and generated tokens."""

    def __init__(self, runner, tokenizer, eos_ids: set[int], exact: bool = False, prefix_cache: bool = True,
                 prefix_min: int = 16, kv_budget_mb: int | None = None,
                 free_memory: Callable[[], int | None] | None = None, cascade=None, threads: int = 1,
                 reuse: ReusePolicy | None = None) -> None:
        """kv_budget_mb: decode KV per batch; None: FREE_SHARE of ``free_memory()`` (bytes free where the
        KV lives, read before each job: runtime/memory.py unless given) plus the arenas already held.
        cascade: engine/generate/rows/cascade_kv.py's ``Cascade`` (decode rows on one shared prompt KV;
        never in exact mode).
        threads: how many threads choose the rows' tokens between passes (the session's own count).
        reuse: what held KV may serve (package/reuse.py): a prompt reuses the previous one's KV only within its
        length class, and rows crossing a LongRoPE switch run their whole sequence again."""
        self.runner, self.tokenizer, self.eos_ids = runner, tokenizer, eos_ids
        self.exact = exact
        self.prefix_cache = prefix_cache and not exact  # a shorter pass may change an exact-mode graph's numbers
        self.prefix_min = prefix_min  # shared tokens worth a cut of the held KV
        self.kv_budget = kv_budget_mb * 2**20 if kv_budget_mb else None
        self.free_memory = free_memory
        self.cascade, self.threads = cascade, threads
        self.reuse = reuse or ReusePolicy()
        self._said_unknown = False
        self.stats = {"prompts": 0, "prompt_tokens": 0, "reused_tokens": 0, "decode_passes": 0,
                      "row_steps": 0, "generated_tokens": 0}
        self._held: tuple[tuple[int, ...], object] | None = None  # last prompt and its one-row KV
        self._kv_rows = None
        self.recurrent = bool(getattr(getattr(runner, "package", None), "recurrent", False))
        self._branches: dict[tuple[int, ...], tuple[int, ...]] = {}  # recurrent state: where to keep it
        self._kept: list[tuple[tuple[int, ...], object]] = []  # recurrent state kept at branch points, nested

    def fresh(self, exact: bool = False) -> SharedPromptSampler:
        """A copy holding no prompt KV, with its own stats; ``exact``: one row per pass, no prefix reuse
        (the generation canary's two ways, engine/generate/canary.py)."""
        self.kv_rows  # noqa: B018  (chosen once, shared by the copies)
        other = copy.copy(self)
        other._held, other._kept, other._branches, other.stats = None, [], {}, dict.fromkeys(self.stats, 0)
        if exact:
            other.exact, other.prefix_cache = True, False
        return other

    @property
    def kv_rows(self):
        """How rows' KV is kept (engine/generate/rows/kv.py): in place on the host where the graph allows it."""
        if self._kv_rows is None:
            self._kv_rows = choose_kv(self.runner)
            # decode rows may share one prompt KV on top of it (not across a LongRoPE switch: rows run again there)
            if self.cascade is not None and self.cascade.mode == "on" and self.reuse.rope_switch is not None:
                raise OrtEvalsError(f"cascade=on is impossible for this package: its rotary factors switch past "
                                    f"{self.reuse.rope_switch} tokens (LongRoPE), where decode rows run their whole "
                                    "sequence again; cascade=auto or off generates without it")
            if self.cascade is not None and not self.exact and self.reuse.rope_switch is None:
                self._kv_rows = CascadeKV(self._kv_rows, CopyKV(self.runner), self.cascade)
            log.info("raw path: KV kept %s", self._kv_rows.name)
        # exact mode decodes on the package's own graph: one row per pass, its own prompt KV
        return getattr(self._kv_rows, "base", self._kv_rows) if self.exact else self._kv_rows

    def run(self, jobs: Sequence[Job], rng: Callable[..., np.random.Generator],
            finish: Callable[[int, Sample], None], name: Callable[[int], str]) -> None:
        """Every job's rows; ``rng(i)``: request i's generator (``rng(i, j)``: its MBR candidate j);
        ``finish(i, sample)`` as each row ends. Consecutive sampled jobs share decode passes where the cascade
        graph serves them (:meth:`streams`)."""
        if self.recurrent and self.prefix_cache:
            self._branches = branch_points([job.prompt for job in jobs], self.prefix_min)
        for stream in self.streams(jobs):
            if len(stream) > 1:
                starts = [(len(job.members), lambda job=job: Rows.of(job, *self.prompt(job.prompt, shared=True),
                                                                       rng, name)) for job in stream]
                for rows, done in self._decode(starts, self._reserve(stream)):
                    for i, sample in zip(rows.members, done, strict=True):
                        finish(i, sample)
                continue
            job = stream[0]
            if job.settings.num_beams > 1:  # deterministic: one search serves every row
                sample = self.beam(job.prompt, job.settings)
                for i in job.members:
                    finish(i, sample)
                continue
            logits, past = self.prompt(job.prompt, job.settings.max_gen_toks)
            if job.settings.mbr_samples > 1:
                self._mbr(job, logits, past, rng, finish, name)
                continue
            members = job.members if job.settings.do_sample else job.members[:1]  # greedy rows are equal
            for chunk in self._chunks(members, len(job.prompt), job.settings.max_gen_toks):
                done = self.decode(logits, past, job.settings, [rng(i) for i in chunk], [name(i) for i in chunk],
                                   job.prompt)
                for i, sample in zip(chunk, done, strict=True):
                    finish(i, sample)
                    if not job.settings.do_sample:
                        for twin in job.members[1:]:
                            finish(twin, sample)

    def streams(self, jobs: Sequence[Job]) -> list[tuple[Job, ...]]:
        """``jobs`` in order, consecutive ones in one stream where each samples several rows (no beams, no MBR)
        with the same ``max_gen_toks`` (the rows' buffers are as long) and the cascade graph is in use: a stream
        decodes up to GROUPS prompts' rows a pass, the next prompt joining as soon as its rows fit
        (:meth:`_decode`). One job at a time otherwise."""
        out: list[tuple[Job, ...]] = []
        for job in jobs:
            last = out[-1] if out else ()
            if last and self._joins(last[0], job):
                out[-1] = (*last, job)
            else:
                out.append((job,))
        return out

    def _joins(self, first: Job, job: Job) -> bool:
        def sampled(j: Job) -> bool:
            s = j.settings
            return s.do_sample and s.num_beams == 1 and s.mbr_samples < 2 and len(j.members) > 1

        if self.exact or not (sampled(first) and sampled(job) and isinstance(self.kv_rows, CascadeKV)):
            return False
        if first.settings.max_gen_toks != job.settings.max_gen_toks:
            return False
        rows = len(first.members) + len(job.members)  # two prompts' rows at once at least, or no stream
        longest = max(len(first.prompt), len(job.prompt)) + job.settings.max_gen_toks + 1
        return self.kv_rows.peak(longest).rows_within(self.budget(), rows) == rows and self.kv_rows.ready()

    def _reserve(self, stream: Sequence[Job]) -> int:
        """Rows a stream's buffers hold: GROUPS prompts' rows, as many as the KV budget allows at its peak."""
        rows = GROUPS * max(len(j.members) for j in stream)
        longest = max(len(j.prompt) for j in stream) + stream[0].settings.max_gen_toks + 1
        return max(self.kv_rows.peak(longest).rows_within(self.budget(), rows), max(len(j.members) for j in stream))

    def _mbr(self, job: Job, logits, past, rng, finish, name) -> None:
        """MBR (engine/generate/search/mbr.py): per request, ``mbr_samples`` candidates decoded together from the shared
        prompt (candidate j of request i draws from ``rng(i, j)``); the one closest to the others wins."""
        from ortevals.engine.generate.search.mbr import mbr_select

        m = job.settings.mbr_samples
        for i in job.members:
            cands = self.decode(logits, past, job.settings, [rng(i, j) for j in range(m)], [name(i)] * m,
                                job.prompt)
            finish(i, cands[mbr_select([c.text for c in cands], job.settings.mbr_metric).index])

    def beam(self, prompt: tuple[int, ...], settings: GenSettings) -> Sample:
        """Beam / diverse beam search (engine/generate/search/beam.py) on this runner; the best hypothesis,
        cut at a stop."""
        from ortevals.engine.generate.search.beam import beam_search

        def is_stop(seq) -> bool:  # special tokens kept, as TextStream (and lm-eval hf's criteria) look
            text = self.tokenizer.decode(list(seq), skip_special_tokens=False)
            return any(u in text for u in settings.until)

        found = beam_search(RawStepModel(self.runner, self.reuse), prompt, settings, self.eos_ids, is_stop).best
        stream = TextStream(self.tokenizer, settings, self.eos_ids)
        for tok in found.tokens:
            if stream.push(int(tok)):
                break
        self.stats["prompts"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["generated_tokens"] += len(stream.out)
        return Sample(*stream.result, float(found.logprob), tuple(stream.out), stream.eos)  # EOS in the sum

    def _chunks(self, members: Sequence[int], prompt_len: int, max_new: int) -> list[Sequence[int]]:
        """Rows per decode batch: one in exact mode, else as many as the KV budget holds at the
        batch's peak (every row grown to prompt + max_gen_toks)."""
        width = 1
        if not self.exact and len(members) > 1:
            width = self.kv_rows.peak(prompt_len + max_new + 1).rows_within(self.budget(), len(members))
        return [members[j:j + width] for j in range(0, len(members), width)]

    def budget(self) -> int:
        """Bytes a decode batch may hold: ``kv_budget_mb``, else FREE_SHARE of what is free where the KV
        lives plus the arenas this sampler already holds (the next batch reuses them)."""
        if self.kv_budget is not None:
            return self.kv_budget
        free = (self.free_memory or self._free_where_kv_lives)()
        if free is None:
            if not self._said_unknown:
                log.info("raw path: free memory where the KV lives is unknown; decode KV budget %d MiB",
                         UNKNOWN_BUDGET // 2**20)
                self._said_unknown = True
            return UNKNOWN_BUDGET
        return int(FREE_SHARE * (free + self.kv_rows.held_bytes()))

    def _free_where_kv_lives(self) -> int | None:
        from ortevals.runtime.memory import free_bytes

        return free_bytes(getattr(self.runner, "bind_device", None) or "cpu", getattr(self.runner, "device_id", 0))

    def prompt(self, tokens: tuple[int, ...], max_new: int = 0, shared: bool = False) -> tuple[np.ndarray, object]:
        """One prompt pass → (logits ``[V]`` after the last token, one-row KV of the whole prompt, with
        room for ``max_new`` more tokens where the KV is kept in place; ``shared``: no room, the buffer holds the
        prompt alone, as the cascade graph's rows read it in place).

        The tokens shared with the previous prompt are not run again: its KV, cut to them, is the past. A
        recurrent state is never cut: the prompt starts from the deepest state kept at a branch point it
        begins with (:meth:`_from_branches`).
        """
        kv_rows = self.kv_rows
        capacity = len(tokens) if shared else len(tokens) + max_new + 1
        if self.recurrent:
            reused, base, past = self._from_branches(tokens, capacity)
        else:
            reused, base, past = self._from_held(tokens, capacity)
        logits, kv = kv_rows.run(np.asarray([tokens[base:]], dtype=np.int64), past, last=True)
        self.stats["prompts"] += 1
        self.stats["prompt_tokens"] += len(tokens) - reused
        self.stats["reused_tokens"] += reused
        self._held = (tokens, kv) if self.prefix_cache and not self.recurrent else None
        return logits[0], kv

    def _from_held(self, tokens: tuple[int, ...], capacity: int) -> tuple[int, int, object]:
        """(tokens reused, where this prompt's pass starts, its past): the previous prompt's KV cut to the prefix
        they share, where it is worth it (within its length class, ``MIN_PASS_TOKENS`` of its own to run)."""
        if self.prefix_cache and self._held is not None and self.reuse.same_class(len(self._held[0]), len(tokens)):
            common = min(common_prefix(self._held[0], tokens), len(tokens) - MIN_PASS_TOKENS)
            if common >= self.prefix_min:
                return common, common, self.kv_rows.prefix(self._held[1], common, capacity)
        return 0, 0, self.kv_rows.empty(1, capacity)

    def _from_branches(self, tokens: tuple[int, ...], capacity: int) -> tuple[int, int, object]:
        """Recurrent state: start from the deepest kept state this prompt begins with, then run up to each of its
        own branch points (:func:`branch_points`) one pass each and keep the state there. Returns (tokens reused,
        where the prompt's last pass starts, its past)."""
        kept = [(t, kv) for t, kv in self._kept if tokens[:len(t)] == t]  # nested: the states on this path
        base, past = (len(kept[-1][0]), kept[-1][1]) if kept else (0, self.kv_rows.empty(1, capacity))
        reused = base
        for depth in self._branches.get(tokens, ()) if self.prefix_cache else ():
            if depth - base >= MIN_SPLIT and len(tokens) - depth >= MIN_SPLIT:
                _, past = self.kv_rows.run(np.asarray([tokens[base:depth]], dtype=np.int64), past, last=True)
                kept.append((tokens[:depth], past))
                base = depth
        self._kept = kept if self.prefix_cache else []
        return reused, base, past

    def decode(self, logits: np.ndarray, past, settings: GenSettings, rngs: Sequence[np.random.Generator],
               names: Sequence[str], prompt: Sequence[int] = ()) -> list[Sample]:
        """Rows that continue one prompt: ``logits [V]`` after it, ``past`` its one-row KV, ``prompt`` its
        ids (the repetition penalties look at them).

        Each row draws from its own ``rngs[r]``; a finished row leaves the batch before the next pass.
        """
        rows = Rows(logits, past, settings, tuple(rngs), tuple(names), tuple(prompt))
        ((_, samples),) = self._decode([(len(rngs), lambda: rows)], len(rngs))
        return samples

    def _decode(self, starts: Sequence[tuple[int, Callable[[], Rows]]],
                reserve: int) -> Iterator[tuple[Rows, list[Sample]]]:
        """Decode passes over the rows of ``starts`` (``(rows, start)``: ``start()`` runs the prompt pass),
        yielding each prompt's ``(rows, samples)`` as its last row ends. With several, the next prompt joins the
        batch (a new last group) whenever the cascade graph takes another prompt and its rows fit the ``reserve``
        rows of the buffers; its rows' first tokens come from its prompt's logits. Each row draws from its own
        generator and leaves the batch when it ends."""
        queue, steps = list(starts)[::-1], RowSteps(self.tokenizer, self.eos_ids, self.threads)
        past, logits, several = None, None, len(starts) > 1
        while queue or steps.groups:
            fresh = []
            while queue and (past is None or (several and len(steps.groups) < GROUPS
                                              and steps.live + queue[-1][0] <= reserve)):
                n, start = queue.pop()
                rows = start()
                steps.add(rows)
                if past is None:
                    past = self.kv_rows.share(rows.past, n, reserve=reserve, room=rows.settings.max_gen_toks + 1) \
                        if several else self.kv_rows.repeat(rows.past, n)
                else:
                    past = self.kv_rows.join(past, rows.past, n)
                fresh.append(np.broadcast_to(rows.logits, (n, rows.logits.shape[-1])))
            step_logits = np.concatenate(([] if logits is None else [logits]) + fresh) if fresh else logits
            keep, tokens, done = steps.take(step_logits)
            yield from done
            if not keep:
                past, logits = None, None
                continue
            if len(keep) < len(tokens):  # finished rows stop costing at once
                past = self.kv_rows.keep(past, keep)
            if self.reuse.rope_switch is None or self.reuse.same_class(past.length, past.length + 1):
                logits, past = self.kv_rows.run(tokens[keep][:, None], past)
            else:  # a LongRoPE switch crossed: the rows run again in one pass, as transformers' Phi-3 does
                logits, past = self._again(steps)
            self.stats["decode_passes"] += 1
            self.stats["row_steps"] += len(keep)
        self.stats["generated_tokens"] += steps.generated


    def _again(self, steps: RowSteps) -> tuple[np.ndarray, object]:
        """The live rows' whole sequences (prompt and tokens so far, one prompt: equal lengths) in one pass with
        no past: their logits ``[rows, V]`` and KV, in buffers as long as the prompt pass sized them."""
        ids = np.asarray([[*g.rows.prompt, *g.streams[r].out] for g in steps.groups for r in g.live], np.int64)
        logits, kv = CopyKV(self.runner).run(ids, None)
        first = steps.groups[0].rows
        return logits, self.kv_rows.prefix(kv, ids.shape[1], len(first.prompt) + first.settings.max_gen_toks + 1)


class RawStepModel:
    """engine/generate/search/beam.py's ``StepModel`` on a DecoderRunner: ``start`` prefills the prompt once and
    replicates its KV over ``rows``; ``step`` reorders the rows' KV by ``parents``, then appends
    ``tokens`` (past a LongRoPE switch of ``reuse``, the rows' whole sequences run again once). Logits are
    float32 ``[rows, V]``."""

    def __init__(self, runner, reuse: ReusePolicy | None = None) -> None:
        self.kv_rows = CopyKV(runner)  # every step gathers rows by parents: a new cache each step anyway
        self.past = None
        self.reuse = reuse or ReusePolicy()
        self.seqs: list[tuple[int, ...]] = []

    def start(self, prompt: Sequence[int], rows: int) -> np.ndarray:
        logits, kv = self.kv_rows.run(np.asarray([list(prompt)], dtype=np.int64), None, last=True)
        self.past = self.kv_rows.repeat(kv, rows)
        self.seqs = [tuple(prompt)] * rows
        return np.repeat(logits, rows, axis=0)

    def step(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        self.seqs = [(*self.seqs[int(p)], int(t)) for p, t in zip(parents, tokens, strict=True)]
        if not self.reuse.same_class(self.past.length, self.past.length + 1):
            logits, self.past = self.kv_rows.run(np.asarray(self.seqs, dtype=np.int64), None)
            return logits
        past = self.kv_rows.keep(self.past, np.asarray(parents, dtype=np.int64))
        logits, self.past = self.kv_rows.run(np.asarray(tokens, dtype=np.int64)[:, None], past)
        return logits


def run_sampling(sampler: SharedPromptSampler, items: Sequence[tuple[Sequence[int], GenSettings]],
                 keys: Sequence[list], finish: Callable[[int, Sample], None], name: Callable[[int], str]) -> None:
    """generate_until's raw path: ``items[i]`` = (prompt ids, settings) of request i, ``keys[i]`` its store
    key (request + sample index: resume.request_keys); request i draws from the generator the og path
    would give it (engine/generate/og/schedule.py), so a sample is the same whichever rows ran beside it."""
    from ortevals.engine.generate.choice.seeds import sample_rng

    jobs = plan_jobs(items)
    log.info("generate_until: %d requests (%d prompts, up to %d samples each) on the raw shared-prompt path "
             "(onnxruntime%s)", len(items), len(jobs), max((len(j.members) for j in jobs), default=0),
             ", exact mode: one row per pass" if sampler.exact else "")
    sampler.run(jobs, lambda i, candidate=None: sample_rng(items[i][1].seed, keys[i], candidate), finish, name)
    s = sampler.stats
    log.info("raw path: %d prompt tokens run, %d reused from a shared prefix, %d decode passes, %d tokens "
             "generated", s["prompt_tokens"], s["reused_tokens"], s["decode_passes"], s["generated_tokens"])
