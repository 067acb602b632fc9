"""Decoders whose passes return only the last position's logits, whatever their graph declares (issue 57 item 2).

NPU/QNN packages, static-shape exports and the builder's ``prune_lm_head=true`` compute the LM head on the
last position alone. The builder's pruned graph declares ``[B,1,V]``; others declare ``[B,sequence_length,V]``
or no shape. The fixture is the builder's pruned graph with the declaration edited, so what runs is the
builder's graph. The oracle is a plain onnxruntime pass over the full-logit package built from the same
weights (no ortevals code): one- and multi-token continuations within 1e-5, on the raw sessions (``path=auto``:
prefill, whose probe shows one row) and on onnxruntime-genai (``path=incremental``: its first multi-token pass
shows one row), each run stepping and saying so in its mode line.
"""

from __future__ import annotations

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM
from tests.fixtures.matrix import oracle
from tests.fixtures.tiny import build_tiny_last_row

PAIRS = [
    ("The capital of France is", " paris"),
    ("The capital of France is", " rome. The river of the city"),
    ("Question: one two three. Answer:", " B"),
    ("Question: one two three. Answer:", " C is the answer, four five six seven"),
    ("Nine ten ", "eleven twelve three four"),
    ("A model of the graph", " layer"),
]


def token_requests(lm: OrtLM) -> list[dict]:
    out = []
    for context, continuation in PAIRS:
        ctx, cont = lm._encode_pair(context, continuation)
        out.append({"context_ids": list(ctx), "continuation_ids": list(cont)})
    return out


@pytest.mark.parametrize("path", ["auto", "incremental"])
@pytest.mark.parametrize("declared", ["sequence_length", None], ids=["declared [B,S,V]", "no shape"])
def test_a_last_row_decoder_scores_as_the_full_logit_package(tiny_pkg, fixture_cache, declared, path):
    lm = OrtLM.from_package(ModelArgs(pkg=str(build_tiny_last_row(fixture_cache, declared)), max_length=256,
                                      path=path, store="none"))
    assert lm.backends.capability.full_logits  # the declaration promises every position
    requests = token_requests(lm)
    lengths = [len(r["continuation_ids"]) for r in requests]
    assert min(lengths) == 1 and max(lengths) >= 5
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    want = oracle.loglikelihoods(tiny_pkg, requests)
    diffs = np.abs(np.array([lp for lp, _ in got]) - np.array(want))
    assert diffs.max() <= 1e-5, diffs
    for (_, greedy), r in zip(got, requests):  # greedy: every continuation token the full package's argmax
        ids = r["context_ids"] + r["continuation_ids"]
        logp = oracle.logprobs(tiny_pkg, ids[:-1])
        n = len(r["continuation_ids"])
        assert greedy == all(int(logp[len(ids) - 1 - n + j].argmax()) == t for j, t in enumerate(ids[-n:]))
    mode = lm.run.stats["mode"]
    assert "stepping" in mode and "only the last position's logits" in mode, mode
    assert mode.startswith("stepping" if path == "auto" else "incremental; stepping"), mode
    # on the held KV: far fewer tokens than a fresh pass per scored position would run
    fresh = sum(len(r["context_ids"]) + n - 1 - j for r, n in zip(requests, lengths) for j in range(n))
    assert lm.run.engine.tokens_run < fresh / 2
