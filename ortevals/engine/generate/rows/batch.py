"""Token choice for the rows of a decode batch, one step at a time: what each row has drawn so far.

Owns :class:`Sample` (a finished row), :class:`Rows` (the rows of one prompt, ready to decode) and the
step state of a batch of one or more prompts' rows (each row's text stream, summed log-prob and
self-certainty; each prompt's own sampler over its slice of the step's logits), used by
engine/generate/rows/sampler.py's decode loop. Pure numpy and the tokenizer; no onnxruntime.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.choice.certainty import RunningCertainty, row_logsumexp
from ortevals.engine.generate.choice.logits import Sampler, Workspace, check_logits
from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.choice.stops import TextStream


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
    certainty: float = float("nan")  # self-certainty (engine/generate/choice/certainty.py) of the tokens it chose

    @property
    def scored(self) -> int:
        """Tokens in ``logprob``: the generated ones and the ending EOS (best-of-k normalises by it)."""
        return self.tokens + self.eos


def token_logprob(logits: np.ndarray, tokens: np.ndarray, lse: np.ndarray | None = None) -> np.ndarray:
    """log softmax(logits)[row, tokens[row]] in float64; logits ``[R,V]``, tokens ``[R]`` → ``[R]``; ``lse [R]``
    the rows' log-sum-exp (engine/generate/choice/certainty.py's ``row_logsumexp``) when already computed."""
    x = np.asarray(logits, dtype=np.float64)
    if lse is None:
        lse = row_logsumexp(x)
    return x[np.arange(len(tokens)), tokens] - lse


@dataclass(frozen=True)
class Rows:
    """The rows of one prompt, ready to decode: ``logits [V]`` after the prompt, ``past`` its one-row KV, one
    generator and one name a row, ``prompt`` its ids (the repetition penalties look at them), ``members`` the
    requests the rows answer."""

    logits: np.ndarray
    past: object
    settings: GenSettings
    rngs: tuple
    names: tuple
    prompt: tuple = ()
    members: tuple = ()

    @classmethod
    def of(cls, job, logits, past, rng, name) -> Rows:  # job: engine/generate/rows/sampler.Job
        return cls(logits, past, job.settings, tuple(rng(i) for i in job.members),
                   tuple(name(i) for i in job.members), job.prompt, job.members)


class _Group:
    """One prompt's rows in a batch: each row's stream, summed log-prob and self-certainty, its own
    :class:`~ortevals.engine.generate.choice.logits.Sampler` (settings, the rows' generators), the rows still live."""

    def __init__(self, rows: Rows, tokenizer, eos_ids, work: Workspace) -> None:
        self.rows = rows
        n = len(rows.rngs)
        self.streams = [TextStream(tokenizer, rows.settings, eos_ids) for _ in range(n)]
        self.chooser = Sampler(rows.settings, rows.rngs, work)  # each generator consumed by its own row only
        self.logprob = np.zeros(n)
        self.certainty = RunningCertainty(n)  # on the raw logits, before the processors: the model's own
        self.live = list(range(n))
        s = rows.settings
        self.needs_history = s.repetition_penalty != 1.0 or s.no_repeat_ngram_size > 0

    def step(self, logits: np.ndarray, rows: list[int], work: Workspace) -> tuple[np.ndarray, np.ndarray]:
        """(tokens ``[n]``, their log-probs ``[n]``) for live rows ``rows`` (``n`` of this group's) from their float32
        logits ``[n, V]``; adds the rows' self-certainty terms. Row by row: the same numbers for any ``rows``."""
        top = np.max(logits, axis=1)  # [n]: the rows' largest logits (the log-sum-exp's shift below)
        for k in np.flatnonzero(~np.isfinite(top)):  # a row that saw NaN or inf: one line naming it and the step
            check_logits(logits[k], len(self.streams[rows[k]].out) + 1, self.rows.names[rows[k]])
        wide = work.float64("wide", logits)  # one float64 copy, one log-sum-exp for all three
        histories = [[*self.rows.prompt, *self.streams[r].out] for r in rows] if self.needs_history else \
            [()] * len(rows)
        tokens = self.chooser.choose(wide, histories, rows)
        lse = row_logsumexp(wide, out=work.take("exp", wide.shape), top=top.astype(np.float64))
        self.certainty.add(wide, rows, lse)
        return tokens, token_logprob(wide, tokens, lse)

    def samples(self) -> list[Sample]:
        return [Sample(*s.result, float(lp), tuple(s.out), s.eos, float(c))
                for s, lp, c in zip(self.streams, self.logprob, self.certainty.values(), strict=True)]


class RowSteps:
    """Token choice for the live rows of a batch of one or more prompts (:class:`Rows` each, a group of rows in
    batch order: groups join at the end, :meth:`add`, and leave when their last row ends), one step at a time.
    Each group chooses over its own slice of the step's logits with its own settings and generators, so a row's
    tokens do not depend on the rows beside it."""

    def __init__(self, tokenizer, eos_ids, threads: int = 1) -> None:
        self.tokenizer, self.eos_ids, self.threads = tokenizer, eos_ids, threads
        self.work = Workspace()  # the steps' [rows, V] float64 arrays, kept (a new one each step costs page faults)
        self.groups: list[_Group] = []
        self.generated = 0

    @property
    def live(self) -> int:
        """Rows still running."""
        return sum(len(g.live) for g in self.groups)

    def add(self, rows: Rows) -> None:
        """A new group after the others; its rows' first tokens come from ``rows.logits`` at the next step."""
        self.groups.append(_Group(rows, self.tokenizer, self.eos_ids, self.work))

    def take(self, step_logits: np.ndarray) -> tuple[list[int], np.ndarray, list[tuple[Rows, list[Sample]]]]:
        """One token for each live row from ``step_logits [live, V]`` (batch order) → (batch indices of the rows
        that go on, in their new batch order (:func:`placed`: groups in order, each row before its old index or at
        it), the tokens ``[live]``, ``(rows, samples)`` of each group whose last row ended)."""
        spans = np.cumsum([0] + [len(g.live) for g in self.groups])
        tokens, chosen = self._choose(step_logits, spans)
        keep, done = [], []
        for g, a in zip(self.groups, spans, strict=False):
            still = []
            for k, r in enumerate(g.live):
                g.logprob[r] += chosen[a + k]  # the EOS that ends a row too: best-of-k scores the whole sequence
                if g.streams[r].push(int(tokens[a + k])):
                    self.generated += len(g.streams[r].out)
                else:
                    still.append((a + k, r))
            still = placed(still, len(keep))
            keep += [src for src, _ in still]
            g.live = [r for _, r in still]
            if not still:
                done.append((g.rows, g.samples()))
        self.groups = [g for g in self.groups if g.live]
        return keep, tokens, done

    def _choose(self, step_logits: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens ``[live]``, their log-probs ``[live]``): the live rows cut into up to ``threads`` pieces of
        consecutive rows (a group's rows may fall in two), each chosen on its own thread (numpy lets go of the
        GIL in its array loops; onnxruntime's threads are idle between passes). Every row's numbers are its own,
        so they do not depend on the cut."""
        live = int(spans[-1])
        cuts = np.linspace(0, live, max(1, min(self.threads, live // PIECE_ROWS)) + 1).astype(int)

        def piece(lo: int, hi: int) -> list[tuple[np.ndarray, np.ndarray]]:  # batch rows lo..hi-1, group by group
            out = []
            for g, a, b in zip(self.groups, spans, spans[1:], strict=False):
                s, e = max(a, lo), min(b, hi)  # the group's rows in this piece
                if s < e:
                    out.append(g.step(step_logits[s:e], g.live[s - a:e - a], self.work))
            return out

        pool = _pool(len(cuts) - 2, os.getpid()) if len(cuts) > 2 else None
        jobs = [pool.submit(piece, lo, hi) for lo, hi in zip(cuts[1:-1], cuts[2:])] if pool else []
        parts = piece(cuts[0], cuts[1]) + [x for job in jobs for x in job.result()]
        return np.concatenate([t for t, _ in parts]), np.concatenate([c for _, c in parts])


# rows a piece has at least: 8 rows' choice takes ~3 ms on a 49k vocabulary (2-core machine), a hop to another
# thread and back ~20 us
PIECE_ROWS = 8


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """Threads beside the caller's for token choice, kept for the process (idle ones cost nothing); by ``pid``
    because a forked child has none of its parent's threads."""
    return ThreadPoolExecutor(workers, thread_name_prefix="ortevals-choice")


def placed(kept: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """A group's rows that go on, ``(batch index, row)`` ascending, in the order they take batch slots ``start,
    start + 1, ...``: a row already at one of those slots stays there, the others fill the rest in order. When
    one row ends, its group's last row takes its slot and each later group's last row moves to its first (one
    row a group moves, not every row after it: the rows' KV moves with them). Every other row's index is past the
    group's slots (rows only leave before it), so a row moves only to a slot before its own index."""
    ours = {src - start: (src, r) for src, r in kept if start <= src < start + len(kept)}
    others = iter([x for x in kept if not start <= x[0] < start + len(kept)])
    return [ours[i] if i in ours else next(others) for i in range(len(kept))]
