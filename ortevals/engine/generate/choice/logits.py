"""Token choice for R rows at once: logits processors, Mirostat v2 and per-row seeded draws.

Owns the pure numpy logits processors on ``[R, V]`` arrays (R rows = samples or beams of one
prompt), each equal to the transformers processor of the same name (tests/test_sampling.py
checks them against transformers on random logits):

- penalties (greedy and sampling): :func:`repetition_penalty` (RepetitionPenaltyLogitsProcessor,
  over each row's prompt + generated ids), :func:`no_repeat_ngram` (NoRepeatNGramLogitsProcessor);
- warpers (sampling only): :func:`temperature` (TemperatureLogitsWarper), :func:`top_k`,
  :func:`top_p`, :func:`min_p`, :func:`typical` (TopK/TopP/MinP/TypicalLogitsWarper);
- :func:`mirostat_v2` (Basu et al. 2021; not in transformers): truncate the tokens whose surprise
  exceeds the row's mu, sample, then mu -= eta * (surprise - tau).

:func:`choose_tokens` applies them in transformers' order (penalties, temperature, top-k, top-p,
min-p, typical; Mirostat after temperature, in place of the truncating warpers) and draws one
token per row from that row's own ``np.random.Generator``, which
:func:`~ortevals.engine.generate.choice.seeds.row_rng` seeds from (seed, request key, sample index),
so a sample's text never depends on the batch it ran in. :func:`choose_token` is one row's choice and
:func:`check_logits` the non-finite check every decoding loop runs. No onnxruntime here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ortevals.engine.score import scoring
from ortevals.errors import OrtEvalsError

if TYPE_CHECKING:
    from ortevals.engine.generate.choice.settings import GenSettings

NEG = -np.inf


def softmax_weights(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``exp(x - row max)`` of ``[R, V]``: the softmax before its normaliser; ``out``: where to write it
    (``x`` itself allowed)."""
    z = np.subtract(x, np.max(x, axis=-1, keepdims=True), out=out)
    return np.exp(z, out=z)


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``[R, V]`` (float64); -inf entries get probability 0."""
    z = softmax_weights(x)
    return z / z.sum(axis=-1, keepdims=True)


def temperature(x: np.ndarray, t: float, out: np.ndarray | None = None) -> np.ndarray:
    """TemperatureLogitsWarper: ``x / t`` (into ``out`` if given)."""
    return np.divide(x, t, out=out)


class Workspace:
    """Float64 ``[R, V]`` buffers kept across the steps of one decode loop, by name, one set per thread.

    A step's softmax, cumulative sums and log-sum-exp each need a ``[R, V]`` temporary (6 MiB at 16 rows of a
    49k vocabulary). glibc hands blocks that large back to the kernel when they are freed, so a new one every
    step costs its page faults again: 2.6 ms against 0.7 ms for one log-sum-exp of 16 rows on the 2-core
    machine (docs/benchmarks.md §8). A buffer here grows to the largest shape asked and is reused; fewer rows
    (finished samples left the batch) take a leading slice, contiguous. Each thread has its own buffers (the
    decode loop chooses tokens for the rows in pieces, on several threads: engine/generate/rows/batch.py)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float64 array of ``shape`` (contents undefined) in this thread's buffer ``name``."""
        size = int(np.prod(shape))
        buffers = self._local.__dict__.setdefault("buffers", {})
        buf = buffers.get(name)
        if buf is None or buf.size < size:
            buf = buffers[name] = np.empty(size, dtype=np.float64)
        return buf[:size].reshape(shape)

    def float64(self, name: str, x: np.ndarray) -> np.ndarray:
        """``x`` as float64 in buffer ``name`` (``x.astype(np.float64)``, without a new array)."""
        out = self.take(name, x.shape)
        np.copyto(out, x)
        return out


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """TopKLogitsWarper: -inf below the k-th largest value of each row (ties at it kept)."""
    if k <= 0 or k >= x.shape[-1]:
        return x
    kth = np.partition(x, -k, axis=-1)[:, -k:].min(axis=-1, keepdims=True)
    return np.where(x < kth, NEG, x)


def _scatter(sorted_mask: np.ndarray, order: np.ndarray) -> np.ndarray:
    """A mask over sorted positions back to vocabulary positions."""
    out = np.empty_like(sorted_mask)
    np.put_along_axis(out, order, sorted_mask, axis=-1)
    return out


def top_p(x: np.ndarray, p: float, first: int | None = None) -> np.ndarray:
    """TopPLogitsWarper: keep the smallest set of most likely tokens whose mass reaches p.

    As transformers: sort ascending, drop the tokens whose cumulative mass is <= 1 - p, always
    keep the most likely one; among equal logits the higher index ranks higher (a stable
    ascending sort; transformers' own order among ties is torch's unstable sort).

    Without the full-vocabulary sort (:func:`_nucleus`): the ``first`` largest logits (default
    TOP_P_FIRST) are partitioned out and sorted, then TOP_P_GROWTH times as many, until their
    mass reaches p. A row whose boundary mass lies within rounding of p is decided by the full
    sort (:func:`_top_p_sorted`), so the kept set is always the one the full sort keeps.
    """
    if p >= 1.0:
        return x
    z = softmax_weights(x)  # unnormalised masses, as softmax computes them
    total = z.sum(axis=-1)
    out = np.array(x, copy=True)
    for r in range(x.shape[0]):
        found = _nucleus(x[r], z[r], float(total[r]), p, first or TOP_P_FIRST)
        if found is None:
            out[r] = _top_p_sorted(x[r:r + 1], p)[0]
            continue
        size, edge = found
        kept = x[r] > edge
        tied = np.flatnonzero(x[r] == edge)
        kept[tied[len(tied) - (size - int(kept.sum())):]] = True  # ties at the edge: the highest indices
        out[r][~kept] = NEG
    return out


TOP_P_FIRST = 64  # a peaked distribution's nucleus is a few tokens; a flat one grows the set
TOP_P_GROWTH = 4


def _nucleus(row: np.ndarray, z: np.ndarray, total: float, p: float, first: int) -> tuple[int, float] | None:
    """(kept count, the smallest kept logit) of one row ``[V]``, from its largest logits only; None
    where the full sort must decide (the set would exceed V/4, or the mass is within rounding of p).

    Kept: the tokens before which the mass (largest first) is still below p. The full sort's
    cumulative sums and these differ by rounding only, at most about 2 (V + 512) eps of the
    dtype (sequential sums over at most V terms, pairwise normalisers): outside that margin
    around p both decide alike.
    """
    v = row.shape[-1]
    tol = 2 * (v + 512) * float(np.finfo(z.dtype).eps)
    c = min(first, v)
    while c <= v // 4:
        top = np.argpartition(row, v - c)[v - c:]  # the c largest logits (which of equal ones: any)
        mass = np.cumsum(np.sort(z[top])[::-1]) / total  # mass of the 1, 2, ..., c largest
        j = int(np.searchsorted(mass, p, side="left"))  # the first count whose mass reaches p, less one
        if j < c:
            below = float(mass[j - 1]) if j else 0.0
            if p - below > tol and float(mass[j]) - p > tol:
                return j + 1, float(np.sort(row[top])[::-1][j])
            return None
        c *= TOP_P_GROWTH
    return None


def _top_p_sorted(x: np.ndarray, p: float) -> np.ndarray:
    """TopPLogitsWarper on ``[R, V]`` by a full stable sort (the reference the partial path equals)."""
    order = np.argsort(x, axis=-1, kind="stable")
    cum = np.cumsum(softmax(np.take_along_axis(x, order, axis=-1)), axis=-1)
    drop = cum <= 1 - p
    drop[:, -1] = False
    return np.where(_scatter(drop, order), NEG, x)


def min_p(x: np.ndarray, p: float) -> np.ndarray:
    """MinPLogitsWarper: drop tokens whose probability is below ``p`` times the row's top probability."""
    if p <= 0.0:
        return x
    probs = softmax(x)
    drop = probs < p * probs.max(axis=-1, keepdims=True)
    drop[np.arange(x.shape[0]), np.argmax(probs, axis=-1)] = False
    return np.where(drop, NEG, x)


def typical(x: np.ndarray, mass: float) -> np.ndarray:
    """TypicalLogitsWarper (Meister et al. 2023): keep the tokens whose surprise is closest to the
    row's entropy until their mass reaches ``mass``."""
    if mass >= 1.0:
        return x
    logp = scoring.log_softmax(x, np.float64)
    with np.errstate(invalid="ignore"):
        ent = -np.nansum(logp * np.exp(logp), axis=-1, keepdims=True)
    shifted = np.abs(-logp - ent)
    order = np.argsort(shifted, axis=-1, kind="stable")
    sorted_scores = np.take_along_axis(shifted, order, axis=-1)
    cum = np.cumsum(softmax(np.take_along_axis(x, order, axis=-1)), axis=-1)
    last = np.minimum((cum < mass).sum(axis=-1), x.shape[-1] - 1)
    drop = sorted_scores > np.take_along_axis(sorted_scores, last[:, None], axis=-1)
    drop[:, 0] = False
    return np.where(_scatter(drop, order), NEG, x)


def repetition_penalty(x: np.ndarray, penalty: float, histories: Sequence[Sequence[int]]) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: every id in a row's history (prompt + generated) has its
    score divided by ``penalty`` if positive, multiplied if negative."""
    if penalty == 1.0:
        return x
    x = x.copy()
    for r, hist in enumerate(histories):
        ids = np.unique(np.asarray(hist, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < x.shape[-1])]
        s = x[r, ids]
        x[r, ids] = np.where(s < 0, s * penalty, s / penalty)
    return x


def no_repeat_ngram(x: np.ndarray, n: int, histories: Sequence[Sequence[int]]) -> np.ndarray:
    """NoRepeatNGramLogitsProcessor: ban each token that would repeat an n-gram already in the row."""
    if n <= 0:
        return x
    x = x.copy()
    for r, hist in enumerate(histories):
        h = np.asarray(hist, dtype=np.int64)
        if h.shape[0] < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(h, n)
        prefix = h[h.shape[0] - (n - 1):]
        banned = windows[(windows[:, :-1] == prefix).all(axis=-1), -1]
        x[r, banned[banned < x.shape[-1]]] = NEG
    return x


def mirostat_v2(x: np.ndarray, mu: np.ndarray, tau: float, eta: float,
                rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """Mirostat v2 (Basu et al. 2021, "Mirostat: a neural text decoding algorithm that directly
    controls perplexity", Alg. 2): per row, keep the tokens with surprise ``-log2 p <= mu`` (at
    least the most likely one), renormalise, sample, then ``mu -= eta * (s - tau)`` where ``s`` is
    the sampled token's surprise under the untruncated distribution (the paper's S(X); llama.cpp
    uses the truncated one). ``x [R, V]`` scores, ``mu [R]`` updated in place; returns tokens ``[R]``."""
    probs = softmax(x)
    out = np.empty(x.shape[0], dtype=np.int64)
    for r in range(x.shape[0]):
        with np.errstate(divide="ignore"):
            surprise = -np.log2(probs[r])
        keep = surprise <= mu[r]
        keep[np.argmax(probs[r])] = True
        q = np.where(keep, probs[r], 0.0)
        out[r] = rngs[r].choice(q.shape[0], p=q / q.sum())
        mu[r] -= eta * (surprise[out[r]] - tau)
    return out


def penalised(x: np.ndarray, s: GenSettings, histories: Sequence[Sequence[int]]) -> np.ndarray:
    """The processors transformers applies in every mode (greedy, sampling, beam): repetition
    penalty, then no-repeat n-gram. ``x [R, V]`` float64."""
    return no_repeat_ngram(repetition_penalty(x, s.repetition_penalty, histories), s.no_repeat_ngram_size,
                           histories)


def warped(x: np.ndarray, s: GenSettings) -> np.ndarray:
    """The sampling warpers in transformers' order: temperature, top-k, top-p, min-p, typical."""
    if s.temperature != 1.0:
        x = temperature(x, s.temperature)
    return typical(min_p(top_p(top_k(x, s.top_k), s.top_p), s.min_p), s.typical_p)


def choose_tokens(logits: np.ndarray, s: GenSettings, histories: Sequence[Sequence[int]],
                  rngs: Sequence[np.random.Generator], mu: np.ndarray | None = None,
                  work: Workspace | None = None) -> np.ndarray:
    """One token per row: ``logits [R, V]`` → ``tokens [R]`` (int64).

    histories: each row's prompt + generated ids (used only by the penalties). rngs: one
    generator per row (:func:`row_rng`), each consumed by its own row only. mu ``[R]``: the
    Mirostat state, updated in place (required when ``s.mirostat_tau > 0``; see :class:`Sampler`).
    work: buffers kept across steps (plain sampling at a temperature then allocates no ``[R, V]`` array);
    ``logits`` is never written.
    """
    x = np.asarray(logits)
    if work is not None and s.do_sample and s.plain and _temperature_only(s):
        probs = work.take("probs", x.shape)  # the float64 cast, the division and the softmax in one buffer
        if s.temperature != 1.0:
            temperature(x.astype(np.float64, copy=False), s.temperature, out=probs)
        else:
            np.copyto(probs, x)
        return draw_weights(softmax_weights(probs, out=probs), rngs)
    if not s.plain or s.do_sample:
        x = penalised(x.astype(np.float64), s, histories)
    if not s.do_sample:
        return np.argmax(x, axis=-1).astype(np.int64)
    if s.mirostat_tau > 0:
        if mu is None:
            raise ValueError("mirostat needs the per-row state mu: use Sampler")
        return mirostat_v2(temperature(x, s.temperature), mu, s.mirostat_tau, s.mirostat_eta, rngs)
    return draw(softmax(warped(x, s)), rngs)


def _temperature_only(s: GenSettings) -> bool:
    """No warper but the temperature (the sampling warpers' off values: settings.py)."""
    return s.top_k == 0 and s.top_p >= 1.0 and s.min_p <= 0.0 and s.typical_p >= 1.0


def draw(probs: np.ndarray, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """One token per row of ``probs [R, V]``, row r by ``rngs[r]``: exactly ``rngs[r].choice(V, p=probs[r])``
    for every row, with the rows' cumulative sums taken in one call (a pass of 16 rows over a 49k vocabulary
    costs ~4 ms as 16 ``choice`` calls). numpy's ``Generator.choice`` with ``p`` draws one ``random()``,
    takes the float64 cumulative sum of ``p``, divides it by its last value and returns
    ``searchsorted(u, side="right")``; this does the same steps (tests/test_sampling.py compares the two
    draw for draw). ``→ [R]`` int64."""
    u = [g.random() for g in rngs]
    cdf = np.asarray(probs, dtype=np.float64).cumsum(axis=1)
    last = cdf[:, -1:]
    if not (np.all(np.isfinite(last)) and np.all(last > 0)):  # choice refuses these too
        raise ValueError("probabilities contain NaN or sum to 0")
    cdf /= last
    return np.array([np.searchsorted(cdf[r], u[r], side="right") for r in range(len(u))], dtype=np.int64)


BLOCK = 128  # vocabulary entries a block: draw_weights locates a draw by block sums, then within one block


def draw_weights(z: np.ndarray, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """One token per row of the softmax weights ``z [R, V]`` (float64 ``exp(x - max)``), row r by ``rngs[r]``:
    exactly what :func:`draw` gives on :func:`softmax` of the same logits (``choice(V, p=z[r] / z[r].sum())``),
    without dividing and summing the whole vocabulary in sequence (the cumulative sum cost ~2.2 ms a 16-row
    step on a 49k vocabulary, a third of the step's token choice).

    The draw ``u`` is placed among approximate cumulative sums (block sums of ``BLOCK`` weights, then the sums
    inside the one block that holds it, over the pairwise total). Both these and ``choice``'s sequential sums
    are within ``(V + 8) eps`` of the true cumulative probabilities, so where ``u`` lies more than
    ``8 (V + 8) eps`` from the two sums around it both pick the same token; otherwise (about once in 1e10
    draws) that row is drawn by ``choice``'s own steps. ``→ [R]`` int64."""
    rows, v = z.shape
    u = np.array([g.random() for g in rngs])
    total = z.sum(axis=-1)  # softmax's normaliser, the same pairwise sum
    if not (np.all(np.isfinite(total)) and np.all(total > 0)):  # choice refuses these too
        raise ValueError("probabilities contain NaN or sum to 0")
    whole = v // BLOCK * BLOCK
    blocks = np.concatenate([z[:, :whole].reshape(rows, -1, BLOCK).sum(axis=-1), z[:, whole:].sum(axis=-1)[:, None]],
                            axis=1)
    edges = np.cumsum(blocks, axis=1) / total[:, None]  # [R, blocks]: approximate cumulative sum at each block's end
    tol = 8 * (v + 8) * float(np.finfo(np.float64).eps)
    out = np.empty(rows, dtype=np.int64)
    for r in range(rows):
        k = min(int(np.searchsorted(edges[r], u[r], side="right")), edges.shape[1] - 1)
        start = float(edges[r, k - 1]) if k else 0.0
        inner = start + np.cumsum(z[r, k * BLOCK:(k + 1) * BLOCK]) / total[r]
        j = int(np.searchsorted(inner, u[r], side="right"))
        clear = j < inner.size and u[r] - (inner[j - 1] if j else start) > tol and inner[j] - u[r] > tol
        out[r] = k * BLOCK + j if clear else _choice(z[r] / total[r], u[r])
    return out


def _choice(p: np.ndarray, u: float) -> int:
    """``Generator.choice(V, p=p)`` for the draw ``u``: its sequential cumulative sum, renormalised."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, u, side="right"))


class Sampler:
    """Token choice for a fixed set of rows across steps (holds Mirostat's mu per row).

    rngs: one generator per row. :meth:`choose` takes the logits of all rows, or of a subset
    ``rows`` (indices into the sampler's rows) when finished rows were dropped from the batch.
    """

    def __init__(self, settings: GenSettings, rngs: Sequence[np.random.Generator],
                 work: Workspace | None = None) -> None:
        self.settings = settings
        self.rngs = list(rngs)
        self.mu = np.full(len(self.rngs), 2.0 * settings.mirostat_tau)  # the paper's initial mu = 2 tau
        self.work = work

    def choose(self, logits: np.ndarray, histories: Sequence[Sequence[int]],
               rows: Sequence[int] | None = None) -> np.ndarray:
        """``logits [len(rows), V]`` → tokens ``[len(rows)]``."""
        if rows is None:
            return choose_tokens(logits, self.settings, histories, self.rngs, self.mu, self.work)
        idx = np.asarray(rows, dtype=np.int64)
        mu = self.mu[idx]
        out = choose_tokens(logits, self.settings, histories, [self.rngs[i] for i in idx], mu, self.work)
        self.mu[idx] = mu
        return out


def choose_token(logits: np.ndarray, s: GenSettings, rng: np.random.Generator,
                 history: Sequence[int] = ()) -> int:
    """One row's token (logits ``[V]``): see :func:`ortevals.engine.generate.choice.logits.choose_tokens`.

    ``history``: the row's prompt + generated ids (repetition penalty, no-repeat n-gram).
    Mirostat keeps state across steps: use :class:`ortevals.engine.generate.choice.logits.Sampler` for it."""
    return int(choose_tokens(np.asarray(logits)[None, :], s, [history], [rng])[0])


def check_logits(logits: np.ndarray, step: int, request: str) -> None:
    """Raise if ``logits [V]`` hold a NaN or +inf, or no finite value (all -inf).

    One reduction: max() is NaN if any value is, +inf if any is, -inf only if all are.
    ``step`` counts generated tokens from 1; ``request`` names the request.
    """
    top = float(np.max(logits))
    if np.isfinite(top):
        return
    what = "NaN" if np.isnan(top) else ("+inf" if top > 0 else "all -inf")
    raise OrtEvalsError(f"non-finite logits ({what}) at generated token {step} for {request}; "
                        "the model overflowed (fp16?) or its weights hold NaN/inf")
