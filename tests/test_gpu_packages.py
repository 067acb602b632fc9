"""Every ``-e cuda`` package the GPU plan builds, built here on CPU (scripts/gpu/README.md, issue 36): the
builder's fp16, bf16 and int4 CUDA packages of tiny Llama/SmolLM2-, Qwen3- and Gemma-3-shaped models.

Nothing here runs a CUDA graph. Each package must pass ``onnx.checker`` (with its external data; see
:func:`checker` for the one op onnx has no schema for) and
ortevals' loader must read its config and graph I/O in the package's precision. The Qwen3 CUDA graph feeds
the q/k RMS-norm weights into GroupQueryAttention, which the CPU kernel refuses: the message names that
kernel limit and never blames genai_config.json. The fp32 CUDA package (invalid from builder 0.18) is
refused before any work. The models are built once into the fixture cache (scripts/gpu/make_model.py
reuses a folder built from the same spec).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import onnx
import pytest

from ortevals.errors import PackageError
from ortevals.package.graph import graph_facts
from ortevals.package.loader import ModelPackage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

ARCHS = ("smollm2", "qwen3", "gemma3")  # smollm2: the Llama shape (LlamaForCausalLM)
PRECISIONS = {"fp16": "float16", "bf16": "bfloat16", "int4": "float16"}  # the CUDA int4 package computes in fp16


def checker(pkg_dir: Path, tmp: Path) -> set[str]:
    """``onnx.checker`` on the package's graph with its external data (copied beside a copy of the graph: the
    checker refuses links). The builder writes onnxruntime's SimplifiedLayerNormalization in the ONNX domain,
    where onnx has no schema for it: such ops are moved to com.microsoft (whose ops the checker does not
    look up) and returned, so a test can say which. The full check (strict shape inference) is not run:
    the builder declares its [1]-shaped INT64 constants with rank 0, which onnxruntime does not mind."""
    from onnx import defs, helper

    model = onnx.load(str(pkg_dir / "model.onnx"), load_external_data=False)
    moved = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx") and not defs.has(n.op_type)}
    for n in model.graph.node:
        if n.op_type in moved and n.domain in ("", "ai.onnx"):
            n.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    tmp.mkdir(parents=True, exist_ok=True)
    for data in pkg_dir.glob("*.data"):
        shutil.copyfile(data, tmp / data.name)
    onnx.save(model, str(tmp / "model.onnx"))
    onnx.checker.check_model(str(tmp / "model.onnx"))
    return moved


def build(fixture_cache: Path, arch: str, precision: str, capsys) -> Path:
    import make_model

    out = fixture_cache / "gpu-kit-models" / f"{arch}-1e6"
    code = make_model.main([str(out), "--arch", arch, "--params", "1e6", "--precision", precision, "--ep", "cuda"])
    assert code == 0, capsys.readouterr().err[-2000:]
    return out / f"{precision}-cuda"


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_package_passes_the_checker_and_the_loader(arch, precision, fixture_cache, capsys, tmp_path):
    pkg_dir = build(fixture_cache, arch, precision, capsys)
    assert checker(pkg_dir, tmp_path) == {"SimplifiedLayerNormalization"}
    pkg = ModelPackage.load(pkg_dir)
    hf = __import__("json").loads((pkg_dir.parent / "hf" / "config.json").read_text())
    assert len(pkg.kv) == hf["num_hidden_layers"] and pkg.vocab_size == hf["vocab_size"]
    assert {s.dtype for s in pkg.kv} == {PRECISIONS[precision]}
    assert {(s.kv_heads, s.head_size) for s in pkg.kv} == {(hf["num_key_value_heads"], hf["head_dim"])}
    assert pkg.decoder.output(pkg.logits_name).dtype in (PRECISIONS[precision], "float32")
    assert ("int4" in graph_facts(pkg.decoder.path).precision) == (precision == "int4")
    assert [name for name, _ in __import__("ortevals.package.session_options", fromlist=["x"]).provider_entries(
        pkg.decoder.session_options)] == ["cuda"]
    if arch == "gemma3":  # a sliding-window layer and a global one
        assert {s.window for s in pkg.kv} <= {None, 512} and hf["layer_types"][-1] == "full_attention"


def test_qwen3_cuda_graph_on_cpu_names_the_kernel_limit_not_the_config(fixture_cache, capsys):
    """GroupQueryAttention's q_norm_weight/k_norm_weight: the CPU kernel's own refusal, the provider the
    package was built for, and no word of genai_config.json (the probe used to say "config and graph must
    agree")."""
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.sessions import DecoderRunner

    pkg = ModelPackage.load(build(fixture_cache, "qwen3", "fp16", capsys))
    gqa = [n for n in onnx.load(str(pkg.decoder.path), load_external_data=False).graph.node
           if n.op_type == "GroupQueryAttention"]
    assert gqa and all(len(n.input) == 16 and "q_norm" in n.input[14] and "k_norm" in n.input[15] for n in gqa)
    with pytest.raises(PackageError) as err:
        DecoderRunner.open(pkg, from_package(pkg.decoder.session_options, "cpu"))
    msg = str(err.value)
    assert "\n" not in msg and "q_norm_weight" in msg and "CPUExecutionProvider" in msg and "--ep cuda" in msg
    assert "genai_config.json match" not in msg and "must agree" not in msg


def test_the_checker_refuses_the_builders_fp32_cuda_package(fixture_cache, capsys, tmp_path):
    """The package make_model.py no longer builds (builder 0.18, -p fp32 -e cuda): its present.* outputs are
    produced by no node, which the same check catches (and onnxruntime refuses it too)."""
    import subprocess

    hf = build(fixture_cache, "smollm2", "fp16", capsys).parent / "hf"
    bad = fixture_cache / "gpu-kit-models" / "smollm2-1e6" / "fp32-cuda-invalid"
    if not (bad / "model.onnx").is_file():
        proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/builder_shim.py"), "-i", str(hf), "-o", str(bad),
                               "-p", "fp32", "-e", "cuda", "-c", str(tmp_path / "c")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(onnx.checker.ValidationError, match="present.0.key' is not an output of any node"):
        checker(bad, tmp_path / "check")
    with pytest.raises(PackageError, match="present.0.key"):
        from ortevals.runtime.providers import from_package
        from ortevals.runtime.sessions import DecoderRunner

        pkg = ModelPackage.load(bad)
        DecoderRunner.open(pkg, from_package(pkg.decoder.session_options, "cpu"))


def test_make_model_refuses_the_fp32_cuda_package_before_any_work(tmp_path, capsys):
    import make_model

    assert make_model.main([str(tmp_path / "m"), "--arch", "llama", "--params", "1e6", "--precision", "fp32",
                            "--ep", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --precision fp32 --ep cuda") and "--ep cpu" in err[0]
    assert not (tmp_path / "m").exists()
