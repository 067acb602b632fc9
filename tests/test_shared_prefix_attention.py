"""Shared-prefix batches on the standard ONNX ``Attention`` op (issue 57): Mobius' ``--ep default`` exports.

The tiny Llama exported by Mobius with ``--ep default`` (opset-24 ``Attention`` with a boolean padding mask,
``RotaryEmbedding`` on ``position_ids``) and Mobius' Gemma 3 (sliding windows and causality in an additive float
mask): the shared-prefix graph (runtime/prefix_graph.py, runtime/prefix_onnx.py) scores many rows on one bound
copy of a prefix's KV within float32 rounding of one plain onnxruntime pass of the package per row, and of
transformers in float64 on the same weights; the engine runs them many a pass on real MMLU-Pro prompts.
"""

from __future__ import annotations

import numpy as np
import pytest

from ortevals.package.loader import ModelPackage
from ortevals.runtime.prefix_graph import PREFIX_KEY, PREFIX_LENGTH, PREFIX_RESIDENT, PREFIX_VALUE, prefix_decoder
from tests.test_shared_prefix import (
    _assert_float32,
    _engine_scores,
    _log_softmax,
    _session,
    _six_rows_on_a_header_in_one_pass,
)

PREFIX, LENS = 60, (9, 17, 5, 12, 30)


@pytest.fixture(scope="module")
def mobius_default(fixture_cache):
    from tests.fixtures import mobius

    if mobius.version() == "absent":
        pytest.skip("mobius-onnx is not installed")
    return mobius.default_export(fixture_cache)


def _package_pass(pkg: ModelPackage, ids: np.ndarray):
    """The package's own decoder on ``ids`` from an empty past, plain onnxruntime: (logits [S,V], present)."""
    sess = _session(pkg.decoder.path, pkg.root)
    n = len(ids)
    feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    for spec in pkg.kv:
        feeds[spec.key_name] = feeds[spec.value_name] = np.zeros((1, spec.kv_heads, 0, spec.head_size), np.float32)
    names = [pkg.logits_name] + [n for s in pkg.kv for n in (s.present_key_name, s.present_value_name)]
    out = sess.run(names, feeds)
    return out[0][0].astype(np.float64), out[1:]


def _rows(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, PREFIX), [rng.integers(3, vocab, n) for n in LENS], rng.integers(3, vocab, 40)


def _graph_scores(pkg: ModelPackage, tmp_path):
    """The shared-prefix graph's log-probs ``[B, 2, 40]``: five right-padded rows on a 60-token prefix (its KV
    from the package's own pass), each row's last two positions; and the token ids."""
    prefix, rows, targets = _rows(pkg.vocab_size)
    _, present = _package_pass(pkg, prefix)
    width = max(LENS)
    ids = np.zeros((len(rows), width), np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    feeds = {"input_ids": ids, "ortevals_positions": np.array([[n - 2, n - 1] for n in LENS])[:, :, None],
             "ortevals_targets": np.tile(targets[None, None], (len(rows), 2, 1)),
             "position_ids": np.tile(np.arange(PREFIX, PREFIX + width), (len(rows), 1)),
             "attention_mask": np.ones((len(rows), PREFIX + width), np.int64),
             PREFIX_LENGTH: np.array([PREFIX]), PREFIX_RESIDENT: np.array([PREFIX])}
    for i, spec in enumerate(pkg.kv):
        feeds[PREFIX_KEY % spec.layer], feeds[PREFIX_VALUE % spec.layer] = present[2 * i][0], present[2 * i + 1][0]
    sess = _session(prefix_decoder(pkg, tmp_path / "cache"), pkg.root)
    return sess.run(["ortevals_logprobs"], feeds)[0], (prefix, rows, targets)


def _transformers(hf_dir, prefix, rows, targets) -> np.ndarray:
    """transformers' float64 log-probs of ``targets`` at each row's last two positions after ``prefix``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(np.concatenate([prefix, r])[None])
            logits = model(ids).logits[0, -2:].numpy()
            out.append(_log_softmax(logits)[:, targets])
    return np.stack(out)


def test_standard_attention_rows_score_as_one_pass_of_the_package_and_as_transformers(mobius_default, tiny,
                                                                                      tmp_path):
    """Was refused ('the decoder takes position_ids'): each row of the batch within float32 rounding of the
    package's own pass over prefix + row, and of transformers in float64 on the checkpoint Mobius exported."""
    pkg = ModelPackage.load(mobius_default)
    ours, (prefix, rows, targets) = _graph_scores(pkg, tmp_path)
    one_pass = np.stack([_log_softmax(_package_pass(pkg, np.concatenate([prefix, r]))[0][[PREFIX + n - 2,
                                                                                            PREFIX + n - 1]])
                         [:, targets] for r, n in zip(rows, LENS)])
    _assert_float32(ours, one_pass)
    _assert_float32(ours, _transformers(tiny[0], prefix, rows, targets))


def test_the_engine_runs_mobius_default_many_rows_a_pass(mobius_default):
    """Real five-shot MMLU-Pro prompts with shared_prefix_batch=on: many rows a pass, within float32 rounding of
    exact mode, and the mode line says shared-prefix batches."""
    ours, lm = _engine_scores(mobius_default, shared_prefix_batch="on")
    exact, _ = _engine_scores(mobius_default, exact=True)
    _assert_float32(ours, exact)
    stats = lm.engine.shared_stats
    assert stats["passes"] and stats["rows"] > stats["passes"]
    assert "shared-prefix batches" in lm.run.stats["mode"]


@pytest.mark.parametrize("header", [20, 90], ids=["prefix-inside-the-window", "prefix-past-the-window"])
def test_a_float_mask_with_sliding_windows_is_applied_as_the_package_applies_it(fixture_cache, tmp_path, header):
    """Mobius' Gemma 3 (--ep default): two sliding-window (32) layers whose window and causality come in an
    additive float mask, under a 20- and a 90-token prefix, six inputs in one pass: within float32 rounding of
    exact mode."""
    from tests.fixtures.matrix.cache import built

    _six_rows_on_a_header_in_one_pass(built("mobius_gemma3_default", fixture_cache)[0] / "fp32", tmp_path, header)
