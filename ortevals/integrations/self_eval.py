"""P(True) requests (issue 24, ``--self-eval``): the package asked whether its own answer is true.

Owns the prompt and the lm-eval requests that carry it. The format is Kadavath et
al. (2022) §4 ("Question: … Proposed Answer: … Is the proposed answer: (A) True
(B) False The proposed answer is:"), written *after* the task's own prompt so that
prompt's KV is a prefix of every P(True) input::

    <the task's prompt, which asks the question><proposed answer>
    <blank line>Is the proposed answer:
     (A) True
     (B) False
    The proposed answer is:

then the log-likelihoods of " (A)" and " (B)"; P(True) is the first normalised over
the two (:func:`ortevals.report.calibration.p_true`).

* Multiple choice: every choice of every question gets its pair of requests inside the
  *same* ``loglikelihood`` call as the question's own requests (:func:`choice_requests`),
  so the engine's prefix plan computes the prompt once and each P(True) input runs only
  its answer and the suffix (tests/test_self_eval.py counts the tokens).
* Generation (CoT): the answer exists only after generation, so the pairs are scored
  after the run (:func:`generation_scores`); the prompt and the generated text run again
  (shared few-shot headers once), which docs/calibration.md measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval.api.instance import Instance

SUFFIX = "\n\nIs the proposed answer:\n (A) True\n (B) False\nThe proposed answer is:"
TRUE, FALSE = " (A)", " (B)"
Scores = dict[tuple[str, int], dict[int, tuple[float, float]]]  # (task, doc_id) -> answer index -> (A, B)


def prompt(context: str, answer: str) -> str:
    """The P(True) context for ``answer`` proposed after ``context``."""
    return context + answer + SUFFIX


def choice_requests(requests: Sequence[Instance]) -> list[Instance]:
    """Two P(True) requests per choice of every multiple-choice question in ``requests``.

    A question is the requests of one (task, doc_id) sharing a non-empty text context, at least two of
    them (choices); lm-eval's unconditional requests (empty context), media requests and P(True)
    requests themselves are left out. The new requests come in pairs, " (A)" then " (B)", with
    metadata (task, doc_id) and ``idx`` the choice's index (what :func:`collect` reads).
    """
    questions: dict[tuple[Any, Any, str], list[Instance]] = {}
    for r in requests:
        args = r.args
        if r.task_name is None or r.doc_id is None or len(args) != 2 or not isinstance(args[0], str) \
                or not args[0] or args[0].endswith(SUFFIX):
            continue
        questions.setdefault((r.task_name, r.doc_id, args[0]), []).append(r)
    extra = []
    for (task, doc_id, context), choices in questions.items():
        if len(choices) < 2:
            continue
        for r in choices:
            for option in (TRUE, FALSE):
                extra.append(Instance("loglikelihood", r.doc, (prompt(context, r.args[1]), option), r.idx,
                                      (task, doc_id, 1)))
    return extra


def collect(extra: Sequence[Instance], scores: Sequence[tuple[float, bool]]) -> Scores:
    """The scores of :func:`choice_requests`' requests (same order) as (task, doc_id) -> idx -> (A, B)."""
    out: Scores = {}
    for i in range(0, len(extra), 2):
        a, b = extra[i], extra[i + 1]
        if (a.args[1], b.args[1]) != (TRUE, FALSE) or a.args[0] != b.args[0]:
            raise ValueError(f"P(True) requests out of pairs at {i}")  # a bug here, never a user error
        out.setdefault((a.task_name, int(a.doc_id)), {})[a.idx] = (float(scores[i][0]), float(scores[i + 1][0]))
    return out


def generation_scores(lm, results: dict[str, Any]) -> Scores:
    """P(True) of each generated answer of the run's generation tasks (one response per question),
    scored now through ``lm.loglikelihood`` (the result store keeps them)."""
    extra: list[Instance] = []
    for task, records in (results.get("samples") or {}).items():
        for r in records:
            raw = r.get("resps") or []
            first = raw[0] if raw else None
            if not (isinstance(first, list) and len(first) == 1 and isinstance(first[0], str)):
                continue  # not a single generated text (choices, or K samples per question)
            context = _context(r.get("arguments"))
            if context is None:
                continue
            for option in (TRUE, FALSE):
                extra.append(Instance("loglikelihood", r.get("doc") or {}, (prompt(context, first[0]), option), 0,
                                      (task, int(r["doc_id"]), 1)))
    if not extra:
        return {}
    return collect(extra, lm.loglikelihood(extra))


def _context(arguments: Any) -> str | None:
    """The prompt of a generation record: ``[[ctx, gen_kwargs]]`` or lm-eval's tracker layout."""
    if isinstance(arguments, dict):
        first = arguments.get("gen_args_0") or {}
        ctx = first.get("arg_0")
    elif isinstance(arguments, list) and arguments and isinstance(arguments[0], (list, tuple)):
        ctx = arguments[0][0]
    else:
        return None
    return ctx if isinstance(ctx, str) and ctx else None
