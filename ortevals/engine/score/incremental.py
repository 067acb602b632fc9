"""The incremental scoring engine: log-likelihoods through onnxruntime-genai.

Owns scoring token requests with a Generator cursor (``append_tokens``,
``get_logits``, ``rewind_to``): inputs are grouped like the prefill path and
visited in lexicographic order, so the cursor rewinds to the prefix shared
with the previous input (MMLU-Pro's 5-shot header) and appends only the rest:
one pass per question. On a package with recurrent state the cursor can come back
only to a position it saved: each input tells it where the next one branches off.
Used for packages that cannot return full logits
(pruned LM head ``[B,1,V]``, NPU/hybrid providers, fixed-window exports) and
on request (``path=incremental``).

The cursor is passed in; this module imports no runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ortevals.engine.score.prefill import MIN_OWN_TOKENS, EngineSettings, Score, TokenRequest, plan_groups
from ortevals.engine.score.scoring import ScoreSink
from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)


class IncrementalEngine:
    """Scores log-likelihood requests one input at a time on a Generator cursor.

    runner: has ``cursor(max_length)`` returning an object with ``move_to``,
    ``append``, ``tail_logits`` and ``tokens_run`` (see runtime/genai.py).
    """

    def __init__(self, runner, settings: EngineSettings, full_logits: bool = True) -> None:
        self.runner = runner
        self.settings = settings
        self.full_logits = full_logits  # og returns every position of an append
        self.forward_passes = 0
        self.tokens_run = 0

    def score(self, requests: Sequence[TokenRequest],
              on_done: Callable[[int, Score], None] | None = None) -> list[Score]:
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        results: list[Score | None] = [None] * len(requests)
        sink = ScoreSink(requests, results, on_done)
        if not groups:
            return []
        width = max(len(g.tokens) for g in groups)  # og refuses more than the context
        cursor = self.runner.cursor(width)
        run = 0
        # lexicographic order: each input shares the longest prefix with the one before; exact mode (a graph
        # whose numbers depend on the pass) gives every input a cursor of its own: nothing reused
        ordered = sorted(groups, key=lambda g: g.tokens)
        for j, group in enumerate(ordered):
            if self.settings.exact:
                run, cursor = run + cursor.tokens_run, self.runner.cursor(width)
            k = max(n for _, n in group.members)
            after = None if self.settings.exact or j + 1 == len(ordered) else ordered[j + 1]
            rows = self._rows(cursor, group.tokens, k, _branch(group, after))
            sink.group(rows, group, k)
        run += cursor.tokens_run
        self.tokens_run += run
        log.info("incremental: %d inputs, %d tokens run", len(groups), run)
        return results  # type: ignore[return-value]

    def _rows(self, cursor, tokens: tuple[int, ...], k: int, keep_at: int | None = None) -> np.ndarray:
        """Logits ``[k, V]`` predicting the last k tokens of ``tokens`` + the next one; ``keep_at``: where the
        next input branches off (the cursor saves recurrent state there)."""
        end = len(tokens)
        first = cursor.move_to(tokens[:end - k + 1], keep_at=keep_at)  # predicts token end-k+1
        self.forward_passes += 1
        if k == 1:
            return first[None]
        rest = list(tokens[end - k + 1:])
        if self.full_logits:
            cursor.append(rest)
            self.forward_passes += 1
            tail = cursor.tail_logits(k - 1)
            if tail is not None:
                return np.concatenate([first[None], tail])
            raise RuntimeError("onnxruntime-genai returned only the last position's logits")
        rows = [first]
        for t in rest:  # one token per pass: the package returns the last position only
            rows.append(cursor.append([t]))
            self.forward_passes += 1
        return np.stack(rows)


def _target(group) -> tuple[int, ...]:
    """What the cursor moves to for ``group``: its input up to the first scored position."""
    return group.tokens[:len(group.tokens) - max(n for _, n in group.members) + 1]


def _branch(group, after) -> int | None:
    """Where the input ``after`` branches off ``group``'s cursor target, leaving ``after`` at least
    MIN_OWN_TOKENS of its own to run (the prefill path's rule: no one-token pass on a cached past)."""
    if after is None:
        return None
    here, there = _target(group), _target(after)
    return max(0, min(common_prefix(here, there), len(there) - MIN_OWN_TOKENS)) or None
