"""Scoring on shared prefixes: the prefill engine's walk over the prefix plan.

Owns :class:`SharedPrefixes`, the part of :class:`~ortevals.engine.score.prefill.PrefillEngine` that scores
inputs on top of cached prefixes: depth-first over the radix plan (:mod:`ortevals.engine.score.prefix`),
holding the KV of the prefixes on the current path within ``prefix_budget_mb`` (:meth:`_score_shared`),
computing a prefix's KV on top of its deepest held ancestor (:meth:`_extend`), and running the inputs that
wait on a prefix (:meth:`_continue`): many rows a pass on the shared-prefix graph, every row reading the one
prefix (``shared_prefix_batch``, :meth:`_continue_shared`); else one row a pass, writing its tokens after the
prefix held once in a buffer (``shared_buffer``, :meth:`_continue_in_place`) or on its own copy; or batched
with the prefix's past replicated across the batch where the provider takes it.
"""

from __future__ import annotations

import logging

import numpy as np

from ortevals.engine.score.passes import (
    Group,
    last_positions,
    own_width,
    pad_right,
    rows_for,
    scored_positions,
    shared_batches,
)
from ortevals.engine.score.prefix import PrefixPlan
from ortevals.engine.score.scoring import ScoreSink
from ortevals.errors import OrtEvalsError, first_line

log = logging.getLogger(__name__)
SHARED_PENDING = 2048  # inputs collected under one prefix before its shared-prefix passes run


class SharedPrefixes:
    """Mixin of the prefill engine: its shared-prefix walk (uses the engine's ``settings``, ``runner``, ``pool``,
    ``kv_bytes_per_token``, ``shared_runner``, ``shared_stats``, ``on_refused``, ``_pass``, ``_count`` and
    ``_call``)."""

    def _score_shared(self, groups: list[Group], plan: PrefixPlan, done: ScoreSink) -> None:
        """Depth-first over the radix plan; the stack holds the KV of the prefixes on the path.

        Consecutive inputs under the same deepest held prefix are collected and run
        ``prefix_batch`` rows per pass (see :meth:`_continue`); the pending rows are
        flushed before the stack changes, so evicted KV is never kept alive.
        """
        budget = self.settings.prefix_budget_mb * 2**20
        stack: list[tuple[int, object]] = []  # (node index, KVCache)
        pending: list[Group] = []  # inputs waiting to run on top of the stack's deepest prefix
        # pending inputs flushed at once: a batch's rows, or on one row per pass enough to keep every pass busy
        limit = (self.settings.prefix_batch or 256) * (1 if self.settings.passes == 1 else 8 * self.settings.passes)
        if self.shared_runner is not None or (self.settings.shared_buffer and self.settings.passes == 1):
            limit = SHARED_PENDING  # several shared-prefix passes' rows sorted together, or one held copy for many
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
        if past is not None and self.shared_runner is not None:
            self._continue_shared(pending, base, past, done)
        while pending:
            tail = len(pending[0].tokens) - base
            gathers = getattr(self.runner, "gathers_positions", False)
            k = scored_positions(pending) if gathers else None
            n = self.settings.prefix_batch or rows_for(self.settings, tail, k, base + tail)
            if past is not None:  # the replicated past stays within the prefix budget
                n = min(n, max(1, self.settings.prefix_budget_mb * 2**20 // max(past.nbytes, 1)))
            if n == 1 or getattr(self, "prefix_batch_refused", False):  # one row per pass, ``passes`` at a time
                if self._in_place(past):
                    self._continue_in_place(pending, base, past, done)
                for group in pending:
                    self.pool.submit(*self._continue_rows([group], base, past, done))
                pending.clear()
                return
            chunk, pending[:] = pending[:n], pending[n:]
            try:
                run, report = self._continue_rows(chunk, base, past, done)
                report(run())
            except OrtEvalsError as e:
                if past is None:
                    raise
                log.warning("prefix continuations: batched pass refused (%s); one row per pass from now on", e)
                self.prefix_batch_refused = True
                pending[:0] = chunk

    def _continue_shared(self, pending: list[Group], base: int, past, done: ScoreSink) -> None:
        """Score ``pending`` many rows a pass on the shared-prefix graph (runtime/prefix_graph.py), every row
        reading ``past`` (one row, ``base`` tokens) as it is; passes from :func:`shared_batches`. Until one pass has
        run, each runs here: where it is refused the engine says so once (``on_refused``) and goes on one row per
        pass (``pending`` is left for it), and nothing of it is counted (a pass is counted once it has run)."""
        batches = list(shared_batches(pending, base, self.settings))
        pending.clear()
        for i, (chunk, width) in enumerate(batches):
            run, report = self._shared_pass(chunk, width, base, past, done)
            if self.shared_stats["passes"]:  # the graph has served a pass: the rest go to the pool
                self.pool.submit(run, report)
                continue
            try:  # a refusal is the graph's (a request's non-finite score, raised by report, is not)
                out = run()
            except OrtEvalsError as e:
                log.warning("shared-prefix batches: refused (%s); one input a pass on shared prefixes from now on", e)
                self.shared_runner, self.shared_refused = None, first_line(e)
                if self.on_refused is not None:
                    self.on_refused(self.shared_refused)
                pending.extend(g for c, _ in batches[i:] for g in c)
                return
            report(out)

    def _shared_pass(self, chunk: list[Group], width: int, base: int, past, done: ScoreSink):
        """One shared-prefix pass over ``chunk`` (own tokens right-padded to ``width``) as ``(run, report)`` for
        :class:`PassPool`; ``report`` counts it (it has run) and gives each row's scores to ``done``."""
        ids, tail = pad_right([g.tokens[base:] for g in chunk], self.settings.pad_token_id, width)
        lengths = [len(g.tokens) - base for g in chunk]
        k, positions = last_positions(chunk, lengths)
        targets = done.targets(chunk, k)

        def report(out) -> None:
            stats = self.shared_stats
            stats["passes"] += 1
            stats["rows"] += len(chunk)
            stats["tokens"] += sum(lengths)
            stats["padded"] += ids.size - sum(lengths)
            self._count(ids, tail)
            for b, g in enumerate(chunk):
                done.scores(out[0][b], out[1][b], g, k)

        return lambda: self.shared_runner.score(ids, past, positions, targets), report

    def _in_place(self, past) -> bool:
        """Whether one-a-pass inputs write their tokens into a held buffer of the prefix (``shared_buffer``): one
        pass at a time (they share the buffer's tail), a runner that scores in place."""
        return (past is not None and self.settings.shared_buffer and self.settings.passes == 1
                and getattr(self.runner, "scores_in_place", False))

    def _continue_in_place(self, pending: list[Group], base: int, past, done: ScoreSink) -> None:
        """Score ``pending`` one a pass, each writing its own tokens (right-padded to a multiple of
        ``shape_bucket`` within the rotary table: :func:`own_width`) after the prefix held once in a buffer of the
        widest pass's capacity, and empty it."""
        widths = [own_width(len(g.tokens) - base, base, self.settings) for g in pending]
        held = self.runner.held_in(past, base + max(widths))
        for group, width in zip(pending, widths):
            ids, tail = pad_right([group.tokens[base:]], self.settings.pad_token_id, width)
            self._count(ids, tail)
            k, positions = last_positions([group], [len(group.tokens) - base])
            targets = done.targets([group], k)
            self.pool.submit(lambda i=ids, p=positions, t=targets: self.runner.forward_inplace(i, held, p, targets=t),
                             lambda out, g=group, k=k: done.scores(out[0][0], out[1][0], g, k))
        pending.clear()

    def _continue_rows(self, chunk: list[Group], base: int, past, done: ScoreSink):
        """The pass of ``chunk``'s own tokens on the ``base`` tokens of ``past``, as :meth:`_pass` makes it."""
        ids, tail_mask = pad_right([g.tokens[base:] for g in chunk], self.settings.pad_token_id)
        mask = np.concatenate([np.ones((len(chunk), base), dtype=np.int64), tail_mask], axis=1)
        if past is not None and len(chunk) > 1:
            repeat = getattr(self.runner, "repeat_past", None)
            past = repeat(past, len(chunk)) if repeat else _repeat_host(past, len(chunk))
        return self._pass(ids, mask, chunk, [len(g.tokens) - base for g in chunk], done, past)

    def _extend(self, tokens, stack, plan: PrefixPlan, depth: int):
        """KV of ``tokens[:depth]``, computed on top of the deepest cached prefix: in a pass of
        ``ReusePolicy.kv_width`` tokens of ``tokens`` (longer than ``depth`` past a length switch), cut back."""
        base = _depth(stack, plan)
        past = stack[-1][1] if stack else None
        width = self.settings.reuse.kv_width(depth, len(tokens))
        ids = np.asarray([tokens[base:width]], dtype=np.int64)
        # only the KV is wanted: a derived graph computes the head at one position, not [1,S,V] logits
        last = np.array([[ids.shape[1] - 1]], np.int64) if getattr(self.runner, "gathers_positions", False) else None
        mask = np.ones((1, width), dtype=np.int64)
        self._count(ids, mask)  # on a worker while the passes already started go on
        _, kv = self.pool.call(lambda: self._call(ids, mask, past, want_present=True, positions=last))
        return kv if width == depth else self.runner.narrow_past(kv, depth)


def _repeat_host(past, batch: int):
    """A numpy KVCache's rows (KV and any recurrent state) repeated ``batch`` times (runners without
    ``repeat_past``)."""
    return past.rows(lambda t: np.repeat(t, batch, axis=0))


def _depth(stack, plan: PrefixPlan) -> int:
    return plan.nodes[stack[-1][0]].depth if stack else 0
