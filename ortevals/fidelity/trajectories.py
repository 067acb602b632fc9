"""``ortevals fidelity --trajectories RUN``: the KL along the reference's own generated chains.

Owns following a reference run's outputs token by token: each question of the run's generation tasks (chain
of thought; the first output where ``--samples`` made several) becomes one sequence, BOS where the tokenizer
adds one (as fidelity's windows), the prompt's tokens, then the first ``--first N`` tokens of the output
(the text re-encoded, no special tokens). Both models read the whole sequence in one pass (teacher forcing:
each sees the reference's chain, never its own), and the predictions of the generated tokens are compared as
fidelity compares a window's (:mod:`~ortevals.fidelity.stats`: top-k + tail KL, same top-1, Δ log-prob of
the actual token), then broken down by the generated token's index (:mod:`~ortevals.fidelity.positions`,
buckets at 16, 64, 256, 1024, …), every interval clustered by question. Where the KL grows along the chain,
the quantized model's own chains drift from there.
"""

from __future__ import annotations

import logging
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


def sequences(run_path: Path, tok, bos: int | None, first: int, limit: int | None) -> list[tuple[np.ndarray, int]]:
    """``(ids [L], prompt length)`` per question of the run's generation tasks, at most ``limit`` tokens followed."""
    from ortevals.report.runs import load_run

    run = load_run(run_path)
    tasks = [t for t in run.tasks.values() if t.kind == "generation" and t.generations is not None]
    if not tasks:
        raise OrtEvalsError(f"{run_path}: no generation task in this run; --trajectories follows generated "
                            "outputs (a chain-of-thought run such as ortevals mmlu-pro --cot)")
    out, total = [], 0
    head = [] if bos is None else [bos]
    for t in tasks:
        for prompt, outputs in zip(t.prompt, t.generations.outputs):
            gen = tok.encode(outputs[0], add_special_tokens=False)[:first]
            if gen and (limit is None or total < limit):
                ids = head + tok.encode(prompt, add_special_tokens=False)
                out.append((np.asarray(ids + gen, np.int64), len(ids)))
                total += len(gen)
    if not out:
        raise OrtEvalsError(f"{run_path}: every output of its generation tasks is empty: nothing to follow")
    return out


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
    body = table(s, "By generated token (its index in the reference's output)", "token")
    return lines + body
