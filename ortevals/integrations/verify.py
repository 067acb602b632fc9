"""Verifiers behind one interface (issue 25): ``--verifier self`` and ``--verifier PATH``.

Owns scoring each question's K generated answers after a ``--samples K`` run:

* ``self``: P(True) on the package itself, in ``--self-eval``'s format (integrations/self_eval.py:
  the task's prompt, the proposed answer, then "Is the proposed answer: (A) True (B) False"); the
  2K requests of a question go to one ``loglikelihood`` call, so the engine's prefix plan runs the
  question's prompt once and each answer only its own tokens and the suffix (``tokens_run`` counts
  what ran: tests/test_verify.py shows the reuse);
* ``PATH``: an outcome reward model, an ONNX sequence classifier with its tokenizer
  (runtime/reward.py) on ``context + answer``; each text runs whole (such a classifier has no KV
  inputs to share a prompt through);
* with ``prm=true``, the same scorer as a process reward model: each step (split at
  ``step_separator``) scored as the answer up to it (engine/generate/prm.py).

:func:`verify_run` returns each question's scores in sample order, keyed by (task, doc_id).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from lm_eval.api.instance import Instance

from ortevals.engine.generate.prm import TextPrm
from ortevals.integrations.self_eval import FALSE, TRUE, _context, prompt
from ortevals.report.calibration import p_true
from ortevals.runtime.reward import RewardModel

log = logging.getLogger(__name__)
Key = tuple[str, int]  # (task, doc_id)


class Verifier(Protocol):
    """Scores answers proposed after one context; ``tokens_run``: the tokens its model ran so far."""

    name: str

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        """``[N]`` a score per answer (higher: more likely right)."""

    @property
    def tokens_run(self) -> int: ...


class SelfVerifier:
    """P(True) of each answer on the package being evaluated (the run's own engine and result store)."""

    name = "self"

    def __init__(self, lm) -> None:
        self.lm = lm

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        reqs = [Instance("loglikelihood", {}, (prompt(context, a), option), 0, ("verifier", 0, 1))
                for a in answers for option in (TRUE, FALSE)]
        if not reqs:
            return np.zeros(0)
        ll = np.array([s[0] for s in self.lm.loglikelihood(reqs, disable_tqdm=True)], dtype=np.float64)
        return p_true(ll[0::2], ll[1::2])

    @property
    def tokens_run(self) -> int:
        engine = self.lm.engine
        return int(engine.tokens_run - engine.canary_tokens)


class OrmVerifier:
    """An ONNX sequence classifier's score of ``context + answer``."""

    def __init__(self, model: RewardModel) -> None:
        self.model, self.name = model, str(model.path)

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        return self.model.score([context + a for a in answers])

    @property
    def tokens_run(self) -> int:
        return self.model.tokens_run


def open_verifier(spec: str, lm) -> Verifier:
    """``self`` or a classifier folder (a one-line error when it is not one)."""
    return SelfVerifier(lm) if spec == "self" else OrmVerifier(RewardModel.open(spec))


@dataclass(frozen=True)
class Question:
    """One question's prompt and its K answers (sample order)."""

    key: Key
    context: str
    answers: tuple[str, ...]


@dataclass
class Verified:
    """What a verifier said about a run: per question its K scores (and K step-score lists with ``prm``),
    the tokens its model ran and the seconds it took."""

    name: str
    scores: dict[Key, list[float]] = field(default_factory=dict)
    steps: dict[Key, list[list[float]]] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0


def questions_of(results: dict[str, Any], tasks: Sequence[str]) -> list[Question]:
    """The questions with K > 1 generated answers in the run's logged samples (one per (task, doc_id))."""
    out, seen = [], set()
    for task in tasks:
        for r in (results.get("samples") or {}).get(task) or []:
            key = (task, int(r["doc_id"]))
            texts = (r.get("resps") or [[]])[0]
            context = _context(r.get("arguments"))
            if key in seen or context is None or not isinstance(texts, list) or len(texts) < 2:
                continue
            seen.add(key)
            out.append(Question(key, context, tuple(str(t) for t in texts)))
    return out


def verify_run(verifier: Verifier, questions: Sequence[Question], prm: bool = False,
               separator: str = "\n\n") -> Verified:
    """Every question's answers scored (outcome, and step scores with ``prm``), one scorer call per question."""
    out = Verified(verifier.name)
    before, start = verifier.tokens_run, time.perf_counter()
    steps = TextPrm(verifier.score_texts, separator)
    for q in questions:
        out.scores[q.key] = [float(x) for x in verifier.score_texts(q.context, q.answers)]
        if prm:
            out.steps[q.key] = steps.step_scores(q.context, q.answers)
    out.tokens, out.seconds = verifier.tokens_run - before, time.perf_counter() - start
    log.info("verifier %s: %d questions, %d tokens run, %.1f s", verifier.name, len(questions), out.tokens,
             out.seconds)
    return out
