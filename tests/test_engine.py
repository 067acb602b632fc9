"""Grouping, batching and padding in the prefill engine, with a numpy model."""

import numpy as np
import pytest

from ortevals.engine.prefill import EngineSettings, PrefillEngine, TokenRequest, pad_right, plan_groups, rows_for
from ortevals.engine.scoring import continuation_logprob

V = 11


class CausalToyModel:
    """A numpy decoder with known logits that reads the mask and positions as GroupQueryAttention does.

    Like GQA it reads only each row's mask sum and assumes the real tokens are
    a contiguous prefix: keys at index >= the sum are invisible (right padding
    is exact; left padding or a mask off by one is not). Token t of a pass
    sits at absolute position past_len + t, so a past of the wrong length
    moves every position. Its "KV" is each token's embedding plus the sine
    encoding of its position; hidden state at t is the mean of the visible KV
    rows up to t plus t's own encoding; logits = 3 * hidden @ head.
    """

    def __init__(self):
        rng = np.random.default_rng(0)
        self.emb = rng.normal(size=(V, 8)).astype(np.float32)
        self.head = rng.normal(size=(8, V)).astype(np.float32)
        self.freq = rng.uniform(0.3, 1.7, size=8).astype(np.float32)
        self.calls = []

    gathers_positions = False

    def encode_positions(self, pos):
        return np.sin(pos[..., None] * self.freq).astype(np.float32)

    def forward(self, input_ids, attention_mask, past=None, want_present=False, positions=None):
        self.calls.append(input_ids.shape)
        batch, seq = input_ids.shape
        past_len = past.length if past is not None else 0
        if attention_mask is None:
            attention_mask = np.ones((batch, past_len + seq), np.int64)
        assert attention_mask.shape == (batch, past_len + seq), (attention_mask.shape, past_len, seq)
        total = attention_mask.sum(axis=1)  # [B]: all GQA reads of the mask
        visible = (np.arange(past_len + seq)[None, :] < total[:, None]).astype(np.float32)  # [B, P+S]
        enc = self.encode_positions(np.arange(past_len, past_len + seq, dtype=np.float32))[None]  # [1,S,8]
        kv = self.emb[input_ids] + enc  # [B,S,8]
        if past is not None:
            kv = np.concatenate([np.repeat(past.h, batch // len(past.h), 0), kv], axis=1)
        seen = np.cumsum(kv * visible[:, :, None], axis=1) / np.maximum(np.cumsum(visible, axis=1), 1)[:, :, None]
        hidden = seen[:, past_len:] + enc
        if positions is not None:  # like the derived graph: the head only at these rows
            assert self.gathers_positions
            hidden = np.take_along_axis(hidden, positions[:, :, None], axis=1)
        return (hidden @ self.head) * 3, ToyKV(kv) if want_present else None


class GatheringToyModel(CausalToyModel):
    gathers_positions = True


class ToyKV:
    def __init__(self, h):
        self.h, self.length, self.nbytes = h, h.shape[1], h.nbytes


def test_toy_model_sees_mask_and_positions():
    """The toy can fail: right padding is exact, but a mask off by one or a shifted position is not."""
    model = CausalToyModel()
    ids = np.array([[4, 5, 6, 7, 8]])
    ref, kv = model.forward(ids, np.ones((1, 5), np.int64), want_present=True)
    padded = np.array([[4, 5, 6, 7, 8, 0, 0], [1, 2, 3, 0, 0, 0, 0]])
    mask = (np.arange(7) < np.array([[5], [3]])).astype(np.int64)
    got, _ = model.forward(padded, mask)
    np.testing.assert_allclose(got[0, :5], ref[0], atol=1e-5)  # right padding: the real rows are exact
    short, _ = model.forward(ids, np.array([[1, 1, 1, 1, 0]]))  # off by one: the last real token masked
    assert np.abs(short[0, 4] - ref[0, 4]).max() > 0.1
    left, _ = model.forward(np.array([[0, 4, 5, 6, 7, 8]]), np.array([[0, 1, 1, 1, 1, 1]]))
    assert np.abs(left[0, 1:] - ref[0]).max() > 0.1  # left padding is wrong, as under GQA
    tail, _ = model.forward(ids[:, 3:], np.ones((1, 5), np.int64), past=ToyKV(kv.h[:, :3]))
    np.testing.assert_allclose(tail[0], ref[0, 3:], atol=1e-5)  # past + new tokens = one pass
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
