"""``ortevals fidelity --trajectories RUN``: the KL along the reference's own generated chains.

Owns following a reference run's outputs token by token: each question of the run's generation tasks (chain
of thought; the first output where ``--samples`` made several) becomes one sequence, the prompt's tokens as
the run encoded them (lm-eval's rule: BOS where the tokenizer adds one, not a second one where the prompt's
text starts with it, as a chat template's does), then the first ``--first N`` tokens of the output (the text
re-encoded, no special tokens), ``--tokens`` generated tokens followed at most in all. A question that does
not fit the models' context (its prompt and max_gen_toks, or the tokens followed) is cut as a run at that
context cuts it (:func:`fit`: the prompt left-truncated, as ``truncate=left`` does; generated tokens past the
context not followed), and the report says how many were. Both models read the whole sequence in one pass
(teacher forcing: each sees the reference's chain, never its own), and the predictions of the generated
tokens are compared as fidelity compares a window's
(:mod:`~ortevals.fidelity.stats`: top-k + tail KL, same top-1, Δ log-prob of the actual token), then broken
down by the generated token's index (:mod:`~ortevals.fidelity.positions`, buckets at 16, 64, 256, 1024, …),
every interval clustered by question. Where the KL grows along the chain, the quantized model's own chains
drift from there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.fidelity.positions import by_position, growth, verdict
from ortevals.fidelity.positions import format_lines as table
from ortevals.fidelity.stats import compare_window, concat_stats, reduce_reference, summarize

log = logging.getLogger(__name__)
DEFAULT_FIRST = 256
EDGES = (16, 64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class Output:
    """One question of the run: its prompt, its (first) output and the request's max_gen_toks (NaN: unknown)."""

    prompt: str
    text: str
    max_gen_toks: float


@dataclass(frozen=True)
class Context:
    """The models' context: ``length`` tokens, the smaller of the two models', and ``where`` it comes from."""

    length: int
    where: str


def outputs(run_path: Path) -> list[Output]:
    """Every question of the run's generation tasks; a run that is missing, holds no generation task or only
    empty outputs is a one-line error (read before any model is opened)."""
    from ortevals.report.runs import load_run

    run = load_run(run_path)
    tasks = [t for t in run.tasks.values() if t.kind == "generation" and t.generations is not None]
    if not tasks:
        raise OrtEvalsError(f"{run_path}: no generation task in this run; --trajectories follows generated "
                            "outputs (a chain-of-thought run such as ortevals mmlu-pro --cot)")
    out = [Output(prompt, texts[0], float(m)) for t in tasks
           for prompt, texts, m in zip(t.prompt, t.generations.outputs, t.generations.max_gen_toks)]
    if not any(o.text for o in out):
        raise OrtEvalsError(f"{run_path}: every output of its generation tasks is empty: nothing to follow")
    return out


def fit(prompt: list[int], gen: list[int], context: int, max_gen_toks: float) -> tuple[list[int], list[int]] | None:
    """A question cut to ``context`` as a run at that context cuts it, None where it fits as it is. The prompt: a
    run leaves ``max_gen_toks`` free after it, and left-truncates a longer one (``truncate=left``, lm-eval's hf
    rule; ``truncate=error`` refuses it), so here too; where the request does not say its max_gen_toks, the
    prompt leaves room for the generated tokens followed. Generated tokens past the context (re-encoding gave
    more than were generated) are not followed."""
    budget = max_gen_toks if math.isfinite(max_gen_toks) and 0 < max_gen_toks < context else 0
    if len(prompt) + max(len(gen), budget) <= context:
        return None
    gen = gen[:context - 1]  # one prompt token at least: the row that predicts the first generated token
    prompt = prompt[-int(context - budget if budget else context - len(gen)):]
    return prompt, gen[:context - len(prompt)]


def sequences(items: list[Output], tok, first: int, limit: int | None,
              context: Context | None) -> tuple[list[tuple[np.ndarray, int]], int]:
    """``(ids [L], prompt length)`` per question, ``first`` generated tokens of each and ``limit`` in all at most,
    and the number of questions cut to the context (:func:`fit`)."""
    out, total, cut = [], 0, 0
    for item in items:
        if limit is not None and total >= limit:
            break
        prompt = tok.encode(item.prompt)  # as the run encoded it: BOS by the tokenizer's rule, never twice
        gen = tok.encode(item.text, add_special_tokens=False)[:first]
        cut_to = fit(prompt, gen, context.length, item.max_gen_toks) if gen and context is not None else None
        if cut_to is not None:
            (prompt, gen), cut = cut_to, cut + 1
        gen = gen if limit is None else gen[:limit - total]
        if gen and prompt:
            out.append((np.asarray(prompt + gen, np.int64), len(prompt)))
            total += len(gen)
    if not out:
        raise OrtEvalsError("the run's outputs give no generated token to follow")
    if cut:
        log.warning("%d questions are longer than the models' context (%d tokens, %s): prompts left-truncated, "
                    "generated tokens past the context not followed", cut, context.length, context.where)
    return out, cut


def follow(ref_source, cand_source, seqs: list[tuple[np.ndarray, int]], k: int):
    """Per generated token of every sequence: :class:`~ortevals.fidelity.stats.TokenStats`, the question index
    (cluster) and the generated token's index (1 = the first) ``[N]``."""
    parts, clusters, index = [], [], []
    for q, (ids, p) in enumerate(seqs):
        rows, targets = slice(p - 1, len(ids) - 1), ids[p:]
        ref_logp = log_softmax(ref_source(ids)[rows], np.float64)
        cand_logp = log_softmax(cand_source(ids)[rows], np.float64)
        if not (np.isfinite(ref_logp).all() and np.isfinite(cand_logp).all()):
            raise OrtEvalsError(f"a model returned non-finite logits on question {q} of the trajectories")
        parts.append(compare_window(reduce_reference(ref_logp, targets, k), cand_logp, targets))
        clusters.append(np.full(len(targets), q, np.int32))
        index.append(np.arange(1, len(targets) + 1))
        if (q + 1) % 10 == 0:
            log.info("trajectories: %d/%d questions", q + 1, len(seqs))
    return concat_stats(parts), np.concatenate(clusters), np.concatenate(index)


def check_edges(edges: tuple[int, ...] | None, first: int) -> None:
    """``--buckets`` with ``--trajectories``: generated-token indices, increasing, from 2 to ``first``."""
    if edges is not None and (list(edges) != sorted(set(edges)) or not all(1 < e <= first for e in edges)):
        raise OrtEvalsError(f"--buckets {','.join(map(str, edges))}: expected increasing generated-token indices "
                            f"between 2 and {first} (--first, the generated tokens followed of each output)")


def trajectory_summary(stats, clusters: np.ndarray, index: np.ndarray, first: int, edges: tuple[int, ...] | None,
                       threshold: float | None) -> dict:
    """The overall numbers and the breakdown by generated token (``by_position``; its ``low``/``high`` are
    generated-token indices)."""
    inner = edges if edges is not None else tuple(e for e in EDGES if e < first)  # no one-token last bucket
    cuts = (1, *[e for e in inner if 1 < e <= first], first + 1)
    buckets = by_position(stats.kl, stats.same_top1, stats.lp_cand - stats.lp_ref, clusters, index, cuts)
    return {**summarize(stats, clusters), "first": first,
            "by_position": {"edges": list(cuts), "buckets": buckets, "growth": growth(stats.kl, clusters, index,
                                                                                     buckets),
                            "verdict": verdict(buckets, threshold, "generated tokens {}") if threshold is not None
                            else None}}


def format_lines(s: dict) -> list[str]:
    """What ``fidelity --trajectories`` prints."""
    kl, top1 = s["kl"], s["same_top1"]
    lines = [f"candidate: {s['candidate']}", f"reference: {s['reference']}",
             f"teacher-forced on the reference run's outputs ({s['trajectories']}): {s['windows']} questions, "
             f"{s['tokens']} generated tokens (the first {s['first']} of each); ± a standard error clustered by "
             "question",
             f"Mean KLD: {kl['mean']:.6g} ± {kl['se']:.4g} nats; same top-1 {100 * top1['mean']:.2f} ± "
             f"{100 * top1['se']:.2f} %; PPL(cand)/PPL(ref) {s['ppl']['ratio']:.4f}"]
    cut = s.get("cut") or {}
    if cut.get("questions"):
        lines.append(f"{cut['questions']} questions did not fit the models' context ({cut['context']} tokens, "
                     f"{cut['where']}): each prompt left-truncated as a run at that context does (truncate=left), "
                     "generated tokens past it not followed")
    body = table(s, "By generated token (its index in the reference's output)", "token")
    return lines + body
