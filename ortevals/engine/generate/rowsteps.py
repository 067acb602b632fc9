"""Token choice for the rows of a decode batch, one step at a time: what each row has drawn so far.

Owns :class:`Sample` (a finished row), :class:`Rows` (the rows of one prompt, ready to decode) and the
step state of a batch of one or more prompts' rows (each row's text stream, summed log-prob and
self-certainty; each prompt's own sampler over its slice of the step's logits), used by
engine/generate/sampler.py's decode loop. Pure numpy and the tokenizer; no onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.certainty import RunningCertainty, row_logsumexp
from ortevals.engine.generate.generation import check_logits
from ortevals.engine.generate.settings import GenSettings
from ortevals.engine.generate.stops import TextStream


@dataclass(frozen=True)
class Sample:
    """One finished row: text cut at the first stop, tokens generated, the summed model log-prob of the
    whole sequence (the generated tokens and the EOS that ended it, if one did), the token ids (EOS
    excluded), and whether an EOS ended it."""

    text: str
    tokens: int
    logprob: float
    ids: tuple[int, ...] = ()
    eos: bool = False
    certainty: float = float("nan")  # self-certainty (engine/generate/certainty.py) of the tokens it chose

    @property
    def scored(self) -> int:
        """Tokens in ``logprob``: the generated ones and the ending EOS (best-of-k normalises by it)."""
        return self.tokens + self.eos


def token_logprob(logits: np.ndarray, tokens: np.ndarray, lse: np.ndarray | None = None) -> np.ndarray:
    """log softmax(logits)[row, tokens[row]] in float64; logits ``[R,V]``, tokens ``[R]`` → ``[R]``; ``lse [R]``
    the rows' log-sum-exp (engine/generate/certainty.py's ``row_logsumexp``) when already computed."""
    x = np.asarray(logits, dtype=np.float64)
    if lse is None:
        lse = row_logsumexp(x)
    return x[np.arange(len(tokens)), tokens] - lse



@dataclass(frozen=True)
class Rows:
    """The rows of one prompt, ready to decode: ``logits [V]`` after the prompt, ``past`` its one-row KV, one
    generator and one name a row, ``prompt`` its ids (the repetition penalties look at them)."""

    logits: np.ndarray
    past: object
    settings: GenSettings
    rngs: tuple
    names: tuple
    prompt: tuple = ()

    @classmethod
    def of(cls, job, logits, past, rng, name) -> Rows:  # job: engine/generate/sampler.Job
        return cls(logits, past, job.settings, tuple(rng(i) for i in job.members),
                   tuple(name(i) for i in job.members), job.prompt)


class _Steps:
    """Token choice for the live rows of one or more groups, one decode step at a time: each row's stream,
    summed log-prob and self-certainty; each group's own :class:`~ortevals.engine.generate.sampling.Sampler`
    (its settings, its rows' generators), over that group's slice of the step's logits."""

    def __init__(self, tokenizer, eos_ids, groups: Sequence[Rows]) -> None:
        from ortevals.engine.generate.sampling import Sampler, Workspace

        self.groups = list(groups)
        self.first = np.cumsum([0] + [len(g.rngs) for g in groups])  # each group's first row
        self.streams = [TextStream(tokenizer, g.settings, eos_ids) for g in groups for _ in g.rngs]
        self.names = [n for g in groups for n in g.names]
        self.work = Workspace()  # the steps' [rows, V] float64 arrays, kept (a new one each step costs page faults)
        # per-row generators (and Mirostat state), each consumed by its own row only
        self.choosers = [Sampler(g.settings, g.rngs, self.work) for g in groups]
        rows = int(self.first[-1])
        self.logprob = np.zeros(rows)
        self.certainty = RunningCertainty(rows)  # on the raw logits, before the processors: the model's own
        self.live = list(range(rows))  # rows still running, in batch order (a group's rows together)

    def take(self, step_logits: np.ndarray) -> tuple[list[int], np.ndarray]:
        """One token for each live row from ``step_logits [live, V]`` → (batch indices of the rows that go on,
        the tokens ``[live]``); the rows left are the live ones from then on."""
        top = np.max(step_logits, axis=1)
        for b in np.flatnonzero(~np.isfinite(top)):
            r = self.live[b]
            check_logits(step_logits[b], len(self.streams[r].out) + 1, self.names[r])
        wide = self.work.float64("wide", step_logits)  # one float64 copy, one log-sum-exp for all three
        tokens = np.empty(len(self.live), dtype=np.int64)
        group = np.searchsorted(self.first, self.live, side="right") - 1
        for g, rows in enumerate(self.groups):
            at = np.flatnonzero(group == g)
            if at.size:
                tokens[at] = self._choose(g, rows, wide[at[0]:at[-1] + 1], at)
        lse = row_logsumexp(wide, out=self.work.take("exp", wide.shape))
        chosen = token_logprob(wide, tokens, lse)
        self.certainty.add(wide, self.live, lse)
        keep = []
        for b, r in enumerate(self.live):
            self.logprob[r] += chosen[b]  # the EOS that ends a row too: best-of-k scores the whole sequence
            if not self.streams[r].push(int(tokens[b])):
                keep.append(b)
        self.live = [self.live[b] for b in keep]
        return keep, tokens

    def _choose(self, g: int, rows: Rows, logits: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Group ``g``'s tokens from its rows' logits (batch positions ``at``, contiguous)."""
        s, first = rows.settings, int(self.first[g])
        local = [self.live[b] - first for b in at]
        needs_history = s.repetition_penalty != 1.0 or s.no_repeat_ngram_size > 0
        histories = [[*rows.prompt, *self.streams[first + r].out] for r in local] if needs_history else \
            [()] * len(local)
        return self.choosers[g].choose(logits, histories, local)

    def samples(self) -> list[list[Sample]]:
        """Each group's samples, in its rows' order."""
        done = [Sample(*s.result, float(lp), tuple(s.out), s.eos, float(c))
                for s, lp, c in zip(self.streams, self.logprob, self.certainty.values(), strict=True)]
        return [done[self.first[g]:self.first[g + 1]] for g in range(len(self.groups))]
