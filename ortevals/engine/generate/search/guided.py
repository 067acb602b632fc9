"""Verifier-guided step-level search: PRM beam search, DVTS and particle filtering.

Owns the three searches over a :class:`~ortevals.engine.generate.search.steps.RowModel` guided by a
:class:`~ortevals.engine.generate.search.steps.StepScorer` (a PRM; its step scores folded by ``aggregation``).
Every choice reaches the decoder as a ``parents`` array (``StepRows.fork``), so the engine forks
rows by copying KV, never re-running the prompt. Each iteration extends rows by one step
(engine/generate/search/steps.py); the last of ``max_steps`` iterations runs to an EOS or a cap.

- :func:`prm_beam_search` (huggingface/search-and-learn ``_beam_search``): ``n`` rows sample one
  step each; every row is scored; finished ones (EOS, the token cap, the last iteration) join the
  completed list; of the others the ``n / width`` best are kept (``np.argsort(scores)[-keep:]``
  as there: a tie goes to the later row; kept rows stay in row order) and repeated round-robin to
  ``n`` rows. The answer: the first ``n`` completed (or the best ``n`` with ``sort_completed``),
  repeated round-robin to ``n`` when fewer, and the first of the highest score among them.
- :func:`dvts` (search-and-learn ``_dvts``): ``n / width`` independent subtrees; each expands its
  current solution by ``width`` sampled steps and keeps the first best-scored one; a subtree stops
  when that one finishes. The ``n`` candidates: each subtree's last ``width`` expansions.
- :func:`particle_filter` (Puri et al. 2025, Algorithm 1, as its authors' its_hub
  ``ParticleFiltering`` runs it): ``n`` particles; each iteration every unfinished particle takes
  one step and is scored; log-weight ``logit(score)`` (``reward="raw"``: the score itself), a
  finished particle keeps its own; ``n`` indices are drawn from softmax(log-weights /
  ``temperature``) with ``rng.choice`` (multinomial resampling) and the particles become those
  copies, in draw order. The answer: the first particle of largest log-weight, or by
  :func:`weighted_vote` over the final weights.

Differences from search-and-learn, on purpose: steps end on token ids (a step ends with the token
that completes the separator; no re-tokenisation of text), a step that reaches
``max_step_tokens`` ends there without ending its solution (search-and-learn has one cap per call
and ends the beam), no lookahead, no duplicate filtering, no task-specific stop (``boxed{``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.engine.generate.choice.logits import softmax
from ortevals.engine.generate.search.steps import (
    AGGREGATIONS,
    RowModel,
    Step,
    StepRows,
    StepRules,
    StepScorer,
    TokenChooser,
    aggregate,
)

REWARDS = ("logit", "raw")
LOGIT_CLIP = 1e-7  # its_hub's clip: a score of exactly 0 or 1 stays finite


@dataclass(frozen=True)
class SearchSettings:
    n: int = 4  # beams (beam search), candidates (DVTS), particles
    width: int = 4  # beam width M: n / M beams kept (beam search), n / M subtrees (DVTS)
    max_steps: int = 40  # iterations; the last runs to EOS
    aggregation: str = "last"  # of a solution's PRM step scores: last | min | prod
    sort_completed: bool = False  # beam search: the best n completed rather than the first n
    temperature: float = 1.0  # particle filtering: softmax(log-weight / temperature)
    reward: str = "logit"  # particle filtering: log-weight = logit(score) | the score itself

    def check(self, method: str) -> None:
        """A ValueError naming the setting that cannot work."""
        if self.n < 1 or self.max_steps < 1:
            raise ValueError(f"{method}: n and max_steps must be at least 1 (got {self.n}, {self.max_steps})")
        if method != "particle_filter" and (self.width < 1 or self.n % self.width):
            raise ValueError(f"{method}: n ({self.n}) must be a multiple of the beam width ({self.width})")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r}: expected one of {', '.join(AGGREGATIONS)}")
        if self.reward not in REWARDS or not self.temperature > 0:
            raise ValueError(f"particle filtering: reward in {REWARDS} and temperature > 0 "
                             f"(got {self.reward!r}, {self.temperature})")


@dataclass(frozen=True)
class Solution:
    steps: tuple[Step, ...]
    scores: tuple[float, ...]  # [len(steps)] the PRM's step scores at its last scoring
    score: float  # their aggregate

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for s in self.steps for t in s.tokens)

    @property
    def logprob(self) -> float:
        return float(sum(s.logprob for s in self.steps))

    @property
    def finished(self) -> bool:
        return bool(self.steps) and self.steps[-1].finishes


@dataclass(frozen=True)
class SearchOutcome:
    solutions: tuple[Solution, ...]  # [n]
    best: int  # index of the answer in solutions
    weights: tuple[float, ...] | None  # particle filtering: [n] final normalised weights
    generated_tokens: int  # decoded in any row, pruned ones included
    passes: int  # model calls after the prompt
    scored: int  # partial solutions the PRM scored
    scored_tokens: int  # their generated tokens (the PRM's work if it shared nothing between calls)


class _Judge:
    """The PRM on partial solutions: (step scores, aggregate) each; counts its work."""

    def __init__(self, scorer: StepScorer, prompt: Sequence[int], how: str) -> None:
        self.scorer, self.prompt, self.how = scorer, list(prompt), how
        self.scored = self.tokens = 0

    def __call__(self, partials: Sequence[tuple[Step, ...]]) -> list[tuple[tuple[float, ...], float]]:
        raw = self.scorer.score(self.prompt, [[list(s.tokens) for s in p] for p in partials])
        if len(raw) != len(partials) or any(len(r) != len(p) for r, p in zip(raw, partials, strict=True)):
            raise ValueError(f"the PRM returned {[len(r) for r in raw]} step scores for solutions of "
                             f"{[len(p) for p in partials]} steps")
        self.scored += len(partials)
        self.tokens += sum(len(s.tokens) for p in partials for s in p)
        return [(tuple(float(x) for x in r), aggregate(r, self.how)) for r in raw]


def _keep_top(scores: Sequence[float], keep: int) -> list[int]:
    """Indices of the ``keep`` highest scores, ascending (a tie goes to the later index, as
    ``np.argsort(scores)[-keep:]`` in search-and-learn)."""
    return sorted(int(i) for i in np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")[-keep:])


def _round_robin(items: list, n: int) -> list:
    return (items * (n // len(items) + 1))[:n]


def _outcome(solutions, best, weights, rows: StepRows, judge: _Judge) -> SearchOutcome:
    return SearchOutcome(tuple(solutions), int(best), weights, rows.generated, rows.passes, judge.scored,
                         judge.tokens)


def prm_beam_search(model: RowModel, prompt: Sequence[int], scorer: StepScorer, rules: StepRules,
                    chooser: TokenChooser, s: SearchSettings) -> SearchOutcome:
    """Step-level beam search guided by a PRM (see the module docstring)."""
    s.check("beam search")
    rows = StepRows(model, prompt, s.n, rules, chooser)
    judge = _Judge(scorer, prompt, s.aggregation)
    beams: list[tuple[Step, ...]] = [()] * s.n
    completed: list[Solution] = []
    for it in range(s.max_steps):
        beams = [b + (st,) for b, st in zip(beams, rows.extend(final=it == s.max_steps - 1), strict=True)]
        judged = judge(beams)
        completed += [Solution(b, *j) for b, j in zip(beams, judged, strict=True) if b[-1].finishes]
        live = [i for i, b in enumerate(beams) if not b[-1].finishes]
        if not live:
            break
        kept = [live[j] for j in _keep_top([judged[i][1] for i in live], s.n // s.width)]
        parents = _round_robin(kept, s.n)
        rows.fork(parents)
        beams = [beams[p] for p in parents]
    if s.sort_completed:
        completed = sorted(completed, key=lambda c: -c.score)  # stable: the earlier of equal scores first
    final = _round_robin(completed[:s.n], s.n)
    return _outcome(final, np.argmax([c.score for c in final]), None, rows, judge)


def dvts(model: RowModel, prompt: Sequence[int], scorer: StepScorer, rules: StepRules,
         chooser: TokenChooser, s: SearchSettings) -> SearchOutcome:
    """Diverse verifier tree search: n / width greedy subtrees of width ``width``."""
    s.check("dvts")
    m, trees = s.width, s.n // s.width
    rows = StepRows(model, prompt, s.n, rules, chooser)
    judge = _Judge(scorer, prompt, s.aggregation)
    base: list[tuple[Step, ...]] = [()] * trees  # each subtree's chosen solution so far
    last: list[list[Solution]] = [[] for _ in range(trees)]  # its last width expansions
    alive = list(range(trees))  # subtrees still running; subtree alive[j] owns rows j*m .. j*m+m-1
    for it in range(s.max_steps):
        new = rows.extend(final=it == s.max_steps - 1)
        cands = [base[t] + (new[j * m + i],) for j, t in enumerate(alive) for i in range(m)]
        judged = judge(cands)
        parents, still = [], []
        for j, t in enumerate(alive):
            last[t] = [Solution(cands[j * m + i], *judged[j * m + i]) for i in range(m)]
            pick = int(np.argmax([c.score for c in last[t]]))
            base[t] = last[t][pick].steps
            if not last[t][pick].finished:
                still.append(t)
                parents += [j * m + pick] * m
        alive = still
        if not alive:
            break
        rows.fork(parents)
    final = [c for group in last for c in group]
    return _outcome(final, np.argmax([c.score for c in final]), None, rows, judge)


def log_weight(score: float, reward: str) -> float:
    """A particle's log-weight from its aggregated PRM score: logit (scores in [0, 1]) or as is."""
    if reward == "raw":
        return float(score)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"particle filtering with reward='logit' needs PRM scores in [0, 1]; got {score}")
    x = min(max(score, LOGIT_CLIP), 1.0 - LOGIT_CLIP)
    return float(np.log(x / (1.0 - x)))


def _resample(rng: np.random.Generator, probs: np.ndarray, n: int) -> np.ndarray:
    """Multinomial resampling: ``n`` particle indices drawn with probabilities ``probs [n]``."""
    return rng.choice(len(probs), size=n, p=probs)


def particle_filter(model: RowModel, prompt: Sequence[int], scorer: StepScorer, rules: StepRules,
                    chooser: TokenChooser, s: SearchSettings, rng: np.random.Generator) -> SearchOutcome:
    """Particle filtering (Puri et al. 2025); ``rng`` draws the resampling indices only."""
    s.check("particle_filter")
    rows = StepRows(model, prompt, s.n, rules, chooser)
    judge = _Judge(scorer, prompt, s.aggregation)
    parts: list[Solution] = [Solution((), (), 0.0)] * s.n
    row_of = list(range(s.n))  # particle → its row, -1 once finished; running particles hold rows in order
    for it in range(s.max_steps):
        new = rows.extend(final=it == s.max_steps - 1)
        running = [i for i in range(s.n) if row_of[i] >= 0]
        grown = [parts[i].steps + (new[row_of[i]],) for i in running]
        for i, steps, judged in zip(running, grown, judge(grown), strict=True):
            parts[i] = Solution(steps, *judged)
        logw = np.array([log_weight(p.score, s.reward) for p in parts])
        probs = softmax(logw / s.temperature)
        drawn = _resample(rng, probs, s.n)
        parents = [row_of[j] for j in drawn if not parts[j].finished]
        parts = [parts[j] for j in drawn]
        row_of, r = [], 0
        for p in parts:
            row_of.append(-1 if p.finished else r)
            r += not p.finished
        if not parents:
            break
        rows.fork(parents)
    logw = np.array([log_weight(p.score, s.reward) for p in parts])
    probs = softmax(logw / s.temperature)
    return _outcome(parts, np.argmax(logw), tuple(float(x) for x in probs), rows, judge)


def weighted_vote(answers: Sequence[Hashable | None], weights: Sequence[float]) -> int | None:
    """Index of the first sample of the answer whose samples' weights sum highest (a tie goes to the
    answer seen first; None answers do not vote); None when nothing votes."""
    sums: dict[Hashable, float] = {}
    first: dict[Hashable, int] = {}
    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        if a is not None:
            sums[a] = sums.get(a, 0.0) + float(w)
            first.setdefault(a, i)
    if not sums:
        return None
    return first[max(sums, key=sums.__getitem__)]  # max keeps the first of equal keys (insertion order)
