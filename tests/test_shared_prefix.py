"""The shared-prefix scoring graph (issue 46): many rows on one bound copy of a prefix's KV, as one pass of each.

* The graph (runtime/prefix_graph.py) against a plain onnxruntime session of the package's own decoder, one full
  pass per row (the oracle uses onnxruntime alone): the tiny package, SmolLM2, and hand-changed graphs for what the
  builder's CPU exports lack (softcap, interleaved rotary, a scale that is not a power of two, the Q/K norm fused
  into the attention node), within float32 rounding; an fp16 graph within fp16's.
* The engine with ``shared_prefix_batch=on`` on real MMLU-Pro prompts: equal to exact mode within float32
  rounding, the same answers, many rows a pass; the fallbacks (windows, int8 activations on CPU) in one line.
* What it is keyed by (the canary's key, the result store's scope) and the option's one-line refusals.
The parity matrix (tests/test_matrix.py, path ``shared_batch``) covers every builder architecture.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.score.invariance import canary_key
from ortevals.engine.score.passes import EngineSettings, Group, shared_batches
from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.runtime.cascade import Refused
from ortevals.runtime.prefix_graph import PREFIX_KEY, PREFIX_LENGTH, PREFIX_RESIDENT, PREFIX_VALUE, prefix_decoder
from tests.fixtures import attention_variants
from tests.fixtures.matrix.prompts import requests

FLOAT32 = (1e-5, 1e-6)  # float32 rounding of another summation order: atol + rtol * |log-prob|


def _session(path, weights_dir):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _one_pass(pkg: ModelPackage, ids: np.ndarray, want_present: bool = False):
    """The package's own decoder, one pass from an empty past, plain onnxruntime: (logits [S,V], present)."""
    sess = _session(pkg.decoder.path, pkg.root)
    feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)}
    for spec in pkg.kv:
        dtype = np.float16 if spec.dtype == "float16" else np.float32
        feeds[spec.key_name] = feeds[spec.value_name] = np.zeros((1, spec.kv_heads, 0, spec.head_size), dtype)
    names = [pkg.logits_name] + [n for s in pkg.kv for n in (s.present_key_name, s.present_value_name)]
    out = sess.run(names, feeds)
    return out[0][0].astype(np.float64), out[1:]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _shared_vs_one_pass(graph_pkg: ModelPackage, oracle_pkg: ModelPackage, tmp_path, seed: int = 0):
    """(the graph's log-probs [B,M], the oracle's [B,M]) for five rows of different lengths on a 60-token prefix,
    scored at each row's last two positions for 40 targets; the prefix's KV from the oracle's own pass."""
    rng = np.random.default_rng(seed)
    vocab = oracle_pkg.vocab_size
    prefix = rng.integers(3, vocab, 60)
    lens = [9, 17, 5, 12, 30]
    rows = [rng.integers(3, vocab, n) for n in lens]
    _, present = _one_pass(oracle_pkg, prefix, want_present=True)
    sess = _session(prefix_decoder(graph_pkg, tmp_path / "cache"), graph_pkg.root)
    ids = np.zeros((len(rows), max(lens)), np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    positions = np.array([[n - 2, n - 1] for n in lens], np.int64)[:, :, None]
    targets = np.tile(rng.integers(3, vocab, 40)[None, None], (len(rows), 2, 1))
    feeds = {"input_ids": ids, "ortevals_positions": positions, "ortevals_targets": targets,
             PREFIX_LENGTH: np.array([60]), PREFIX_RESIDENT: np.array([60])}
    for i, spec in enumerate(graph_pkg.kv):
        feeds[PREFIX_KEY % spec.layer], feeds[PREFIX_VALUE % spec.layer] = present[2 * i][0], present[2 * i + 1][0]
    ours = sess.run(["ortevals_logprobs"], feeds)[0]
    ref = np.stack([_log_softmax(_one_pass(oracle_pkg, np.concatenate([prefix, r]))[0][[60 + n - 2, 60 + n - 1]])
                    [:, targets[0, 0]] for r, n in zip(rows, lens)])
    return ours, ref


def _assert_float32(ours, ref):
    atol, rtol = FLOAT32
    worst = np.max(np.abs(ours - ref) - rtol * np.abs(ref))
    assert worst <= atol, f"shared-prefix graph {worst:.3g} beyond float32 rounding of one pass"


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_graph_scores_each_row_as_one_pass_of_the_package(which, request, tmp_path):
    pkg = ModelPackage.load(request.getfixturevalue("tiny_pkg") if which == "tiny"
                            else request.getfixturevalue("smollm2")[1])
    _assert_float32(*_shared_vs_one_pass(pkg, pkg, tmp_path))


@pytest.mark.parametrize("attributes", [{"softcap": 3.0}, {"rotary_interleaved": 1}, {"scale": 0.3}],
                         ids=["softcap", "interleaved", "scale"])
def test_softcap_interleaved_rotary_and_any_scale_as_the_kernel_computes_them(attributes, tiny_pkg, tmp_path):
    pkg = ModelPackage.load(attention_variants.with_attributes(tiny_pkg, tmp_path / "pkg", **attributes))
    ours, ref = _shared_vs_one_pass(pkg, pkg, tmp_path)
    plain, _ = _shared_vs_one_pass(ModelPackage.load(tiny_pkg), ModelPackage.load(tiny_pkg), tmp_path / "plain")
    assert np.max(np.abs(ref - plain)) > 0.1  # the change reaches the numbers: a graph ignoring it would fail
    _assert_float32(ours, ref)


def test_the_fused_qk_norm_as_the_unfused_chain_computes_it(fixture_cache, tmp_path):
    from tests.fixtures.matrix.cache import built

    folder, info = built("qwen3", fixture_cache)
    fused, unfused = attention_variants.fused_qk_norm(folder / "fp32", tmp_path / "fused", tmp_path / "unfused")
    fused_pkg, unfused_pkg = ModelPackage.load(fused), ModelPackage.load(unfused)
    nodes = onnx.load(str(fused_pkg.decoder.path), load_external_data=False).graph.node
    assert all(n.input[14] and n.input[15] for n in nodes if n.op_type == "GroupQueryAttention")
    _assert_float32(*_shared_vs_one_pass(fused_pkg, unfused_pkg, tmp_path))


def test_an_fp16_graph_attends_in_float32_within_fp16_rounding(tiny_pkg, tmp_path):
    """Its attention runs in float32 (the casts): as close to the fp32 package as the fp16 package's own pass."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = attention_variants.with_attributes(tiny_pkg, tmp_path / "fp16")
    model = convert_float_to_float16(onnx.load(str(half / "model.onnx")), keep_io_types=False)
    onnx.save(model, str(half / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    pkg16, pkg32 = ModelPackage.load(half), ModelPackage.load(tiny_pkg)
    ours, ref16 = _shared_vs_one_pass(pkg16, pkg16, tmp_path / "a")
    _, ref32 = _shared_vs_one_pass(pkg32, pkg32, tmp_path / "b")
    assert np.max(np.abs(ours - ref16)) < 2e-2  # the canary's fp16 tolerance
    assert np.max(np.abs(ours - ref32)) <= 1.5 * np.max(np.abs(ref16 - ref32))


def _engine_scores(pkg, **args):
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=1024, **args))
    out = lm.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(requests())], disable_tqdm=True)
    return np.array([lp for lp, _ in out]), lm


def test_the_engine_on_real_mmlu_pro_prompts_equals_exact_mode(smollm2):
    """Four real five-shot MMLU-Pro questions (ten choices each) on SmolLM2: one shared-prefix pass for the four,
    every request within float32 rounding of exact mode, the same answer for every question; the mode line and
    the engine's record say how it ran."""
    ours, lm = _engine_scores(smollm2[1], shared_prefix_batch="on")
    exact, _ = _engine_scores(smollm2[1], exact=True)
    _assert_float32(ours, exact)
    contexts = [c for c, _ in requests()]
    for context in set(contexts):
        chosen = [i for i, c in enumerate(contexts) if c == context]
        assert ours[chosen].argmax() == exact[chosen].argmax()
    stats = lm.engine.shared_stats
    assert stats["rows"] >= 4 and stats["passes"] < stats["rows"]
    assert "shared-prefix batches" in lm.run.stats["mode"] and "padding" in lm.run.stats["mode"]


def test_packages_it_cannot_serve_fall_back_in_one_logged_line(lfm2, tiny_int4, caplog):
    """A hybrid package (LFM2: recurrent state) and, on CPU, an int4 package (int8 activations) are scored one
    input a pass, with the exact numbers, and the mode line says why."""
    for pkg, why in ((lfm2[1], "recurrent state"), (tiny_int4, "int8")):
        ours, lm = _engine_scores(pkg, shared_prefix_batch="on")
        exact, _ = _engine_scores(pkg, exact=True)
        assert np.max(np.abs(ours - exact)) <= 1e-5
        assert lm.engine.shared_stats["passes"] == 0 and why in lm.run.stats["mode"]


def test_what_the_graph_cannot_serve_is_refused_in_one_line(lfm2, tmp_path):
    pkg = ModelPackage.load(lfm2[1])
    with pytest.raises(Refused, match="recurrent state"):
        prefix_decoder(pkg, tmp_path)


def test_shared_batches_sort_bucket_and_keep_to_the_budgets():
    groups = [Group(tuple(range(100 + n)), ((i, 1),)) for i, n in enumerate([37, 5, 90, 12, 64, 33, 8])]
    settings = EngineSettings(max_length=4096, vocab_size=1000, shape_bucket=16, shared_token_budget=200,
                              attention_heads=4, memory_budget_mb=1024)
    out = list(shared_batches(groups, 100, settings))
    assert sorted(len(g.tokens) for rows, _ in out for g in rows) == sorted(len(g.tokens) for g in groups)
    for rows, width in out:
        own = [len(g.tokens) - 100 for g in rows]
        assert own == sorted(own) and width % 16 == 0 and max(own) <= width < max(own) + 16
        assert len(rows) * width <= 200 or len(rows) == 1
    assert [len(rows) for rows, _ in out] == [4, 2, 1]  # 5, 8, 12, 33 at 48 (192); 37, 64 at 64 (128); 90 alone
    tight = EngineSettings(max_length=4096, vocab_size=1000, shared_token_budget=0, attention_heads=4,
                           memory_budget_mb=1)  # 12 * 4 * w * (100 + w) bytes of scores a row
    for rows, width in shared_batches(groups, 100, tight):
        assert len(rows) == 1 or len(rows) * (12 * 4 * width * (100 + width) + 24000) <= 2**20


def test_the_mode_is_part_of_every_key():
    on = EngineSettings(max_length=1, vocab_size=1, shared_prefix_batch=True)
    off = EngineSettings(max_length=1, vocab_size=1)
    assert canary_key("prefill", on) != canary_key("prefill", off)


def test_the_option_is_refused_where_it_would_do_nothing():
    from ortevals.options import parse_model_args

    with pytest.raises(OrtEvalsError, match="shared_prefix_batch='on' does nothing without prefix_cache=true"):
        parse_model_args({"pkg": "x", "shared_prefix_batch": "on", "prefix_cache": "false"})
    with pytest.raises(OrtEvalsError, match="shared_prefix_batch must be one of auto, on, off"):
        parse_model_args({"pkg": "x", "shared_prefix_batch": "yes"})


@pytest.mark.parametrize("value", ["on", "off"])
def test_the_option_with_path_incremental_is_one_line_before_any_work(value):
    """path=incremental scores on onnxruntime-genai, which never runs a shared-prefix pass: on or off there is
    refused in one line (the CLI: exit 2) before the package is read (it does not exist); auto is accepted."""
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.options import parse_model_args
    from tests.test_cli import assert_one_line_error

    needle = f"shared_prefix_batch={value!r} does nothing without prefix_cache=true, scoring_graph=true, exact=false " \
             "and path=auto or prefill"
    with pytest.raises(OrtEvalsError, match=needle):
        parse_model_args({"pkg": "x", "shared_prefix_batch": value, "path": "incremental"})
    result = CliRunner().invoke(cli, ["run", "--pkg", "/nonexistent/package", "--tasks", "gsm8k", "--model-args",
                                      f"shared_prefix_batch={value},path=incremental"], catch_exceptions=False)
    assert_one_line_error(result, needle)
    assert parse_model_args({"pkg": "x", "path": "incremental"}).shared_prefix_batch == "auto"
    assert parse_model_args({"pkg": "x", "shared_prefix_batch": value, "path": "prefill"}).path == "prefill"


def _engine(pkg_dir, cache, io_binding: bool, **settings):
    """A prefill engine on ``pkg_dir`` (``io_binding``: KV left as OrtValues, as on a device), with a shared-prefix
    runner when ``shared_prefix_batch`` is set."""
    from ortevals.engine.score.prefill import PrefillEngine
    from ortevals.package.reuse import reuse_policy
    from ortevals.runtime.prefix_runner import PrefixRunner
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    pkg, cpu = ModelPackage.load(pkg_dir), ProviderConfig("cpu")
    runner = DecoderRunner.open(pkg, cpu, cache, io_binding=io_binding)
    shared = PrefixRunner.open(runner, cpu, cache) if settings.get("shared_prefix_batch") else None
    base = EngineSettings(max_length=1024, vocab_size=pkg.vocab_size, pad_token_id=pkg.pad_token_id or 0,
                          check=False, reuse=reuse_policy(pkg), attention_heads=4, prefix_min_saving=16)
    return PrefillEngine(runner, dataclasses.replace(base, **settings), shared=shared)


def _token_requests(vocab: int, seed: int = 0):
    from ortevals.engine.score.prefill import TokenRequest

    rng = np.random.default_rng(seed)
    header = tuple(int(t) for t in rng.integers(3, vocab, 90))
    return [TokenRequest(header + tuple(int(t) for t in rng.integers(3, vocab, n)), (int(c),))
            for n in (7, 30, 12, 19, 3) for c in rng.integers(3, vocab, 3)]


@pytest.mark.parametrize("io_binding", [False, True], ids=["host", "device-style"])
def test_one_input_a_pass_writes_into_the_held_prefix_bit_for_bit(tiny_pkg, tmp_path, io_binding, monkeypatch):
    """shared_buffer: the prefix is copied once into a buffer of the widest pass's capacity (own tokens bucketed)
    and every pass writes its tokens there in place: the same numbers, bit for bit, as a new present a pass."""
    from ortevals.runtime.inplace import InplacePasses

    reqs = _token_requests(ModelPackage.load(tiny_pkg).vocab_size)
    plain = _engine(tiny_pkg, tmp_path, io_binding).score(reqs)
    held = []
    real = InplacePasses.held_in
    monkeypatch.setattr(InplacePasses, "held_in", lambda self, past, cap: held.append(cap) or real(self, past, cap))
    ours = _engine(tiny_pkg, tmp_path, io_binding, shared_buffer=True, shape_bucket=8).score(reqs)
    assert [s.logprob for s in ours] == [s.logprob for s in plain]
    assert held == [90 + 32]  # one copy of the header, wide enough for the longest input (30 own tokens -> 32)


def test_shared_prefix_passes_bind_device_kv_by_pointer(tiny_pkg, tmp_path):
    """The prefix KV left as OrtValues (a device's case) is bound without its batch axis, by pointer: the same
    numbers as host arrays."""
    reqs = _token_requests(ModelPackage.load(tiny_pkg).vocab_size, seed=1)
    host = _engine(tiny_pkg, tmp_path, False, shared_prefix_batch=True)
    device = _engine(tiny_pkg, tmp_path, True, shared_prefix_batch=True)
    a, b = host.score(reqs), device.score(reqs)
    assert device.shared_stats["passes"] and device.shared_stats["rows"] > device.shared_stats["passes"]
    assert [s.logprob for s in a] == [s.logprob for s in b]


@pytest.mark.parametrize("header", [20, 90], ids=["prefix-inside-the-window", "prefix-past-the-window"])
def test_windowed_layers_see_their_window_of_the_prefix(fixture_cache, tmp_path, header):
    """Gemma 3's sliding layers (a 32-token window, the builder's window-sized buffers) under a 20-token prefix
    (its buffer rows past 20 hold nothing) and a 90-token one (the buffer holds its last 32 tokens), six inputs in
    one pass: within
    float32 rounding of one row a pass with no shared prefix."""
    from tests.fixtures.matrix.cache import built

    _six_rows_on_a_header_in_one_pass(built("gemma3", fixture_cache)[0] / "fp32", tmp_path, header)


def _six_rows_on_a_header_in_one_pass(pkg, tmp_path, header: int) -> None:
    """Six inputs (own tokens 5, 40 and 12, two continuations each) on one random ``header``-token prefix: one
    shared-prefix pass, within float32 rounding of exact mode."""
    from ortevals.engine.score.prefill import TokenRequest

    vocab = ModelPackage.load(pkg).vocab_size
    rng = np.random.default_rng(header)
    head = tuple(int(t) for t in rng.integers(3, vocab, header))
    reqs = [TokenRequest(head + tuple(int(t) for t in rng.integers(3, vocab, n)), (int(c),))
            for n in (5, 40, 12) for c in rng.integers(3, vocab, 2)]
    engine = _engine(pkg, tmp_path, False, shared_prefix_batch=True, attention_heads=2)
    ours = np.array([s.logprob for s in engine.score(reqs)])
    exact = np.array([s.logprob for s in _engine(pkg, tmp_path, False, exact=True).score(reqs)])
    assert engine.shared_stats["rows"] == 6 and engine.shared_stats["passes"] == 1
    _assert_float32(ours, exact)


def test_auto_is_on_with_a_gpu_that_holds_a_second_copy_and_off_on_cpu(tiny_pkg, monkeypatch):
    """shared_prefix_batch=auto, resolved when the run opens (run.shared_prefix_plan): on for a device provider
    unless a second session of the decoder would take more than half of what the device holds beside the
    first; off on CPU; off wherever prefix_cache or scoring_graph is off; on and off as given."""
    from ortevals.options import parse_model_args
    from ortevals.run import run as run_module
    from ortevals.runtime.providers import ProviderConfig

    pkg = ModelPackage.load(tiny_pkg)
    weights = run_module.decoder_bytes(pkg)

    def plan(provider, total=None, **given):
        monkeypatch.setattr(run_module, "total_bytes", lambda device, device_id=0: total)
        return run_module.shared_prefix_plan(parse_model_args({"pkg": str(tiny_pkg), **given}), pkg,
                                             provider).shared_prefix_batch

    cuda, cpu = ProviderConfig("cuda"), ProviderConfig("cpu")
    assert plan(cuda, 3 * weights) == "on" and plan(cuda, 3 * weights - 1) == "off" and plan(cuda, None) == "on"
    assert plan(cpu, 10**12) == "off" and plan(cpu, 10**12, shared_prefix_batch="on") == "on"
    assert plan(cuda, 10**12, shared_prefix_batch="off") == "off"
    assert plan(cuda, 10**12, prefix_cache="false") == "off" and plan(cuda, 10**12, scoring_graph="false") == "off"


def test_a_refused_first_shared_pass_is_recorded_as_one_input_a_pass(tiny_pkg, tmp_path, monkeypatch):
    """The shared-prefix graph refusing its first pass (as a device kernel can): every input runs one a pass, and
    the record says so: the mode line, the passes and tokens counted (those onnxruntime ran, counted here around
    the decoder's session calls), and the store, whose answers are then keyed as shared_prefix_batch=off's (a run
    with off reuses every one; one with on, its graph serving, none)."""
    from ortevals.errors import PackageError
    from ortevals.runtime.prefix_runner import PrefixRunner
    from ortevals.runtime.sessions import DecoderRunner

    reqs = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(requests())]
    store = str(tmp_path / "store.sqlite")

    def lm_for(value: str) -> OrtLM:
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=1024, batch_size=1, store=store,
                                          shared_prefix_batch=value))
        lm.run.ready()
        return lm

    lm = lm_for("on")
    ran = []  # (rows, tokens) of every pass onnxruntime ran on the decoder
    real_run, real_inplace = DecoderRunner._run, DecoderRunner.forward_inplace

    def counted_run(self, names, host, input_ids, *rest, **kw):
        ran.append(input_ids.shape)
        return real_run(self, names, host, input_ids, *rest, **kw)

    def counted_inplace(self, input_ids, *rest, **kw):
        ran.append(input_ids.shape)
        return real_inplace(self, input_ids, *rest, **kw)

    def refused(self, *args, **kw):
        raise PackageError("model.onnx: onnxruntime failed to run the shared-prefix scoring graph: test refusal")

    with monkeypatch.context() as m:
        m.setattr(DecoderRunner, "_run", counted_run)
        m.setattr(DecoderRunner, "forward_inplace", counted_inplace)
        m.setattr(PrefixRunner, "score", refused)
        ours = np.array([lp for lp, _ in lm.loglikelihood(reqs, disable_tqdm=True)])
    engine = lm.engine
    assert all(rows == 1 for rows, _ in ran)  # one row a pass: its ids are its real tokens
    assert engine.shared_stats["passes"] == 0 and engine.shared_stats["rows"] == 0
    assert engine.forward_passes == len(ran) and engine.tokens_run == sum(n for _, n in ran)
    assert "one input a pass on shared prefixes (model.onnx: onnxruntime failed" in lm.run.stats["mode"]
    assert "inputs in" not in lm.run.stats["mode"]
    lm.store.close()

    off = lm_for("off")
    again = np.array([lp for lp, _ in off.loglikelihood(reqs, disable_tqdm=True)])
    assert off.run.stats["reused"] == len(reqs) and off.engine.forward_passes == 0
    fresh, _ = _engine_scores(tiny_pkg, shared_prefix_batch="off", store="none", batch_size=1)
    assert np.array_equal(again, ours) and np.max(np.abs(ours - fresh)) <= 1e-5
    off.store.close()
    on = lm_for("on")
    on.loglikelihood(reqs, disable_tqdm=True)
    assert on.run.stats["reused"] == 0 and on.engine.shared_stats["passes"] >= 1


def test_bucketed_passes_stop_at_the_rotary_table(tiny_pkg, tmp_path):
    """A device's 32-token bucket on inputs within 31 tokens of the context: a pass's own tokens are padded only up
    to the rotary table's rows (the decoder's cos_cache, read here with onnx), past which onnxruntime refuses the
    pass (GroupQueryAttention's CheckInputs, RotaryEmbedding's positions). Every input scores: one a pass into the
    held prefix bit for bit as the unbucketed path, many a pass within float32 rounding of exact mode."""
    from ortevals.engine.score.prefill import TokenRequest
    from ortevals.options import parse_model_args
    from ortevals.run.run import engine_settings
    from ortevals.runtime.providers import ProviderConfig

    graph = onnx.load(str(tiny_pkg / "model.onnx"), load_external_data=False).graph
    tables = {t.name: t.dims[0] for t in graph.initializer}
    rows = min(tables[n.input[7]] for n in graph.node if n.op_type == "GroupQueryAttention")
    pkg = ModelPackage.load(tiny_pkg)
    device = engine_settings(pkg, ProviderConfig("cuda"), parse_model_args({"pkg": str(tiny_pkg)}))
    assert device.rotary_rows == rows == 1024 and device.shape_bucket == 32

    rng = np.random.default_rng(7)
    header = tuple(int(t) for t in rng.integers(3, pkg.vocab_size, 500))
    contexts = [header + tuple(int(t) for t in rng.integers(3, pkg.vocab_size, n - 500))
                for n in (rows, rows - 1, rows - 13, rows - 31, rows - 40)]  # own tokens: 524 to 484
    reqs = [TokenRequest(c, (int(t),)) for c in contexts for t in rng.integers(3, pkg.vocab_size, 2)]
    bucketed = {"shape_bucket": 32, "rotary_rows": rows}
    plain = [s.logprob for s in _engine(tiny_pkg, tmp_path, False).score(reqs)]
    held = [s.logprob for s in _engine(tiny_pkg, tmp_path, False, shared_buffer=True, **bucketed).score(reqs)]
    assert held == plain
    engine = _engine(tiny_pkg, tmp_path, False, shared_prefix_batch=True, **bucketed)
    ours = np.array([s.logprob for s in engine.score(reqs)])
    exact = np.array([s.logprob for s in _engine(tiny_pkg, tmp_path, False, exact=True).score(reqs)])
    _assert_float32(ours, exact)
    stats = engine.shared_stats
    assert stats["rows"] == 5 and stats["padded"] > 0 and not engine.shared_refused
