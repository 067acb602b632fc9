"""``ortevals info``'s package lint (issue 48 §6): a warning line where config and graph disagree in a way that
changes numbers, and none on packages where they agree (the builder's and Mobius' own fixtures)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortevals.package.lint import lint
from ortevals.package.loader import ModelPackage
from tests.test_cli import run


def _config(pkg, change) -> None:
    path = pkg / "genai_config.json"
    config = json.loads(path.read_text())
    change(config["model"])
    path.write_text(json.dumps(config))


def test_packages_whose_config_and_graph_agree_get_no_warning(tiny_pkg, gemma4, windowed_gemma4):
    for pkg in (tiny_pkg, gemma4[1], windowed_gemma4[1]):
        assert lint(ModelPackage.load(pkg)) == []


@pytest.fixture(scope="module")
def windowed_gemma4(fixture_cache):
    from tests.fixtures.gemma4 import build_gemma4

    return build_gemma4(fixture_cache / "gemma4", windowed=True)


def test_a_declared_window_the_graph_lacks_and_other_windowed_layers(tiny_pkg, windowed_gemma4, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    _config(pkg, lambda m: m["decoder"].update(sliding_window={"window_size": 4, "layers": [0, 1]}))
    assert lint(ModelPackage.load(pkg)) == [
        f"{pkg / 'genai_config.json'}: model.decoder.sliding_window declares a 4-token window that no attention "
        "node of model.onnx applies (every layer attends to the whole past)"]
    pkg = copy_pkg(windowed_gemma4[1])
    _config(pkg, lambda m: m["decoder"]["sliding_window"].update(layers=[0]))
    (line,) = lint(ModelPackage.load(pkg))
    assert line.endswith("declares 16-token windows on layers [0] but decoder.onnx's attention applies layer 0: 16, "
                         "layer 1: 16")


@pytest.mark.parametrize("scale, warned", [(1.0, False), (1.5, True)])
def test_layers_of_one_type_that_rotate_differently(gemma4, copy_pkg, scale, warned):
    """Layer 1 (a sliding layer, as layer 0) rotated with its own table: a copy of the sliding table (the same
    values under another name: nothing to say) or a scaled one (a warning naming both groups)."""
    pkg = copy_pkg(gemma4[1])
    path = pkg / "decoder.onnx"
    model = onnx.load(str(path), load_external_data=False)
    table = next(t for t in model.graph.initializer if t.name == "cos_cache_local")
    values = numpy_helper.to_array(table, base_dir=str(pkg)) * np.float32(scale)
    model.graph.initializer.append(numpy_helper.from_array(values, "cos_cache_layer1"))
    for node in model.graph.node:
        if node.name.startswith("/model/layers.1/") and node.op_type == "RotaryEmbedding":
            node.input[2] = "cos_cache_layer1"
    onnx.save(model, str(path))
    found = lint(ModelPackage.load(pkg))
    assert found == ([] if not warned else [
        "layers of one type (16-token window) rotate differently: layers [0]: cos_cache_local (interleaved 0, dim 0); "
        "layers [1]: cos_cache_layer1 (interleaved 0, dim 0)"])


def test_a_context_beyond_the_rotary_table_and_the_cli(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    _config(pkg, lambda m: m.update(context_length=4096))  # Mobius writes 4096 over a 1024-row table
    result = run("info", "--pkg", str(pkg))
    assert result.exit_code == 0
    assert (f"warning: {pkg / 'genai_config.json'}: model.context_length=4096 but model.onnx's rotary table has 1024 "
            "positions: a sequence past 1024 tokens has no rotation there (keep max_length at or below 1024)"
            ) in result.output.splitlines()
