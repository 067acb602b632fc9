"""``ortevals compare --by-length``: accuracy and choice-KL by prompt length, and how lengths are counted.

Owns counting a text's length (tokens by a ``tokenizer.json``, the ``tokenizers`` library, special tokens
left out: ``--tokenizer``, which must be the tokenizer of one of the compared runs' models where they name
theirs, else the runs' own tokenizer where every run names the same one on disk; else characters), the
prompt-length buckets and, per bucket of a run against the reference, the paired Δ accuracy
(:func:`ortevals.report.stats.paired_delta`: clustered by category, t(G − 1), where every question has one
and the bucket holds at least :data:`MIN_CLUSTERS` categories; else per question, t(n − 1): with two or three
categories the clustered standard error rests on one or two sums and is often zero on 0/1 scores, a
zero-width interval), both accuracies and, for log-likelihood tasks, the mean KL(ref‖run) of the choice
distribution with its t(n − 1) interval (questions independent). A
prompt's length is its first request's context (few-shot examples and chat template included): the same
for every choice of a question. With ``--kl-threshold`` the verdict names the first bucket, shortest prompts
first, whose mean choice-KL exceeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.package.config import CONFIG_NAME
from ortevals.package.tokenizer import package_tokenizer_root, tokenizer_digest
from ortevals.report import stats

log = logging.getLogger(__name__)
MIN_CLUSTERS = 5  # categories a bucket holds at least for its Δ to be clustered by category
TOKEN_EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CHAR_EDGES = tuple(4 * e for e in TOKEN_EDGES)  # about four characters a token in English text


@dataclass(frozen=True)
class Counter:
    """A text's length in ``unit`` (``tokens`` or ``characters``); ``encode``: its token ids (tokens only);
    ``by``: whose tokens (``--tokenizer`` or ``the runs' tokenizer``), ``path`` and ``digest``: that
    ``tokenizer.json`` and its :func:`~ortevals.package.tokenizer.tokenizer_digest`."""

    unit: str
    count: Callable[[str], int]
    encode: Callable[[str], list[int]] | None = None
    by: str = "characters"
    path: str = ""
    digest: str = ""

    @property
    def label(self) -> str:
        """How lengths are counted, as the report says it."""
        return f"tokens of {self.by} {self.path}" if self.unit == "tokens" else "characters"


@dataclass(frozen=True)
class LengthOptions:
    """What ``compare`` was asked about lengths: ``--by-length`` (with ``--length-buckets`` and
    ``--kl-threshold``) and how a length is counted (``--tokenizer``)."""

    counter: Counter
    by_length: bool = False
    edges: tuple[int, ...] | None = None
    kl_threshold: float | None = None


def counter(tokenizer: Path | None) -> Counter:
    """Tokens of ``tokenizer`` (a ``tokenizer.json``, a package folder or a folder holding one), else characters."""
    if tokenizer is None:
        return Counter("characters", len)
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        path = (package_tokenizer_root(path) if (path / CONFIG_NAME).is_file() else path) / "tokenizer.json"
    if not path.is_file():
        raise OrtEvalsError(f"--tokenizer {tokenizer}: expected a tokenizer.json or a folder holding one")
    return tokens_of(path, "--tokenizer")


def tokens_of(path: Path, by: str) -> Counter:
    """Tokens of the ``tokenizer.json`` at ``path``; ``by``: whose it is, naming it in errors and the report."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own kinds; name the file
        raise OrtEvalsError(f"{by} {path}: not a tokenizers file ({str(e).splitlines()[0]})") from None

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return Counter("tokens", lambda text: len(encode(text)), encode, by, str(path), tokenizer_digest(path))


def for_runs(o: LengthOptions | None, runs: list[tuple[str, str]], needed: bool) -> LengthOptions:
    """``o`` (None: no flags) against the runs' tokenizers, ``(run, its tokenizer.json or "")`` each: a
    ``--tokenizer`` that is none of theirs is a one-line error (lengths in another model's tokens); without one,
    where lengths are ``needed``, tokens of the runs' tokenizer when every run names one and all are the same
    (one digest), else characters."""
    o = o or LengthOptions(counter(None))
    known = [(run, path, d) for run, path in runs if path and (d := _digest(run, path))]
    digests = {d for *_, d in known}
    if o.counter.unit == "tokens":
        if known and o.counter.digest not in digests:
            listed = "; ".join(f"{run}: {path}" for run, path, _ in known)
            raise OrtEvalsError(f"--tokenizer {o.counter.path}: not the tokenizer of the compared runs' models "
                                f"({listed}); lengths would be counted in another model's tokens: pass one of "
                                "those, or leave --tokenizer out")
        return o
    if not needed or len(known) < len(runs) or len(digests) != 1:
        return o
    try:
        return replace(o, counter=tokens_of(Path(known[0][1]), "the runs' tokenizer"))
    except OrtEvalsError as e:
        log.warning("lengths in characters: %s", e)
        return o


def _digest(run: str, path: str) -> str:
    try:
        return tokenizer_digest(Path(path))
    except OrtEvalsError as e:
        log.warning("run %s: its model's tokenizer cannot count lengths: %s", run, e)
        return ""


def length_options(by_length: bool, buckets: str | None, kl_threshold: float | None,
                   tokenizer: Path | None) -> LengthOptions:
    """The CLI's flags checked: ``--length-buckets`` and ``--kl-threshold`` need ``--by-length``."""
    for flag, value in (("--length-buckets", buckets), ("--kl-threshold", kl_threshold)):
        if value is not None and not by_length:
            raise OrtEvalsError(f"{flag} needs --by-length (the comparison by prompt length)")
    if kl_threshold is not None and not (np.isfinite(kl_threshold) and kl_threshold >= 0):
        raise OrtEvalsError(f"--kl-threshold {kl_threshold:g}: expected a finite KL divergence >= 0 in nats")
    return LengthOptions(counter(tokenizer), by_length, parse_edges(buckets), kl_threshold)


def parse_edges(text: str | None) -> tuple[int, ...] | None:
    """``512,2048`` → (512, 2048): increasing positive lengths, or a one-line error."""
    if text is None:
        return None
    try:
        edges = tuple(int(x) for x in text.split(","))
    except ValueError:
        edges = ()
    if not edges or any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise OrtEvalsError(f"--length-buckets {text}: expected increasing positive lengths, e.g. 512,2048")
    return edges


@dataclass(frozen=True)
class LengthBucket:
    low: int
    high: int  # exclusive; the last bucket's is one past the longest prompt
    n: int
    ref_accuracy: float
    accuracy: float
    delta: stats.Interval  # run − ref, paired
    kl: stats.Interval | None  # choice tasks: mean KL(ref‖run), t(n−1)
    clusters: int = 0  # categories delta is clustered on (0: per question)
    categories: int = 0  # categories the bucket holds where every question has one (0: not all have one)


@dataclass(frozen=True)
class LengthBreakdown:
    unit: str
    buckets: tuple[LengthBucket, ...]
    verdict: str | None = None
    counted_by: str = ""  # Counter.label: "tokens of --tokenizer /x/tokenizer.json", "characters"


def edges_for(lengths: np.ndarray, inner: tuple[int, ...] | None, unit: str) -> tuple[int, ...]:
    """``[0, inner…, longest + 1]``, the default inner edges being the doublings below the longest prompt."""
    top = int(lengths.max()) + 1 if len(lengths) else 1
    inner = inner if inner is not None else (TOKEN_EDGES if unit == "tokens" else CHAR_EDGES)
    return (0, *[e for e in inner if e < top], top)


def breakdown(lengths: np.ndarray, ref_correct: np.ndarray, run_correct: np.ndarray, categories,
              kl: np.ndarray | None, edges: tuple[int, ...], unit: str,
              threshold: float | None = None, counted_by: str = "") -> LengthBreakdown:
    """Per bucket of prompt ``lengths`` ``[N]``: the accuracies, paired Δ and the choice-KL ``[N]`` (None: none)."""
    cats = np.array([c or "" for c in categories], dtype=object)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (lengths >= lo) & (lengths < hi)
        if not m.any():
            continue
        g = len(set(cats[m])) if all(categories[i] for i in np.flatnonzero(m)) else 0
        clustered = g >= MIN_CLUSTERS
        out.append(LengthBucket(int(lo), int(hi), int(m.sum()), float(ref_correct[m].mean()),
                                float(run_correct[m].mean()),
                                stats.paired_delta(ref_correct[m], run_correct[m], cats[m] if clustered else None),
                                stats.clustered_interval(kl[m]) if kl is not None else None,
                                g if clustered else 0, g))
    return LengthBreakdown(unit, tuple(out), verdict(out, threshold, unit) if threshold is not None and kl is not None
                           else None, counted_by or unit)


def verdict(buckets: list[LengthBucket], threshold: float, unit: str) -> str:
    """Where the mean choice-KL first exceeds ``threshold`` nats, shortest prompts first."""
    for b in buckets:
        if b.kl.estimate > threshold:
            above = "the whole 95% interval above it" if b.kl.low > threshold else "its 95% interval reaches below it"
            return (f"choice-KL first exceeds {threshold:g} nats at prompts of {b.low}-{b.high - 1} {unit}: "
                    f"{b.kl.estimate:.4g} [{b.kl.low:.4g}, {b.kl.high:.4g}] ({above})")
    return f"choice-KL stays at or under {threshold:g} nats up to prompts of {buckets[-1].high - 1} {unit}"


def task_breakdown(a, b, kl: np.ndarray | None, o: LengthOptions) -> LengthBreakdown:
    """The breakdown of run ``b`` against reference ``a`` (aligned :class:`~ortevals.report.runs.TaskRun`)."""
    lengths = np.array([o.counter.count(p) for p in a.prompt], np.int64)
    edges = edges_for(lengths, o.edges, o.counter.unit)
    return breakdown(lengths, np.nan_to_num(a.correct), np.nan_to_num(b.correct), a.category, kl, edges,
                     o.counter.unit, o.kl_threshold, o.counter.label)


def format_lines(lb: LengthBreakdown) -> list[str]:
    """The printed table of a task's :class:`LengthBreakdown`."""
    lines = [f"  by prompt length ({lb.counted_by}; Δ and KL with 95% intervals):"]
    for b in lb.buckets:
        kl = "" if b.kl is None else (f"; choice-KL {b.kl.estimate:.4g}" + (
            f" [{b.kl.low:.4g}, {b.kl.high:.4g}]" if np.isfinite(b.kl.low) else ""))
        lines.append(f"    {b.low:>6}-{b.high - 1:<6} n={b.n:<5} accuracy {b.accuracy:.4f} (ref {b.ref_accuracy:.4f}), "
                     f"delta {b.delta.estimate:+.4f} [{b.delta.low:+.4f}, {b.delta.high:+.4f}] "
                     f"({_clustering(b)}){kl}")
    if lb.verdict:
        lines.append(f"  {lb.verdict}")
    return lines


def _clustering(b: LengthBucket) -> str:
    if b.clusters:
        return f"clustered by {b.clusters} categories"
    return f"per question: {b.categories} categories" if b.categories > 1 else "per question"


def record(lb: LengthBreakdown) -> dict:
    """The ``--json`` field ``by_length``."""
    def iv(x: stats.Interval | None):
        return None if x is None else {"mean": x.estimate, "se": x.se, "ci95": [x.low, x.high]}

    return {"unit": lb.unit, "counted_by": lb.counted_by, "verdict": lb.verdict,
            "buckets": [{"low": b.low, "high": b.high, "n": b.n, "ref_accuracy": b.ref_accuracy,
                         "accuracy": b.accuracy, "delta": iv(b.delta), "delta_clusters": b.clusters,
                         "kl": iv(b.kl)} for b in lb.buckets]}
