"""Grouping, batching and padding in the prefill engine, with a numpy model."""

import numpy as np
import pytest

from ortevals.engine import EngineSettings, PrefillEngine, TokenRequest, pad_right, plan_groups, rows_for
from ortevals.scoring import continuation_logprob

V = 11


class CausalToyModel:
    """logits[b, i] depend on ids[b, :i+1] only (a running mean of embeddings), like a decoder."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.emb = rng.normal(size=(V, 8)).astype(np.float32)
        self.head = rng.normal(size=(8, V)).astype(np.float32)
        self.calls = []

    gathers_positions = False

    def forward(self, input_ids, attention_mask, past=None, want_present=False, positions=None):
        self.calls.append(input_ids.shape)
        h = self.emb[input_ids]  # [B,S,8]
        if past is not None:  # the toy's "KV" is every embedding seen so far
            assert attention_mask.shape[1] == past.length + input_ids.shape[1]
            h = np.concatenate([np.repeat(past.h, len(h), 0), h], axis=1)
        mean = np.cumsum(h, axis=1) / np.arange(1, h.shape[1] + 1)[None, :, None]
        hidden = mean[:, -input_ids.shape[1]:]
        if positions is not None:  # like the derived graph: the head only at these rows
            assert self.gathers_positions
            hidden = np.take_along_axis(hidden, positions[:, :, None], axis=1)
        return (hidden @ self.head) * 3, ToyKV(h) if want_present else None


class GatheringToyModel(CausalToyModel):
    gathers_positions = True


class ToyKV:
    def __init__(self, h):
        self.h, self.length, self.nbytes = h, h.shape[1], h.nbytes


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
