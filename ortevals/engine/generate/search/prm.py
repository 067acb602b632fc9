"""A process reward model (PRM) from an outcome scorer: step scores at a text separator (issue 25).

Owns splitting a solution into steps at a separator (``"\\n\\n"`` by default, search-and-learn's and
OpenR's) and scoring each step as the score of the solution *up to and including* that step, with
the step text kept exactly as generated (so the last step's score is the whole answer's: the
``last`` aggregation equals the outcome score). The scorer is any ``score_texts(context, parts)``
callable (an ORM classifier, P(True) on the package), so one adapter serves ``--verifier self`` and
``--verifier PATH``. :class:`TextPrm` is also engine/generate/search/steps.py's ``StepScorer`` over token
ids (decoded with the policy's tokenizer) for the step-level searches. Pure apart from the callables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ortevals.errors import OrtEvalsError

ScoreTexts = Callable[[str, Sequence[str]], np.ndarray]  # (context, answers [N]) -> scores [N]


def split_steps(text: str, separator: str = "\n\n") -> list[str]:
    """``text`` cut after each ``separator`` (the separator stays with the step before it, so the steps
    joined give ``text`` back); an empty text is one empty step (a solution always has a step)."""
    if not separator:
        raise OrtEvalsError("step_separator must be a non-empty string")
    steps, start = [], 0
    while (at := text.find(separator, start)) >= 0:
        end = at + len(separator)
        steps.append(text[start:end])
        start = end
    if start < len(text) or not steps:
        steps.append(text[start:])
    return steps


class TextPrm:
    """Step scores of solutions of one context: ``score_texts`` on each step's prefix, all prefixes of all
    solutions in one call (the context's KV shared by the scorer where it can)."""

    def __init__(self, score_texts: ScoreTexts, separator: str = "\n\n",
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.score_texts, self.separator, self.decode = score_texts, separator, decode

    def step_scores(self, context: str, answers: Sequence[str]) -> list[list[float]]:
        """Per answer (in order): one score per step."""
        prefixes, owners = [], []
        for i, answer in enumerate(answers):
            done = ""
            for step in split_steps(answer, self.separator):
                done += step
                prefixes.append(done)
                owners.append(i)
        return _by_owner(self.score_texts(context, prefixes), owners, len(answers))

    def score(self, prompt: Sequence[int], solutions: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
        """engine/generate/search/steps.py's ``StepScorer``: per solution (its steps as token ids) one score per step,
        each the score of the decoded solution up to that step."""
        if self.decode is None:
            raise ValueError("TextPrm.score needs the policy's decode")  # a wiring bug, never a user error
        context = self.decode(list(prompt))
        prefixes, owners = [], []
        for i, steps in enumerate(solutions):
            ids: list[int] = []
            for step in steps:
                ids.extend(step)
                prefixes.append(self.decode(ids))
                owners.append(i)
        return _by_owner(self.score_texts(context, prefixes), owners, len(solutions))


def _by_owner(scores, owners: Sequence[int], n: int) -> list[list[float]]:
    """``[P]`` prefix scores and each prefix's owner -> per owner (``n`` of them) its scores in order."""
    out: list[list[float]] = [[] for _ in range(n)]
    for owner, value in zip(owners, np.asarray(scores, dtype=np.float64), strict=True):
        out[owner].append(float(value))
    return out
