"""Stop sequences as tokens arrive (engine/generate/choice/stops.py): special-token stops as lm-eval's hf backend fires
them, and incremental decoding equal to decoding everything again, with linear work."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.choice.stops import TextStream, first_stop

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<end_of_turn>"]
TEXTS = ["Hello world, ça va? Ünïcödé — “quotes” … naïve café",
         "日本語のテキスト、中文文本，한국어 텍스트",
         "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 math ∑∫√ ≠ ≤",
         "combining e\u0301 a\u0308 Zalgo z\u0336\u0335 and a literal \ufffd replacement",
         "  leading spaces\n\nnew lines\ttabs  \n Question: x <|im_start|>user"]


class Backend:
    """What TextStream needs of ortevals' Tokenizer: decode(ids, skip_special_tokens)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def byte_fallback_tokenizer(metaspace: bool = False) -> Tokenizer:
    """A Llama-2/Gemma-style SentencePiece BPE: ASCII pieces, every other character as <0xXX> byte tokens,
    decoded by Replace(▁) + ByteFallback + Fuse + Strip (or a Metaspace decoder, T5/Mistral style)."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["▁"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("e", "r"), ("i", "n")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(SPECIALS)
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return tok


@pytest.fixture(scope="module", params=["byte-level (SmolLM2)", "byte-fallback (Llama-2)", "metaspace"])
def backend(request, smollm2):
    if request.param.startswith("byte-level"):
        return Backend(Tokenizer.from_file(str(smollm2[1] / "tokenizer.json")))
    return Backend(byte_fallback_tokenizer(metaspace=request.param == "metaspace"))


def sequences(tok: Tokenizer, seed: int = 0) -> list[list[int]]:
    """The texts encoded, then the same with special tokens spliced in, then random ids (arbitrary
    bytes: broken characters, lone continuation bytes, specials anywhere)."""
    rng = np.random.default_rng(seed)
    size = tok.get_vocab_size()
    out = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    for ids in list(out):
        spliced = list(ids)
        for _ in range(3):
            spliced.insert(int(rng.integers(0, len(spliced) + 1)), int(rng.integers(0, len(SPECIALS))))
        out.append(spliced)
    out += [rng.integers(0, size, 60).tolist() for _ in range(20)]
    return out


def test_incremental_text_equals_decoding_everything_again(backend):
    """At every token, the stream's text (special tokens kept) equals a full decode of the tokens so far,
    and its result equals lm-eval hf's output decode (special tokens skipped)."""
    for ids in sequences(backend.tok):
        stream = TextStream(backend, GenSettings(max_gen_toks=10_000), set())
        for i, t in enumerate(ids):
            stream.push(t)
            assert stream.text == backend.decode(ids[:i + 1]), (ids[:i + 1], stream.text)
        assert stream.result == (backend.decode(ids, skip_special_tokens=True), len(ids))


@pytest.mark.parametrize("until", [["Question:"], ["<|im_start|>"], ["\n\n"], ["é"], ["👍"], ["🏽 fam"]])
def test_stops_fire_where_a_full_decode_first_shows_them(backend, until):
    """The stream ends at the first token whose full decode (special tokens kept) holds a stop, and its
    text is the special-skipped decode cut at the first stop, as lm-eval hf's generate_until."""
    for ids in sequences(backend.tok, seed=1):
        stream = TextStream(backend, GenSettings(until=tuple(until), max_gen_toks=10_000), set())
        found = next((i + 1 for i in range(len(ids)) if first_stop(backend.decode(ids[:i + 1]), until) is not None),
                     None)
        n = found or len(ids)
        ended = [stream.push(t) for t in ids[:n]]
        assert not any(ended[:-1]) and ended[-1] == (found is not None)
        text = backend.decode(ids[:n], skip_special_tokens=True)
        for term in until:  # lm-eval's postprocess_generated_text
            text = text.split(term)[0]
        assert stream.result == (text, n)


def test_a_special_token_stop_fires():
    """`until: ["<|im_start|>"]`: generation ends on the special token, which the output skips (it
    used to be looked for in the special-skipped text: never found, generation ran on)."""
    tok = byte_fallback_tokenizer()
    be = Backend(tok)
    ids = tok.encode("the answer", add_special_tokens=False).ids + [SPECIALS.index("<|im_start|>")] \
        + tok.encode("user next", add_special_tokens=False).ids
    stream = TextStream(be, GenSettings(until=("<|im_start|>",), max_gen_toks=100), set())
    n = next(i + 1 for i, t in enumerate(ids) if stream.push(t))
    assert n == len(tok.encode("the answer", add_special_tokens=False).ids) + 1
    assert stream.result == ("the answer", n)


def test_decode_work_is_linear_in_the_output(smollm2):
    """Token ids handed to the tokenizer per generated token stay flat as the output grows (a window of
    the last chunk + the new token, then two full decodes at the end), where decoding everything at
    every token costs n(n+1)/2 in all: 750 ids a token at n = 1500."""
    be = Backend(Tokenizer.from_file(str(smollm2[1] / "tokenizer.json")))
    ids = be.tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False).ids
    assert len(ids) >= 2000
    per_token = {}
    for n in (250, 500, 1000, 2000):
        stream = TextStream(be, GenSettings(max_gen_toks=n), set())
        for t in ids[:n]:
            stream.push(t)
        assert stream.result[1] == n
        per_token[n] = stream.decoded / n
    assert max(per_token.values()) < 10 and per_token[2000] / per_token[250] < 1.25, per_token
    print("decode work, token ids per generated token:", per_token, "(full re-decoding at n=2000: 1000.5)")


@pytest.mark.slow
def test_special_token_stop_equals_lm_eval_hf_on_smollm2(smollm2):
    """`until: ["<|im_start|>"]` on SmolLM2-Instruct after a closed turn: the model opens the next turn with
    <|im_start|> (not its EOS). lm-eval's HFLM (PyTorch, same weights, batch 1) stops there and returns
    ''; ortevals did not see the special token in the special-skipped text and ran on ('assistant\\n5').
    Both generation paths (raw sampler, onnxruntime-genai cursor) and the batched og Generator."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortevals.integrations.lm import ModelArgs, OrtLM

    hf_dir, pkg = smollm2
    prompts = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
               "<|im_start|>user\nAnd 3+3?<|im_end|>\n",
               "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n",
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
    kwargs = {"until": ["<|im_start|>", "\n\n"], "max_gen_toks": 24, "do_sample": False}
    reqs = [Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(prompts)]
    hf = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=1, dtype="float32", max_length=512)
    theirs = hf.generate_until(reqs, disable_tqdm=True)
    assert theirs[0] == "" and theirs[2].startswith("The capital of France is Paris")
    for args in ({"gen_path": "raw"}, {"gen_path": "og"}, {"gen_path": "og", "gen_batch_size": 3}):
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512, **args))
        assert lm.generate_until(reqs, disable_tqdm=True) == theirs, args
