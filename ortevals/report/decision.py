"""A live decision's record and lines (``--against RUN --decide MARGIN``, decision.py): what ``results.json``'s
``decide`` keeps and what the run prints under the table.

Pure numpy. The difference is in fractions in the record (as report/decide.py keeps it) and in points in the
lines. The candidate's whole-set accuracy is the reference's accuracy over its questions (known exactly: the run
is complete on them) plus the difference, so its interval is the difference's interval shifted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

RULE = ("stop at the first part after which the anytime-valid confidence sequence for the whole-set difference "
        "(Waudby-Smith & Ramdas hedged betting, sampling without replacement) lies inside ±margin (equivalent), "
        "wholly below -margin (worse) or wholly above +margin (better); else at the cap (cap)")
ORDER = {"uniform": "uniform random without replacement over the reference run's questions with a 0/1 score: "
                    "sorted by (task, doc_id), then numpy.random.default_rng(seed).permutation",
         "guided": "reference-guided without replacement over the reference run's questions with a 0/1 score: sorted "
                   "by (task, doc_id), each next one drawn with probability proportional to its weight among those "
                   "left, the weight growing as the reference's choice margin shrinks (report/guided.py; Gumbel "
                   "top-k from numpy.random.default_rng(seed)); the difference estimated by Des Raj's estimator"}
SAYS = {"equivalent": "equivalent: within ±{m} of the reference",
        "worse": "worse: more than {m} below the reference",
        "better": "better: more than {m} above the reference",
        "cap": "not decided: the interval still crosses ±{m} at the cap; run more questions (--decide-cap) "
               "or the whole set"}


@dataclass(frozen=True)
class Look:
    """The sequence after a part: questions used, its interval and the mean difference (fractions), flips so far."""

    used: int
    low: float
    high: float
    estimate: float
    flips: int


def decision_record(decision: str, *, reference: str, outcome: np.ndarray | None, d: np.ndarray,
                    looks: list[Look], margin: float, alpha: float, seed: int, part: int, cap: int | None,
                    order: str = "uniform", used_reference: np.ndarray, population: int) -> dict:
    """``results["decide"]``: ``outcome`` [N] the reference's 0/1 outcomes (the population; None: a package scored
    alongside, whose whole-set accuracy is unknown), ``d`` [n] the paired differences of the questions used in the
    order scored and ``used_reference`` [n] the reference's outcomes on them, ``margin`` in points, ``order``
    uniform or guided."""
    n, last = population, looks[-1]
    acc = None if outcome is None else float(np.mean(outcome))
    return {
        "decision": decision, "margin_points": margin, "alpha": alpha, "seed": seed, "part": part, "cap": cap,
        "rule": RULE, "order": order, "order_rule": ORDER[order],
        "reference": {"run" if outcome is not None else "package": reference, "questions": n, "accuracy": acc,
                      "accuracy_on_used": float(np.mean(used_reference)) if len(used_reference) else None,
                      "scored_alongside": outcome is None},
        "used": int(len(d)), "share": len(d) / n,
        "difference": {"estimate": last.estimate, "low": last.low, "high": last.high},
        "candidate_accuracy": None if acc is None else {"estimate": float(np.clip(acc + last.estimate, 0, 1)),
                                                        "low": float(np.clip(acc + last.low, 0, 1)),
                                                        "high": float(np.clip(acc + last.high, 0, 1))},
        "flips": int(np.count_nonzero(d)), "candidate_right": int(np.sum(d > 0)),
        "reference_right": int(np.sum(d < 0)),
        "looks": [asdict(x) for x in looks],
    }


def part_line(look: Look, population: int, margin: float, decided: str | None, requests: int, reused: int) -> str:
    """The line printed after each part (``requests`` scored in it, ``reused`` from the result store)."""
    return (f"--decide: {look.used} of {population} questions, difference {100 * look.estimate:+.2f} points, "
            f"interval [{100 * look.low:+.2f}, {100 * look.high:+.2f}], {_count(look.flips, 'flip')}: "
            f"{decided or f'not decided at ±{margin:g}'} ({requests} requests scored, {reused} reused from the "
            "result store)")


def decision_lines(r: dict) -> list[str]:
    """What the run prints under the table."""
    ref, diff, cand = r["reference"], r["difference"], r["candidate_accuracy"]
    level, m = f"{1 - r['alpha']:.0%}", _count(r["margin_points"], "point")
    about = (f"{ref['run']} ({ref['questions']} questions, accuracy {ref['accuracy']:.4f})" if cand is not None else
             f"the package {ref['package']} scored alongside ({ref['questions']} questions in the set)")
    return [f"--decide ±{m} against {about}: {SAYS[r['decision']].format(m=m)}",
            f"  {r['used']} questions used ({r['share']:.1%} of the run's; {r['order']} order, seed {r['seed']}, parts "
            f"of {r['part']}, alpha {r['alpha']:g}); the table above scores those {r['used']}",
            f"  difference (this run - reference) {100 * diff['estimate']:+.2f} points, {level} anytime-valid "
            f"interval [{100 * diff['low']:+.2f}, {100 * diff['high']:+.2f}] points; {_count(r['flips'], 'flip')} "
            f"({r['candidate_right']} right only here, {r['reference_right']} right only in the reference)",
            f"  this run's whole-set accuracy estimated {cand['estimate']:.4f}, interval [{cand['low']:.4f}, "
            f"{cand['high']:.4f}] (the reference's {ref['accuracy']:.4f} plus the difference)" if cand is not None else
            f"  the reference's answers on those {r['used']} questions: reference/ in the output folder (accuracy "
            f"{ref['accuracy_on_used']:.4f} on them; its whole-set accuracy is not known)"]


def _count(x: float, unit: str) -> str:
    """``1 point``, ``1.5 points``, ``0 flips``."""
    return f"{x:g} {unit}{'' if x == 1 else 's'}"
