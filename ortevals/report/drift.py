"""Reasoning drift of generation runs (``ortevals compare``, generation tasks): how the outputs changed.

Owns, for a run against the reference on the same questions (every output of ``--samples K`` counted):

* **length** of each output: the runs' own token counts (``sample_tokens``) when both runs kept them (even with
  ``--tokenizer``), else the text re-tokenized by the counter ``compare`` chose (``--tokenizer``, or the runs'
  tokenizer: :func:`ortevals.report.lengths.for_runs`), else characters; its mean, median and 95th percentile,
  and the **ratio** of the mean lengths (run / reference) with a paired percentile bootstrap interval over
  questions (:func:`ortevals.report.stats.bootstrap_interval`, each question's mean length);
* **hit the limit**: the share of a run's outputs whose own token count (``sample_tokens``) reaches the
  request's ``max_gen_toks``; None for a run that kept no counts (re-tokenized text can count fewer tokens
  than the model made: outputs that all stopped at the limit could count as none);
* **loops**: the share of outputs holding a block of at least :data:`LOOP_BLOCK` units (tokens with a
  tokenizer, else whitespace-separated words) repeated :data:`LOOP_COPIES` times back to back
  (:func:`has_loop`);
* **extraction failures**: the share of outputs whose extracted answer is empty or the filter's fallback
  (``[invalid]``, or ``null`` where ortevals' ``--samples`` wrote it);
* **accuracy by length**: each question's correctness against its first output's length, in the four bins
  cut at the quartiles of both runs' lengths pooled (the same bins for both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.report import stats
from ortevals.report.lengths import Counter
from ortevals.report.runs import TaskRun

LOOP_BLOCK = 4  # units in the smallest repeated block that counts as a loop
LOOP_COPIES = 3  # copies back to back
FALLBACKS = (None, "", "[invalid]")


def has_loop(units: np.ndarray, block: int = LOOP_BLOCK, copies: int = LOOP_COPIES) -> bool:
    """Whether ``units`` ``[n]`` hold ``copies`` consecutive copies of one block of ``block`` or more units: some
    ``k ≥ block`` and ``i`` with ``u[i+j] == u[i+j+k]`` for every ``j < (copies − 1)·k``."""
    u = np.asarray(units)
    for k in range(block, len(u) // copies + 1):
        eq = np.concatenate([[False], u[:-k] == u[k:], [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(eq))  # starts and ends of the runs of equal pairs
        if len(edges) and (edges[1::2] - edges[::2]).max() >= (copies - 1) * k:
            return True
    return False


@dataclass(frozen=True)
class Lengths:
    mean: float
    median: float
    p95: float


@dataclass(frozen=True)
class LengthBin:
    low: float
    high: float
    ref_n: int
    ref_accuracy: float
    n: int
    accuracy: float


@dataclass(frozen=True)
class Drift:
    unit: str  # tokens (the runs' own counts, or re-tokenized), or characters
    counted_by: str  # "the runs" (sample_tokens), "--tokenizer", "the runs' tokenizer" or "characters"
    length: Lengths
    ref_length: Lengths
    ratio: stats.Interval  # mean length, run / ref
    hit_limit: float | None  # share of outputs reaching max_gen_toks (None: no token counts kept, or no limit)
    ref_hit_limit: float | None
    loops: float
    ref_loops: float
    loop_unit: str  # tokens or words
    extraction_failures: float
    ref_extraction_failures: float
    by_length: tuple[LengthBin, ...]


def _lengths(t: TaskRun, how: str, count: Counter | None) -> list[list[int]]:
    g = t.generations
    if how == "the runs":
        return [list(c) for c in g.tokens]
    return [[count.count(o) if count else len(o) for o in outs] for outs in g.outputs]


def _units(text: str, encode) -> np.ndarray:
    """A text's token ids (``encode``), else its whitespace-separated words as ids ``[n]``."""
    if encode is not None:
        return np.asarray(encode(text), np.int64)
    words = text.split()
    return np.unique(np.array(words), return_inverse=True)[1].reshape(-1) if words else np.zeros(0, np.int64)


def _summary(values: np.ndarray) -> Lengths:
    p50, p95 = np.percentile(values, [50, 95])
    return Lengths(float(values.mean()), float(p50), float(p95))


def _hit(t: TaskRun) -> float | None:
    """The share of outputs whose own token count reaches ``max_gen_toks``; None where the run kept no counts."""
    g = t.generations
    if g.tokens is None:
        return None
    flags = [n >= lim for lim, outs in zip(g.max_gen_toks, g.tokens) if np.isfinite(lim) for n in outs]
    return float(np.mean(flags)) if flags else None


def _failures(t: TaskRun) -> float:
    return float(np.mean([a in FALLBACKS or (isinstance(a, str) and not a.strip())
                          for answers in t.generations.answers for a in answers]))


def _ratio(ref_q: np.ndarray, run_q: np.ndarray) -> stats.Interval:
    estimate = float(run_q.mean() / ref_q.mean()) if ref_q.mean() > 0 else float("nan")
    if len(ref_q) < 2 or not np.isfinite(estimate):
        return stats.Interval(estimate, float("nan"), float("nan"))
    found = stats.bootstrap_interval((ref_q, run_q), lambda a, b, axis=-1: b.mean(axis=axis) / a.mean(axis=axis),
                                     paired=True, vectorized=True)
    return stats.Interval(estimate, found.low, found.high, found.se)


def _bins(ref_first: np.ndarray, run_first: np.ndarray, ref_ok: np.ndarray, run_ok: np.ndarray) -> tuple:
    cuts = np.unique(np.quantile(np.concatenate([ref_first, run_first]), [0.25, 0.5, 0.75]))
    edges = [-np.inf, *cuts, np.inf]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        a, b = (ref_first > lo) & (ref_first <= hi), (run_first > lo) & (run_first <= hi)
        out.append(LengthBin(float(lo), float(hi), int(a.sum()), float(ref_ok[a].mean()) if a.any() else float("nan"),
                             int(b.sum()), float(run_ok[b].mean()) if b.any() else float("nan")))
    return tuple(out)


def drift(ref: TaskRun, run: TaskRun, count: Counter | None = None) -> Drift | None:
    """The drift of ``run`` from ``ref`` (aligned generation tasks); None where either holds no generations.
    ``count``: a counter in tokens (``--tokenizer`` or the runs' tokenizer), else None."""
    if ref.generations is None or run.generations is None:
        return None
    counter = count if count is not None and count.unit == "tokens" else None
    how = "the runs" if ref.generations.tokens is not None and run.generations.tokens is not None else \
        counter.by if counter is not None else "characters"
    a, b = _lengths(ref, how, counter), _lengths(run, how, counter)
    in_tokens = how != "characters"
    encode = counter.encode if counter is not None else None
    loops = [float(np.mean([has_loop(_units(o, encode)) for outs in t.generations.outputs for o in outs]))
             for t in (ref, run)]
    ref_q, run_q = (np.array([np.mean(x) for x in lens], np.float64) for lens in (a, b))
    first_a, first_b = (np.array([x[0] for x in lens], np.float64) for lens in (a, b))
    return Drift("tokens" if in_tokens else "characters", how,
                 _summary(np.array([n for x in b for n in x], np.float64)),
                 _summary(np.array([n for x in a for n in x], np.float64)), _ratio(ref_q, run_q),
                 _hit(run), _hit(ref),
                 loops[1], loops[0], "tokens" if encode is not None else "words",
                 _failures(run), _failures(ref),
                 _bins(first_a, first_b, np.nan_to_num(ref.correct), np.nan_to_num(run.correct)))


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_lines(d: Drift) -> list[str]:
    """What ``compare`` prints of a generation task's drift."""
    r, a, b = d.ratio, d.ref_length, d.length
    ratio = f"{r.estimate:.3f}" + (f" [{r.low:.3f}, {r.high:.3f}]" if np.isfinite(r.low) else "")
    limit = (f"hit max_gen_toks {_share(d.hit_limit)} (ref {_share(d.ref_hit_limit)})"
             if d.hit_limit is not None or d.ref_hit_limit is not None else
             "hit max_gen_toks: n/a (the runs kept no token counts; re-tokenized text can count fewer)")
    bins = "; ".join(f"{_edge(x.low)}-{_edge(x.high)}: {x.accuracy:.3f} of {x.n} (ref {x.ref_accuracy:.3f} of "
                     f"{x.ref_n})" for x in d.by_length)
    unit = f"{d.unit}, counted by {d.counted_by}" if d.unit == "tokens" else \
        "characters: no token counts, and the runs name no one tokenizer on disk; pass --tokenizer for tokens"
    return [f"  generated length ({unit}): mean {b.mean:.1f} (ref {a.mean:.1f}), "
            f"median {b.median:.0f} (ref {a.median:.0f}), p95 {b.p95:.0f} (ref {a.p95:.0f}); ratio of means {ratio}",
            f"  {limit}; loops ({LOOP_COPIES} copies of a block of >= {LOOP_BLOCK} {d.loop_unit}) "
            f"{_share(d.loops)} (ref {_share(d.ref_loops)}); extraction failures {_share(d.extraction_failures)} "
            f"(ref {_share(d.ref_extraction_failures)})",
            f"  accuracy by the first output's length: {bins}"]


def _edge(x: float) -> str:
    return "0" if x == -np.inf else "inf" if x == np.inf else f"{x:g}"


def record(d: Drift) -> dict:
    """The ``--json`` field ``drift``."""
    from dataclasses import asdict

    out = asdict(d)
    out["ratio"] = {"mean": d.ratio.estimate, "ci95": [d.ratio.low, d.ratio.high]}
    return out
