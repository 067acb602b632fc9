"""Step-level decoding for search: rows of one prompt, each a partial solution made of steps.

Owns what the step-level searches (engine/generate/search/guided.py) need from a decoder and a verifier,
as protocols, and the decoding of one step on many rows:

- :class:`RowModel`: one prompt on R rows whose KV may differ in length. ``start`` prefills the
  prompt once and replicates its KV over the rows; ``fork(parents)`` makes the new row i a copy of
  row ``parents[i]`` (rows are dropped, duplicated, reordered: the engine copies KV rows in
  place, :func:`fork_moves` orders the copies, and never recomputes the prompt); ``step(tokens,
  rows)`` appends ``tokens[a]`` to row ``rows[a]`` only (the other rows wait: a row that has
  ended its step waits for the others).
- :class:`StepScorer`: a process reward model (PRM): one score per step of each partial solution;
  :func:`aggregate` folds them into one (``last``, ``min``, ``prod``, as huggingface/search-and-learn
  ``aggregate_scores``).
- :class:`TokenChooser`: the draw of the next token of some rows, given each row's history (prompt +
  its tokens). :class:`ProcessorChooser` is the run's: the sampler's own token choice
  (engine/generate/choice/logits.py's ``choose_tokens``: penalties, temperature, top-k, top-p, min-p,
  typical, Mirostat) with one seeded generator for the search; :class:`SampleChooser` plain
  temperature sampling by inverse CDF (the toy references).
- :class:`StepRows`: decodes one step on every row: tokens until the step ends (:class:`StepRules`:
  a separator, ``\\n\\n`` by default through :func:`text_separator`), an EOS, the step's token cap
  or the solution's. A step's last token is fed to the model lazily, at the start of the next step
  and after the fork, so a pruned candidate never costs a pass for it.

Pure numpy; no onnxruntime here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ortevals.engine.generate.choice.logits import choose_tokens
from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.score.scoring import log_softmax

AGGREGATIONS = ("last", "min", "prod")
EOS, LENGTH, SEP, CAP = "eos", "length", "sep", "cap"  # why a step ended (eos, length: the solution too)


class RowModel(Protocol):
    """One prompt decoded on rows that share its KV and may differ in length."""

    def start(self, prompt: Sequence[int], rows: int) -> np.ndarray:
        """Logits ``[rows, V]`` after the prompt; its KV replicated to ``rows`` rows."""

    def fork(self, parents: np.ndarray) -> None:
        """The rows become ``[len(parents)]`` rows, row i a copy of former row ``parents[i]``."""

    def step(self, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Append ``tokens [A]`` to rows ``rows [A]`` (ascending); logits ``[A, V]`` of those rows."""


class StepScorer(Protocol):
    """A process reward model over partial solutions of one prompt (token ids of the decoder)."""

    def score(self, prompt: Sequence[int], solutions: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
        """Per solution (a list of steps, each a token list): one score per step."""


class TokenChooser(Protocol):
    def choose(self, logits: np.ndarray, rows: np.ndarray,
               histories: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """The next token ``[A]`` of rows ``rows [A]`` from their logits ``[A, V]``; ``histories [A]``:
        each row's prompt + tokens so far (for penalties)."""

    def fork(self, parents: np.ndarray) -> None:
        """The rows became ``[len(parents)]`` rows, row i a copy of former row ``parents[i]``."""


@dataclass
class SampleChooser:
    """Temperature sampling: ``u = rng.random(A)``, row a takes the first token whose cumulative
    softmax(logits / temperature) exceeds ``u[a]``; temperature 0: the first largest logit."""

    rng: np.random.Generator
    temperature: float = 1.0

    def choose(self, logits: np.ndarray, rows: np.ndarray,
               histories: Sequence[np.ndarray] | None = None) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float64)
        if self.temperature == 0:
            return np.argmax(x, axis=1)
        cdf = np.cumsum(np.exp(log_softmax(x / self.temperature, np.float64)), axis=1)
        u = self.rng.random(len(x))
        picked = (cdf <= u[:, None]).sum(axis=1)  # first index with cdf > u
        return np.minimum(picked, x.shape[1] - 1)  # u beyond a cdf that rounds below 1

    def fork(self, parents: np.ndarray) -> None:
        """No per-row state."""


@dataclass
class ProcessorChooser:
    """The sampler's token choice for search rows: ``choose_tokens`` (engine/generate/choice/logits.py, the
    code the sampler runs) with the request's settings, penalties over each row's history; the rows'
    draws come from one generator, in row order (rows fork, so no row owns a generator). Mirostat's
    per-row mu (``[R]``, the sampler's initial 2 tau) follows the forks."""

    settings: GenSettings
    rng: np.random.Generator
    mu: np.ndarray | None = None

    def choose(self, logits: np.ndarray, rows: np.ndarray,
               histories: Sequence[np.ndarray] | None = None) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        need = int(rows.max()) + 1 if len(rows) else 0
        if self.mu is None or len(self.mu) < need:
            grown = np.full(need, 2.0 * self.settings.mirostat_tau)
            if self.mu is not None:
                grown[:len(self.mu)] = self.mu
            self.mu = grown
        mu = self.mu[rows]
        hist = histories if histories is not None else [()] * len(rows)
        out = choose_tokens(np.asarray(logits), self.settings, hist, [self.rng] * len(rows), mu)
        self.mu[rows] = mu
        return out

    def fork(self, parents: np.ndarray) -> None:
        if self.mu is not None:
            self.mu = self.mu[np.asarray(parents, dtype=np.int64)]


@dataclass(frozen=True)
class StepRules:
    """Where steps and solutions end. ``ends_step(step tokens so far)``: the separator has appeared."""

    eos: frozenset[int]
    ends_step: Callable[[tuple[int, ...]], bool]
    max_step_tokens: int = 256  # a step that reaches it ends there (the solution goes on)
    max_tokens: int = 2048  # a solution that reaches it is finished


def text_separator(decode: Callable[[list[int]], str], separator: str = "\n\n") -> Callable[[tuple[int, ...]], bool]:
    """``ends_step`` for a text separator: the step's decoded text contains it (a token may carry
    it with other characters, or it may span tokens)."""
    return lambda step: separator in decode(list(step))


@dataclass(frozen=True)
class Step:
    tokens: tuple[int, ...]
    end: str  # sep | cap (the step only) | eos | length (the solution too)
    logprob: float  # summed log-prob of the tokens under the model (temperature 1)

    @property
    def finishes(self) -> bool:
        return self.end in (EOS, LENGTH)


def aggregate(scores: Sequence[float], how: str) -> float:
    """One score from a solution's step scores: the last, the smallest, or their product (of probabilities:
    a step score outside [0, 1] is a one-line error there, as two negative logits would multiply to a
    large positive score)."""
    if not len(scores):
        raise ValueError("a PRM returned no step score")
    if how == "last":
        return float(scores[-1])
    if how == "min":
        return float(min(scores))
    if how == "prod":
        if not all(0.0 <= s <= 1.0 for s in scores):
            raise ValueError(f"prm_aggregation=prod multiplies step scores as probabilities; got "
                             f"{[float(s) for s in scores]}, outside [0, 1]")
        return float(math.prod(scores))
    raise ValueError(f"unknown PRM aggregation {how!r}; expected one of {', '.join(AGGREGATIONS)}")


def fork_moves(parents: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """Row copies ``(src, dst)``, in order, that turn ``rows`` rows into ``len(parents)`` rows in
    place, row i then holding what row ``parents[i]`` held. Slot ``max(rows, len(parents))`` is the
    scratch row a cycle (rows that swap) needs. One copy per row that changes, plus one per cycle."""
    scratch = max(rows, len(parents))
    if any(not 0 <= p < rows for p in parents):
        raise ValueError(f"parents {list(parents)} name rows outside 0..{rows - 1}")
    pending = {d: int(p) for d, p in enumerate(parents) if int(p) != d}
    moves = []
    while pending:
        read = set(pending.values())
        ready = [d for d in pending if d not in read]  # no pending copy still needs its content
        if ready:
            for d in ready:
                moves.append((pending.pop(d), d))
            continue
        d = min(pending)  # only cycles left: park one row, its readers read the scratch instead
        moves.append((d, scratch))
        pending = {dst: (scratch if src == d else src) for dst, src in pending.items()}
    return moves


def token_logprob(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log softmax(logits)[a, tokens[a]] in float64: logits ``[A, V]``, tokens ``[A]`` → ``[A]``."""
    return log_softmax(logits, np.float64)[np.arange(len(tokens)), tokens]


class StepRows:
    """Partial solutions of one prompt on a :class:`RowModel`, extended one step at a time.

    ``logits [R, V]`` are each row's next-token logits once its pending token (the last of its
    previous step) is fed; ``used [R]`` its tokens so far. ``generated`` counts every token decoded
    in any row (pruned ones included: the compute), ``passes`` the model calls after the prompt."""

    def __init__(self, model: RowModel, prompt: Sequence[int], rows: int, rules: StepRules,
                 chooser: TokenChooser) -> None:
        self.model, self.rules, self.chooser = model, rules, chooser
        self.logits = np.array(model.start(list(prompt), rows), dtype=np.float64)
        self.prompt = np.asarray(list(prompt), dtype=np.int64)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # each row's tokens (its history after the prompt)
        self.used = np.zeros(rows, dtype=np.int64)
        self.pending = np.full(rows, -1, dtype=np.int64)  # -1: nothing to feed
        self.done = np.zeros(rows, dtype=bool)  # the row's solution has finished (EOS or its cap)
        self.generated = self.passes = 0

    def __len__(self) -> int:
        return len(self.used)

    def fork(self, parents: Sequence[int]) -> None:
        """Rows ← rows[parents] (``parents [R']``, rows that still run)."""
        parents = np.asarray(parents, dtype=np.int64)
        self.model.fork(parents)
        self.chooser.fork(parents)
        self.tokens = [list(self.tokens[p]) for p in parents]
        self.logits, self.used = self.logits[parents], self.used[parents]
        self.pending, self.done = self.pending[parents], self.done[parents]

    def _feed_pending(self) -> None:
        rows = np.flatnonzero(self.pending >= 0)
        if len(rows):
            self.logits[rows] = self.model.step(self.pending[rows], rows)
            self.passes += 1
            self.pending[rows] = -1

    def _end(self, step: list[int], used: int, final: bool) -> str | None:
        r = self.rules
        if step[-1] in r.eos:
            return EOS
        if used >= r.max_tokens:
            return LENGTH
        if not final and r.ends_step(tuple(step)):
            return SEP
        if len(step) >= r.max_step_tokens:
            return LENGTH if final else CAP
        return None

    def extend(self, final: bool = False) -> list[Step]:
        """One step on every row (``final``: no separator, the step runs to an EOS or a cap).
        Rows whose step has ended wait for the others; returns each row's :class:`Step`."""
        if self.done.any():
            raise ValueError(f"rows {np.flatnonzero(self.done).tolist()} have finished; fork them away first")
        self._feed_pending()
        n = len(self)
        steps: list[list[int]] = [[] for _ in range(n)]
        logprob, ends = np.zeros(n), [""] * n
        live = np.arange(n)
        while len(live):
            histories = [np.concatenate([self.prompt, np.asarray(self.tokens[r], dtype=np.int64)]) for r in live]
            tokens = np.asarray(self.chooser.choose(self.logits[live], live, histories), dtype=np.int64)
            logprob[live] += token_logprob(self.logits[live], tokens)
            self.used[live] += 1
            self.generated += len(live)
            going = []
            for a, r in enumerate(live):
                steps[r].append(int(tokens[a]))
                self.tokens[r].append(int(tokens[a]))
                end = self._end(steps[r], int(self.used[r]), final)
                if end is None:
                    going.append(a)
                else:
                    ends[r] = end
                    self.done[r] = end in (EOS, LENGTH)
                    self.pending[r] = -1 if self.done[r] else tokens[a]
            live, tokens = live[going], tokens[going]
            if len(live):
                self.logits[live] = self.model.step(tokens, live)
                self.passes += 1
        return [Step(tuple(s), e, float(lp)) for s, e, lp in zip(steps, ends, logprob, strict=True)]
