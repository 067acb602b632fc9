"""Encoding lm-eval's context + continuation texts by their tails (package/extend.py): the ids of encoding each
text whole, for tokenizers of every kind users ship, on real MMLU-Pro prompts and on texts made to break it."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from ortevals.package.extend import encode_extending, extensions, may_split, split_point
from ortevals.package.tokenizer import SpecialTokens, Tokenizer
from tests.fixtures.matrix.prompts import requests

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> list[str]:
    return [c + x for c, x in requests()]


def _trained(kind: str) -> HFTokenizer:
    """A BPE tokenizer trained on the prompts, laid out as users' tokenizers are: GPT-2's byte level (SmolLM2,
    Qwen), Llama 3's split rule before the bytes, SentencePiece's metaspace with a prepended marker (Llama 2),
    Gemma's layout (spaces replaced by the marker, no pre-tokenizer: the whole text is one pre-token), one whose
    normalizer strips the text, and one with an added token holding a newline."""
    tok = HFTokenizer(BPE())
    if kind == "gemma":
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    elif kind in ("bytelevel", "added-newline", "strip"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # metaspace
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if kind == "strip":
        tok.normalizer = normalizers.Strip()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind not in ("metaspace", "gemma") else []
    size = 1000 if kind == "gemma" else 600  # Gemma's: merges long enough to reach across a split
    tok.train_from_iterator(_corpus(), BpeTrainer(vocab_size=size, initial_alphabet=alphabet, show_progress=False))
    if kind == "added-newline":
        # matched only in an extension, starting before the split ("yes" ends the context's line)
        tok.add_special_tokens([AddedToken("yes\nAnswer: A", special=True)])
    return tok


def _texts() -> list[str]:
    """What lm-eval asks for: each context (without its trailing space) and context + each continuation."""
    out = []
    for context, continuation in requests():
        out += [context.rstrip(), context + continuation]
    # contexts whose last newline follows a space, ends in punctuation, continuations starting with a newline
    out += ["Question: x .\nAnswer:", "Question: x .\nAnswer: B", "a\n\nb", "a\n\nb\nc", "q?\n", "q?\n A",
            "Options:\nA. 12\nB. 3", "Options:\nA. 12\nB. 345", "x\n y", "x\n y\n\nz",
            "zz\nQ: yes\nAnswer:", "zz\nQ: yes\nAnswer: A"]
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("kind", ["bytelevel", "llama3", "metaspace", "gemma", "strip", "added-newline"])
def test_the_ids_are_those_of_encoding_each_text_whole(kind):
    backend = _trained(kind)
    tok = Tokenizer(backend, SpecialTokens(None, None, None))
    texts = _texts()
    for flag in (None, True, False):
        assert tok.encode_many(texts, flag) == [tok.encode(t, flag) for t in texts]


def test_extensions_are_encoded_by_their_tails_where_the_split_holds():
    """On the byte-level tokenizer every continuation of a context is its tail only: the characters encoded
    whole are the contexts', a few tens of characters for each of the other texts."""
    backend = _trained("bytelevel")
    calls = []

    def whole(texts, special):
        calls.append(sum(map(len, texts)))
        return backend.encode_batch_fast(texts, add_special_tokens=special)

    texts = list(dict.fromkeys(t for c, x in requests() for t in (c.rstrip(), c + x)))  # 4 contexts, 39 requests
    ids = encode_extending(texts, True, whole, lambda t, s: backend.encode_batch(t, add_special_tokens=s))
    assert ids == [backend.encode(t).ids for t in texts]
    contexts = [t for t, b in zip(texts, extensions(texts)) if b is None]
    assert sum(calls) < sum(len(t) for t in texts if t not in contexts) / 20  # tails only, beside the contexts


def test_a_split_that_would_not_hold_is_not_taken():
    assert split_point("Question: x\n") is None  # too near the end
    assert split_point("a \nb") is None  # whitespace before the newline
    assert split_point("a\nb \nc") == 1
    assert extensions(["ab", "a", "abc", "b"]) == [1, None, 0, None]


def test_a_tokenizer_without_a_pre_tokenizer_is_encoded_whole():
    """No pre-tokenizer: merges run over the whole text. Here C = "xa\\nbc" passes the check on itself (tokens
    x, a, \\nb, c; its tail "\\nbc" alone gives \\nb, c), but in its extension "xa\\nbcd" the merges c+d then
    b+cd take the b, and a+\\n crosses the split: the tail would give x, a, \\n, bcd."""
    chars = ["x", "a", "\n", "b", "c", "d"]
    merges = [("c", "d"), ("b", "cd"), ("\n", "b"), ("a", "\n")]
    vocab = {t: i for i, t in enumerate(chars + ["".join(m) for m in merges])}
    backend = HFTokenizer(BPE(vocab, merges))
    texts = ["xa\nbc", "xa\nbcd"]
    whole = [backend.encode(t).ids for t in texts]
    assert [[backend.id_to_token(i) for i in ids] for ids in whole] == [["x", "a", "\nb", "c"], ["x", "a\n", "bcd"]]
    batch = lambda t, s: backend.encode_batch(t, add_special_tokens=s)  # noqa: E731
    split = encode_extending(texts, False, batch, batch, splittable=True)  # what splitting would give
    assert [backend.id_to_token(i) for i in split[1]] == ["x", "a", "\n", "bcd"]
    assert Tokenizer(backend, SpecialTokens(None, None, None)).encode_many(texts, False) == whole
    assert not may_split(backend) and not may_split(_trained("gemma")) and not may_split(_trained("metaspace"))
    assert may_split(_trained("bytelevel")) and may_split(_trained("llama3"))
    assert not may_split(_trained("added-newline"))
