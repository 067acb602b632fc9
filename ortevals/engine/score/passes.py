"""Requests to passes: token requests grouped by model input, rows per pass, right padding.

Owns the prefill engine's plain planning, pure Python and numpy: :class:`TokenRequest`,
:class:`EngineSettings` (how requests become passes, the package's :class:`~ortevals.package.reuse.ReusePolicy`
among them), requests with an identical model input grouped into one row (:func:`plan_groups`, longest
first), rows per pass from the memory and token budgets (:func:`rows_for`), consecutive groups cut into
batches that never mix the two sides of a length switch (:func:`batches`: a right-padded pass is as long
as its longest row, and a LongRoPE graph picks every row's rotary factors from that length), and
:func:`pad_right`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ortevals.engine.score.scoring import input_window
from ortevals.package.reuse import ReusePolicy


@dataclass(frozen=True)
class TokenRequest:
    """One log-likelihood request at token level."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class EngineSettings:
    """How requests become forward passes."""

    max_length: int
    vocab_size: int
    batch_size: int | None = None  # None: largest batch within memory_budget_mb
    pad_token_id: int = 0
    memory_budget_mb: int = 2048
    token_budget: int = 0  # max tokens per batch under auto; 0: no cap (accelerators)
    group_by_context: bool = True
    prefix_cache: bool = True  # compute shared prefixes once and reuse their KV as past
    prefix_budget_mb: int = 1024  # KV held for prefixes at any time
    prefix_min_saving: int = 64  # tokens a prefix must save to be worth a pass of its own
    kv_bytes_per_token: int = 0  # all layers' K and V for one token (0: unknown, learnt on the first prefix)
    # rows per prefix-continuation pass: inputs under the same cached prefix run as one batch with
    # the prefix KV replicated across it. 1: one row per pass (CPU: onnxruntime's GroupQueryAttention
    # refuses batch > 1 with a multi-token input and past). 0: as many as rows_for allows (devices).
    prefix_batch: int = 1
    # issue 46: inputs under one cached prefix scored many rows a pass, every row reading the one copy of the
    # prefix's KV (runtime/prefix_graph.py); their own tokens padded to a multiple of ``shape_bucket`` (devices:
    # shapes repeat, so kernels' plans and the memory arena do), rows per pass from ``shared_token_budget`` and
    # the attention scores' memory (``attention_heads`` float32 scores per own token and key, three copies)
    shared_prefix_batch: bool = False
    # one input a pass on a prefix: the prefix held once in a buffer of the pass's capacity, each pass writing its
    # own tokens after it in place (no new present KV, no copy of the prefix into it, per pass)
    shared_buffer: bool = False
    shape_bucket: int = 1
    # positions the decoder's rotary table holds (its cos_cache rows; 0: no table): a bucketed pass never spans
    # more (onnxruntime refuses a position past the table: GroupQueryAttention's CheckInputs, RotaryEmbedding)
    rotary_rows: int = 0
    shared_token_budget: int = 1024
    attention_heads: int = 0
    exact: bool = False  # one row per pass, no prefix reuse, full logits: each input as if run alone
    check: bool = True  # run the invariance canary before the first batched run
    passes: int = 1  # independent passes run at once, each on its own thread (engine/score/parallel.py)
    dtype: str = "float32"  # the logits' float type: sets the canary's tolerance
    reuse: ReusePolicy = ReusePolicy()  # what cached KV may be reused for (package/reuse.py)


@dataclass(frozen=True)
class Group:
    """Requests that share one model input: ``tokens`` plus (request index, continuation length)."""

    tokens: tuple[int, ...]
    members: tuple[tuple[int, int], ...]


def plan_groups(requests: Sequence[TokenRequest], max_length: int, group: bool = True) -> list[Group]:
    """Group requests by identical model input and sort the groups longest-first."""
    by_input: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    singles: list[Group] = []
    for i, req in enumerate(requests):
        tokens = input_window(req.context, req.continuation, max_length)
        member = (i, len(req.continuation))
        if group:
            by_input.setdefault(tokens, []).append(member)
        else:
            singles.append(Group(tokens, (member,)))
    groups = singles or [Group(t, tuple(m)) for t, m in by_input.items()]
    # longest first: the first batch is the largest, so memory problems surface at once
    groups.sort(key=lambda g: -len(g.tokens))
    return groups


def rows_for(settings: EngineSettings, seq_len: int, positions: int | None = None, kv_tokens: int = 0) -> int:
    """Rows per batch: the fixed batch size, or what fits the budgets.

    Per row, a pass holds its logits (``seq_len`` rows of V, 4 bytes + the float32 copy
    scoring makes; with the derived graph only ``positions`` = K rows, 24 bytes: the head's
    output and the scoring's float32/float64 temporaries) and the present KV of its ``kv_tokens``
    (default ``seq_len``; past + new tokens when continuing a prefix). On CPU a long row
    already saturates the cores and extra rows only add memory traffic, so auto caps rows
    by ``token_budget`` as well.
    """
    if settings.batch_size:
        return settings.batch_size
    logits = seq_len * settings.vocab_size * 8 if positions is None else positions * settings.vocab_size * 24
    per_row = logits + (kv_tokens or seq_len) * settings.kv_bytes_per_token
    by_memory = settings.memory_budget_mb * 2**20 // max(per_row, 1)
    by_tokens = settings.token_budget // max(seq_len, 1) if settings.token_budget else by_memory
    return max(1, min(256, by_memory, by_tokens))


def batches(groups: list[Group], settings: EngineSettings, gathers: bool = False) -> Iterator[list[Group]]:
    """Consecutive groups, as many per batch as :func:`rows_for` allows and all of the first one's length
    class (``settings.reuse``). ``gathers``: the runner returns only the last K positions of each row (K: the
    batch's longest continuation)."""
    i = 0
    while i < len(groups):
        seq = len(groups[i].tokens)
        n = rows_for(settings, seq, scored_positions(groups[i:i + 1]) if gathers else None)
        while gathers and n > 1 and rows_for(settings, seq, scored_positions(groups[i:i + n])) < n:
            n = rows_for(settings, seq, scored_positions(groups[i:i + n]))  # a longer continuation joined: fewer rows
        n = next((k for k in range(1, n) if i + k < len(groups)
                  and not settings.reuse.same_class(seq, len(groups[i + k].tokens))), n)
        yield groups[i:i + n]
        i += n


def shared_batches(groups: Sequence[Group], base: int, settings: EngineSettings) -> Iterator[tuple[list[Group], int]]:
    """Inputs under one ``base``-token prefix as shared-prefix passes: ``(rows, width)``, each row's own tokens
    (``len(tokens) - base``) right-padded to ``width`` (:func:`own_width`: a multiple of ``settings.shape_bucket``
    within the rotary table).

    Shortest first, so rows of near lengths share a pass (little padding). Rows per pass: the fixed batch size,
    else what ``shared_token_budget`` tokens and ``memory_budget_mb`` of attention scores (``attention_heads``
    float32 scores per own token and key, ``base + width`` keys, three copies: scores, probabilities and a
    temporary) and scored logits (K rows of V, 24 bytes each) allow, at most 256.
    """
    rows = sorted(groups, key=lambda g: len(g.tokens))
    i = 0
    while i < len(rows):
        n = 1
        while i + n < len(rows):  # one more row (the widest so far): does the pass still fit?
            width = own_width(len(rows[i + n].tokens) - base, base, settings)
            if _shared_rows(settings, width, base, scored_positions(rows[i:i + n + 1])) < n + 1:
                break
            n += 1
        yield rows[i:i + n], own_width(len(rows[i + n - 1].tokens) - base, base, settings)
        i += n


def own_width(n: int, base: int, settings: EngineSettings) -> int:
    """A pass's width for ``n`` own tokens after a ``base``-token prefix: ``n`` rounded up to a multiple of
    ``settings.shape_bucket``, but ``base`` + width never past the rotary table's rows (``rotary_rows``), and
    never less than ``n``."""
    width = bucket(n, settings.shape_bucket)
    return max(n, min(width, settings.rotary_rows - base)) if settings.rotary_rows else width


def bucket(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step if step > 1 else n


def _shared_rows(settings: EngineSettings, width: int, base: int, positions: int) -> int:
    if settings.batch_size:
        return settings.batch_size
    scores = 12 * max(settings.attention_heads, 1) * width * (base + width)
    per_row = scores + positions * settings.vocab_size * 24
    by_memory = settings.memory_budget_mb * 2**20 // max(per_row, 1)
    by_tokens = settings.shared_token_budget // max(width, 1) if settings.shared_token_budget else by_memory
    return max(1, min(256, by_memory, by_tokens))


def scored_positions(batch: Sequence[Group]) -> int:
    """K: the scored positions per row, the longest continuation of any member."""
    return max(n for g in batch for _, n in g.members)


def last_positions(batch: Sequence[Group], lengths: Sequence[int]) -> tuple[int, np.ndarray]:
    """(K, positions ``[B,K]``): each row's last K real positions (row b has ``lengths[b]`` real tokens), K the
    batch's longest continuation (a shorter row's extra positions clipped to 0, never read)."""
    k = scored_positions(batch)
    return k, np.stack([np.clip(np.arange(n - k, n), 0, None) for n in lengths]).astype(np.int64)


def pad_right(rows: Sequence[Sequence[int]], pad_id: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``[B,S]`` int64 ids and mask; row b holds its tokens then padding (S: the longest row, or ``width``)."""
    width = max(width, *(len(r) for r in rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
        mask[b, :len(r)] = 1
    return ids, mask
