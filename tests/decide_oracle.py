"""The reference-guided order of a decision drawn by hand, for the live (test_decide_live.py) and the Olive
(test_olive_decide.py) decisions: what docs/decide.md writes down, from the reference's samples file alone."""

from __future__ import annotations

import numpy as np

from ortevals.report.decide import ConfidenceSequence, verdict


def guided_oracle(ref: dict[int, dict], cand: dict[int, int], seed: int, margin: float, part: int):
    """(decision, the sequence at the stop, the doc_ids used in order, their paired differences). ``ref``: the
    reference's samples records by doc_id; ``cand``: the candidate's 0/1 score by doc_id; ``margin`` in points.

    Each question's margin is its top choice's log-likelihood minus the second's, read from the reference's
    ``filtered_resps``; weights ((rank + 1/2) / N) ** -0.3, the smallest margin ranked 0; the order sorts
    log(weight) + Gumbel noise from numpy's PCG64; the weighted sequence is told each drawn question's position
    among the questions sorted by doc_id."""
    ids = sorted(i for i, r in ref.items() if r["acc"] in (0, 1))
    top = [sorted((float(x[0]) for x in ref[i]["filtered_resps"]), reverse=True)[:2] for i in ids]
    rank = np.empty(len(ids))
    rank[np.argsort([a - b for a, b in top], kind="stable")] = np.arange(len(ids))
    weights = ((rank + 0.5) / len(ids)) ** -0.3
    drawn = np.argsort(-(np.log(weights) + np.random.default_rng(seed).gumbel(size=len(ids))), kind="stable")
    cs, decided, d = ConfidenceSequence(len(ids), 0.05, weights), None, []
    while cs.t < len(ids) and decided is None:
        chunk = drawn[cs.t:cs.t + part]
        d += [int(cand[ids[k]]) - int(ref[ids[k]]["acc"]) for k in chunk]
        cs.update(np.array(d[cs.t:]), chunk)
        decided = verdict(cs.low, cs.high, margin / 100)
    return decided or "cap", cs, [ids[k] for k in drawn[:cs.t]], d
