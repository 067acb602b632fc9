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

    def forward(self, input_ids, attention_mask, past=None, want_present=False):
        self.calls.append(input_ids.shape)
        h = self.emb[input_ids]  # [B,S,8]
        mean = np.cumsum(h, axis=1) / np.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return (mean @ self.head) * 3, None


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


@pytest.mark.parametrize("batch_size", [1, 2, 4, None])
@pytest.mark.parametrize("group", [True, False])
def test_scores_equal_unbatched_reference(batch_size, group):
    settings = EngineSettings(max_length=64, vocab_size=V, batch_size=batch_size, group_by_context=group)
    engine = PrefillEngine(CausalToyModel(), settings)
    got = engine.score(REQS)
    for req, score in zip(REQS, got):
        lp, greedy = reference(req)
        assert score.logprob == pytest.approx(lp, abs=1e-5)
        assert score.greedy == greedy


def test_one_forward_input_per_shared_context():
    model = CausalToyModel()
    engine = PrefillEngine(model, EngineSettings(max_length=64, vocab_size=V, batch_size=1))
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
