"""Verifiers behind one interface (issue 25): ``--verifier self`` and ``--verifier PATH``.

Owns scoring each question's K generated answers after a ``--samples K`` run:

* ``self``: P(True) on the package itself, in ``--self-eval``'s format (integrations/self_eval.py:
  the task's prompt, the proposed answer, then "Is the proposed answer: (A) True (B) False"); the
  2K requests of a question go to one ``loglikelihood`` call, so the engine's prefix plan runs the
  question's prompt once and each answer only its own tokens and the suffix (``tokens_run`` counts
  what ran: tests/test_verify.py shows the reuse);
* ``PATH`` a GenAI package folder (``genai_config.json``): the same P(True) on *that* package, its
  own run (:func:`open_judge`: the normal package loader and raw engine, the run's provider settings);
* ``PATH`` an ONNX sequence classifier with its tokenizer (runtime/reward.py) on ``context + answer``;
  each text runs whole (such a classifier has no KV inputs to share a prompt through);
* with ``prm=true``, the same scorer as a process reward model: each step (split at
  ``step_separator``) scored as the answer up to it (engine/generate/search/prm.py); the outcome score is
  then the last step's (the same text), so nothing is scored twice.

P(True) calls keep every shared token prefix of their requests (:class:`PTrueModel`'s
``loglikelihood``), so a question's prompt, each answer's steps and each (A)/(B) pair's common text run
once. :func:`verify_run` returns each question's scores in sample order, keyed by (task, doc_id).

A P(True) verifier uses a run through a :class:`PTrueModel` (``OrtLM.ptrue_model`` builds it); of the
lm-eval model it is opened with it reads only ``args`` and its class's ``from_package``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from lm_eval.api.instance import Instance
from tqdm import tqdm

from ortevals.engine.generate.search.prm import TextPrm
from ortevals.engine.score.scoring import ContextLimit, describe_request
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.files import store_path
from ortevals.integrations.self_eval import FALSE, SUFFIX, TRUE, _context, prompt
from ortevals.options import ModelArgs
from ortevals.package.scope import Reads
from ortevals.report.calibration import p_true
from ortevals.runtime.reward import RewardModel

log = logging.getLogger(__name__)
Key = tuple[str, int]  # (task, doc_id)
EXPECTED = "self, a GenAI package folder, or an ONNX sequence classifier folder (a package holds " \
           "genai_config.json; a classifier model.onnx and tokenizer.json)"
# what a GenAI judge takes from the run's own model arguments: where and how it runs, never what it scores
JUDGE_ARGS = ("ep", "provider_options", "threads", "memory_budget_mb", "prefix_cache", "prefix_budget_mb",
              "scoring_graph", "path", "exact", "check", "resume", "truncate")


class Verifier(Protocol):
    """Scores answers proposed after one context; ``tokens_run``: the tokens its model ran so far."""

    name: str
    kind: str  # "self", "genai" or "classifier"
    params: int  # the weights its model holds (report/compute.py's verifier FLOPs)
    meaning: str  # what a score is: a probability that the answer is right, and how it is made

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        """``[N]`` a score per answer (higher: more likely right)."""

    @property
    def tokens_run(self) -> int: ...

    def reads(self) -> list[Reads]:
        """What its scores depend on beyond the run's own package (the scope of a ``--search`` run's answers)."""


@dataclass(frozen=True)
class PTrueModel:
    """What P(True) verification uses of a package's run (``OrtLM.ptrue_model`` builds it).

    ``loglikelihood`` keeps every shared prefix that saves a token (the prefill engine's plan otherwise
    wants 64): a question's requests share much shorter runs than a few-shot header, an answer's text
    across its step prefixes, an (A)/(B) pair's whole input but one token. Measured on SmolLM2-135M,
    3 answers of 2-3 steps: 881 tokens in 19 passes with the default, 532 in 30 this way (docs/search.md).
    """

    loglikelihood: Callable[[list[Instance]], list[tuple[float, bool]]]
    tokens_run: Callable[[], int]  # tokens its decoder has run so far, the invariance canary's excluded
    params: int  # the weights its package holds
    reads: Callable[[], list[Reads]]  # what its run reads (files, the settings each path hands its runtime)
    settings: Callable[[], dict]  # its run's settings that can change a number
    limit: Callable[[], ContextLimit] | None = None  # its run's context: the longest input it scores
    count: Callable[[str, bool | None], int] | None = None  # tokens of a text as its run encodes it


class SelfVerifier:
    """P(True) of each answer on a package's run: the package being evaluated (``self``, its own engine and
    result store) or a GenAI judge package (:func:`open_judge`)."""

    meaning = "P(True): expit(log p(' (A)') - log p(' (B)'))"

    def __init__(self, model: PTrueModel, name: str = "self", kind: str = "self") -> None:
        self.model, self.name, self.kind = model, name, kind
        self.params = model.params

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        reqs = [Instance("loglikelihood", {}, (prompt(context, a), option), 0, ("verifier", 0, 1))
                for a in answers for option in (TRUE, FALSE)]
        if not reqs:
            return np.zeros(0)
        ll = np.array([s[0] for s in self.model.loglikelihood(reqs)], dtype=np.float64)
        return p_true(ll[0::2], ll[1::2])

    @property
    def tokens_run(self) -> int:
        return self.model.tokens_run()

    def reads(self) -> list[Reads]:
        """``self``: nothing beyond the run (its package); a judge: everything its run reads and its settings."""
        if self.kind == "self":
            return []
        return [*(dataclasses.replace(r, path=f"verifier {r.path}") for r in self.model.reads()),
                Reads("verifier", settings=self.model.settings())]


class OrmVerifier:
    """An ONNX sequence classifier's score of ``context + answer``."""

    kind = "classifier"

    def __init__(self, model: RewardModel) -> None:
        self.model, self.name, self.params = model, str(model.path), model.params
        self.meaning = model.head.describe()

    def score_texts(self, context: str, answers: Sequence[str]) -> np.ndarray:
        return self.model.score([context + a for a in answers])

    @property
    def tokens_run(self) -> int:
        return self.model.tokens_run

    def reads(self) -> list[Reads]:
        return [dataclasses.replace(self.model.reads, path=f"verifier {self.model.reads.path}")]


def open_verifier(spec: str, lm) -> Verifier:
    """``self``, a GenAI package folder (a judge: :func:`open_judge`) or a classifier folder; anything else
    is a one-line error naming the folder and what was expected."""
    if spec == "self":
        return SelfVerifier(lm.ptrue_model())
    root = Path(spec)
    if (root / "genai_config.json").is_file():
        return SelfVerifier(open_judge(root, lm).ptrue_model(), str(root), "genai")
    if not (root / "model.onnx").is_file() and (root / "config.json").is_file():
        raise PackageError(f"--verifier {root}: {_checkpoint_advice(root)}")
    if (root / "model.onnx").is_file() or (root / "tokenizer.json").is_file():
        return OrmVerifier(RewardModel.open(root))
    what = "no such folder" if not root.exists() else "not a folder" if not root.is_dir() else \
        "neither genai_config.json nor model.onnx there"
    raise PackageError(f"--verifier {root}: {what}; expected {EXPECTED}")


def check_room(verifier: Verifier, prompts: Sequence[tuple[str, int]]) -> None:
    """Before generation: the longest P(True) input each prompt can give (the prompt's tokens, an answer of its
    ``max_gen_toks`` and the P(True) question's, counted as the engine counts an input) fits the verifier's context,
    else one line naming ``--verifier``: after generation it would stop the run with every answer made. An answer
    whose text re-encodes to more tokens than were generated is still refused when it is scored; a classifier
    (no context known) and ``truncate=left`` (inputs left-truncated) are not checked."""
    model = getattr(verifier, "model", None)
    if not isinstance(model, PTrueModel) or model.limit is None or model.count is None:
        return
    limit = model.limit()
    if limit.truncate == "left":
        return
    tail = model.count(SUFFIX + TRUE, False)
    for context, max_gen_toks in prompts:
        head = model.count(context, None)
        if head + max_gen_toks + tail - 1 > limit.max_length:
            raise OrtEvalsError(
                f"--verifier {verifier.name}: a P(True) input would run up to {head + max_gen_toks + tail - 1} "
                f"tokens (a prompt of {head}, {describe_request(context)}, an answer of up to "
                f"max_gen_toks={max_gen_toks} and the P(True) question's {tail}, all but the last) but the verifier's "
                f"context is {limit.source}; give a larger max_length (or a verifier with a longer context), a "
                "smaller max_gen_toks, or truncate=left to left-truncate such inputs")


def _checkpoint_advice(root: Path) -> str:
    """What a transformers checkpoint folder given as ``--verifier`` is, and how to make a verifier of it: a causal
    LM becomes a judge package with the onnxruntime-genai builder, a sequence classifier an ONNX classifier."""
    import json

    try:
        architectures = json.loads((root / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        architectures = []
    names = ", ".join(map(str, architectures)) or "no architectures in config.json"
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        how = ("export the classifier to ONNX (model.onnx with inputs input_ids and attention_mask, first output its "
               "logits) beside its tokenizer.json, and give that folder")
    else:
        how = (f"build a GenAI package of it to judge by P(True): python -m onnxruntime_genai.models.builder -i {root} "
               "-o OUT -p fp32 -e cpu, then --verifier OUT")
    return (f"a transformers checkpoint ({names}), not an ONNX model; ortevals runs verifiers on ONNX Runtime: "
            f"{how}")


def open_judge(root: Path, lm):
    """The judge package's own run, opened as the run's ``lm`` was (its class's ``from_package``: OrtLM, the
    usual package loader and its one-line errors; integrations/lm.py imports this module, so not the other
    way) on the run's provider settings (``JUDGE_ARGS``), resuming from its own store when the run has one."""
    args = lm.args
    taken = {name: getattr(args, name) for name in JUDGE_ARGS}
    store = str(store_path(root)) if args.store else None
    return type(lm).from_package(dataclasses.replace(ModelArgs(pkg=str(root)), store=store, **taken))


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
    kind: str = "self"
    params: int = 0
    meaning: str = ""  # what a score is (the verifier's ``meaning``)
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
               separator: str = "\n\n", progress: bool = True) -> Verified:
    """Every question's answers scored, one scorer call per question: the outcome scores, or with ``prm`` the
    step scores (the outcome score is the last step's: that prefix is the whole answer); a progress bar of
    answers scored (``progress``) as the generation before it has."""
    out = Verified(verifier.name, verifier.kind, verifier.params, verifier.meaning)
    before, start = verifier.tokens_run, time.perf_counter()
    steps = TextPrm(verifier.score_texts, separator)
    bar = tqdm(total=sum(len(q.answers) for q in questions), desc=f"verifier {verifier.name}", unit="answer",
               disable=not progress, dynamic_ncols=True, smoothing=0.1)  # minutes on a long run: a bar as the rest
    try:
        for q in questions:
            if prm:
                out.steps[q.key] = steps.step_scores(q.context, q.answers)
                out.scores[q.key] = [s[-1] for s in out.steps[q.key]]
            else:
                out.scores[q.key] = [float(x) for x in verifier.score_texts(q.context, q.answers)]
            bar.update(len(q.answers))
    except OrtEvalsError as e:  # the verifier's input refused (longer than its context): say whose
        if str(e).startswith("--verifier"):
            raise
        raise OrtEvalsError(f"--verifier {verifier.name}: {e}") from None
    finally:
        bar.close()
    out.tokens, out.seconds = verifier.tokens_run - before, time.perf_counter() - start
    log.info("verifier %s: %d questions, %d tokens run, %.1f s", verifier.name, len(questions), out.tokens,
             out.seconds)
    return out
