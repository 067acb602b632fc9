"""The prefill scoring engine: token requests in, scores out.

Owns grouping, ordering and batching of log-likelihood requests:

* requests whose model input is identical (the same context, one-token
  continuations: MMLU-Pro's ten choices) share one forward pass;
* inputs are sorted longest-first and right-padded with an attention mask
  (left padding is wrong under GroupQueryAttention);
* ``batch_size=None`` ("auto") picks rows per batch from a memory budget for
  the ``[B,S,V]`` logits the pass returns.

The forward pass is passed in (a :class:`~ortevals.runtime.sessions.DecoderRunner`
or anything with the same ``forward``), so the engine is tested with hand-made
logits and never imports a runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ortevals.prefix import PrefixPlan, plan_prefixes
from ortevals.scoring import check_finite, continuation_logprob, input_window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenRequest:
    """One log-likelihood request at token level."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class Score:
    """lm-eval's answer to a log-likelihood request."""

    logprob: float
    greedy: bool


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


@dataclass(frozen=True)
class Group:
    """Requests that share one model input: ``tokens`` plus (request index, continuation length)."""

    tokens: tuple[int, ...]
    members: tuple[tuple[int, int], ...]


class Forward(Protocol):
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


def rows_for(settings: EngineSettings, seq_len: int) -> int:
    """Rows per batch: the fixed batch size, or what fits the budgets.

    On CPU a long row already saturates the cores and extra rows only add memory
    traffic, so auto caps rows by ``token_budget`` as well as by the logits budget.
    """
    if settings.batch_size:
        return settings.batch_size
    per_row = seq_len * settings.vocab_size * 4 * 2  # logits + the float32 copy scoring makes
    by_memory = settings.memory_budget_mb * 2**20 // max(per_row, 1)
    by_tokens = settings.token_budget // max(seq_len, 1) if settings.token_budget else by_memory
    return max(1, min(256, by_memory, by_tokens))


def batches(groups: list[Group], settings: EngineSettings) -> Iterator[list[Group]]:
    i = 0
    while i < len(groups):
        n = rows_for(settings, len(groups[i].tokens))
        yield groups[i:i + n]
        i += n


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

    def __init__(self, runner: Forward, settings: EngineSettings) -> None:
        self.runner = runner
        self.settings = settings
        self.forward_passes = 0
        self.tokens_run = 0
        self.kv_bytes_per_token = settings.kv_bytes_per_token

    def score(
        self,
        requests: Sequence[TokenRequest],
        on_done: Callable[[int, Score], None] | None = None,
    ) -> list[Score]:
        """Score every request; ``on_done(index, score)`` fires as each one finishes."""
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        results: list[Score | None] = [None] * len(requests)
        done = ScoreSink(requests, results, on_done)
        plain = groups
        if self.settings.prefix_cache and len(groups) > 1:
            plan = plan_prefixes([g.tokens for g in groups], [max(n for _, n in g.members) for g in groups],
                                 self.settings.prefix_min_saving)
            plain = [g for g, a in zip(groups, plan.ancestor) if a is None]
            log.info("prefill: %d requests, %d inputs, %d share %d cached prefixes", len(requests), len(groups),
                     len(groups) - len(plain), len(plan.nodes))
            if plan.nodes:
                self._score_shared(groups, plan, done)
        for batch in batches(plain, self.settings):
            ids, mask = pad_right([g.tokens for g in batch], self.settings.pad_token_id)
            logits, ends = self._scored_forward(ids, mask, batch, [len(g.tokens) for g in batch])
            for b, group in enumerate(batch):
                done.group(logits[b], group, ends[b])
        return results  # type: ignore[return-value]

    def _forward(self, ids: np.ndarray, mask: np.ndarray, past=None, want_present: bool = False, positions=None):
        self.forward_passes += 1
        self.tokens_run += int(mask[:, mask.shape[1] - ids.shape[1]:].sum())
        if positions is None:
            return self.runner.forward(ids, mask, past, want_present)
        return self.runner.forward(ids, mask, past, want_present, positions)

    def _scored_forward(self, ids, mask, batch: list[Group], lengths: list[int], past=None):
        """Logits rows for each row's scored tail, and where each row's tail ends in them.

        With a derived graph only the last K positions of each row come back
        (K: the longest continuation in the batch); otherwise all S do.
        """
        if not getattr(self.runner, "gathers_positions", False):
            logits, _ = self._forward(ids, mask, past)
            return logits, lengths
        k = max(n for g in batch for _, n in g.members)
        positions = np.stack([np.clip(np.arange(n - k, n), 0, None) for n in lengths]).astype(np.int64)
        logits, _ = self._forward(ids, mask, past, positions=positions)
        return logits, [k] * len(lengths)

    def _score_shared(self, groups: list[Group], plan: PrefixPlan, done: ScoreSink) -> None:
        """Depth-first over the radix plan; the stack holds the KV of the prefixes on the path.

        One row per pass: GroupQueryAttention refuses batch > 1 when a multi-token
        input comes with past KV.
        """
        budget = self.settings.prefix_budget_mb * 2**20
        stack: list[tuple[int, object]] = []  # (node index, KVCache)
        for gi in plan.order:
            path = plan.paths[gi]
            if not path:
                continue
            while stack and stack[-1][0] not in path:
                stack.pop()  # left that subtree: evict
            tokens = groups[gi].tokens
            for node in path:
                if any(n == node for n, _ in stack) or plan.nodes[node].depth <= _depth(stack, plan):
                    continue
                held = sum(c.nbytes for _, c in stack)
                if held + plan.nodes[node].depth * self.kv_bytes_per_token > budget:
                    continue  # no room: children compute from the deepest prefix held
                kv = self._extend(tokens, stack, plan, plan.nodes[node].depth)
                self.kv_bytes_per_token = kv.nbytes // max(kv.length, 1)
                if held + kv.nbytes <= budget:
                    stack.append((node, kv))
            base = _depth(stack, plan)
            past = stack[-1][1] if stack else None
            ids = np.asarray([tokens[base:]], dtype=np.int64)
            mask = np.ones((1, len(tokens)), dtype=np.int64)
            logits, ends = self._scored_forward(ids, mask, [groups[gi]], [len(tokens) - base], past)
            done.group(logits[0], groups[gi], ends[0])

    def _extend(self, tokens, stack, plan: PrefixPlan, depth: int):
        """KV of ``tokens[:depth]``, computed on top of the deepest cached prefix."""
        base = _depth(stack, plan)
        past = stack[-1][1] if stack else None
        ids = np.asarray([tokens[base:depth]], dtype=np.int64)
        _, kv = self._forward(ids, np.ones((1, depth), dtype=np.int64), past, want_present=True)
        return kv


def _depth(stack, plan: PrefixPlan) -> int:
    return plan.nodes[stack[-1][0]].depth if stack else 0


class ScoreSink:
    """Turns logits rows into scores for a group's members and reports them."""

    def __init__(self, requests, results, on_done) -> None:
        self.requests, self.results, self.on_done = requests, results, on_done

    def group(self, logits: np.ndarray, group: Group, end: int) -> None:
        """logits: ``[R, V]`` rows of one input whose scored tail ends at row ``end``."""
        for index, n_cont in group.members:
            # row i predicts token i+1: the last n_cont input rows predict the continuation
            lp, greedy = continuation_logprob(logits[end - n_cont:end], self.requests[index].continuation)
            score = Score(check_finite(lp, f"request {index}", index), greedy)
            self.results[index] = score
            if self.on_done is not None:
                self.on_done(index, score)
