"""The prefill scoring engine: token requests in, scores out.

Owns running log-likelihood requests as passes (the plain plan, grouping and batching, is
:mod:`ortevals.engine.score.passes`; what cached KV may serve which input is the package's
:class:`~ortevals.package.reuse.ReusePolicy`):

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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from ortevals.engine.score.invariance import (
    CanaryResult,
    Verdicts,
    canary_key,
    compare,
    pick_canary,
    slices,
    straddle,
    tolerance,
)
from ortevals.engine.score.parallel import PassPool
from ortevals.engine.score.passes import (
    EngineSettings,
    Group,
    TokenRequest,
    batches,
    last_positions,
    pad_right,
    plan_groups,
    rows_for,
)
from ortevals.engine.score.prefix import plan_prefixes
from ortevals.engine.score.scoring import NonFiniteScore, Score, ScoreSink
from ortevals.engine.score.shared import SharedPrefixes
from ortevals.package.reuse import MIN_PASS_TOKENS

__all__ = ["EngineSettings", "Group", "PrefillEngine", "Score", "TokenRequest", "pad_right", "plan_groups",
           "rows_for"]
log = logging.getLogger(__name__)
MIN_OWN_TOKENS = MIN_PASS_TOKENS  # tokens of an input run in its own pass on top of a cached prefix


class Forward(Protocol):
    """A runner; with ``gathers_positions`` it also takes ``positions``, with ``scores_in_graph`` it has ``score``
    (runtime/sessions.DecoderRunner)."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, past=None, want_present: bool = False): ...


class PrefillEngine(SharedPrefixes):
    """Scores log-likelihood requests with full-logit forward passes."""

    def __init__(self, runner: Forward, settings: EngineSettings, verdicts: Verdicts | None = None,
                 shared=None) -> None:
        self.runner = runner
        # issue 46: the shared-prefix scoring session (runtime/prefix_runner.py), or None (one input a pass)
        self.shared_runner = shared
        self.shared_stats = {"passes": 0, "rows": 0, "tokens": 0, "padded": 0}
        self.settings = settings
        self.verdicts = verdicts or Verdicts()  # canary verdicts kept across runs (with a store)
        self.canary_passes = 0  # forward passes the canary cost (0 when a stored verdict was reused)
        self.forward_passes = 0
        self.tokens_run = 0
        self.kv_bytes_per_token = settings.kv_bytes_per_token
        self.mode = "exact" if settings.exact else "batched"  # which mode runs and why, for the run's record
        self.shared_refused = ""  # why inputs under a shared prefix ran one a pass though shared_prefix_batch=on
        # called with that reason, on the scoring thread, when the shared-prefix graph refuses its first pass
        self.on_refused: Callable[[str], None] | None = None
        self.canary: CanaryResult | None = None
        self.canary_tokens = 0  # tokens of the canary's one-row reference passes (their scores are kept)
        self.pool = PassPool(settings.passes)  # independent passes, ``passes`` at a time (engine/score/parallel.py)

    @property
    def mode(self) -> str:
        """Which mode ran and why (the run's record): exact, or batched with the canary's verdict, and how the
        inputs under shared prefixes ran."""
        if self.settings.exact or not self.settings.shared_prefix_batch:
            return self._mode
        s = self.shared_stats
        if s["passes"]:
            return (f"{self._mode}; shared-prefix batches: {s['rows']} inputs in {s['passes']} passes "
                    f"({s['rows'] / s['passes']:.1f} a pass), {s['padded'] / max(s['tokens'] + s['padded'], 1):.1%} of "
                    "their tokens padding")
        return f"{self._mode}; one input a pass on shared prefixes ({self.shared_refused or 'none shared'})"

    @mode.setter
    def mode(self, value: str) -> None:
        self._mode = value

    def score(
        self,
        requests: Sequence[TokenRequest],
        on_done: Callable[[int, Score], None] | None = None,
        min_saving: int | None = None,
    ) -> list[Score]:
        """Score every request; ``on_done(index, score)`` fires as each one finishes. ``min_saving``: the
        tokens a shared prefix must save to get a pass of its own in this call (default: the settings')."""
        if not requests:
            return []
        try:
            out = self._score(requests, on_done, min_saving)
            self.pool.drain()
            return out
        except BaseException:
            self.pool.abandon()
            raise

    def _score(self, requests, on_done, min_saving) -> list[Score]:
        if self.settings.exact:
            return self.score_exact(requests, on_done)
        if self.settings.check and self.canary is None and self._can_differ():
            if not self._stored_verdict():
                return self._score_checked(requests, on_done, min_saving)
            return self._score(requests, on_done, min_saving)
        return self.score_batched(requests, on_done, min_saving)

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
            self.pool.submit(*self._pass(ids, mask, [group], [len(group.tokens)], done))
        self.pool.drain()
        return results  # type: ignore[return-value]

    def _score_checked(self, requests: Sequence[TokenRequest], on_done=None, min_saving=None) -> list[Score]:
        """The canary on a few inputs cut short (``invariance.slices``), then the run in the mode it chose.

        A non-finite canary score trips it too: the exact run then names the request that has it.
        """
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        picked = [requests[groups[gi].members[0][0]] for gi in pick_canary([g.tokens for g in groups])]
        pairs = [(r.context, r.continuation) for r in picked]
        sub = [TokenRequest(c, x) for c, x in slices(pairs) + straddle(pairs, self.settings.reuse.rope_switch)]
        key, before, passes = canary_key("prefill", self.settings), self.tokens_run, self.forward_passes
        try:
            exact = self.score_exact(sub)
            configured = self._canary_configured(sub)
            self.canary = compare(np.array([s.logprob for s in configured]), np.array([s.logprob for s in exact]),
                                  np.array([len(r.continuation) for r in sub]), self.settings.dtype)
        except NonFiniteScore as e:
            self.pool.abandon()  # the canary's other passes: not reported
            exact = configured = None
            self.canary = CanaryResult(False, float("nan"), e.index or 0, tolerance(self.settings.dtype, 1))
        self.canary_tokens += self.tokens_run - before
        self.canary_passes += self.forward_passes - passes
        self._canary_verdict(sub, configured, exact)
        if exact is not None:  # a non-finite score is the request's, not the graph's: not kept
            self.verdicts.keep_canary(key, self.canary, self._mode)
        return self.score(requests, on_done, min_saving)

    def _canary_configured(self, sub: list[TokenRequest]) -> list[Score]:
        """The configured way, with any shared prefix reused (a handful of requests saves few tokens)."""
        return self.score_batched(sub, min_saving=1)

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
        min_saving: int | None = None,
    ) -> list[Score]:
        """The configured way: grouped, batched, shared prefixes reused (those saving ``min_saving`` tokens,
        default the settings' ``prefix_min_saving``). Prefixes are planned within each length class of the
        package's reuse policy (package/reuse.py): KV made for one class never serves the other."""
        groups = plan_groups(requests, self.settings.max_length, self.settings.group_by_context)
        results: list[Score | None] = [None] * len(requests)
        done = ScoreSink(requests, results, on_done)
        plain, reuse = groups, self.settings.reuse
        if self.settings.prefix_cache and not reuse.refused and len(groups) > 1:
            classes = sorted({reuse.length_class(len(g.tokens)) for g in groups})
            plain = [g for c in classes
                     for g in self._shared([g for g in groups if reuse.length_class(len(g.tokens)) == c], done,
                                          min_saving)]
            plain.sort(key=lambda g: -len(g.tokens))  # longest first, as plan_groups made them
        for batch in batches(plain, self.settings, getattr(self.runner, "gathers_positions", False)):
            ids, mask = pad_right([g.tokens for g in batch], self.settings.pad_token_id)
            self.pool.submit(*self._pass(ids, mask, batch, [len(g.tokens) for g in batch], done))
        self.pool.drain()
        return results  # type: ignore[return-value]

    def _shared(self, groups: list[Group], done: ScoreSink, min_saving: int | None = None) -> list[Group]:
        """Score the inputs of ``groups`` (one length class) that share a planned prefix; return the others.

        Each input keeps at least 2 tokens for its own pass (``MIN_OWN_TOKENS``, package/reuse.py): on MatMulNBits
        accuracy_level=4 graphs (the builder's int4/int8) a 1-token pass takes another kernel path than the full
        pass (up to 0.59 nats on SmolLM2 int8), while 2 or more are bit-identical to it. Past a length switch,
        a prefix's KV comes from a pass longer than the switch, cut back (``ReusePolicy.kv_width``); where a
        windowed sliding-layer buffer would have evicted what the cut keeps (``cut_exact``), that class is scored
        without shared prefixes; so is every class where the policy shares no prefix (``unshared``).
        """
        if len(groups) < 2:
            return groups
        if self.settings.reuse.unshared:
            log.info("prefill: no shared prefixes: %s", self.settings.reuse.unshared)
            return groups
        plan = plan_prefixes([g.tokens for g in groups], [max(MIN_OWN_TOKENS, *(n for _, n in g.members))
                                                          for g in groups],
                             self.settings.prefix_min_saving if min_saving is None else min_saving)
        if self.shared_runner is not None:  # many inputs a pass on one prefix: deeper prefixes only split them
            plan = plan.top_level()
        reuse, total = self.settings.reuse, len(groups[0].tokens)
        if any(not reuse.cut_exact(reuse.kv_width(n.depth, total), n.depth) for n in plan.nodes):
            log.info("prefill: no shared prefixes for inputs past %s tokens: %s", reuse.rope_switch, reuse.describe())
            return groups
        plain = [g for g, a in zip(groups, plan.ancestor) if a is None]
        log.info("prefill: %d inputs, %d share %d cached prefixes", len(groups), len(groups) - len(plain),
                 len(plan.nodes))
        if plan.nodes:
            self._score_shared(groups, plan, done)
        return plain

    def _forward(self, ids: np.ndarray, mask: np.ndarray, past=None, want_present: bool = False, positions=None,
                 targets=None):
        """One pass, counted, on this thread (see :meth:`_call`)."""
        self._count(ids, mask)
        return self._call(ids, mask, past, want_present, positions, targets)

    def _count(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """A pass and its real tokens (``mask [B, P+S]`` marks each row's real tokens), counted where it is made."""
        self.forward_passes += 1
        self.tokens_run += int(mask[:, mask.shape[1] - ids.shape[1]:].sum())

    def _call(self, ids: np.ndarray, mask: np.ndarray, past=None, want_present: bool = False, positions=None,
              targets=None):
        """The runner's pass (thread-safe on the host: it may run on a :class:`PassPool` worker).

        The model is fed an all-ones mask instead of ``mask``. GroupQueryAttention takes each row's past
        length from its mask sum (CUDA: ``seqlens_k + 1 - S``; it has no padding inside the new
        tokens), so a right-padded row on a shared past would get its KV and positions moved.
        Counted as real, a row's padding sits after all its real tokens, the causal mask keeps it
        from them, and nothing at a padded position is ever read.
        """
        fed = np.ones_like(mask)
        if targets is not None:  # derived graph that scores on the device: (logprobs, greedy) [B,K,M]
            return self.runner.score(ids, fed, past, positions, targets)
        if positions is None:
            return self.runner.forward(ids, fed, past, want_present)
        return self.runner.forward(ids, fed, past, want_present, positions)

    def _pass(self, ids, mask, batch: list[Group], lengths: list[int], done: ScoreSink, past=None):
        """One pass over ``batch`` (row b: ``batch[b]``, ``lengths[b]`` real tokens), counted here, as
        ``(run, report)`` for :class:`PassPool`: ``run()`` computes it, ``report(out)`` gives each member's score
        to ``done``.

        With a derived graph only the last K positions of each row are computed (K: the batch's
        longest continuation) and, where the graph scores, only the targets' log-probabilities
        and argmax flags come back, not logits; otherwise all S rows of logits, scored on the host.
        """
        self._count(ids, mask)
        if not getattr(self.runner, "gathers_positions", False):
            return (lambda: self._call(ids, mask, past)[0],
                    lambda logits: [done.group(logits[b], g, lengths[b]) for b, g in enumerate(batch)])
        k, positions = last_positions(batch, lengths)
        if getattr(self.runner, "scores_in_graph", False):
            targets = done.targets(batch, k)
            return (lambda: self._call(ids, mask, past, positions=positions, targets=targets),
                    lambda out: [done.scores(out[0][b], out[1][b], g, k) for b, g in enumerate(batch)])
        return (lambda: self._call(ids, mask, past, positions=positions)[0],
                lambda logits: [done.group(logits[b], g, k) for b, g in enumerate(batch)])

