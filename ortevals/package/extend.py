"""Encoding texts that extend other texts of the same batch by their tails, where that is provably exact.

lm-eval encodes every multiple-choice request twice, its context and context + continuation: MMLU-Pro's ten
choices are ten texts of ~4,500 characters that differ in their last two, beside the context itself. Where a
text C of a batch is a prefix of others, :func:`encode_extending` encodes C once (with offsets), picks a split k
in C (the last newline after a character that is not whitespace, at least two characters before C's end),
and checks on C itself that encoding from k is separable: a token of C starts at k, and the tail C[k:]
encoded alone (no special tokens) gives exactly C's tokens from there. Then each extension T of C is C's
tokens before k followed by T[k:] encoded alone, about a hundredth of the characters.

Why that is exact where the check passes: a tokenizer's pre-tokenizer splits text by local rules (regular
expressions whose lookahead reaches to the end of a run of whitespace; the rule that starts a run at k sees only
characters from k), byte-pair merges never cross a pre-token, and C and T hold the same characters up to C's end,
with C not ending in whitespace (lm-eval strips it into the continuation), so every split before k is the same
in both and every token before k too. A normalizer or post-processor that acts on a whole string (a prepended
space, a stripped start, an end-of-sequence token) makes the check fail on C, and the extension is then encoded
whole. An added token (matched on the raw text before pre-tokenizing) that holds a newline could span k in T
and not in C: a tokenizer with one is never split. Texts with no such prefix are encoded whole.

That argument needs a pre-tokenizer that ends a pre-token at such a newline (:func:`bounds_at_newlines`: GPT-2's
byte-level regex, a regular-expression split as Llama 3's and Qwen's, the whitespace splitters). Without one
(no pre-tokenizer, as Gemma's and Llama 2's tokenizer.json; SentencePiece's metaspace, which splits at spaces
only) the text around k is one pre-token, and the byte-pair merges the extension's characters start can reach
back across k although C passes its check: such a tokenizer is never split either.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

Batch = Callable[[list[str], bool], list]  # texts, add_special_tokens -> encodings (.ids, and .offsets when asked)


def extensions(texts: Sequence[str]) -> list[int | None]:
    """For each text, the index of the longest other text of ``texts`` that is a proper prefix of it, or None.

    Sorted order puts a prefix before its extensions, with only texts that share it in between: a stack of the
    open prefixes finds each one's longest."""
    order = sorted(range(len(texts)), key=lambda i: texts[i])
    base: list[int | None] = [None] * len(texts)
    stack: list[int] = []
    for i in order:
        while stack and not texts[i].startswith(texts[stack[-1]]):
            stack.pop()
        if stack and len(texts[stack[-1]]) < len(texts[i]):
            base[i] = stack[-1]
        stack.append(i)
    return base


SPLITTERS = ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")  # pre-tokenizers that split at every whitespace


def bounds_at_newlines(pre_tokenizer: dict | None) -> bool:
    """Whether ``pre_tokenizer`` (tokenizer.json's entry) is known to end a pre-token before a newline that
    follows a character that is not whitespace: a byte-level one with its regex, a regular-expression split, a
    whitespace splitter, or a sequence holding one (a sequence's members only split further)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return any(bounds_at_newlines(p) for p in pre_tokenizer.get("pretokenizers") or ())
    if kind == "ByteLevel":
        return bool(pre_tokenizer.get("use_regex", True))
    if kind == "Split":
        return isinstance(pre_tokenizer.get("pattern"), dict) and "Regex" in pre_tokenizer["pattern"]
    return kind in SPLITTERS


def may_split(backend) -> bool:
    """Whether :func:`encode_extending` may split for a ``tokenizers.Tokenizer``: its pre-tokenizer bounds tokens
    at the split (:func:`bounds_at_newlines`) and no added token holds a newline (module docstring)."""
    if any("\n" in t.content for t in backend.get_added_tokens_decoder().values()):
        return False
    pre = backend.pre_tokenizer
    return pre is not None and bounds_at_newlines(json.loads(pre.__getstate__()))


def split_point(text: str) -> int | None:
    """k: the last newline of ``text`` after a character that is not whitespace, at least two characters before
    its end (None where there is none)."""
    k = text.rfind("\n", 0, len(text) - 1)
    while k > 0 and text[k - 1].isspace():
        k = text.rfind("\n", 0, k)
    return k if k > 0 else None


def encode_extending(texts: list[str], special: bool, whole: Batch, with_offsets: Batch,
                     splittable: bool = True) -> list[list[int]]:
    """The ids of each text as ``whole(texts, special)`` gives them (``with_offsets`` is the same encoder
    returning offsets), extensions of a text of the batch encoded by their tails where the split is proven on
    the prefix (module docstring). ``splittable``: False where the tokenizer may not be split (:func:`may_split`)."""
    base = extensions(texts) if splittable else [None] * len(texts)
    prefixes = sorted({b for b in base if b is not None})
    ids: list[list[int] | None] = [None] * len(texts)
    cut: dict[int, tuple[int, list[int]]] = {}  # a proven prefix: k, its tokens before k
    points = {b: split_point(texts[b]) for b in prefixes}
    prefixes = [b for b in prefixes if points[b] is not None]
    if prefixes:
        encoded = with_offsets([texts[b] for b in prefixes], special)
        heads = {b: _head(enc, points[b]) for b, enc in zip(prefixes, encoded, strict=True)}
        for b, enc in zip(prefixes, encoded, strict=True):
            ids[b] = list(enc.ids)
        checked = [b for b in prefixes if heads[b] is not None]
        tails = whole([texts[b][points[b]:] for b in checked], False)
        for b, tail in zip(checked, tails, strict=True):
            if list(tail.ids) == ids[b][heads[b]:]:
                cut[b] = (points[b], ids[b][:heads[b]])
    extended = [i for i, b in enumerate(base) if b in cut and ids[i] is None]
    for i, tail in zip(extended, whole([texts[i][cut[base[i]][0]:] for i in extended], False), strict=True):
        ids[i] = cut[base[i]][1] + list(tail.ids)
    rest = [i for i, x in enumerate(ids) if x is None]
    for i, enc in zip(rest, whole([texts[i] for i in rest], special), strict=True):
        ids[i] = list(enc.ids)
    return ids  # type: ignore[return-value]


def _head(enc, k: int) -> int | None:
    """The number of tokens before character k, where a token starts exactly at k and none before it ends past k."""
    for j, (start, _) in enumerate(enc.offsets):
        if start >= k:
            return j if start == k and (j == 0 or enc.offsets[j - 1][1] <= k) else None
    return None
