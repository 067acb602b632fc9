"""What a scoring pass moves and computes on a device, proven on CPU (issue 20).

* The derived graph scores on the device: only log-probabilities and greedy flags come back,
  equal to the full-logit host path (tiny package, SmolLM2).
* fp16/bf16 logits are scored in float32 from the first op after the LM head (a hand-made fp16
  graph with known logits, where fp16 accumulation is measurably off).
* A separate embedding model's outputs are bound into the decoder as OrtValues, never through numpy.
* ``--ep tensorrt`` is refused in one line.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest
from ortevals.engine.score.scoring import continuation_logprob, log_softmax
from ortevals.errors import ProviderError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.derive import GREEDY, LOGPROBS, TARGETS, _add_scores
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner


def _requests(full: DecoderRunner, seed: int) -> list[TokenRequest]:
    """Six inputs, each with four one-token choices (one of them the model's argmax: greedy flags both ways)
    and one 7-token continuation, so groups have several members and K > 1."""
    rng = np.random.default_rng(seed)
    vocab = full.package.vocab_size
    reqs = []
    for q in range(6):
        ctx = tuple(int(t) for t in rng.integers(3, vocab, 40 + 9 * q))
        logits, _ = full.forward(np.array([ctx], np.int64), np.ones((1, len(ctx)), np.int64))
        top = int(logits[0, -1].argmax())
        reqs += [TokenRequest(ctx, (c,)) for c in (top, *(int(t) for t in rng.integers(3, vocab, 3)))]
        reqs.append(TokenRequest(ctx[:-7], ctx[-7:]))
    return reqs


class RunSpy:
    """Records what every run of a real decoder session returns to the host: (output name, shape) pairs."""

    def __init__(self, session, monkeypatch):
        self.runs: list[list[tuple[str, tuple]]] = []
        real_run = session.run

        def run(names, feeds, *a, **k):
            outs = real_run(names, feeds, *a, **k)
            self.runs.append([(n, o.shape) for n, o in zip(names, outs)])
            return outs

        monkeypatch.setattr(session, "run", run)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_graph_scores_equal_the_full_logit_path(which, tiny_pkg, smollm2, tmp_path, monkeypatch):
    pkg = ModelPackage.load(tiny_pkg if which == "tiny" else smollm2[1])
    cpu = from_package({}, "cpu")
    full, derived = DecoderRunner.open(pkg, cpu), DecoderRunner.open(pkg, cpu, tmp_path)
    assert derived.scores_in_graph and not full.scores_in_graph
    reqs = _requests(full, seed=1)
    settings = EngineSettings(max_length=512, vocab_size=pkg.vocab_size, check=False)
    ref = PrefillEngine(full, settings).score(reqs)
    spy = RunSpy(derived.decoder, monkeypatch)
    engine = PrefillEngine(derived, settings)
    got = engine.score(reqs)
    # scoring passes return [B,K,M] scores; the shared prefixes' KV passes one row of logits, never [B,S,V]
    scored = [r for r in spy.runs if [n for n, _ in r] == [LOGPROBS, GREEDY]]
    assert len(scored) + len([r for r in spy.runs if r[0] == (pkg.logits_name, (1, 1, pkg.vocab_size))]) \
        == len(spy.runs) == engine.forward_passes and scored
    a, b = np.array([s.logprob for s in ref]), np.array([s.logprob for s in got])
    # the host's float32 arithmetic (|lp| up to 106 here; measured max |diff| 9.5e-7)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    assert [s.greedy for s in got] == [s.greedy for s in ref] and 0 < sum(s.greedy for s in ref) < len(ref)


def _head_graph(dtype: int) -> ort.InferenceSession:
    """A hand-made "head": logits input ``[B,K,V]`` of ``dtype`` → Identity → ``logits``, then the derived
    graph's scoring nodes (runtime/derive._add_scores) on it. Checks first that every value the scoring
    nodes make is float32/float64 (or an index/flag): onnxruntime's CPU provider runs fp16 ops in float32
    anyway, so only the graph's types show what a device with fp16 kernels would compute."""
    import onnx

    graph = helper.make_graph([helper.make_node("Identity", ["head"], ["logits"])], "head",
                              [helper.make_tensor_value_info("head", dtype, ["b", "k", "v"])],
                              [helper.make_tensor_value_info("logits", dtype, ["b", "k", "v"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    _add_scores(model, "logits")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.output]}
    made = [o for n in inferred.node if n.name.startswith(TARGETS) for o in n.output]
    assert made and {types[o] for o in made} <= {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64,
                                                 TensorProto.BOOL}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _fp16_logits() -> tuple[np.ndarray, np.ndarray]:
    """fp16 logits ``[1,2,V]``, V = 131,072 values near 4 (the argmax 4.25 at token 7), and targets ``[1,2,3]``.
    The sum of exp(x - max) is about 100,000: past fp16's largest value (65,504), so fp16 arithmetic gives
    log-probabilities of -inf where float32 gives about -11.7."""
    rng = np.random.default_rng(0)
    x = rng.normal(4.0, 0.01, size=(1, 2, 131072)).astype(np.float16)
    x[0, :, 7] = 4.25
    return x, np.array([[[7, 11, 12345], [7, 0, 131071]]], np.int64)


def _fp16_arithmetic(x: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """What scoring in the logits' own type would give: log-softmax computed in fp16."""
    shifted = x - x.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        lse = np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float16))
    return np.take_along_axis(shifted - lse, targets, axis=2).astype(np.float64)


def test_fp16_logits_are_scored_in_float32_in_the_graph():
    x, targets = _fp16_logits()
    lp, greedy = _head_graph(TensorProto.FLOAT16).run([LOGPROBS, GREEDY], {"head": x, TARGETS: targets})
    exact = np.take_along_axis(log_softmax(x.astype(np.float64), np.float64), targets, axis=2)
    assert np.isinf(_fp16_arithmetic(x, targets)).all()  # the case can tell: fp16 accumulation fails here
    assert lp.dtype == np.float32 and np.abs(lp - exact).max() < 1e-5
    assert greedy.tolist() == [[[True, False, False], [True, False, False]]]


def test_fp16_logits_are_scored_in_float32_on_the_host():
    """The host path (full logits, engine/score/scoring.py) upcasts before any reduction."""
    x, targets = _fp16_logits()
    exact = np.take_along_axis(log_softmax(x.astype(np.float64), np.float64), targets, axis=2)
    for j in range(targets.shape[2]):
        lp, greedy = continuation_logprob(x[0], targets[0, :, j])
        assert abs(lp - exact[0, :, j].sum()) < 1e-5 and greedy == (j == 0)


def test_bf16_logits_are_scored_in_float32_in_the_graph():
    import ml_dtypes

    x, targets = _fp16_logits()
    bf16 = x.astype(np.float32).astype(ml_dtypes.bfloat16)
    value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bf16.view(np.uint16), TensorProto.BFLOAT16)
    sess = _head_graph(TensorProto.BFLOAT16)
    lp, greedy = (v.numpy() for v in sess.run_with_ort_values(
        [LOGPROBS, GREEDY], {"head": value, TARGETS: ort.OrtValue.ortvalue_from_numpy(targets)}))
    exact = np.take_along_axis(log_softmax(bf16.astype(np.float64), np.float64), targets, axis=2)
    assert np.abs(lp - exact).max() < 1e-5 and greedy[0, :, 0].all() and not greedy[0, :, 1:].any()


def test_embedding_outputs_are_bound_into_the_decoder_without_numpy(gemma4, monkeypatch):
    """On a device the embedding's outputs stay there: the decoder binds the embedding's own OrtValues.
    A spy on the real OrtValue/IOBinding API counts host copies; scores equal the host path."""
    pkg = ModelPackage.load(gemma4[1])
    cpu = from_package({}, "cpu")
    host, bound = DecoderRunner.open(pkg, cpu), DecoderRunner.open(pkg, cpu, io_binding=True)
    ids = np.random.default_rng(0).integers(3, pkg.vocab_size, (2, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    ref, _ = host.forward(ids, mask)
    made, bound_in, to_numpy, copied_in = [], {}, [], []
    real_outputs, real_bind = ort.IOBinding.get_outputs, ort.IOBinding.bind_ortvalue_input
    real_numpy, real_cpu = ort.OrtValue.numpy, ort.IOBinding.bind_cpu_input

    def get_outputs(self):
        outs = real_outputs(self)
        made.extend(outs)
        return outs

    monkeypatch.setattr(ort.IOBinding, "get_outputs", get_outputs)
    monkeypatch.setattr(ort.IOBinding, "bind_ortvalue_input",
                        lambda self, name, v: (bound_in.__setitem__(name, v), real_bind(self, name, v))[1])
    monkeypatch.setattr(ort.IOBinding, "bind_cpu_input",
                        lambda self, name, v: (copied_in.append(name), real_cpu(self, name, v))[1])
    monkeypatch.setattr(ort.OrtValue, "numpy", lambda self: (to_numpy.append(self), real_numpy(self))[1])
    got, _ = bound.forward(ids, mask)
    embeds = pkg.decoder.inputs.get("inputs_embeds", "inputs_embeds")
    assert any(bound_in[embeds] is v for v in made)  # the embedding session's own output, bound as it is
    assert embeds not in copied_in and len(to_numpy) == 1  # one host copy: the logits
    np.testing.assert_array_equal(got, ref)


def test_tensorrt_is_refused_in_one_line(tiny_pkg, tmp_path):
    for ep in ("tensorrt", "trt", "TensorrtExecutionProvider"):
        with pytest.raises(ProviderError, match="tensorrt.*not supported by ortevals yet.*use --ep cuda"):
            from_package({}, ep)
    with pytest.raises(ProviderError, match="provider_options"):  # a package that lists it first
        from_package({"provider_options": [{"tensorrt": {}}]})
    proc = subprocess.run([sys.executable, "-m", "ortevals.cli", "mmlu-pro", "--pkg", str(tiny_pkg), "--ep",
                           "tensorrt", "--data", "bundled", "--limit", "1", "--no-resume", "--output",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--ep tensorrt" in errors[0] and "Traceback" not in proc.stderr


def test_ray_warm_prefix_keeps_reusing_prefix_passes_on_the_derived_graph(tiny_pkg, tmp_path, monkeypatch):
    """The engine's prefix passes now ask a derived graph for one position; a Ray worker's WarmPrefix keys on it
    and still reuses the header's pass across chunks."""
    from ortevals.integrations.ray import WarmPrefix

    pkg = ModelPackage.load(tiny_pkg)
    runner = DecoderRunner.open(pkg, from_package({}, "cpu"), tmp_path)
    kv_passes, real = [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda *a: (kv_passes.append(a[3] if len(a) > 3 else False), real(*a))[1])
    header = tuple(range(3, 83))
    reqs = [TokenRequest(header + (90 + q, 91 + q), (c,)) for q in range(3) for c in (5, 6)]
    engine = PrefillEngine(WarmPrefix(runner), EngineSettings(max_length=512, vocab_size=pkg.vocab_size,
                                                              prefix_min_saving=16, check=False))
    first = engine.score(reqs)
    assert sum(kv_passes) == 1  # the header's KV, computed once
    again = engine.score(reqs)  # the next chunk under the same header
    assert sum(kv_passes) == 1 and [s.logprob for s in again] == [s.logprob for s in first]


def test_derived_graph_cache_key_covers_the_rewrite(tiny_pkg, monkeypatch):
    """A change to the graph edit (its version or options) is a new derived graph, never a stale one."""
    from ortevals.runtime import derive

    pkg = ModelPackage.load(tiny_pkg)
    before = derive.derive_scope(pkg)
    assert derive.REWRITE["rewrite"] in before.settings
    monkeypatch.setattr(derive, "REWRITE", {**derive.REWRITE, "scores": "something else"})
    assert derive.derive_scope(pkg).digest != before.digest


def test_a_tied_embedding_is_gathered_from_the_head_weight_as_it_is(smollm2, tmp_path):
    """SmolLM2 ties its embedding to the LM head: the builder reads it as Gather(Transpose(head weight)), which
    onnxruntime folds into a second table (or, above 1 GiB, transposes in every pass). The derived graph takes
    the rows from the weight untransposed (Gather axis 1, then a transpose of the rows taken): no transpose
    of the weight is left, and its logits are the package graph's bit for bit."""
    import onnx

    from ortevals.runtime.derive import derived_path

    pkg = ModelPackage.load(smollm2[1])
    cpu = from_package({}, "cpu")
    full, derived = DecoderRunner.open(pkg, cpu), DecoderRunner.open(pkg, cpu, tmp_path)
    graph = onnx.load(str(derived_path(pkg, tmp_path)), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    assert not [n.name for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    assert any(n.op_type == "Gather" and n.input[0] in weights and n.input[1] == "input_ids" for n in graph.node)
    ids = np.random.default_rng(0).integers(3, pkg.vocab_size, (2, 40)).astype(np.int64)
    mask = np.ones_like(ids)
    positions = np.broadcast_to(np.arange(40), (2, 40))
    assert np.array_equal(full.forward(ids, mask)[0], derived.forward(ids, mask, None, False, positions)[0])
