"""``ortevals diagnose --int8`` (issue 51 item 4): int8 as a cheaper choice for a weight group.

A group swapped to the int8 export's node computes what the builder's own per-node int8 override exports (logits
bit for bit, the same bytes added); the printed builder command (``--target_options`` with the exclusions and
the int8 overrides together) builds the mixed set the bench measured; the greedy takes one choice per group;
a whole run recommends and verifies a mix; a package that is not an int8 export is one line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.diagnose.stats import Gain, greedy_steps
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import ProviderConfig

DOWN1 = "/model/layers.1/mlp/down_proj/MatMul"
QKV0 = "/model/layers.0/attn/qkv_proj/MatMul"


@pytest.fixture(scope="module")
def tiny_int8(fixture_cache):
    from tests.fixtures.tiny import build_tiny_int8

    return build_tiny_int8(fixture_cache)


def logits(pkg) -> np.ndarray:
    from ortevals.runtime.sessions import DecoderRunner

    ids = (np.arange(1, 120) * 37 % 512)[None]
    runner = DecoderRunner.open(ModelPackage.load(pkg), ProviderConfig("cpu"))
    return runner.forward(ids, np.ones_like(ids))[0]


def weight_bytes(pkg) -> int:
    graph = onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph
    return sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in graph.initializer)


def test_a_group_at_int8_is_the_builders_int8_override(fixture_cache, tiny, tiny_int4, tiny_int8, tmp_path):
    from ortevals.diagnose.int8 import bytes_added, mixed_package
    from ortevals.runtime.swap import Refused, size_delta
    from tests.fixtures.tiny import build_tiny_mixed

    cand, ref, donor = (ModelPackage.load(p) for p in (tiny_int4, tiny[1], tiny_int8))
    built = build_tiny_mixed(fixture_cache, (), (DOWN1,))
    ours = mixed_package(cand, ref, donor, (DOWN1 + "@int8",), tmp_path)
    np.testing.assert_array_equal(logits(ours), logits(built))
    assert np.abs(logits(tiny_int4) - logits(built)).max() > 0.01  # int8 changes the numbers
    assert bytes_added(cand, ref, donor, (DOWN1 + "@int8",)) == weight_bytes(built) - weight_bytes(tiny_int4) > 0
    assert size_delta(cand, donor, (DOWN1,)) < size_delta(cand, ref, (DOWN1,))  # cheaper than fp32
    with pytest.raises(Refused, match="no int8 embeddings .the builder exports int4 GatherBlockQuantized only"):
        size_delta(cand, donor, ("/model/embed_tokens/Gather",))


def test_the_printed_command_builds_the_mixed_set_the_bench_measured(fixture_cache, tiny, tiny_int4, tiny_int8,
                                                                     tmp_path):
    """One group at fp32 and one at int8: the builder (0.18) drops nodes_to_exclude when --target_options carries
    overrides, so the command puts both there; its build equals the derived package bit for bit."""
    from ortevals.diagnose.int8 import mixed_package
    from ortevals.diagnose.recommend import build_settings, builder_command, olive_pass
    from ortevals.diagnose.verify import build

    cand, ref, donor = (ModelPackage.load(p) for p in (tiny_int4, tiny[1], tiny_int8))
    nodes = (QKV0, DOWN1 + "@int8")
    settings = build_settings(cand)
    cmd = builder_command(settings, nodes, str(tiny[0]), "OUT")
    assert "--extra_options" not in cmd and json.loads(cmd[cmd.index("--target_options") + 1]) == {
        "quant_config": {"weights": {"op_types": ["MatMul"],  # the tiny model's embeddings are float
                                     "overrides": [{"match": {"name": QKV0}, "exclude": True},
                                                   {"match": {"name": DOWN1}, "type": "int8"}]}}}
    assert olive_pass(settings, nodes) is None and olive_pass(settings, (QKV0,))["extra_options"]
    build(settings, nodes, tiny[0], tmp_path / "built", fixture_cache)
    np.testing.assert_array_equal(logits(tmp_path / "built"), logits(mixed_package(cand, ref, donor, nodes,
                                                                                   tmp_path / "cache")))


def test_the_greedy_takes_one_choice_per_group():
    gains = [Gain("a", 0.5, 4_000_000), Gain("a@int8", 0.6, 500_000), Gain("b", 0.7, 1_000_000),
             Gain("b@int8", 0.75, 200_000)]
    # per MB recovered from 1.0: a 0.125, a@int8 0.8, b 0.3, b@int8 1.25
    assert greedy_steps(1.0, gains, 10_000_000) == ["b@int8", "a@int8"]


def test_a_whole_run_with_int8_recommends_and_verifies_a_mix(tmp_path, tiny, tiny_int4, tiny_int8):
    hf_dir, ref = tiny
    out = tmp_path / "diag"
    result = CliRunner().invoke(cli, ["diagnose", "--pkg", str(tiny_int4), "--ref", str(ref), "--int8",
                                      str(tiny_int8), "--checkpoint", str(hf_dir), "--verify", "--tokens", "512",
                                      "--budget", "12", "--questions", "0", "--output", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    s = json.loads((out / "diagnose.json").read_text())
    labels = {g["label"] for g in s["sensitivity"]["groups"]}
    assert {"layers.1.down", "layers.1.down@int8"} <= labels
    rec, v = s["recommendation"], s["verify"]
    assert any(u.endswith("@int8") for u in rec["units"]) and rec["olive_pass"] is None
    assert len({u.split("@")[0] for u in rec["units"]}) == len(rec["units"])  # one choice per group
    assert v["kl"] == pytest.approx(rec["kl"], abs=1e-6) and "bit for bit" in v["same_weights"]
    assert abs(v["bytes"] - rec["expected_size"]) <= 0.01 * rec["expected_size"]
    assert "Olive pass: none" in result.output and "warning: the build is" not in result.output


def test_a_package_that_is_not_an_int8_export_is_one_line(tmp_path, tiny, tiny_int4):
    result = CliRunner().invoke(cli, ["diagnose", "--pkg", str(tiny_int4), "--ref", str(tiny[1]), "--int8",
                                      str(tiny_int4), "--output", str(tmp_path / "o")])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1
    assert "--int8" in lines[0] and "expected the builder's int8 export (every MatMulNBits of 8 bits), found bits 4" \
        in lines[0]


def test_a_tied_int4_embedding_table_keeps_its_op_type_in_the_recipe(tiny_int4, tmp_path):
    """A candidate with GatherBlockQuantized (SmolLM2's tied int4 table) gets op_types MatMul and Gather in
    --target_options; without them builder 0.18 exported that table in fp32 (SmolLM2: 204.7 MB, not 91.5)."""
    from types import SimpleNamespace

    from onnx import helper

    from ortevals.diagnose.recommend import build_settings, target_options

    model = onnx.load(str(tiny_int4 / "model.onnx"), load_external_data=False)
    model.graph.node.append(helper.make_node("GatherBlockQuantized", ["a", "b", "c"], ["d"], domain="com.microsoft"))
    onnx.save(model, str(tmp_path / "model.onnx"))
    fake = SimpleNamespace(decoder=SimpleNamespace(path=tmp_path / "model.onnx", session_options={}))
    settings = build_settings(fake)
    weights = json.loads(target_options(settings, (DOWN1 + "@int8",))[1])["quant_config"]["weights"]
    assert weights["op_types"] == ["MatMul", "Gather"]
    assert target_options(settings, (DOWN1,)) == []  # no int8 group: the legacy nodes_to_exclude as before
