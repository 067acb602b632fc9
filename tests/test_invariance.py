"""Batch and prefix invariance is checked, not assumed (issue 10, section 2).

Every score is compared with an oracle that runs each request alone through a
plain ``onnxruntime.InferenceSession`` on the package's own decoder (one row,
empty past, every position's logits), tokenized with the HF ``tokenizers``
library directly: no ortevals code in the reference.
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import onnx
import pytest
from lm_eval.api.instance import Instance
from onnx import TensorProto, helper, numpy_helper

from ortevals.engine.score.invariance import compare, detect, pick_canary, scan_graph
from ortevals.integrations.lm import ModelArgs, OrtLM
from tests.fixtures.dynquant import build_dynquant, build_shape_dependent
from tests.fixtures.tiny import WORDS

rng = random.Random(7)
HEADER = " ".join(rng.choice(WORDS) for _ in range(40))  # a long shared context: prefix reuse kicks in
PAIRS = [(f"{HEADER} question {' '.join(rng.choice(WORDS) for _ in range(3 + 4 * q))}. Answer:", cont)
         for q in range(3) for cont in (" A", " B", " C", " paris berlin")]
PAIRS += [("The capital of France is", " paris"), ("One two three", " four five six"),
          ("Nine ten", " eleven"), (" ".join(rng.choice(WORDS) for _ in range(25)), " rome.")]


@pytest.fixture(scope="module")
def dynquant(tiny_pkg, fixture_cache):
    return build_dynquant(tiny_pkg, fixture_cache)


@pytest.fixture(scope="module")
def shape_dependent(tiny_pkg, tmp_path_factory):
    return build_shape_dependent(tiny_pkg, tmp_path_factory.mktemp("shapedep") / "tiny-shapedep")


def instances(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]


def model_inputs(pkg, pairs) -> set[tuple[int, ...]]:
    """The distinct token inputs of ``pairs``: context + continuation without its last token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))
    return {tuple(tok.encode(ctx + cont).ids[:-1]) for ctx, cont in pairs}


def oracle(pkg, pairs) -> np.ndarray:
    """Each request alone: lm-eval's split of context/continuation tokens, input = all but the last token."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))  # its post-processor adds BOS, as the hf backend does
    dec = json.loads((pkg / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    out = []
    for ctx, cont in pairs:
        whole, n_ctx = tok.encode(ctx + cont).ids, len(tok.encode(ctx).ids)
        ids = np.array([whole[:-1]], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for i in (i for i in sess.get_inputs() if i.name.startswith("past_key_values")):
            feeds[i.name] = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
        logits = sess.run(["logits"], feeds)[0][0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out.append(sum(logp[t - 1, whole[t]] for t in range(n_ctx, len(whole))))
    return np.array(out)


def scores(pkg, pairs=PAIRS, **kw):
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, **kw))
    return lm, np.array([lp for lp, _ in lm.loglikelihood(instances(pairs), disable_tqdm=True)])


# --- the dynamic-quant fixture ------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("scoring_graph", [True, False])
@pytest.mark.parametrize("batch_size", [1, 2, 4, None])
def test_dynamic_quant_every_setting_equals_one_row_oracle(dynquant, batch_size, prefix_cache, scoring_graph):
    ref = oracle(dynquant, PAIRS)
    lm, got = scores(dynquant, batch_size=batch_size, prefix_cache=prefix_cache, scoring_graph=scoring_graph)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    assert lm.stats["mode"] == "exact (DynamicQuantizeLinear x9)"


def test_incremental_path_honours_exact_mode(dynquant):
    """path=incremental on a detected graph: every input on a Generator of its own, no rewind to the previous
    input's prefix (on main: 0.11 nats off the oracle). One-token continuations: one og pass per input, as
    the oracle's (a longer one is appended in a second pass: og's API, not comparable to one pass here)."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(dynquant), max_length=256, path="incremental"))
    pairs = [(f"{HEADER} q {' '.join(rng.choice(WORDS) for _ in range(2 + i))}. Answer:", x)
             for i in range(8) for x in (" A", " B", " the", " 1")]
    pairs = [(c, x) for c, x in pairs if len(lm.tok_encode(c + x)) - len(lm.tok_encode(c)) == 1]
    assert len({c for c, _ in pairs}) >= 6  # several inputs sharing the header: the cursor would rewind
    got = np.array([lp for lp, _ in lm.loglikelihood(instances(pairs), disable_tqdm=True)])
    np.testing.assert_allclose(got, oracle(dynquant, pairs), atol=1e-4)


def test_dynamic_quant_detection_warns_once(dynquant, caplog):
    with caplog.at_level(logging.WARNING, logger="ortevals"):
        lm, _ = scores(dynquant, batch_size=4)
        lm.loglikelihood(instances(PAIRS[:3]), disable_tqdm=True)
    warned = [r for r in caplog.records if "depend on what else is in a pass" in r.getMessage()]
    assert len(warned) == 1 and "DynamicQuantizeLinear x9" in warned[0].getMessage()
    assert lm.engine.canary is None  # detected: no canary needed
    assert not lm.engine.runner.gathers_positions  # the package's own decoder, not the derived graph


# --- the canary -----------------------------------------------------------------------------------------


def test_canary_trips_on_a_graph_detection_misses(shape_dependent, caplog):
    assert not detect([shape_dependent / "model.onnx"]).found
    ref = oracle(shape_dependent, PAIRS)
    with caplog.at_level(logging.WARNING, logger="ortevals"):
        lm, got = scores(shape_dependent, batch_size=4)
        again = [lp for lp, _ in lm.loglikelihood(instances(PAIRS[::-1]), disable_tqdm=True)]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    np.testing.assert_allclose(again, ref[::-1], atol=1e-4)
    warned = [r.getMessage() for r in caplog.records if "invariance canary" in r.getMessage()]
    assert len(warned) == 1 and "switching to exact mode" in warned[0], warned
    assert not lm.engine.canary.passed and lm.engine.canary.max_diff > 1e-2
    assert lm.stats["mode"].startswith("exact (canary")


def test_no_check_keeps_batching_and_is_wrong_there(shape_dependent):
    lm, got = scores(shape_dependent, batch_size=4, check=False)
    assert lm.engine.canary is None and lm.stats["mode"].startswith("batched")
    assert np.abs(got - oracle(shape_dependent, PAIRS)).max() > 1e-2  # what the canary protects against


def test_exact_forces_exact_without_canary(shape_dependent, caplog):
    with caplog.at_level(logging.WARNING, logger="ortevals"):
        lm, got = scores(shape_dependent, batch_size=4, exact=True)
    np.testing.assert_allclose(got, oracle(shape_dependent, PAIRS), atol=1e-4)
    assert lm.engine.canary is None and lm.stats["mode"] == "exact (forced: exact=true)"
    assert lm.engine.forward_passes == len(model_inputs(shape_dependent, PAIRS))  # one pass per input
    assert not [r for r in caplog.records if "invariance canary" in r.getMessage()]


def test_canary_passes_on_an_invariant_graph_and_batching_stays(tiny_pkg):
    pairs = [(" ".join(rng.choice(WORDS) for _ in range(3 + n % 7)), " " + rng.choice(WORDS)) for n in range(30)]
    lm, got = scores(tiny_pkg, pairs, batch_size=None)
    np.testing.assert_allclose(got, oracle(tiny_pkg, pairs), atol=1e-4)
    assert lm.engine.canary.passed and lm.stats["mode"].startswith("batched (canary passed")
    # 6 canary inputs alone + their configured batch + the other 24 inputs in one or two batches
    assert lm.engine.forward_passes <= 6 + 2 + 2 < len(model_inputs(tiny_pkg, pairs))


def _stored_run(pkg, pairs, store, **kw):
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=256, store=str(store), **kw))
    got = np.array([lp for lp, _ in lm.loglikelihood(instances(pairs), disable_tqdm=True)])
    lm.store.close()
    return lm, got


def test_a_stored_verdict_is_reused_and_pays_no_canary(tiny_pkg, shape_dependent, tmp_path):
    """Issue 22 §9: the verdict is an artefact under the scope. Other requests, same package and settings:
    no canary pass; the stored verdict decides the mode, a failing one included."""
    store = tmp_path / "s.sqlite"
    first, _ = _stored_run(tiny_pkg, PAIRS[:8], store, batch_size=4)
    assert first.engine.canary.passed and first.engine.canary_passes > 0 and first.engine.canary_tokens > 0
    second, got = _stored_run(tiny_pkg, PAIRS[8:], store, batch_size=4)
    assert second.engine.canary_passes == 0 and second.engine.canary_tokens == 0
    assert second.engine.canary.passed and second.stats["mode"].endswith("stored verdict reused")
    np.testing.assert_allclose(got, oracle(tiny_pkg, PAIRS[8:]), atol=1e-4)

    bad = tmp_path / "bad.sqlite"
    tripped, _ = _stored_run(shape_dependent, PAIRS[4:], bad, batch_size=4)  # unrelated inputs: batched
    assert not tripped.engine.canary.passed and tripped.engine.canary_passes > 0
    again, got = _stored_run(shape_dependent, PAIRS[:4], bad, batch_size=4)
    assert again.engine.canary_passes == 0 and again.engine.settings.exact
    assert again.stats["mode"].startswith("exact (canary") and again.stats["mode"].endswith("reused")
    np.testing.assert_allclose(got, oracle(shape_dependent, PAIRS[:4]), atol=1e-4)  # exact, as the verdict said


@pytest.mark.parametrize("change", ["batch size", "prefix budget", "package file", "ortevals source",
                                    "onnxruntime"])
def test_what_a_verdict_depends_on_reruns_the_canary(change, tiny_pkg, copy_pkg, tmp_path, monkeypatch):
    from ortevals.package import scope

    store, pkg = tmp_path / "s.sqlite", copy_pkg(tiny_pkg)
    _stored_run(pkg, PAIRS[:6], store, batch_size=4)
    kw = {"batch_size": 4}
    if change == "batch size":
        kw["batch_size"] = 2
    elif change == "prefix budget":
        kw["prefix_budget_mb"] = 64
    elif change == "package file":  # the decoder re-saved with another producer string: its bytes differ
        model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
        model.producer_version = "re-exported"
        onnx.save(model, str(pkg / "model.onnx"))
    elif change == "ortevals source":
        monkeypatch.setattr(scope, "source_digest", lambda: "0" * 64)
    else:
        real = scope.runtime_versions()
        monkeypatch.setattr(scope, "runtime_versions", lambda: {**real, "onnxruntime": "onnxruntime==99"})
    lm, _ = _stored_run(pkg, PAIRS[6:12], store, **kw)
    assert lm.engine.canary_passes > 0 and "stored verdict" not in lm.stats["mode"]


def test_model_args_parse_the_switches(tiny_pkg):
    args = ModelArgs.parse({"pkg": str(tiny_pkg), "exact": "true", "check": "false"})
    assert args.exact is True and args.check is False
    assert ModelArgs.parse({"pkg": str(tiny_pkg)}).check is True


@pytest.mark.parametrize("flags, mode", [([], "exact (DynamicQuantizeLinear x9)"),
                                         (["--exact"], "exact (forced: exact=true)")])
def test_cli_records_the_mode_in_results(dynquant, tmp_path, flags, mode):
    from click.testing import CliRunner

    from ortevals.cli import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(dynquant), "--data", "bundled", "--limit", "2",
                                      "--output", str(out), "--no-resume", "--truncate", "left", *flags],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["ortevals"]["mode"] == mode
    assert f"scoring mode: {mode}" in result.output


def test_cli_no_check_skips_the_canary(shape_dependent, tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(shape_dependent), "--data", "bundled", "--limit",
                                      "2", "--output", str(out), "--no-resume", "--no-check", "--batch-size", "4",
                                      "--truncate", "left"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["ortevals"]["mode"].startswith("batched (check=false")


# --- pure helpers ---------------------------------------------------------------------------------------


def test_compare_tolerance_by_dtype_and_nan():
    lp = np.array([-1.0, -2.0, -3.0])
    assert compare(lp + 5e-5, lp, np.array([1, 1, 1]), "float32").passed
    bad = compare(lp + np.array([0, 3e-4, 0]), lp, np.array([1, 1, 1]), "float32")
    assert not bad.passed and bad.index == 1 and abs(bad.max_diff - 3e-4) < 1e-9 and bad.tolerance == 1e-4
    assert compare(lp + 3e-4, lp, np.array([1, 1, 1]), "float16").passed  # looser for fp16
    assert compare(lp + 3e-4, lp, np.array([16, 16, 16]), "float32").passed  # sqrt(16) * 1e-4
    assert not compare(np.array([np.nan, -2.0, -3.0]), lp, np.array([1, 1, 1]), "float32").passed


def test_pick_canary_takes_shared_prefixes_and_both_extremes():
    inputs = [tuple(range(100, 100 + n)) for n in (5, 9, 13)] + [(1,) * 40 + (k,) for k in range(3)] \
        + [(7,) * 60, (2, 3)] + [(9, k) * 4 for k in range(6)]
    picked = pick_canary(inputs)
    assert len(picked) == 6 and {3, 4, 5} <= set(picked)  # the three sharing 40 tokens
    assert 6 in picked and 7 in picked  # longest and shortest


# --- detection on hand-made graphs ------------------------------------------------------------------------


def _model(node, inputs, inits=()):
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


X3 = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])


def _axes(values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), "axes")


@pytest.mark.parametrize("case, flagged", [
    ("reduce_mean_last", False), ("reduce_max_all", True), ("reduce_sum_seq", True), ("dql", True),
    ("reduce_mean_last_unknown_rank", True), ("mask_length", False), ("mask_over_batch", True),
    ("reduce_noop", False), ("layernorm_last", False), ("argmax_default_axis0", True),
])
def test_detection_on_small_graphs(case, flagged):
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
    x_unknown = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    cases = {
        "reduce_mean_last": _model(helper.make_node("ReduceMean", ["x", "axes"], ["y"]), [X3], [_axes([-1])]),
        "reduce_max_all": _model(helper.make_node("ReduceMax", ["x"], ["y"]), [X3]),
        "reduce_sum_seq": _model(helper.make_node("ReduceSum", ["x", "axes"], ["y"]), [X3], [_axes([1])]),
        "dql": _model(helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"]), [X3]),
        "reduce_mean_last_unknown_rank": _model(helper.make_node("ReduceMean", ["x", "axes"], ["y"]),
                                                [x_unknown], [_axes([-1])]),
        "mask_length": _model(helper.make_node("ReduceSum", ["attention_mask", "axes"], ["y"]), [mask], [_axes([1])]),
        "mask_over_batch": _model(helper.make_node("ReduceSum", ["attention_mask", "axes"], ["y"]), [mask],
                                  [_axes([0])]),
        "reduce_noop": _model(helper.make_node("ReduceSum", ["x"], ["y"], noop_with_empty_axes=1), [X3]),
        "layernorm_last": _model(helper.make_node("LayerNormalization", ["x", "g"], ["y"]), [X3],
                                 [numpy_helper.from_array(np.ones(64, np.float32), "g")]),
        "argmax_default_axis0": _model(helper.make_node("ArgMax", ["x"], ["y"]), [X3]),
    }
    found = scan_graph(cases[case])
    assert bool(found) == flagged, found


def _constant_axes(form):
    """A Constant node holding the axes ``[-1]`` (or the scale 0.5) in one of the forms onnx allows."""
    if form == "sparse_value":
        sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([-1], np.int64), "v"),
                                           numpy_helper.from_array(np.array([0], np.int64), "i"), [1])
        return helper.make_node("Constant", [], ["axes"], sparse_value=sparse)
    value = {"value": numpy_helper.from_array(np.array([-1], np.int64)), "value_ints": [-1], "value_int": -1,
             "value_floats": [0.5], "value_float": 0.5}[form]
    return helper.make_node("Constant", [], ["axes"], **{form: value})


@pytest.mark.parametrize("form", ["value", "value_ints", "value_int", "sparse_value", "value_floats", "value_float"])
def test_detection_reads_every_constant_form(form):
    """A Constant in any form onnx allows is read (Mobius writes axes as value_ints): an integer one is the axes
    of a ReduceMean over the last axis, a float one the fixed activation scale of MatMulIntegerToFloat."""
    if form.startswith("value_float"):
        node = helper.make_node("MatMulIntegerToFloat", ["x", "w", "axes", "ws"], ["y"], domain="com.microsoft")
    else:
        node = helper.make_node("ReduceMean", ["x", "axes"], ["y"])
    graph = helper.make_graph([_constant_axes(form), node], "g", [X3],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    assert not scan_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    computed = helper.make_graph([helper.make_node("Shape", ["x"], ["axes"]), node], "g", [X3], graph.output)
    assert scan_graph(helper.make_model(computed, opset_imports=[helper.make_opsetid("", 18)]))  # run-time axes


def test_detection_on_real_graphs(tiny_pkg, dynquant, gemma4):
    assert not detect([tiny_pkg / "model.onnx"]).found  # builder's ReduceSum(attention_mask, 1) is per row
    assert not detect([gemma4[1] / "embedding.onnx", gemma4[1] / "decoder.onnx"]).found
    found = detect([dynquant / "model.onnx"])
    assert found.ops == (("DynamicQuantizeLinear", 9),) and found.reason == "DynamicQuantizeLinear x9"
    model = onnx.load(str(dynquant / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == 11  # really dynamically quantized


def test_canary_inputs_are_cut_short_and_keep_their_shared_prefix():
    from ortevals.engine.score.invariance import CANARY_TOKENS, SHARED_KEEP, shorten
    from ortevals.tokens import common_prefix

    header = tuple(range(1000, 1500))  # a 500-token few-shot header
    pairs = [(header + (1, 2, 3), (7,)), (header + (4, 5), (8,)), (header + (6,), (9, 9)),
             (tuple(range(2000, 2400)), (5,)), ((3, 4), (6,))]
    cut = shorten(pairs)
    assert [x for _, x in cut] == [x for _, x in pairs]  # continuations untouched
    assert all(c == p[-len(c):] for (c, _), (p, _) in zip(cut, pairs))  # only leading context dropped
    group = [c + x for c, x in cut[:3]]
    assert common_prefix(group[0], group[1]) == common_prefix(group[0], group[2]) == SHARED_KEEP
    assert len(cut[3][0]) + 1 == CANARY_TOKENS and cut[4] == pairs[4]  # the long one cut, the short one kept
    assert all(len(c) >= 1 for c, _ in shorten([((1,), (2,) * 300)]))  # a context keeps one token


def test_prefill_canary_slices_keep_a_shared_past_and_pad():
    """The prefill canary's inputs (``slices``): at most SLICE_TOKENS tokens each; the shared-prefix group
    still shares SLICE_SHARED tokens; the others get distinct lengths (their batch pads); continuations whole."""
    from ortevals.engine.score.invariance import SLICE_SHARED, SLICE_TOKENS, slices
    from ortevals.tokens import common_prefix

    header = tuple(range(1000, 1500))  # a 500-token few-shot header
    pairs = [(header + tuple(range(1, 100)), (7,)), (header + (4, 5), (8,)), (header + tuple(range(6, 60)), (9, 9)),
             (header[:300] + tuple(range(2000, 2400)), (5,)), (tuple(range(3000, 3350)), (6,)), ((3, 4), (6,))]
    cut = slices(pairs)
    assert [x for _, x in cut] == [x for _, x in pairs]  # continuations untouched
    assert all(len(c + x) <= SLICE_TOKENS for c, x in cut)
    group = [c + x for c, x in cut[:3]]
    assert common_prefix(group[0], group[1]) == common_prefix(group[0], group[2]) == SLICE_SHARED
    for (c, _), (p, _) in zip(cut[:3], pairs):  # the header's last tokens, then the context's own last ones
        assert c[:SLICE_SHARED] == header[-SLICE_SHARED:] and c[SLICE_SHARED:] == p[len(p) - len(c) + SLICE_SHARED:]
    assert cut[1][0] == header[-SLICE_SHARED:] + (4, 5)  # a short tail kept whole
    others = [len(c + x) for c, x in cut[3:5]]
    assert others[0] == SLICE_TOKENS and others[0] > others[1] > len(cut[5][0] + cut[5][1])  # distinct: they pad
    assert all(c == p[-len(c):] for (c, _), (p, _) in zip(cut[3:], pairs[3:])) and cut[5] == pairs[5]
    assert slices([((1,), (2,) * 300)]) == [((1,), (2,) * 300)]  # a context keeps one token
    assert slices([((1, 2, 3), (4,)), ((1, 2, 5), (6,))]) == [((1, 2, 3), (4,)), ((1, 2, 5), (6,))]  # short: kept


def test_canary_passes_pad_a_batch_reuse_a_past_and_gather_the_head(tiny_pkg, tmp_path):
    """What the cheaper canary runs the configured way on inputs shaped like MMLU-Pro's (a long shared
    header, long questions): a right-padded batch of several rows, a shared prefix's past, and only the
    scored positions through the LM head; the reference side one row at a time with no past."""
    from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.sessions import DecoderRunner

    pkg = ModelPackage.load(tiny_pkg)
    runner = DecoderRunner.open(pkg, from_package({}, "cpu"), tmp_path)
    gen = np.random.default_rng(3)
    body = lambda n: tuple(int(t) for t in gen.integers(3, pkg.vocab_size, n))  # noqa: E731
    header = body(300)
    reqs = [TokenRequest(header + body(n), body(1)) for n in (80, 120, 150, 40, 60, 90)]
    reqs += [TokenRequest(body(n), body(1)) for n in (300, 340, 380, 420)]
    engine = PrefillEngine(runner, EngineSettings(max_length=1024, vocab_size=pkg.vocab_size))
    passes, call = [], engine._call

    def spy(ids, mask, past=None, want_present=False, positions=None, targets=None):
        passes.append((ids.shape[0], bool((mask[:, mask.shape[1] - ids.shape[1]:] == 0).any()), past is not None,
                       positions is not None))
        return call(ids, mask, past, want_present, positions, targets)

    engine._call = spy
    engine.score(reqs)
    canary = passes[:engine.canary_passes]
    assert engine.canary.passed and canary
    assert any(rows > 1 and padded for rows, padded, _, _ in canary)  # a right-padded batch
    assert any(past for *_, past, _ in canary)  # continuations on a shared prefix's past
    assert all(gathered for *_, gathered in canary)  # the head at the scored positions only
    alone = [p for p in canary if p[0] == 1 and not p[1] and not p[2]]
    assert len(alone) >= 6  # the reference: each canary input alone, no past


@pytest.fixture(scope="module")
def leaky(tiny_pkg, tmp_path_factory):
    """The tiny package with GQA in plain ops under CUDA's contract, broken on a past (gqa_contract ``leak``)."""
    from tests.fixtures.gqa_contract import contract_package

    return contract_package(tiny_pkg, tmp_path_factory.mktemp("leaky") / "tiny-leaky", leak=True)


def test_canary_catches_a_kernel_that_breaks_its_contract_on_a_past(tiny_pkg, leaky, caplog):
    """A kernel right on first prompts but off by one on a past (each query sees the next key) is invisible
    to graph detection and to one row alone; the canary's prefix continuation shows it, the run goes exact
    and equals the raw-onnxruntime oracle on the real kernel. With the check off the scores are wrong."""
    assert not detect([leaky / "model.onnx"]).found
    ref = oracle(tiny_pkg, PAIRS)
    np.testing.assert_allclose(scores(leaky, PAIRS, exact=True)[1], ref, atol=1e-4)  # first prompts: right
    with caplog.at_level(logging.WARNING, logger="ortevals"):
        lm, got = scores(leaky)
    assert lm.stats["mode"].startswith("exact (canary"), lm.stats["mode"]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    unchecked = scores(leaky, check=False)[1]
    assert np.abs(unchecked - ref).max() > 1e-2  # what the canary protects against
