"""A package's ``session_options`` reach ortevals' own sessions as onnxruntime-genai applies them (issue 48 §5).

onnxruntime-genai 0.18 reads a few keys of a model's ``session_options`` itself (threads, logging, memory arena,
``graph_optimization_level``, ``custom_ops_library``, ``provider_options``) and hands every other one to
onnxruntime as a session config entry (``ep.cuda.fpa_intb_gemm``, ``optimization.disable_specified_optimizers``).
Each raw session gets its own model's section: read back from the opened sessions, and recorded in the scope.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortevals.errors import ProviderError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import from_package
from ortevals.runtime.reads import runner_reads
from ortevals.runtime.sessions import DecoderRunner

ASKED = {"graph_optimization_level": "ORT_ENABLE_BASIC",
         "optimization.disable_specified_optimizers": "SimplifiedLayerNormFusion",
         "session.intra_op.allow_spinning": "0",
         "ep.context_enable": "1",  # makes onnxruntime write an EP context model: never into the package folder
         "log_id": "onnxruntime-genai"}


def _edit(pkg, section: str, options: dict) -> None:
    path = pkg / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"][section].setdefault("session_options", {}).update(options)
    path.write_text(json.dumps(config))


def test_the_sessions_get_the_packages_settings(tiny_pkg, copy_pkg):
    import onnxruntime as ort

    pkg = copy_pkg(tiny_pkg)
    _edit(pkg, "decoder", ASKED)
    package = ModelPackage.load(pkg)
    provider = from_package(package.decoder.session_options)
    runner = DecoderRunner.open(package, provider)
    opened = runner.decoder.get_session_options()
    assert opened.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    for key in ("optimization.disable_specified_optimizers", "session.intra_op.allow_spinning"):
        assert opened.get_session_config_entry(key) == ASKED[key]
    with pytest.raises(Exception, match="does not have configuration with key"):
        opened.get_session_config_entry("ep.context_enable")
    assert sorted(p.name for p in pkg.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data",
                                                      "tokenizer.json", "tokenizer_config.json"]  # nothing written
    # the scope records them, so answers stored under the package's defaults are not reused
    (record,) = runner_reads(package, provider)
    assert record.settings["graph_optimization_level"] == "ORT_ENABLE_BASIC"
    assert record.settings["session_config"] == {k: ASKED[k] for k in ("optimization.disable_specified_optimizers",
                                                                       "session.intra_op.allow_spinning")}
    plain = ModelPackage.load(tiny_pkg)
    assert runner_reads(plain, from_package(plain.decoder.session_options))[0].settings != record.settings
    # onnxruntime-genai opens the package with the same section (it would refuse a key it cannot apply)
    import onnxruntime_genai as og

    og.Model(str(pkg))
    assert len(list(pkg.iterdir())) == 5
    # the numbers are those of a plain onnxruntime session opened with the same settings
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.add_session_config_entry("optimization.disable_specified_optimizers", "SimplifiedLayerNormFusion")
    session = ort.InferenceSession(str(pkg / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ids = np.array([[1, 45, 67, 89, 23, 301, 7]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for spec in package.kv:
        feeds[spec.key_name] = feeds[spec.value_name] = np.zeros((1, spec.kv_heads, 0, spec.head_size), np.float32)
    expected = session.run(["logits"], feeds)[0]
    assert np.array_equal(runner.forward(ids, np.ones_like(ids))[0], expected)


@pytest.mark.parametrize("options, needle", [
    ({"graph_optimization_level": "ALL"}, "session_options.graph_optimization_level='ALL'; expected one of "
                                          "ORT_DISABLE_ALL, ORT_ENABLE_BASIC"),
    ({"optimization.disable_specified_optimizers": 1}, "session_options.optimization.disable_specified_optimizers=1 "
                                                       "must be a string: onnxruntime-genai hands it to onnxruntime"),
])
def test_a_setting_onnxruntime_genai_cannot_apply_is_one_line(tiny_pkg, copy_pkg, options, needle):
    pkg = copy_pkg(tiny_pkg)
    _edit(pkg, "decoder", options)
    with pytest.raises(ProviderError) as err:
        ModelPackage.load(pkg)
    assert needle in str(err.value) and "\n" not in str(err.value)
