"""The prefill scoring engine: token requests in, scores out.

Owns grouping, ordering and batching of log-likelihood requests:

* requests whose model input is identical (the same context, one-token
  continuations: MMLU-Pro's ten choices) share one forward pass;
* inputs are sorted longest-first and right-padded; the mask fed to the
  model counts every position as real (see :meth:`PrefillEngine._forward`)
  and scores are read only at real positions;
* ``batch_size=None`` ("auto") picks rows per batch from a memory budget for
  what one pass holds: ``[B,S,V]`` logits, or ``[B,K,V]`` with the derived
  scoring graph (LM head at the K scored positions), plus the present KV;
* exact mode (``exact=True``): one row per pass, no prefix reuse, full logits,
  as if each input ran alone. Before the first batched run a canary scores a
  few of the requests both ways (:mod:`ortevals.engine.score.invariance`) and switches to
  exact mode when they differ.

The forward pass is passed in (a :class:`~ortevals.runtime.sessions.DecoderRunner`
or anything with the same ``forward``), so the engine is tested with hand-made
logits and never imports a runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ortevals.engine.score.invariance import (
    CanaryResult,
    Verdicts,
    canary_key,
    compare,
    pick_canary,
    slices,
    tolerance,
)
from ortevals.engine.score.prefix import PrefixPlan, plan_prefixes
from ortevals.engine.score.scoring import NonFiniteScore, Score, ScoreSink, input_window
from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)
MIN_OWN_TOKENS = 2  # tokens of an input run in its own pass on top of a cached prefix (see score_batched)


@dataclass(frozen=True)
class TokenRequest:
    """One log-likelihood request at token level."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class EngineSettings:
    """How requests become forward passes."""

    max_length: int
    vocab_size: int
    batch_size: int | None = None  # None: largest batch within memory_budget_mb
    pad_token_id: int = 0
    memory_budget_mb: int = 2048
    token_budget: int = 0  # max tokens per batch under auto; 0: no cap (accelerators)
    group_by_context: bool = True
    prefix_cache: bool = True  # compute shared prefixes once and reuse their KV as past
    prefix_budget_mb: int = 1024  # KV held for prefixes at any time
    prefix_min_saving: int = 64  # tokens a prefix must save to be worth a pass of its own
    kv_bytes_per_token: int = 0  # all layers' K and V for one token (0: unknown, learnt on the first prefix)
    # rows per prefix-continuation pass: inputs under the same cached prefix run as one batch with
    # the prefix KV replicated across it. 1: one row per pass (CPU: onnxruntime's GroupQueryAttention
    # refuses batch > 1 with a multi-token input and past). 0: as many as rows_for allows (devices).
    prefix_batch: int = 1
    exact: bool = False  # one row per pass, no prefix reuse, full logits: each input as if run alone
    check: bool = True  # run the invariance canary before the first batched run
    dtype: str = "float32"  # the logits' float type: sets the canary's tolerance


@dataclass(frozen=True)
class Group:
    """Requests that share one model input: ``tokens`` plus (request index, continuation length)."""

    tokens: tuple[int, ...]
    members: tuple[tuple[int, int], ...]


class Forward(Protocol):
    """A runner; with ``gathers_positions`` it also takes ``positions``, with ``scores_in_graph`` it has ``score``
    (runtime/sessions.DecoderRunner)."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, past=None, want_present: bool = False): ...


def plan_groups(requests: Sequence[TokenRequest], max_length: int, group: bool = True) -> list[Group]:
    """Group requests by identical model input and sort the groups longest-first."""
    by_input: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    singles: list[Group] = []
    for i, req in enumerate(requests):
        tokens = input_window(req.context, req.continuation, max_length)
        member = (i, len(req.continuation))
        if group:
            by_input.setdefault(tokens, []).append(member)
        else:
            singles.append(Group(tokens, (member,)))
    groups = singles or [Group(t, tuple(m)) for t, m in by_input.items()]
    # longest first: the first batch is the largest, so memory problems surface at once
    groups.sort(key=lambda g: -len(g.tokens))
    return groups


def rows_for(settings: EngineSettings, seq_len: int, positions: int | None = None, kv_tokens: int = 0) -> int:
    """Rows per batch: the fixed batch size, or what fits the budgets.

    Per row, a pass holds its logits (``seq_len`` rows of V, 4 bytes + the float32 copy
    scoring makes; with the derived graph only ``positions`` = K rows, 24 bytes: the head's
    output and the scoring's float32/float64 temporaries) and the present KV of its ``kv_tokens``
    (default ``seq_len``; past + new tokens when continuing a prefix). On CPU a long row
    already saturates the cores and extra rows only add memory traffic, so auto caps rows
    by ``token_budget`` as well.
    """
    if settings.batch_size:
        return settings.batch_size
    logits = seq_len * settings.vocab_size * 8 if positions is None else positions * settings.vocab_size * 24
    per_row = logits + (kv_tokens or seq_len) * settings.kv_bytes_per_token
    by_memory = settings.memory_budget_mb * 2**20 // max(per_row, 1)
    by_tokens = settings.token_budget // max(seq_len, 1) if settings.token_budget else by_memory
    return max(1, min(256, by_memory, by_tokens))


def batches(groups: list[Group], settings: EngineSettings, gathers: bool = False) -> Iterator[list[Group]]:
    """Consecutive groups, as many per batch as :func:`rows_for` allows. ``gathers``: the runner returns
    only the last K positions of each row (K: the batch's longest continuation)."""
    i = 0
    while i < len(groups):
        seq = len(groups[i].tokens)
        n = rows_for(settings, seq, _positions(groups[i:i + 1]) if gathers else None)
        while gathers and n > 1 and rows_for(settings, seq, _positions(groups[i:i + n])) < n:
            n = rows_for(settings, seq, _positions(groups[i:i + n]))  # a longer continuation joined: fewer rows
        yield groups[i:i + n]
        i += n


def _positions(batch: Sequence[Group]) -> int:
    """K: the scored positions per row, the longest continuation of any member."""
    return max(n for g in batch for _, n in g.members)


def pad_right(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``[B,S]`` int64 ids and mask; row b holds its tokens then padding."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
        mask[b, :len(r)] = 1
    return ids, mask


class PrefillEngine:
    """Scores log-likelihood requests with full-logit forward passes."""

    def __init__(self, runner: Forward, settings: EngineSettings, verdicts: Verdicts | None = None) -> None:
        self.runner = runner
        self.settings = settings
        self.verdicts = verdicts or Verdicts()  # canary verdicts kept across runs (with a store)
        self.canary_passes = 0  # forward passes the canary cost (0 when a stored verdict was reused)
        self.forward_passes = 0
        self.tokens_run = 0
        self.kv_bytes_per_token = settings.kv_bytes_per_token
        self.mode = "exact" if settings.exact else "batched"  # which mode runs and why, for the run's record
        self.canary: CanaryResult | None = None
        self.canary_tokens = 0  # tokens of the canary's one-row reference passes (their scores are kept)

    def score(
        self,
        requests: Sequence[TokenRequest],
        on_done: Callable[[int, Score], None] | None = None,
    ) -> list[Score]:
        """Score every request; ``on_done(index, score)`` fires as each one finishes."""
        if not requests:
            return []
        if self.settings.exact:
            return self.score_exact(requests, on_done)
        if self.settings.check and self.canary is None and self._can_differ():
            if not self._stored_verdict():
                return self._score_checked(requests, on_done)
            return self.score(requests, on_done)
        return self.score_batched(requests, on_done)

    def _stored_verdict(self) -> bool:
        """Take the verdict a run with the same scope and settings kept, if any (issue 22 §9)."""
        found = self.verdicts.canary(canary_key("prefill", self.settings))
        if found is not None:
            (self.canary, self.mode), exact = found, not found[0].passed
            self.settings = replace(self.settings, exact=self.settings.exact or exact)
        return found is not None

    def _can_differ(self) -> bool:
        """Whether the configured way is anything but one full-logits row per pass."""
        s = self.settings
        return s.batch_size != 1 or s.prefix_cache

    def score_exact(self, requests: Sequence[TokenRequest], on_done=None) -> list[Score]:
        """One row per pass, no prefix reuse: each input as if run alone.

        A derived graph still returns only the scored rows ([1,K,V], not [1,S,V]: 1 GB for a 900-token
        prompt on a 262k vocabulary); a graph whose numbers depend on the pass is opened without one.
        """
        results: list[Score | None] = [None] * len(requests)
        done = ScoreSink(requests, results, on_done)
        for group in plan_groups(requests, self.settings.max_length, self.settings.group_by_context):
            ids, mask = pad_right([group.tokens], self.settings.pad_token_id)
            self._score_pass(ids, mask, [group], [len(group.tokens)], done)
        return results  # type: ignore[return-value]

    def _score_checked(self, requests: Sequence[TokenRequest], on_done=None) -> list[Score]:
        """The canary on a few inputs cut short (``invariance.slices``), then the run in the mode it chose.

        A non-finite canary score trips it too: the exact run then names the request that has it.
        """
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        picked = [requests[groups[gi].members[0][0]] for gi in pick_canary([g.tokens for g in groups])]
        sub = [TokenRequest(c, x) for c, x in slices([(r.context, r.continuation) for r in picked])]
        key, before, passes = canary_key("prefill", self.settings), self.tokens_run, self.forward_passes
        try:
            exact = self.score_exact(sub)
            configured = self._canary_configured(sub)
            self.canary = compare(np.array([s.logprob for s in configured]), np.array([s.logprob for s in exact]),
                                  np.array([len(r.continuation) for r in sub]), self.settings.dtype)
        except NonFiniteScore as e:
            exact = configured = None
            self.canary = CanaryResult(False, float("nan"), e.index or 0, tolerance(self.settings.dtype, 1))
        self.canary_tokens += self.tokens_run - before
        self.canary_passes += self.forward_passes - passes
        self._canary_verdict(sub, configured, exact)
        if exact is not None:  # a non-finite score is the request's, not the graph's: not kept
            self.verdicts.keep_canary(key, self.canary, self.mode)
        return self.score(requests, on_done)

    def _canary_configured(self, sub: list[TokenRequest]) -> list[Score]:
        """The configured way, with any shared prefix reused (a handful of requests saves few tokens)."""
        saved = self.settings
        self.settings = replace(saved, prefix_min_saving=1)
        try:
            return self.score_batched(sub)
        finally:
            self.settings = saved

    def _canary_verdict(self, sub, configured, exact) -> None:
        c = self.canary
        if c.passed:
            self.mode = f"batched (canary passed on {len(sub)} requests: max |diff| {c.max_diff:.1e})"
            log.info("invariance canary: %s", self.mode)
            return
        req = sub[c.index]
        self.settings = replace(self.settings, exact=True)
        if exact is None:
            self.mode = "exact (canary: non-finite score)"
            log.warning("invariance canary: a non-finite score (%d context + %d continuation tokens); switching "
                        "to exact mode, which names the request that has it", len(req.context), len(req.continuation))
            return
        self.mode = f"exact (canary: |diff| {c.max_diff:.3g} > {c.tolerance:.0e})"
        log.warning(
            "invariance canary: an input of %d context + %d continuation tokens scores %.6f the configured way "
            "(batched, prefix reuse) but %.6f run alone: |diff| %.3g > tolerance %.0e for %s logits; switching to "
            "exact mode (one row per pass, no prefix reuse). exact=true (--exact) skips the check; check=false "
            "(--no-check) keeps batching", len(req.context), len(req.continuation),
            configured[c.index].logprob, exact[c.index].logprob, c.max_diff, c.tolerance, self.settings.dtype)

    def score_batched(
        self,
        requests: Sequence[TokenRequest],
        on_done: Callable[[int, Score], None] | None = None,
    ) -> list[Score]:
        """The configured way: grouped, batched, shared prefixes reused."""
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        results: list[Score | None] = [None] * len(requests)
        done = ScoreSink(requests, results, on_done)
        plain = groups
        if self.settings.prefix_cache and len(groups) > 1:
            # each input keeps at least 2 tokens for its own pass: on MatMulNBits accuracy_level=4 graphs (the
            # builder's int4/int8) a 1-token pass takes another kernel path than the full pass (up to 0.59 nats on
            # SmolLM2 int8), while 2 or more are bit-identical to it (docs/calibration.md, issue 24)
            plan = plan_prefixes([g.tokens for g in groups],
                                 [max(MIN_OWN_TOKENS, *(n for _, n in g.members)) for g in groups],
                                 self.settings.prefix_min_saving)
            plain = [g for g, a in zip(groups, plan.ancestor) if a is None]
            log.info("prefill: %d requests, %d inputs, %d share %d cached prefixes", len(requests), len(groups),
                     len(groups) - len(plain), len(plan.nodes))
            if plan.nodes:
                self._score_shared(groups, plan, done)
        for batch in batches(plain, self.settings, getattr(self.runner, "gathers_positions", False)):
            ids, mask = pad_right([g.tokens for g in batch], self.settings.pad_token_id)
            self._score_pass(ids, mask, batch, [len(g.tokens) for g in batch], done)
        return results  # type: ignore[return-value]

    def _forward(self, ids: np.ndarray, mask: np.ndarray, past=None, want_present: bool = False, positions=None,
                 targets=None):
        """One pass; ``mask [B, P+S]`` marks each row's real tokens and counts the tokens run.

        The model is fed an all-ones mask instead. GroupQueryAttention takes each row's past
        length from its mask sum (CUDA: ``seqlens_k + 1 - S``; it has no padding inside the new
        tokens), so a right-padded row on a shared past would get its KV and positions moved.
        Counted as real, a row's padding sits after all its real tokens, the causal mask keeps it
        from them, and nothing at a padded position is ever read.
        """
        self.forward_passes += 1
        self.tokens_run += int(mask[:, mask.shape[1] - ids.shape[1]:].sum())
        fed = np.ones_like(mask)
        if targets is not None:  # derived graph that scores on the device: (logprobs, greedy) [B,K,M]
            return self.runner.score(ids, fed, past, positions, targets)
        if positions is None:
            return self.runner.forward(ids, fed, past, want_present)
        return self.runner.forward(ids, fed, past, want_present, positions)

    def _score_pass(self, ids, mask, batch: list[Group], lengths: list[int], done: ScoreSink, past=None) -> None:
        """One pass over ``batch`` (row b: ``batch[b]``, ``lengths[b]`` real tokens); each member's score to ``done``.

        With a derived graph only the last K positions of each row are computed (K: the batch's
        longest continuation) and, where the graph scores, only the targets' log-probabilities
        and argmax flags come back, not logits; otherwise all S rows of logits, scored on the host.
        """
        if not getattr(self.runner, "gathers_positions", False):
            logits, _ = self._forward(ids, mask, past)
            for b, group in enumerate(batch):
                done.group(logits[b], group, lengths[b])
            return
        k = _positions(batch)
        positions = np.stack([np.clip(np.arange(n - k, n), 0, None) for n in lengths]).astype(np.int64)
        if getattr(self.runner, "scores_in_graph", False):
            lp, greedy = self._forward(ids, mask, past, positions=positions, targets=done.targets(batch, k))
            for b, group in enumerate(batch):
                done.scores(lp[b], greedy[b], group, k)
            return
        logits, _ = self._forward(ids, mask, past, positions=positions)
        for b, group in enumerate(batch):
            done.group(logits[b], group, k)

    def _score_shared(self, groups: list[Group], plan: PrefixPlan, done: ScoreSink) -> None:
        """Depth-first over the radix plan; the stack holds the KV of the prefixes on the path.

        Consecutive inputs under the same deepest held prefix are collected and run
        ``prefix_batch`` rows per pass (see :meth:`_continue`); the pending rows are
        flushed before the stack changes, so evicted KV is never kept alive.
        """
        budget = self.settings.prefix_budget_mb * 2**20
        stack: list[tuple[int, object]] = []  # (node index, KVCache)
        pending: list[Group] = []  # inputs waiting to run on top of the stack's deepest prefix
        limit = self.settings.prefix_batch or 256
        for gi in plan.order:
            path = plan.paths[gi]
            if not path:
                continue
            if stack and stack[-1][0] not in path:
                self._continue(pending, stack, plan, done)
            while stack and stack[-1][0] not in path:
                stack.pop()  # left that subtree: evict
            tokens = groups[gi].tokens
            for node in path:
                if any(n == node for n, _ in stack) or plan.nodes[node].depth <= _depth(stack, plan):
                    continue
                held = sum(c.nbytes for _, c in stack)
                if held + plan.nodes[node].depth * self.kv_bytes_per_token > budget:
                    continue  # no room: children compute from the deepest prefix held
                self._continue(pending, stack, plan, done)
                kv = self._extend(tokens, stack, plan, plan.nodes[node].depth)
                self.kv_bytes_per_token = kv.nbytes // max(kv.length, 1)
                if held + kv.nbytes <= budget:
                    stack.append((node, kv))
            pending.append(groups[gi])
            if len(pending) >= limit:
                self._continue(pending, stack, plan, done)
        self._continue(pending, stack, plan, done)

    def _continue(self, pending: list[Group], stack, plan: PrefixPlan, done: ScoreSink) -> None:
        """Score ``pending`` (which all start with the stack's deepest prefix) and empty it.

        Rows are right-padded; the mask is ``[B, base + S]``: ones over the prefix, then
        each row's own tokens. The prefix KV is replicated across the batch by the
        runner's ``repeat_past`` (on the device for device KV). If the provider refuses
        the batched pass (onnxruntime's CPU GroupQueryAttention does), fall back to one
        row per pass for the rest of the run and say so once.
        """
        base = _depth(stack, plan)
        past = stack[-1][1] if stack else None
        while pending:
            tail = len(pending[0].tokens) - base
            gathers = getattr(self.runner, "gathers_positions", False)
            n = self.settings.prefix_batch or rows_for(self.settings, tail, _positions(pending) if gathers else None,
                                                       base + tail)
            if past is not None:  # the replicated past stays within the prefix budget
                n = min(n, max(1, self.settings.prefix_budget_mb * 2**20 // max(past.nbytes, 1)))
            if getattr(self, "prefix_batch_refused", False):
                n = 1
            chunk, pending[:] = pending[:n], pending[n:]
            if len(chunk) > 1:
                try:
                    self._continue_rows(chunk, base, past, done)
                    continue
                except OrtEvalsError as e:
                    if past is None:
                        raise
                    log.warning("prefix continuations: batched pass refused (%s); one row per pass from now on",
                                e)
                    self.prefix_batch_refused = True
            for group in chunk:
                self._continue_rows([group], base, past, done)

    def _continue_rows(self, chunk: list[Group], base: int, past, done: ScoreSink) -> None:
        ids, tail_mask = pad_right([g.tokens[base:] for g in chunk], self.settings.pad_token_id)
        mask = np.concatenate([np.ones((len(chunk), base), dtype=np.int64), tail_mask], axis=1)
        if past is not None and len(chunk) > 1:
            repeat = getattr(self.runner, "repeat_past", None)
            past = repeat(past, len(chunk)) if repeat else _repeat_host(past, len(chunk))
        self._score_pass(ids, mask, chunk, [len(g.tokens) - base for g in chunk], done, past)

    def _extend(self, tokens, stack, plan: PrefixPlan, depth: int):
        """KV of ``tokens[:depth]``, computed on top of the deepest cached prefix."""
        base = _depth(stack, plan)
        past = stack[-1][1] if stack else None
        ids = np.asarray([tokens[base:depth]], dtype=np.int64)
        # only the KV is wanted: a derived graph computes the head at one position, not [1,S,V] logits
        last = np.array([[ids.shape[1] - 1]], np.int64) if getattr(self.runner, "gathers_positions", False) else None
        _, kv = self._forward(ids, np.ones((1, depth), dtype=np.int64), past, want_present=True, positions=last)
        return kv


def _repeat_host(past, batch: int):
    """A numpy KVCache's rows (KV and any recurrent state) repeated ``batch`` times (runners without
    ``repeat_past``)."""
    return past.rows(lambda t: np.repeat(t, batch, axis=0))


def _depth(stack, plan: PrefixPlan) -> int:
    return plan.nodes[stack[-1][0]].depth if stack else 0
