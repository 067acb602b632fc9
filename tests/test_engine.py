"""Grouping, batching and padding in the prefill engine, with a numpy model."""

from dataclasses import replace

import numpy as np
import pytest

from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest, pad_right, plan_groups, rows_for
from ortevals.engine.score.scoring import continuation_logprob

V = 11


class CausalToyModel:
    """A numpy decoder with known logits whose attention follows onnxruntime's CUDA GroupQueryAttention contract.

    The contract (source references in tests/fixtures/gqa_contract.py, which runs it in ONNX ops): with
    S new tokens and a mask of width W (past + new), the first prompt is W == S, with no past; otherwise
    row b's past length is ``off_b = sum(mask_b) - S`` (GetSequenceLengths: ``seqlens_k + 1 - S``), its
    new KV is written at ``off_b``, and new token s sits at position ``off_b + s`` and sees the keys
    ``0 .. off_b + s``. The mask counts only through its sum: there is no padding inside the new tokens,
    so a row whose mask ends in zeros gets a shorter past, not padding. Its "KV" is each token's embedding
    plus the sine encoding of its position; hidden state at s is the mean of the visible KV rows plus s's
    own encoding; logits = 3 * hidden @ head.
    """

    def __init__(self, vocab: int = V):
        rng = np.random.default_rng(0)
        self.emb = rng.normal(size=(vocab, 8)).astype(np.float32)
        self.head = rng.normal(size=(8, vocab)).astype(np.float32)
        self.freq = rng.uniform(0.3, 1.7, size=8).astype(np.float32)
        self.calls = []
        self.batched_on_past = 0  # passes of several rows with several new tokens on a past

    gathers_positions = False

    def encode_positions(self, pos):
        return np.sin(pos[..., None] * self.freq).astype(np.float32)

    def forward(self, input_ids, attention_mask, past=None, want_present=False, positions=None):
        self.calls.append(input_ids.shape)
        batch, seq = input_ids.shape
        past_len = past.length if past is not None else 0
        self.batched_on_past += batch > 1 and seq > 1 and past is not None
        if attention_mask is None:
            attention_mask = np.ones((batch, past_len + seq), np.int64)
        assert attention_mask.shape == (batch, past_len + seq), (attention_mask.shape, past_len, seq)
        width = attention_mask.shape[1]
        offset = np.zeros(batch, np.int64) if seq == width else np.maximum(attention_mask.sum(axis=1) - seq, 0)
        pos = offset[:, None] + np.arange(seq)[None, :]  # [B,S] each new token's position
        enc = self.encode_positions(pos.astype(np.float32))  # [B,S,8]
        kv = np.zeros((batch, max(width, past_len), 8), np.float32)  # the present cache
        if past is not None:
            kv[:, :past_len] = past.h
        for b in range(batch):
            kv[b, offset[b]:offset[b] + seq] = self.emb[input_ids[b]] + enc[b]
        visible = (np.arange(kv.shape[1])[None, None, :] <= pos[:, :, None]).astype(np.float32)  # [B,S,T]
        hidden = (visible @ kv) / visible.sum(axis=2, keepdims=True) + enc
        if positions is not None:  # like the derived graph: the head only at these rows
            assert self.gathers_positions
            hidden = np.take_along_axis(hidden, positions[:, :, None], axis=1)
        return (hidden @ self.head) * 3, ToyKV(kv) if want_present else None

    def repeat_past(self, past, batch):
        return ToyKV(np.repeat(past.h, batch, axis=0))


class GatheringToyModel(CausalToyModel):
    gathers_positions = True


class ToyKV:
    def __init__(self, h):
        self.h, self.length, self.nbytes = h, h.shape[1], h.nbytes


def test_toy_model_sees_mask_and_positions():
    """The toy can fail: right padding of a first prompt is exact, but a zero mask tail on a past,
    left padding or a past of the wrong length is not."""
    model = CausalToyModel()
    ids = np.array([[4, 5, 6, 7, 8]])
    ref, kv = model.forward(ids, np.ones((1, 5), np.int64), want_present=True)
    padded = np.array([[4, 5, 6, 7, 8, 0, 0], [1, 2, 3, 0, 0, 0, 0]])
    mask = (np.arange(7) < np.array([[5], [3]])).astype(np.int64)
    got, _ = model.forward(padded, mask)
    np.testing.assert_allclose(got[0, :5], ref[0], atol=1e-5)  # right padding: the real rows are exact
    tail, _ = model.forward(ids[:, 3:], np.ones((1, 5), np.int64), past=ToyKV(kv.h[:, :3]))
    np.testing.assert_allclose(tail[0], ref[0, 3:], atol=1e-5)  # past + new tokens = one pass
    padded_tail, _ = model.forward(np.array([[7, 8, 0]]), np.array([[1, 1, 1, 1, 1, 0]]), past=ToyKV(kv.h[:, :3]))
    assert np.abs(padded_tail[0, :2] - ref[0, 3:]).max() > 0.1  # a zero tail on a past shortens the past
    left, _ = model.forward(np.array([[0, 4, 5, 6, 7, 8]]), np.array([[0, 1, 1, 1, 1, 1]]))
    assert np.abs(left[0, 1:] - ref[0]).max() > 0.1  # left padding is wrong, as under GQA
    shifted, _ = model.forward(ids[:, 3:], np.ones((1, 3), np.int64), past=ToyKV(kv.h[:, :1]))
    assert np.abs(shifted[0] - ref[0, 3:]).max() > 0.1  # a past of the wrong length moves positions


def reference(req: TokenRequest) -> tuple[float, bool]:
    model = CausalToyModel()
    tokens = list(req.context) + list(req.continuation)
    logits, _ = model.forward(np.array([tokens[:-1]]), None)
    n = len(req.continuation)
    return continuation_logprob(logits[0, -n:], req.continuation)


REQS = [
    TokenRequest((1, 2, 3), (4,)),
    TokenRequest((1, 2, 3), (5,)),
    TokenRequest((1, 2, 3), (6,)),
    TokenRequest((7, 8), (9, 10)),
    TokenRequest((2,), (3, 4, 5)),
    TokenRequest((1, 2, 3, 4, 5, 6), (7,)),
]


@pytest.mark.parametrize("model", [CausalToyModel, GatheringToyModel])
@pytest.mark.parametrize("batch_size", [1, 2, 4, None])
@pytest.mark.parametrize("group", [True, False])
def test_scores_equal_unbatched_reference(batch_size, group, model):
    settings = EngineSettings(max_length=64, vocab_size=V, batch_size=batch_size, group_by_context=group)
    engine = PrefillEngine(model(), settings)
    got = engine.score(REQS)
    for req, score in zip(REQS, got):
        lp, greedy = reference(req)
        assert score.logprob == pytest.approx(lp, abs=1e-5)
        assert score.greedy == greedy


def test_one_forward_input_per_shared_context():
    model = CausalToyModel()
    # check=False: count the configured path's own passes, without the invariance canary's
    engine = PrefillEngine(model, EngineSettings(max_length=64, vocab_size=V, batch_size=1, check=False))
    engine.score(REQS)
    # the three one-token continuations of (1,2,3) share one input: 6 requests -> 4 inputs
    assert len(model.calls) == 4
    assert engine.tokens_run == 3 + 3 + 3 + 6


def test_groups_are_sorted_longest_first_and_on_done_fires_per_request():
    groups = plan_groups(REQS, max_length=64)
    assert [len(g.tokens) for g in groups] == sorted((len(g.tokens) for g in groups), reverse=True)
    seen = []
    PrefillEngine(CausalToyModel(), EngineSettings(max_length=64, vocab_size=V)).score(
        REQS, lambda i, s: seen.append(i))
    assert sorted(seen) == list(range(len(REQS)))


def test_truncation_keeps_the_last_tokens():
    long = TokenRequest(tuple(range(1, 10)) * 3, (3,))
    engine = PrefillEngine(CausalToyModel(), EngineSettings(max_length=8, vocab_size=V, batch_size=1))
    (score,) = engine.score([long])
    tokens = (list(long.context) + [3])[-9:]
    lp, _ = reference(TokenRequest(tuple(tokens[:-1]), (3,)))
    assert score.logprob == pytest.approx(lp, abs=1e-5)


def test_pad_right_and_auto_rows():
    ids, mask = pad_right([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    s = EngineSettings(max_length=10, vocab_size=1000, memory_budget_mb=1)
    assert rows_for(s, 10) == 1 * 2**20 // (10 * 1000 * 8)
    assert rows_for(EngineSettings(max_length=10, vocab_size=10, batch_size=3), 10) == 3


HEADER = tuple(range(1, 11)) * 4  # 40 shared tokens


def shared_requests():
    rng = np.random.default_rng(3)
    reqs = []
    for q in range(6):
        question = HEADER + tuple(int(t) for t in rng.integers(1, V, size=5 + q))
        reqs += [TokenRequest(question, (c,)) for c in range(1, 5)]
    reqs.append(TokenRequest(HEADER[:5], (7, 8, 9)))  # shares too little to use the cache
    return reqs


@pytest.mark.parametrize("model", [CausalToyModel, GatheringToyModel])
@pytest.mark.parametrize("budget_mb", [1024, 0])
def test_prefix_cache_gives_the_same_scores_with_fewer_tokens(budget_mb, model):
    reqs = shared_requests()
    base = EngineSettings(max_length=64, vocab_size=V, batch_size=1, prefix_cache=False)
    off = PrefillEngine(CausalToyModel(), base)
    ref = off.score(reqs)
    on = PrefillEngine(model(), EngineSettings(max_length=64, vocab_size=V, batch_size=1,
                                                        prefix_min_saving=8, prefix_budget_mb=budget_mb,
                                                        kv_bytes_per_token=64, check=False))  # no canary passes
    got = on.score(reqs)
    for a, b in zip(ref, got):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.greedy == b.greedy
    if budget_mb:
        assert on.tokens_run == off.tokens_run - 5 * len(HEADER)  # the header ran once, not six times
    else:  # no room for any prefix: nothing computed twice, the same answers
        assert on.tokens_run == off.tokens_run


@pytest.mark.parametrize("model", [CausalToyModel, GatheringToyModel])
def test_batched_continuations_on_a_shared_past_equal_one_row(model):
    """Devices batch the inputs under one cached prefix (prefix_batch=0): right-padded tails of different
    lengths on one past. Under the kernel's contract a zero mask tail moves a row's past; the engine counts
    every position as real, so each row's scores are its own one-row pass's."""
    reqs = shared_requests()
    toy = model()
    engine = PrefillEngine(toy, EngineSettings(max_length=64, vocab_size=V, batch_size=None, prefix_batch=0,
                                               prefix_min_saving=8, kv_bytes_per_token=64, check=False))
    got = engine.score(reqs)
    assert toy.batched_on_past >= 1
    for req, score in zip(reqs, got):
        lp, greedy = reference(req)
        assert score.logprob == pytest.approx(lp, abs=1e-5) and score.greedy == greedy


def test_auto_rows_count_what_the_derived_graph_returns():
    """A 262k vocabulary and 900-token prompts with one-token continuations (MMLU-Pro on Gemma): full logits
    are 1.9 GB a row, one row per pass; the derived graph holds [B,1,V] plus the present KV (Gemma-3-4B-like:
    34 layers x 4 KV heads x 256 x 2 bytes x K,V), so several rows fit the same 2 GiB budget."""
    kv = 2 * 34 * 4 * 256 * 2
    s = EngineSettings(max_length=4096, vocab_size=262144, memory_budget_mb=2048, kv_bytes_per_token=kv)
    assert rows_for(s, 900) == 1
    per_row = 262144 * 24 + 900 * kv
    assert rows_for(s, 900, positions=1) == 2048 * 2**20 // per_row > 1
    # through the engine: eight such inputs run as one pass of the derived-graph toy
    rng = np.random.default_rng(0)
    reqs = [TokenRequest(tuple(int(t) for t in rng.integers(1, 262144, 900)), (int(rng.integers(1, 262144)),))
            for _ in range(8)]
    engine = PrefillEngine(GatheringToyModel(262144), replace(s, prefix_cache=False, check=False))
    got = engine.score(reqs)
    assert engine.forward_passes == 1
    one = PrefillEngine(GatheringToyModel(262144), replace(s, batch_size=1, prefix_cache=False, check=False))
    for a, b in zip(got, one.score(reqs)):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.greedy == b.greedy
