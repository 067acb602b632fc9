"""The loader: what it reads from a package, and every bad package it refuses."""

import json
from pathlib import Path

import pytest

from ortevals.errors import PackageError, ProviderError
from ortevals.package.loader import ModelPackage
from ortevals.package.session_options import normalize
from ortevals.runtime.providers import from_package, parse_options, provider_mode


def edit_config(pkg: Path, fn) -> None:
    path = pkg / "genai_config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def test_reads_text_package(tiny_pkg):
    pkg = ModelPackage.load(tiny_pkg)
    assert pkg.model_type == "llama"
    assert [(s.kv_heads, s.head_size, s.window) for s in pkg.kv] == [(2, 16, None)] * 2
    assert pkg.embedding is None and pkg.vocab_size == 512 and pkg.logits_width == 512
    assert pkg.kv[1].key_name == "past_key_values.1.key" and pkg.kv[1].present_value_name == "present.1.value"
    assert ModelPackage.load(tiny_pkg / "genai_config.json").root == tiny_pkg


def test_fingerprint_changes_with_the_model(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    before = ModelPackage.load(pkg).fingerprint()
    assert ModelPackage.load(pkg).fingerprint() == before
    edit_config(pkg, lambda c: c["search"].update(top_k=3))
    assert ModelPackage.load(pkg).fingerprint() != before


BAD_CONFIGS = [
    ("empty", lambda p: (p / "genai_config.json").write_text(""), "is empty"),
    ("invalid json", lambda p: (p / "genai_config.json").write_text("{\"model\": "), "invalid JSON at line 1"),
    ("not an object", lambda p: (p / "genai_config.json").write_text("[1]"), "'model' object"),
    ("no decoder", lambda p: edit_config(p, lambda c: c["model"].pop("decoder")), "model.decoder"),
    ("no filename", lambda p: edit_config(p, lambda c: c["model"]["decoder"].pop("filename")),
     "model.decoder.filename"),
    ("missing decoder file", lambda p: (p / "model.onnx").unlink(), "model.decoder.filename='model.onnx' not found"),
    ("path escape", lambda p: edit_config(p, lambda c: c["model"]["decoder"].update(filename="../x/model.onnx")),
     "escapes the package folder"),
    ("absolute path", lambda p: edit_config(p, lambda c: c["model"]["decoder"].update(filename="/etc/passwd")),
     "absolute path"),
    ("layers", lambda p: edit_config(p, lambda c: c["model"]["decoder"].update(num_hidden_layers=3)),
     "num_hidden_layers=3 but model.onnx has 2"),
    ("vocab", lambda p: edit_config(p, lambda c: c["model"].update(vocab_size=1000)),
     "vocab_size=1000 but model.onnx returns logits of width 512"),
    ("vocab type", lambda p: edit_config(p, lambda c: c["model"].update(vocab_size="512")),
     "model.vocab_size must be int"),
    ("no type", lambda p: edit_config(p, lambda c: c["model"].pop("type")), "model.type is missing"),
    ("truncated data", lambda p: (p / "model.onnx.data").write_bytes(b"\0" * 100), "external data is truncated"),
    ("missing data", lambda p: (p / "model.onnx.data").unlink(), "external data file 'model.onnx.data' is missing"),
    ("corrupt onnx", lambda p: (p / "model.onnx").write_bytes(b"not a protobuf" * 10), "not a readable ONNX model"),
]


@pytest.mark.parametrize("name,breaker,message", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_package_is_one_clear_error(tiny_pkg, copy_pkg, name, breaker, message):
    pkg = copy_pkg(tiny_pkg)
    breaker(pkg)
    with pytest.raises(PackageError, match=message) as err:
        ModelPackage.load(pkg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key,value,message", [
    # the graph's head size is the symbol 'kv_cache_dim': only a real pass can show the config is wrong
    ("head_size", 32, r"layer 0 KV is \[heads=2, head_size=32\] by model.decoder.num_key_value_heads/head_size, "
                      r"but model.onnx declares past_key_values.0.key as \['batch_size', 2, 'past_sequence_length', "
                      r"'kv_cache_dim'\] and refused past KV of that shape in a probe pass \(.*got 32 expected 16\); "
                      r"config and graph must agree"),
    # KV heads are concrete in the graph: the load itself compares them
    ("num_key_value_heads", 4, r"model.decoder.num_key_value_heads=4 but model.onnx declares \[2\] KV heads"),
])
def test_config_graph_mismatch_on_symbolic_dims_is_caught_at_open(tiny_pkg, copy_pkg, key, value, message):
    """Before issue 10 the head-size case surfaced as ORT's generic GroupQueryAttention error."""
    from ortevals.runtime.sessions import DecoderRunner

    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, lambda c: c["model"]["decoder"].update({key: value}))
    with pytest.raises(PackageError, match=message) as err:
        DecoderRunner.open(ModelPackage.load(pkg), from_package({}, "cpu"))
    assert str(err.value).startswith(str(pkg / "genai_config.json")) and "\n" not in str(err.value)
    assert "onnxruntime failed to run" not in str(err.value)


def test_symlinked_files_are_allowed_but_config_paths_may_not_escape(tiny_pkg, tmp_path):
    """A hub cache links package files to blobs elsewhere: that is the user's folder, not an escape."""
    pkg = tmp_path / "linked"
    pkg.mkdir()
    for f in tiny_pkg.iterdir():
        (pkg / f.name).symlink_to(f.resolve())
    assert ModelPackage.load(pkg).decoder.path == pkg / "model.onnx"


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(PackageError, match="package folder not found"):
        ModelPackage.load(tmp_path / "nope")
    with pytest.raises(PackageError, match="genai_config.json: not found"):
        ModelPackage.load(tmp_path)


def test_other_models_are_never_opened(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    (pkg / "vision.onnx").write_bytes(b"garbage that onnx cannot parse")
    edit_config(pkg, lambda c: c["model"].update(vision={"filename": "vision.onnx"},
                                                 speech={"filename": "missing-speech.onnx"}))
    loaded = ModelPackage.load(pkg)
    assert loaded.skipped_models == ("vision", "speech")
    assert all("vision" not in str(f) for f in loaded.model_files())


def test_symbolic_kv_dims_fall_back_to_config(tiny_pkg, copy_pkg):
    import onnx

    pkg = copy_pkg(tiny_pkg)
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    for inp in model.graph.input:
        if inp.name.startswith("past_key_values"):
            inp.type.tensor_type.shape.dim[3].dim_param = "head_size_sym"
    onnx.save(model, str(pkg / "model.onnx"))
    assert {s.head_size for s in ModelPackage.load(pkg).kv} == {16}
    edit_config(pkg, lambda c: c["model"]["decoder"].pop("head_size"))
    with pytest.raises(PackageError, match="symbolic dim 'head_size_sym'"):
        ModelPackage.load(pkg)


def test_cuda_sessions_pin_flash_attention_unless_the_user_chooses(caplog):
    """onnxruntime 1.31 prefers cuDNN SDPA on sm90 for GroupQueryAttention and builds a cuDNN graph for every
    new shape (an H200 profile: 2.4 s of host time in the op against 0.04 s of kernels); scoring changes shapes
    every pass, so CUDA sessions get sdpa_kernel=3 (flash, memory-efficient fallback). A package's own value is
    replaced and logged, the user's stands, the CPU gets none, and the mode line says which."""
    so = {"provider_options": [{"cuda": {"sdpa_kernel": "8"}}]}
    with caplog.at_level("INFO", logger="ortevals.runtime.providers"):
        cfg = from_package(so, None)
    assert cfg.options["sdpa_kernel"] == cfg.raw_options["sdpa_kernel"] == "3"
    assert any("sdpa_kernel=8 from the package replaced by 3" in r.getMessage() for r in caplog.records)
    assert "sdpa_kernel=3 (flash attention" in provider_mode(cfg)
    user = from_package(so, None, {"sdpa_kernel": "0"})
    assert user.raw_options["sdpa_kernel"] == "0" and "sdpa_kernel=0" in provider_mode(user)
    assert "sdpa_kernel" not in from_package(so, "cpu").options


def test_providers_resolve_and_merge_options():
    so = {"provider_options": [{"cuda": {"enable_cuda_graph": "1", "device_id": "0"}}]}
    cfg = from_package(so, None, parse_options(["device_id=1"]))
    assert (cfg.name, cfg.ort_name, cfg.options) == ("cuda", "CUDAExecutionProvider",
                                                      {"enable_cuda_graph": "1", "device_id": "1", "use_tf32": "0",
                                                       "sdpa_kernel": "3"})
    assert from_package(so, None, {"use_tf32": "1"}).options["use_tf32"] == "1"  # the user's choice stands
    assert from_package(so, "cpu").options == {}
    assert normalize("CUDAExecutionProvider") == "cuda" and normalize("DirectML") == "dml"
    with pytest.raises(ProviderError, match="unknown execution provider 'tpu'"):
        normalize("tpu")
    with pytest.raises(ProviderError, match="key=value"):
        parse_options(["oops"])


def test_unavailable_provider_is_refused(tiny_pkg):
    from ortevals.runtime.sessions import open_session

    pkg = ModelPackage.load(tiny_pkg)
    with pytest.raises(ProviderError, match="'cuda' .* is not available"):
        open_session(pkg.decoder, from_package({}, "cuda"))


def test_custom_ops_library_is_not_loaded(tiny_pkg, copy_pkg):
    from ortevals.runtime.sessions import open_session

    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, lambda c: c["model"]["decoder"]["session_options"].update(custom_ops_library="libevil.so"))
    loaded = ModelPackage.load(pkg)
    with pytest.raises(PackageError, match="custom_ops_library"):
        open_session(loaded.decoder, from_package({}, "cpu"))


def test_mixed_install_is_detected(monkeypatch):
    from ortevals import install
    from ortevals.errors import RuntimeMissingError

    monkeypatch.setattr(install, "installed", lambda names, module=None: [n for n in names if n in ("onnxruntime",
                                                                                        "onnxruntime-gpu")])
    with pytest.raises(RuntimeMissingError, match="onnxruntime and onnxruntime-gpu are both installed"):
        install.check_install()
    monkeypatch.setattr(install, "installed", lambda names, module=None: [n for n in names if n in ("onnxruntime-gpu",
                                                                                        "onnxruntime-genai")])
    with pytest.raises(RuntimeMissingError, match="onnxruntime-genai needs onnxruntime but onnxruntime-gpu"):
        install.check_install()
    # the ROCm and training wheels install the same module as the CPU one (issue 23: one wheel list)
    for other in ("onnxruntime-rocm", "onnxruntime-training"):
        monkeypatch.setattr(install, "installed", lambda names, module=None, o=other: [
            n for n in names if n in ("onnxruntime", o)])
        with pytest.raises(RuntimeMissingError, match=f"onnxruntime and {other} are both installed"):
            install.check_install()
