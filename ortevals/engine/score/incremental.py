"""The incremental scoring engine: log-likelihoods through onnxruntime-genai.

Owns scoring token requests with a Generator cursor (``append_tokens``,
``get_logits``, ``rewind_to``): inputs are grouped like the prefill path and
visited in lexicographic order, so the cursor rewinds to the prefix shared
with the previous input (MMLU-Pro's 5-shot header) and appends only the rest:
one pass per question. On a package with recurrent state the cursor can come back
only to a position it saved: each input tells it where the next one branches off.
Used for packages that cannot return full logits
(pruned LM head ``[B,1,V]``, NPU/hybrid providers, fixed-window exports) and
on request (``path=incremental``). Where a pass returns only the last position's logits (declared so or not:
the first multi-token pass shows it), continuations are scored by stepping: one pass per scored position. The
same engine steps on raw sessions (runtime/raw_steps.py) for a decoder whose probe returned one row.

The cursor is passed in; this module imports no runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ortevals.engine.score.prefill import EngineSettings, Score, TokenRequest, plan_groups
from ortevals.engine.score.scoring import ScoreSink
from ortevals.errors import OrtEvalsError
from ortevals.package.reuse import MIN_PASS_TOKENS
from ortevals.tokens import common_prefix

log = logging.getLogger(__name__)
# the mode line of a run whose passes return only the last position's logits
STEPPING = "stepping ({} only the last position's logits: one pass per continuation token on the held KV)"


class IncrementalEngine:
    """Scores log-likelihood requests one input at a time on a Generator cursor.

    runner: has ``cursor(max_length)`` returning an object with ``move_to``,
    ``append``, ``tail_logits`` and ``tokens_run`` (see runtime/genai.py).
    """

    def __init__(self, runner, settings: EngineSettings, full_logits: bool = True,
                 who: str = "onnxruntime-genai") -> None:
        self.runner = runner
        self.settings = settings
        self.full_logits = full_logits  # the runner returns every position of an append
        self.who = who  # what returns the logits, for the mode line
        self.mode = "incremental" if full_logits else f"incremental; {STEPPING.format(who + ' returns')}"
        self.forward_passes = 0
        self.tokens_run = 0

    def score(self, requests: Sequence[TokenRequest], on_done: Callable[[int, Score], None] | None = None,
              min_saving: int | None = None) -> list[Score]:
        """Score every request on one cursor; ``min_saving`` is the prefill engine's (this path plans no
        prefixes: each input rewinds to the longest prefix it shares with the one before)."""
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
        """Logits ``[k, V]`` at the last k positions of ``tokens`` (predicting its last k - 1 tokens and the next).

        The prefill path's rules (package/reuse.py), passed on to the cursor: every pass on a kept past runs
        ``MIN_PASS_TOKENS`` new tokens at least, and every pass of an input is of the input's length class. With
        full logits: one pass to the first scored position, then one of the scored tail (both of the input's
        class and 2 tokens or more), else the input's tail in one pass. A pruned head (last position only): one
        pass per scored position, each ending there (a rewind of one token and two run). ``keep_at``: where the
        next input branches off (the cursor's first move saves recurrent state there).
        """
        end, reuse = len(tokens), self.settings.reuse
        at = {"keep_at": keep_at} if keep_at else {}  # only where there is a branch point to keep
        if k == 1:
            self.forward_passes += 1
            return cursor.move_to(tokens, **at)[None]
        if not self.full_logits:
            if not reuse.same_class(end - k + 1, end):
                raise OrtEvalsError(
                    f"an input of {end} tokens scored over its last {k} positions crosses the package's rotary "
                    f"switch at {reuse.rope_switch} tokens (LongRoPE); a package whose LM head returns only the last "
                    "position cannot score it exactly: export it with full logits (no prune_lm_head) and use "
                    "path=prefill")
            self.forward_passes += k
            return np.stack([cursor.move_to(tokens[:p], **at) for p in range(end - k + 1, end + 1)])
        if end - k >= MIN_PASS_TOKENS and reuse.same_class(end - k, end):
            cursor.move_to(tokens[:end - k], **at)
            cursor.append(list(tokens[end - k:]))
            self.forward_passes += 2
        else:  # the tail crosses the switch, or the head is too short for a pass of its own
            cursor.move_to(tokens, own=k, **at)
            self.forward_passes += 1
        tail = cursor.tail_logits(k)
        if tail is None:  # the first pass that shows how many rows come back showed one: step from now on
            self.full_logits = False
            self.mode = f"incremental; {STEPPING.format(self.who + ' returned')}"
            log.warning("%s returned the last position's logits alone for a pass of %d tokens (whatever the graph "
                        "declares): scoring by stepping from now on, one pass per continuation token", self.who, k)
            return self._rows(cursor, tokens, k, keep_at)
        return tail


def _branch(group, after) -> int | None:
    """Where the input ``after`` branches off ``group``'s, leaving ``after``'s first move (whichever
    :meth:`IncrementalEngine._rows` makes: up to its scored tail at the latest) MIN_PASS_TOKENS of its own."""
    if after is None:
        return None
    k = max(n for _, n in after.members)
    return max(0, min(common_prefix(group.tokens, after.tokens), len(after.tokens) - k - MIN_PASS_TOKENS)) or None
