"""No silent per-node CPU fallback on a device provider, and TF32 off on CUDA (runtime/placement.py,
runtime/opening.py, runtime/providers.py).

A session asked for a device provider is opened with ``session.disable_cpu_ep_fallback=1`` and without
the CPU provider in its list. The CPU onnxruntime has no GPU provider, but it has one that takes no
node at all: ``AzureExecutionProvider``. Standing in for CUDA (``PROVIDERS["cuda"]`` patched), it makes
the real onnxruntime put every node on the CPU, so its real refusal and its real record of where each
node went are what the tests read; the expected op counts come from the graph file itself.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortevals.errors import ProviderError
from ortevals.package.loader import ModelPackage
from ortevals.package.session_options import PROVIDERS
from ortevals.runtime.placement import FALLBACK_KEY, RECORD_KEY, REFUSAL
from ortevals.runtime.providers import from_package
from ortevals.runtime.sessions import DecoderRunner

STAND_IN = "AzureExecutionProvider"
pytestmark = pytest.mark.skipif(STAND_IN not in ort.get_available_providers(),
                                reason="this onnxruntime build has no AzureExecutionProvider")


@pytest.fixture()
def spy(monkeypatch):
    """Every InferenceSession call: (providers, fallback entry, record entry, the error it raised or None)."""
    calls, real = [], ort.InferenceSession

    def entry_of(so, key):
        try:
            return so.get_session_config_entry(key)
        except Exception:  # onnxruntime raises when the key was never set
            return None

    def constructor(source, so=None, providers=None, **kw):
        entry = [providers, entry_of(so, FALLBACK_KEY), entry_of(so, RECORD_KEY) == "1", None]
        calls.append(entry)
        try:
            return real(source, so, providers=providers, **kw)
        except Exception as e:
            entry[3] = str(e)
            raise

    monkeypatch.setattr(ort, "InferenceSession", constructor)
    return calls


@pytest.fixture()
def cuda_stand_in(monkeypatch):
    monkeypatch.setitem(PROVIDERS, "cuda", STAND_IN)


def op_counts(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_a_gpu_provider_session_is_opened_without_cpu_fallback_and_tf32_off(tiny_pkg, monkeypatch, spy):
    """The wiring, with a provider list that claims CUDA: the first session is asked for CUDA alone, with
    the fallback disabled and use_tf32=0; this CPU onnxruntime cannot give CUDA, so it refuses (its own
    sentence), and the reopening finds the provider never loaded: the install hint, one line."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    pkg = ModelPackage.load(tiny_pkg)
    with pytest.raises(ProviderError) as err:
        DecoderRunner.open(pkg, from_package(pkg.decoder.session_options, "cuda"))
    first = spy[0]
    assert first[0] == [("CUDAExecutionProvider", {"use_tf32": "0", "sdpa_kernel": "3"})]  # no CPU provider listed
    assert first[1] == "1" and REFUSAL in first[3]
    assert spy[1][1] is None and spy[1][2]  # reopened: fallback allowed, assignment recorded
    msg = str(err.value)
    assert "\n" not in msg and "CUDAExecutionProvider requested but the session runs on CPUExecutionProvider" in msg


def test_compute_nodes_on_the_cpu_are_refused_in_one_line_naming_their_op_types(tiny_pkg, cuda_stand_in, spy):
    """Every node lands on the CPU: onnxruntime refuses with its real sentence, and the message names the
    float ops (counted from the graph file), not the integer attention-mask arithmetic."""
    pkg = ModelPackage.load(tiny_pkg)
    with pytest.raises(ProviderError) as err:
        DecoderRunner.open(pkg, from_package(pkg.decoder.session_options, "cuda"))
    msg = str(err.value)
    assert spy[0][1] == "1" and REFUSAL in spy[0][3]
    assert spy[0][0] == [(STAND_IN, {"use_tf32": "0", "sdpa_kernel": "3"})]
    counts = op_counts(pkg.decoder.path)
    assert "\n" not in msg and str(pkg.decoder.path) in msg and "allow_cpu_fallback=true" in msg
    assert f"GroupQueryAttention x{counts['GroupQueryAttention']}" in msg and "MatMul x" in msg
    for integer_op in ("ReduceSum", "Shape", "Sub"):  # the attention-mask subgraph: int64 in, int32 out
        assert integer_op not in msg


def test_allow_cpu_fallback_opens_and_names_what_runs_on_the_cpu(tiny_pkg, cuda_stand_in, spy, caplog):
    pkg = ModelPackage.load(tiny_pkg)
    provider = from_package(pkg.decoder.session_options, "cuda", allow_cpu_fallback=True)
    with caplog.at_level(logging.INFO, logger="ortevals.runtime.placement"):
        runner = DecoderRunner.open(pkg, provider, io_binding=False)  # no CUDA memory here
    assert runner.decoder.get_providers() == [STAND_IN, "CPUExecutionProvider"]
    assert spy[0][0] == [(STAND_IN, {"use_tf32": "0", "sdpa_kernel": "3"}), ("CPUExecutionProvider", {})]
    assert spy[0][1] is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("allow_cpu_fallback=true" in w and "GroupQueryAttention x" in w for w in warned), warned


def test_integer_shape_nodes_on_the_cpu_are_accepted(cuda_stand_in, caplog):
    """Shape -> Gather -> Cast (the builder's total_sequence_length): onnxruntime's CUDA provider places
    such consumers of a Shape output on the CPU by design; a graph of only those opens, and is logged."""
    x = helper.make_tensor_value_info("x", TensorProto.INT64, ["b", "s"])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [])
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "one"], ["len"], name="gather"),
             helper.make_node("Cast", ["len"], ["y"], to=TensorProto.INT32, name="cast")]
    model = helper.make_model(helper.make_graph(nodes, "shape_only", [x], [y], [one]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    provider = from_package({}, "cuda")
    from ortevals.runtime.opening import create_session

    def options(config):
        so = ort.SessionOptions()
        for key, value in config.items():
            so.add_session_config_entry(key, value)
        return so

    with caplog.at_level(logging.INFO, logger="ortevals.runtime.placement"):
        session = create_session(model.SerializeToString(), provider, options, {}, "shape_only")
    assert session.run(None, {"x": [[1, 2, 3]]})[0] == 3
    info = [r.getMessage() for r in caplog.records if "integer shape nodes" in r.getMessage()]
    assert info and all(op in info[0] for op in ("Shape x1", "Gather x1", "Cast x1"))


def test_results_json_and_mode_line_record_tf32_and_the_fallback_opt_in(tiny_pkg, tmp_path):
    """The whole CLI run with allow_cpu_fallback=true on the CUDA stand-in: results.json's config holds
    use_tf32=0 and the opt-in, and the mode line (printed and in results.json) says both."""
    code = ("from ortevals.package.session_options import PROVIDERS; PROVIDERS['cuda'] = 'AzureExecutionProvider'; "
            "from ortevals.runtime import sessions; sessions.BIND_DEVICES['cuda'] = 'cpu'; "  # no CUDA memory here
            "from ortevals.cli import main; main()")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", code, "mmlu-pro", "--pkg", str(tiny_pkg), "--ep", "cuda",
                           "--model-args", "allow_cpu_fallback=true,truncate=left", "--data", "bundled", "--limit", "1",
                           "--no-resume", "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["provider_options"]["use_tf32"] == "0" and results["config"]["allow_cpu_fallback"]
    mode = results["ortevals"]["mode"]
    assert "use_tf32=0" in mode and "allow_cpu_fallback=true" in mode
    assert f"scoring mode: {mode}" in proc.stdout
