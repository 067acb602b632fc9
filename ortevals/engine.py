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
    group_by_context: bool = True


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
    """Rows per batch: the fixed batch size, or what fits the logits budget."""
    if settings.batch_size:
        return settings.batch_size
    per_row = seq_len * settings.vocab_size * 4 * 2  # logits + the float32 copy scoring makes
    return max(1, min(256, settings.memory_budget_mb * 2**20 // max(per_row, 1)))


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

    def score(
        self,
        requests: Sequence[TokenRequest],
        on_done: Callable[[int, Score], None] | None = None,
    ) -> list[Score]:
        """Score every request; ``on_done(index, score)`` fires as each one finishes."""
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        log.info("prefill: %d requests in %d forward inputs", len(requests), len(groups))
        results: list[Score | None] = [None] * len(requests)
        for batch in batches(groups, self.settings):
            ids, mask = pad_right([g.tokens for g in batch], self.settings.pad_token_id)
            logits, _ = self.runner.forward(ids, mask)
            self.forward_passes += 1
            self.tokens_run += int(mask.sum())
            for b, group in enumerate(batch):
                self._score_group(logits[b], group, requests, results, on_done)
        return results  # type: ignore[return-value]

    def _score_group(self, logits, group: Group, requests, results, on_done) -> None:
        end = len(group.tokens)
        for index, n_cont in group.members:
            # row i predicts token i+1: the last n_cont input rows predict the continuation
            lp, greedy = continuation_logprob(logits[end - n_cont:end], requests[index].continuation)
            score = Score(check_finite(lp, f"request {index}"), greedy)
            results[index] = score
            if on_done is not None:
                on_done(index, score)
