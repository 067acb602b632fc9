"""``decoder-pipeline`` packages (issue 48 §4): refused at load in one line naming the stage that blocks.

The packages are the tiny one with its ``model.decoder`` turned into Olive's pipeline form (stages, no
``filename``): the stages are the tiny decoder itself and a context stage that is either a plain graph or a
com.microsoft ``EPContext`` node compiled for QNN (as Olive's QNN exports hold).
"""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage
from tests.test_cli import assert_one_line_error, run


def _stage(path, compiled: bool) -> None:
    x = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", 64])
    y = helper.make_tensor_value_info("hidden_out", TensorProto.FLOAT, ["batch", "seq", 64])
    node = (helper.make_node("EPContext", ["hidden"], ["hidden_out"], domain="com.microsoft", embed_mode=1,
                             ep_cache_context=b"\0" * 16, source="QNN") if compiled else
            helper.make_node("Identity", ["hidden"], ["hidden_out"]))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(helper.make_graph([node], "ctx", [x], [y]), opset_imports=opsets), str(path))


@pytest.mark.parametrize("compiled, needle", [
    (True, "stage 'context' is an EPContext node compiled for QNN, which runs only on that provider"),
    (False, "its transformer is split into stages that no single decoder graph holds"),
])
def test_a_pipeline_package_is_one_line_naming_the_stage(tiny_pkg, copy_pkg, compiled, needle):
    pkg = copy_pkg(tiny_pkg)
    _stage(pkg / "context.onnx", compiled)
    path = pkg / "genai_config.json"
    config = json.loads(path.read_text())
    decoder = config["model"]["decoder"]
    decoder["pipeline"] = [{"embeddings": {"filename": decoder.pop("filename"), "run_on_token_gen": True}},
                           {"context": {"filename": "context.onnx", "run_on_token_gen": False}}]
    path.write_text(json.dumps(config))
    with pytest.raises(PackageError) as err:
        ModelPackage.load(pkg)
    assert "model.decoder.pipeline has 2 stages (embeddings, context) and no model.decoder.filename" in str(err.value)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert_one_line_error(run("mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "1"), needle)
