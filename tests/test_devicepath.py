"""The GPU path on a CPU-only machine: no silent provider fallback, raw-session option
filtering, bfloat16 buffers as OrtValues, and batched prefix continuations.

Every test runs the real CPU onnxruntime; where a GPU would be needed, the smallest
seam is patched (the list of available providers, a spy on the session constructor).
Batched prefix continuations, which CPU GroupQueryAttention refuses, run on a copy of
the package whose GQA nodes follow the CUDA kernel's contract in plain ONNX ops
(tests/fixtures/gqa_contract.py), checked against the CPU kernel where it runs.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest
from ortevals.errors import PackageError, ProviderError
from ortevals.install import load_cuda_libraries
from ortevals.package.loader import KVSpec, ModelPackage
from ortevals.runtime.buffers import ONNX_TYPES, KVView, _nbytes, empty_past, host_float32
from ortevals.runtime.providers import from_package, raw_session_options
from ortevals.runtime.replicate import Replicator
from ortevals.runtime.sessions import DecoderRunner, open_session

CPU_ONLY = ["AzureExecutionProvider", "CPUExecutionProvider"]


# --- 1. no silent fallback ----------------------------------------------------------------------

@pytest.fixture()
def cuda_claimed(monkeypatch):
    """onnxruntime says CUDA is available; the real session then falls back to CPU."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *CPU_ONLY])


def test_fallback_to_cpu_is_an_error_naming_provider_file_and_fix(tiny_pkg, cuda_claimed, capfd):
    pkg = ModelPackage.load(tiny_pkg)
    with pytest.raises(ProviderError) as err:
        DecoderRunner.open(pkg, from_package({}, "cuda", {"device_id": "0"}))
    msg = str(err.value)
    assert "\n" not in msg and str(pkg.decoder.path) in msg
    assert "CUDAExecutionProvider requested but the session runs on CPUExecutionProvider" in msg
    assert "onnxruntime-gpu" in msg and "preload_dlls" in msg
    # ORT's own warning (a [W:onnxruntime ...] line) is no longer hidden at fatal level
    assert "[W:onnxruntime" in capfd.readouterr().err


@pytest.fixture()
def preload_spy(monkeypatch):
    """onnxruntime.preload_dlls replaced by a recorder that prints, as the real one does; the once-a-process cache
    emptied before and after."""
    calls = []

    def preload():
        calls.append(1)
        print("loaded libcudart.so.13")

    monkeypatch.setattr(ort, "preload_dlls", preload, raising=False)
    load_cuda_libraries.cache_clear()
    yield calls
    load_cuda_libraries.cache_clear()


def test_cuda_libraries_are_preloaded_once_before_the_first_cuda_session(tiny_pkg, cuda_claimed, preload_spy, caplog,
                                                                         capsys):
    """onnxruntime-gpu finds the CUDA and cuDNN of the nvidia pip packages only after preload_dlls() (or torch
    imported first): the GPU bench's own workers called it and ortevals did not. Once a process, before the
    first CUDA session, never for the CPU; its prints go to the log, not to the results on stdout."""
    pkg = ModelPackage.load(tiny_pkg)
    DecoderRunner.open(pkg, from_package({}, "cpu"))
    assert preload_spy == []
    with caplog.at_level(logging.INFO, logger="ortevals.install"):
        for _ in range(2):
            with pytest.raises(ProviderError):  # the CPU wheel: the real session falls back and is refused
                DecoderRunner.open(pkg, from_package({}, "cuda"))
    assert preload_spy == [1]
    assert "loaded libcudart.so.13" in caplog.text and "libcudart" not in capsys.readouterr().out


def test_onnxruntime_genai_configs_for_cuda_preload_the_libraries_too(tiny_pkg, preload_spy):
    """Every og.Model ortevals opens (the incremental path's and the media path's) is configured by og_config:
    on CUDA it preloads first, as the raw sessions do; never on the CPU."""
    import onnxruntime_genai as og

    from ortevals.runtime.genai import TEXT_SECTIONS, og_config

    pkg = ModelPackage.load(tiny_pkg)
    og_config(og, pkg, from_package({}, "cpu"), TEXT_SECTIONS)
    assert preload_spy == []
    try:
        og_config(og, pkg, from_package({}, "cuda"), TEXT_SECTIONS)
    except ProviderError:  # a CPU onnxruntime-genai may refuse the provider: the libraries were loaded before
        pass
    assert preload_spy == [1]


def test_embedding_session_is_checked_too(gemma4, cuda_claimed):
    pkg = ModelPackage.load(gemma4[1])
    with pytest.raises(ProviderError, match="embedding.*CUDAExecutionProvider requested|"
                                            r"CUDAExecutionProvider requested.*"):
        open_session(pkg.embedding, from_package({}, "cuda"))
    with pytest.raises(ProviderError) as err:
        DecoderRunner.open(pkg, from_package({}, "cuda"))
    assert str(pkg.embedding.path) in str(err.value)  # opened first, checked first


def test_cli_fallback_is_one_line_exit_2(tiny_pkg, tmp_path):
    code = ("import onnxruntime as o; o.get_available_providers = lambda: ['CUDAExecutionProvider', "
            "'CPUExecutionProvider']; from ortevals.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "mmlu-pro", "--pkg", str(tiny_pkg), "--ep", "cuda",
                           "--data", "bundled", "--limit", "1", "--no-resume", "--output", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "runs on CPUExecutionProvider" in errors[0] and "Traceback" not in proc.stderr


# --- 2. provider options for raw sessions ---------------------------------------------------------

# provider_options exactly as onnxruntime-genai's builder writes them (builders/base.py, ep_attrs)
BUILDER_OPTIONS = {
    "cuda": [{"cuda": {"enable_cuda_graph": "1"}}],
    "dml": [{"dml": {"enable_graph_capture": "1"}}],
    "webgpu": [{"webgpu": {"enableGraphCapture": "1", "validationMode": "disabled"}}],
    "nvtensorrtrtx": [{"NvTensorRtRtx": {"enable_cuda_graph": "1"}}],
}


@pytest.mark.parametrize("ep", sorted(BUILDER_OPTIONS))
def test_builder_options_are_kept_for_og_and_dropped_for_raw_sessions(ep, caplog):
    with caplog.at_level(logging.INFO, logger="ortevals.runtime.providers"):
        cfg = from_package({"provider_options": BUILDER_OPTIONS[ep]}, ep)
    package_opts = next(iter(BUILDER_OPTIONS[ep][0].values()))
    # on CUDA, TF32 off and flash attention pinned unless the user sets them
    cuda_defaults = {"use_tf32": "0", "sdpa_kernel": "3"} if ep == "cuda" else {}
    assert cfg.options == package_opts | cuda_defaults  # onnxruntime-genai's config is otherwise unchanged
    assert cfg.raw_options == cuda_defaults
    lines = [r.getMessage() for r in caplog.records if "not passed to raw" in r.getMessage()]
    assert len(lines) == 1 and all(k in lines[0] for k in package_opts)


def test_safe_package_options_and_user_options_survive():
    opts = {"enable_cuda_graph": "1", "device_id": "1", "gpu_mem_limit": "1000", "made_up": "x",
            "tunable_op_enable": "1"}
    raw = raw_session_options("cuda", opts, user_keys=("tunable_op_enable", "made_up"))
    assert raw.kept == {"device_id": "1", "gpu_mem_limit": "1000", "made_up": "x"}
    assert raw.dropped_package == ("enable_cuda_graph",) and raw.dropped_user == ("tunable_op_enable",)
    # an unknown provider keeps only the generic options
    assert raw_session_options("qnn", {"device_id": "0", "backend_path": "x"}).kept == {"device_id": "0"}


def test_unsafe_user_option_is_warned_and_kept_for_og_only(caplog):
    with caplog.at_level(logging.INFO, logger="ortevals.runtime.providers"):
        cfg = from_package({}, "cuda", {"enable_cuda_graph": "1", "device_id": "0"})
    assert cfg.options == {"enable_cuda_graph": "1", "device_id": "0", "use_tf32": "0", "sdpa_kernel": "3"}
    assert cfg.raw_options == {"device_id": "0", "use_tf32": "0", "sdpa_kernel": "3"}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "enable_cuda_graph" in warned[0].getMessage()


def test_raw_session_gets_the_filtered_options(copy_pkg, tiny_pkg, monkeypatch):
    """A spy on the real constructor: the package's og-only options never reach ORT."""
    import json

    pkg_dir = copy_pkg(tiny_pkg)
    cfg_path = pkg_dir / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["decoder"]["session_options"]["provider_options"] = [{"cpu": {"enable_cuda_graph": "1"}}]
    cfg_path.write_text(json.dumps(cfg))
    seen, real = [], ort.InferenceSession

    def spy(path, so=None, providers=None, **kw):
        seen.append(providers)
        return real(path, so, providers=providers, **kw)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    pkg = ModelPackage.load(pkg_dir)
    DecoderRunner.open(pkg, from_package(pkg.decoder.session_options))
    assert seen and all(p == [("CPUExecutionProvider", {})] for p in seen)


def test_store_scope_records_the_options_each_path_is_handed(tiny_pkg):
    """Raw sessions get the filtered options, onnxruntime-genai every option (cuda graphs change og's
    numbers): og's Config is handed exactly its record, and the scope holds both records, so an og-only
    option splits stored scores where og runs (issue 22, items 4 and 10)."""
    import json
    from types import SimpleNamespace

    from ortevals.engine.backends import Backends
    from ortevals.report.scope import results_scope
    from ortevals.runtime.genai import TEXT_SECTIONS, genai_reads, og_config

    pkg = ModelPackage.load(tiny_pkg)
    provider = from_package(pkg.decoder.session_options, "cuda", {"enable_cuda_graph": "1", "device_id": "0"})
    calls = []

    class Config:  # og.Config's contract: providers cleared, then appended with their options
        def __init__(self, path):
            calls.append(("Config", path))

        def __getattr__(self, name):
            return lambda *a: calls.append((name, *a))

    og_config(SimpleNamespace(Config=Config), pkg, provider, TEXT_SECTIONS)
    handed = {c[2]: c[3] for c in calls if c[0] == "set_provider_option"}
    assert ("append_provider", "cuda") in calls
    assert handed == genai_reads(pkg, provider).settings["provider_options"] == {
        "enable_cuda_graph": "1", "device_id": "0", "use_tf32": "0", "sdpa_kernel": "3"}

    def scope(options: dict):
        prov = from_package(pkg.decoder.session_options, "cuda", options)
        settings = EngineSettings(max_length=64, vocab_size=pkg.vocab_size)
        return results_scope(pkg.root, Backends(pkg, prov, settings, gen_path="og").reads(), {})

    assert scope({"enable_cuda_graph": "1"}).digest != scope({}).digest
    recorded = json.loads(scope({"enable_cuda_graph": "1"}).settings)
    assert recorded["path:onnxruntime-genai"]["provider_options"] == {"enable_cuda_graph": "1", "use_tf32": "0",
                                                                       "sdpa_kernel": "3"}
    assert recorded["path:raw sessions"]["provider_options"] == {"use_tf32": "0", "sdpa_kernel": "3"}
    assert recorded["path:raw sessions"]["session_config"] == {"session.disable_cpu_ep_fallback": "1"}


# --- 3. bfloat16 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_pkg(tmp_path_factory, tiny):
    """The tiny HF model through onnxruntime-genai's builder with -p bf16 -e cpu (about 10 s)."""
    out = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tiny[0]), "-o", str(out),
                    "-p", "bf16", "-e", "cpu", "-c", str(out.parent / "cache")],
                   check=True, capture_output=True, timeout=600)
    return out


def test_bf16_package_is_refused_on_cpu_with_one_line(bf16_pkg):
    pkg = ModelPackage.load(bf16_pkg)
    assert pkg.kv[0].dtype == "bfloat16"
    # the runtime fact the refusal rests on: ORT's CPU kernels cannot load the builder's bf16 graph
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|Could not find an implementation"):
        ort.InferenceSession(str(pkg.decoder.path), providers=["CPUExecutionProvider"])
    with pytest.raises(PackageError) as err:
        DecoderRunner.open(pkg, from_package({}, "cpu"))
    msg = str(err.value)
    assert "\n" not in msg and str(pkg.decoder.path) in msg and "bfloat16" in msg and "CPU" in msg


def _cast_to_float(value) -> np.ndarray:
    """Read any float OrtValue back through a real ORT Cast (numpy cannot hold bfloat16)."""
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "c",
                          [helper.make_tensor_value_info("x", value.element_type(), None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
    return s.run_with_ort_values(["y"], {"x": value})[0].numpy()


@pytest.mark.parametrize("window", [None, 8])
def test_bf16_past_buffers_are_ortvalues_of_the_graph_type(window):
    spec = KVSpec(0, "past.0.key", "past.0.value", "present.0.key", "present.0.value", "bfloat16", 2, 16, window)
    value = empty_past(spec, 3, "cpu")
    assert isinstance(value, ort.OrtValue) and value.data_type() == "tensor(bfloat16)"
    assert value.shape() == [3, 2, window or 0, 16] and _nbytes(value) == 3 * 2 * (window or 0) * 16 * 2
    assert (_cast_to_float(value) == 0).all()  # a window buffer is zeroed, not left uninitialised
    # without a device, numpy's own dtypes stay numpy arrays (the CPU hot path is unchanged)
    fp32 = KVSpec(0, "k", "v", "pk", "pv", "float32", 2, 16, None)
    assert isinstance(empty_past(fp32, 1), np.ndarray)


@pytest.mark.parametrize("dtype,size", [(np.uint8, 1), (np.float64, 8), (np.int64, 8), (np.float16, 2)])
def test_nbytes_of_ortvalues_uses_the_element_size(dtype, size):
    value = ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 3, 5), dtype=dtype))
    assert _nbytes(value) == 30 * size


def test_bf16_logits_come_back_as_float32():
    import ml_dtypes

    x = np.array([[1.0, -2.25, 1 / 3, 3.0e38, 1e-3]], dtype=np.float32)
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)], "c",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, None)])
    s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
    out = s.run_with_ort_values(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(x)})[0]
    got = host_float32(out)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).astype(np.float32))


# --- 4. prefix continuations as one batch ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_replicator_expands_where_the_value_lives(dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 7, 4)).astype(dtype)
    rep = Replicator(from_package({}, "cpu"), "cpu")
    out = rep.expand(ort.OrtValue.ortvalue_from_numpy(x), 3)
    assert out.device_name().lower() == "cpu"
    np.testing.assert_array_equal(out.numpy(), np.repeat(x, 3, axis=0))


@pytest.mark.parametrize("offset_bytes", [0, 2])  # 2: a view not on an 8-byte boundary (written byte by byte)
def test_replicator_zeroes_exactly_the_view_it_is_given(offset_bytes):
    """Fresh device memory holds whatever was there (here all-ones bits, NaN in float16): ``zero`` clears the
    view's bytes where they live, by pointer, and no byte outside it."""
    owner = ort.OrtValue.ortvalue_from_numpy(np.full((3, 2, 5, 4), 0xFFFF, np.uint16).view(np.float16))
    row = owner.numpy()[0].nbytes
    view = KVView(owner, (1, 2, 5, 4), ONNX_TYPES["float16"], "cpu").rows(0, 1)
    view = KVView(owner, view.shape, view.elem_type, "cpu", 0, row + offset_bytes)
    Replicator(from_package({}, "cpu"), "cpu").zero(view)
    flat = owner.numpy().view(np.uint8).reshape(-1)
    start = row + offset_bytes
    assert not flat[start:start + row].any()
    assert (flat[:start] == 0xFF).all() and (flat[start + row:] == 0xFF).all()


@pytest.mark.parametrize("which", ["gemma3", "lfm2"])
def test_a_first_pass_on_a_device_clears_its_buffers_there(which, gemma3, lfm2, monkeypatch):
    """A first pass's window-capacity past (Gemma 3's sliding layers) and zero recurrent state (LFM2's
    convolutions: its content changes every output) are made where the session runs, in memory that holds
    whatever was there (here all-ones bits): they are cleared there, with no host array of zeros copied in,
    and the logits equal the host path's."""
    pkg = ModelPackage.load(gemma3[1] if which == "gemma3" else lfm2[1])
    assert pkg.windowed or pkg.states
    cpu = from_package({}, "cpu")
    ids = np.random.default_rng(0).integers(3, pkg.vocab_size, (2, 20)).astype(np.int64)
    ref, _ = DecoderRunner.open(pkg, cpu).forward(ids, np.ones_like(ids))
    bound = DecoderRunner.open(pkg, cpu, io_binding=True)
    make, write, host_zeros = ort.OrtValue.ortvalue_from_shape_and_type, ort.OrtValue.update_inplace, []

    def stale(shape, elem_type, device, device_id=0):
        value = make(shape, elem_type, device, device_id)
        if all(shape):
            bits = np.dtype(f"u{_nbytes(value) // int(np.prod(shape))}")
            write(value, np.full(shape, np.iinfo(bits).max, bits))
        return value

    def from_host(value, array):
        host_zeros.extend([array.nbytes] if array.size and not array.any() else [])
        write(value, array)

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(stale))
    monkeypatch.setattr(ort.OrtValue, "update_inplace", from_host)
    got, _ = bound.forward(ids, np.ones_like(ids))
    np.testing.assert_array_equal(got, ref)
    assert host_zeros == []


def test_runner_repeats_device_past_without_numpy(tiny_pkg):
    pkg = ModelPackage.load(tiny_pkg)
    runner = DecoderRunner.open(pkg, from_package({}, "cpu"), io_binding=True)
    ids = np.arange(3, 12, dtype=np.int64)[None]
    _, kv = runner.forward(ids, np.ones_like(ids), want_present=True)
    assert isinstance(kv.layers[0][0], ort.OrtValue)
    rep = runner.repeat_past(kv, 4)
    for (k, v), (k4, v4) in zip(kv.layers, rep.layers):
        assert isinstance(k4, ort.OrtValue)
        np.testing.assert_array_equal(k4.numpy(), np.repeat(k.numpy(), 4, axis=0))
        np.testing.assert_array_equal(v4.numpy(), np.repeat(v.numpy(), 4, axis=0))


@pytest.fixture(scope="module")
def contract(tiny_pkg, gemma4, tmp_path_factory):
    """(real package, its copy whose GQA follows the CUDA kernel's contract in plain ops), by name."""
    from tests.fixtures.gqa_contract import contract_package

    root = tmp_path_factory.mktemp("gqa-contract")
    return {name: (src, contract_package(src, root / name)) for name, src in (("tiny", tiny_pkg),
                                                                              ("gemma4", gemma4[1]))}


class PassSpy:
    """The real runner, counting passes of several rows with several new tokens on a past (it computes nothing)."""

    def __init__(self, runner):
        self.runner, self.batched_calls = runner, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _see(self, ids, past):
        self.batched_calls += ids.shape[0] > 1 and ids.shape[1] > 1 and past is not None

    def forward(self, ids, mask, past=None, *args):
        self._see(ids, past)
        return self.runner.forward(ids, mask, past, *args)

    def score(self, ids, mask, past, *args):
        self._see(ids, past)
        return self.runner.score(ids, mask, past, *args)


@pytest.mark.parametrize("which", ["tiny", "gemma4"])
def test_contract_model_equals_the_cpu_kernel_where_it_runs(which, contract):
    """The fixture's plain-op GQA (CUDA's per-row contract) against onnxruntime's own CPU kernel on every input
    that kernel accepts: one row with a past (more tokens than the gemma4 sliding window), and a right-padded
    batch without past (compared at real positions; present KV at valid positions)."""
    real_dir, fake_dir = contract[which]
    real, fake = (DecoderRunner.open(ModelPackage.load(d), from_package({}, "cpu")) for d in (real_dir, fake_dir))
    assert not any(n.op_type == "GroupQueryAttention" for n in onnx_nodes(fake.package.decoder.path))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, real.package.vocab_size, (1, 41)).astype(np.int64)
    (a, kva), (b, kvb) = (r.forward(ids[:, :30], np.ones((1, 30), np.int64), want_present=True) for r in (real, fake))
    np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)
    for steps in (ids[:, 30:], ids[:, 30:31]):  # a multi-token continuation, and one decode step
        mask = np.ones((1, 30 + steps.shape[1]), np.int64)
        (a, pa), (b, pb) = (r.forward(steps, mask, kva, want_present=True) for r in (real, fake))
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)
        for x, y in zip(pa.layers, pb.layers):
            np.testing.assert_allclose(y[0], x[0], atol=2e-5, rtol=0)
            np.testing.assert_allclose(y[1], x[1], atol=2e-5, rtol=0)
    lens = [25, 17, 9]
    ids = rng.integers(3, real.package.vocab_size, (3, 25)).astype(np.int64)
    mask = (np.arange(25)[None] < np.array(lens)[:, None]).astype(np.int64)
    (a, pa), (b, pb) = (r.forward(ids, mask, want_present=True) for r in (real, fake))
    for i, n in enumerate(lens):
        np.testing.assert_allclose(b[i, :n], a[i, :n], atol=2e-5, rtol=0)
        for x, y in zip(pa.layers, pb.layers):
            np.testing.assert_allclose(y[0][i, :, :n], x[0][i, :, :n], atol=2e-5, rtol=0)


def onnx_nodes(path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.node


def _requests(vocab: int, seed: int = 0) -> list[TokenRequest]:
    """Two 90-token prefixes, each with six continuations of 3-25 tokens (tails of different length)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(2):
        prefix = tuple(int(t) for t in rng.integers(3, vocab, 90))
        for n in (3, 25, 7, 12, 1, 18):
            body = tuple(int(t) for t in rng.integers(3, vocab, n))
            reqs.append(TokenRequest(prefix + body[:-1] if n > 1 else prefix, body[-1:] if n > 1 else body))
    return reqs


def _score(runner, pkg, prefix_batch: int, reqs):
    settings = EngineSettings(max_length=512, vocab_size=pkg.vocab_size, batch_size=None,
                              prefix_min_saving=16, prefix_batch=prefix_batch)
    engine = PrefillEngine(runner, settings)
    return engine.score(reqs), engine


@pytest.mark.parametrize("which", ["tiny", "gemma4"])
@pytest.mark.parametrize("derived", [False, True])
def test_batched_prefix_continuations_equal_one_row(which, derived, contract, tmp_path):
    """Prefix continuations as one right-padded batch on a shared past (prefix_batch=0, as on devices), run by
    the CUDA-contract model, which computes what CPU GroupQueryAttention refuses: each row's scores equal its
    one-row pass, on the contract model and on the real CPU kernel."""
    real_dir, fake_dir = contract[which]
    real, fake = (DecoderRunner.open(ModelPackage.load(d), from_package({}, "cpu"), tmp_path / d.name if derived
                                     else None) for d in (real_dir, fake_dir))
    pkg = real.package
    reqs = _requests(pkg.vocab_size)
    one, e1 = _score(fake, pkg, 1, reqs)
    kernel, _ = _score(real, pkg, 1, reqs)
    spy = PassSpy(fake)
    batched, e6 = _score(spy, pkg, 0, reqs)
    assert spy.batched_calls >= 2 and e6.forward_passes < e1.forward_passes
    assert e6.mode.startswith("batched (canary passed"), e6.mode  # a wrong batch trips the canary into exact mode
    np.testing.assert_allclose([s.logprob for s in batched], [s.logprob for s in one], atol=1e-5, rtol=0)
    np.testing.assert_allclose([s.logprob for s in batched], [s.logprob for s in kernel], atol=1e-4, rtol=0)
    assert [s.greedy for s in batched] == [s.greedy for s in one] == [s.greedy for s in kernel]


@pytest.mark.parametrize("which", ["tiny", "gemma4"])
def test_cpu_refusal_of_a_batched_continuation_falls_back_to_one_row(which, tiny_pkg, gemma4, caplog):
    pkg = ModelPackage.load(tiny_pkg if which == "tiny" else gemma4[1])
    runner = DecoderRunner.open(pkg, from_package({}, "cpu"))
    reqs = _requests(pkg.vocab_size, seed=1)
    one, _ = _score(runner, pkg, 1, reqs)
    with caplog.at_level(logging.WARNING, logger="ortevals.engine.score.prefill"):
        got, engine = _score(runner, pkg, 4, reqs)
    refused = [r.getMessage() for r in caplog.records if "batched pass refused" in r.getMessage()]
    assert len(refused) == 1 and "batch_size must be 1 when sequence_length > 1" in refused[0]
    assert engine.prefix_batch_refused
    np.testing.assert_allclose([s.logprob for s in got], [s.logprob for s in one], atol=0, rtol=0)
