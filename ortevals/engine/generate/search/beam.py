"""Beam search and diverse beam search over a step model (pure numpy; the model is a protocol).

Owns the search, not the model: :class:`StepModel` is what a runtime implements (the
raw-onnxruntime engine replicates the prompt's KV to ``rows`` and reorders it by ``parents``).

- Beam search (``num_beams``, ``length_penalty``, ``early_stopping``) follows transformers'
  ``GenerationMixin._beam_search`` (5.x) step for step: per step the top ``max(2, 1 + n_eos) *
  num_beams`` continuations by summed log-prob; a continuation that ends (EOS, a stop, or
  ``max_gen_toks``) among the first ``num_beams`` joins the finished list with score
  ``sum_logprob / generated_len ** length_penalty`` (the list keeps the best ``num_beams``);
  the best unfinished ``num_beams`` run on; the search ends when every continuation ends, when
  ``early_stopping=True`` and the list is full, or when the best running beam can no longer beat
  the worst finished one (transformers' heuristic, with ``early_stopping="never"`` and a positive
  length penalty measured at ``max_gen_toks``). tests/test_search.py checks token equality with
  ``generate(num_beams=4)``.
- Diverse beam search (``num_beam_groups`` G, ``diversity_penalty`` λ; Vijayakumar et al. 2018):
  the beams split into G groups of ``num_beams / G``; at each step group g runs the beam step
  above on log-probs minus λ times the number of times each token was chosen at this step by
  groups 0..g-1 (Hamming diversity, as transformers' HammingDiversityLogitsProcessor did; the
  penalised scores accumulate, as there). The answer is the best finished hypothesis of any group.
  Done groups stop contributing to the diversity counts.

The penalties of :mod:`ortevals.engine.generate.choice.logits` (repetition, no-repeat n-gram) apply to the
log-probs, as transformers applies its processors in beam search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ortevals.engine.generate.choice.logits import penalised
from ortevals.engine.score.scoring import log_softmax

if TYPE_CHECKING:
    from ortevals.engine.generate.choice.settings import GenSettings

BIG = 1.0e9  # transformers' "very large negative" for beams that must not be chosen


class StepModel(Protocol):
    """One prompt decoded on ``rows`` rows that share its KV."""

    def start(self, prompt: Sequence[int], rows: int) -> np.ndarray:
        """Logits ``[rows, V]`` after the prompt; its KV replicated to ``rows``."""

    def step(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """Reorder the KV rows by ``parents [rows]`` (row i continues row parents[i]), append
        ``tokens [rows]``; logits ``[rows, V]``."""


@dataclass(frozen=True)
class Hypothesis:
    """One finished sequence."""

    tokens: tuple[int, ...]  # generated ids, the EOS that ended it included (as transformers returns them)
    score: float  # summed (penalised) log-prob / len(tokens) ** length_penalty
    logprob: float  # summed log-prob of the tokens under the model (after repetition penalties)
    group: int = 0


@dataclass(frozen=True)
class SearchResult:
    best: Hypothesis
    nbest: tuple[Hypothesis, ...]  # best first: num_beams of them (per group, all groups merged)
    steps: int  # forward steps after the prompt


@dataclass
class _Group:
    """The state of one group of ``width`` beams (plain beam search: one group)."""

    width: int
    index: int
    seqs: list[tuple[int, ...]] = field(default_factory=list)
    scores: np.ndarray = None  # [width] running summed scores
    logprobs: np.ndarray = None  # [width] running summed log-probs (no diversity penalty)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self) -> None:
        self.seqs = [()] * self.width
        self.scores = np.full(self.width, -BIG)
        self.scores[0] = 0.0  # only the first beam expands at step 1: no duplicate beams
        self.logprobs = np.zeros(self.width)


def _ends(seq: tuple[int, ...], eos: set[int], max_new: int, is_stop) -> bool:
    return seq[-1] in eos or len(seq) >= max_new or (is_stop is not None and is_stop(seq))


def _group_step(g: _Group, scores: np.ndarray, raw: np.ndarray, s: GenSettings, eos: set[int],
                is_stop) -> tuple[np.ndarray, np.ndarray]:
    """One beam step of group g. ``scores [width, V]``: this step's (penalised) log-probs;
    ``raw [width, V]``: the same without the diversity penalty. Returns (tokens, parents) ``[width]``."""
    vocab = scores.shape[-1]
    flat = (scores + g.scores[:, None]).reshape(-1)
    keep = max(2, 1 + len(eos)) * g.width
    top = np.argsort(-flat, kind="stable")[:keep]
    parent, token, acc = top // vocab, top % vocab, flat[top]
    acc_lp = g.logprobs[parent] + raw[parent, token]
    cands = [(*g.seqs[p], int(t)) for p, t in zip(parent, token, strict=True)]
    hits = np.array([_ends(c, eos, s.max_gen_toks, is_stop) for c in cands])
    gen_len = len(cands[0])
    if g.improvable and not (len(g.finished) == g.width and s.early_stopping is True):
        new = [Hypothesis(cands[i], float(acc[i] / gen_len ** s.length_penalty), float(acc_lp[i]), g.index)
               for i in range(g.width) if hits[i]]
        merged = sorted([*g.finished, *new], key=lambda h: -h.score)  # stable: earlier entries win ties
        g.finished = merged[:g.width]
    running = acc - hits * BIG
    nxt = np.argsort(-running, kind="stable")[:g.width]
    g.seqs = [cands[i] for i in nxt]
    g.scores, g.logprobs = running[nxt], acc_lp[nxt]
    length = s.max_gen_toks if (s.early_stopping == "never" and s.length_penalty > 0) else gen_len
    best_running = g.scores[0] / length ** s.length_penalty
    worst = min(h.score for h in g.finished) if len(g.finished) == g.width else -BIG
    g.improvable = g.improvable and bool(best_running > worst)
    full = len(g.finished) == g.width and s.early_stopping is True
    g.done = (not g.improvable) or full or bool(hits.all())
    return token[nxt].astype(np.int64), parent[nxt].astype(np.int64)


def beam_search(model: StepModel, prompt: Sequence[int], s: GenSettings, eos_ids: set[int] | Sequence[int],
                is_stop: Callable[[tuple[int, ...]], bool] | None = None) -> SearchResult:
    """Beam search (``s.num_beam_groups == 1``) or diverse beam search on ``model``.

    eos_ids: tokens that end a hypothesis. is_stop(generated ids) -> True where a stop sequence
    has appeared (the hypothesis ends there, the text is cut later by the caller)."""
    eos = {int(e) for e in eos_ids}
    groups_n = s.num_beam_groups
    width = s.num_beams // groups_n
    groups = [_Group(width, i) for i in range(groups_n)]
    prompt = list(prompt)
    logits = model.start(prompt, s.num_beams)
    steps = 0
    while True:
        raw = log_softmax(logits, np.float64)
        raw = penalised(raw, s, [prompt + list(seq) for g in groups for seq in g.seqs])
        tokens = np.empty(s.num_beams, dtype=np.int64)
        parents = np.empty(s.num_beams, dtype=np.int64)
        chosen: list[int] = []  # tokens chosen at this step by the groups before
        for g in groups:
            rows = slice(g.index * width, (g.index + 1) * width)
            if g.done:  # keeps its rows alive, contributes nothing
                tokens[rows], parents[rows] = min(eos) if eos else 0, np.arange(rows.start, rows.stop)
                continue
            scores = raw[rows]
            if s.diversity_penalty > 0 and chosen:
                scores = scores - s.diversity_penalty * np.bincount(chosen, minlength=scores.shape[-1])[None, :]
            tok, par = _group_step(g, scores, raw[rows], s, eos, is_stop)
            tokens[rows], parents[rows] = tok, par + rows.start
            chosen.extend(int(t) for t in tok)
        if all(g.done for g in groups):
            break
        logits = model.step(tokens, parents)
        steps += 1
    nbest = tuple(sorted((h for g in groups for h in g.finished), key=lambda h: -h.score))
    return SearchResult(nbest[0], nbest, steps)
