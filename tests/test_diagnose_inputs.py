"""``ortevals diagnose``'s bad inputs: each one line, exit 2, before any model runs or file is written."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from tests.test_cli import assert_one_line_error


@pytest.fixture(scope="session")
def tiny3(fixture_cache):
    from tests.fixtures.tiny import build_tiny_layers

    return build_tiny_layers(fixture_cache, 3)


@pytest.fixture()
def no_names(tiny_int4, copy_pkg):
    """The int4 package with every node renamed (no builder layer names)."""
    pkg = copy_pkg(tiny_int4)
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
    onnx.save(model, str(pkg / "model.onnx"))
    return pkg


@pytest.fixture(autouse=True)
def no_model_work(monkeypatch):
    """Any session opened or fidelity pass run fails the test: the checks come before any work."""
    def refuse(*a, **k):
        raise AssertionError("model work started before the inputs were checked")

    monkeypatch.setattr("ortevals.runtime.taps.TapRunner.open", refuse)
    monkeypatch.setattr("ortevals.fidelity.run.run_fidelity", refuse)


def run(tmp_path, *args):
    return CliRunner().invoke(cli, ["diagnose", *map(str, args), "--output", str(tmp_path / "out")],
                              catch_exceptions=False)


def check(tmp_path, result, *needles):
    assert_one_line_error(result, *needles)
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_different_architectures(tmp_path, tiny_int4, gemma4):
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", gemma4[1]), "different architectures",
          "'llama'", "'gemma4'")


def test_different_vocabularies(tmp_path, tiny_int4, smollm2):
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", smollm2[1]), "different vocabularies", "512", "49152")


def test_different_layer_counts(tmp_path, tiny_int4, tiny3):
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny3), "different layer counts", "has 2 layers",
          "has 3")


def test_checkpoint_with_other_layer_count(tmp_path, tiny_int4, tiny3):
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny3.parent / "tiny3-hf"), "different layer counts",
          "config.json")


def test_verify_checkpoint_of_another_model_is_refused_before_any_work(tmp_path, tiny_int4, tiny_pkg, tiny3, smollm2):
    """Issue 49 item 5: `--checkpoint OTHER --verify` ran 50 s, built the wrong model and failed naming
    reference.npz; now one line naming --checkpoint, before any model work."""
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny_pkg, "--checkpoint", tiny3.parent / "tiny3-hf",
                        "--verify"), "--checkpoint", "tiny3-hf", "different layer counts", "has 2", "has 3")
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny_pkg, "--checkpoint", smollm2[0], "--verify"),
          "--checkpoint", "different vocabularies", "512", "49152")


def test_a_hybrid_candidate_is_refused_in_one_line(tmp_path, lfm2_int4, lfm2):
    """Issue 49 item 6: an LFM2 candidate printed `compared layers none`, a blank largest added error and groups
    `+0.0 MB, over the budget of +0.0 MB`; its recurrent layers have no attention block to compare."""
    check(tmp_path, run(tmp_path, "--pkg", lfm2_int4[1], "--ref", lfm2[1]), "--pkg", "a hybrid decoder with "
          "recurrent state", "ortevals fidelity")


def test_candidate_without_layer_names(tmp_path, no_names, tiny_pkg):
    check(tmp_path, run(tmp_path, "--pkg", no_names, "--ref", tiny_pkg), "--pkg", "layer names", "/model/layers.N/")


def test_reference_itself_quantized(tmp_path, tiny_int4):
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny_int4), "--ref", "itself quantized",
          "MatMulNBits")


def test_different_tokenizers(tmp_path, tiny_int4, tiny_pkg, copy_pkg):
    ref = copy_pkg(tiny_pkg)
    data = json.loads((ref / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<unknown>"
    (ref / "tokenizer.json").write_text(json.dumps(data))
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", ref), "different tokenizers")


@pytest.mark.parametrize("args,needle", [
    ((), "pass --pkg"),
    (("--budget", "0"), "--budget must be"),
    (("--budget", "5000"), "--budget must be a percentage of the candidate's size above 0 and at most 1000, got "
                           "5000"),  # issue 49 item 12: the cap was not named
    (("--tokens", "0"), "--tokens must be >= 1"),
    (("--questions", "-1"), "--questions must be >= 0"),
    (("--ctx", "7"), "--ctx must be an even number"),
    (("--verify",), "--verify builds the recommended package"),
    (("--checkpoint", "/nonexistent"), "--checkpoint /nonexistent: expected a transformers checkpoint"),
    (("--ref", "/nonexistent/ref"), "--ref /nonexistent/ref: no such folder"),  # issue 49 item 12
    (("--text", "/nonexistent.txt"), "/nonexistent.txt: cannot read the text"),
])
def test_bad_options(tmp_path, tiny_int4, tiny_pkg, args, needle):
    given = () if args == () else ("--pkg", tiny_int4) + (() if "--ref" in args else ("--ref", tiny_pkg))
    check(tmp_path, run(tmp_path, *given, *args), needle)


def test_the_candidate_as_its_own_reference_is_refused_before_any_work(tmp_path, tiny_pkg, copy_pkg):
    """Issue 55 item 13: `--pkg X --ref X` ran 92 s to print zeros; now one line naming --ref, before any model
    runs: the same folder (or a link to it), or a copy whose model files hold the same bytes. A copy with one weight
    changed is another model: its checks pass and the work starts (the fixture's refusal)."""
    check(tmp_path, run(tmp_path, "--pkg", tiny_pkg, "--ref", tiny_pkg), f"--ref {tiny_pkg}",
          "the same package folder as --pkg", "in higher precision")
    (tmp_path / "link").symlink_to(tiny_pkg)
    check(tmp_path, run(tmp_path, "--pkg", tiny_pkg, "--ref", tmp_path / "link"), "the same package folder as --pkg")
    twin = copy_pkg(tiny_pkg)
    check(tmp_path, run(tmp_path, "--pkg", tiny_pkg, "--ref", twin), f"--ref {twin}", "the same model files as --pkg",
          "model.onnx.data")
    data = twin / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit of one weight in the middle of the file
    data.write_bytes(bytes(raw))
    assert "model work started" in run(tmp_path, "--pkg", tiny_pkg, "--ref", twin).output


@pytest.mark.parametrize("given,needle", [
    ("/nonexistent/int8", "--int8 /nonexistent/int8: no such folder; expected the builder's int8 export"),
    ("empty", "--int8 {}: {}/genai_config.json: not found; expected an ONNX Runtime GenAI package folder"),
    ("hf", "--int8 {}: a transformers checkpoint; expected the builder's int8 export of it: "
           "`python -m onnxruntime_genai.models.builder -i {} -o OUT -p int8"),
])
def test_int8_that_is_no_package_names_int8(tmp_path, tiny, tiny_int4, given, needle):
    """Issue 55 item 13: `--int8 MISSING` said `MISSING: package folder not found` without naming --int8 (and a
    checkpoint there was told to `pass --pkg OUT`)."""
    folder = {"empty": tmp_path / "empty", "hf": tiny[0]}.get(given, given)
    (tmp_path / "empty").mkdir()
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", tiny[1], "--int8", folder),
          needle.replace("{}", str(folder)))


def test_saved_reference_file_is_not_a_reference_model(tmp_path, tiny_int4):
    ref = tmp_path / "ref.npz"
    ref.write_bytes(b"x")
    check(tmp_path, run(tmp_path, "--pkg", tiny_int4, "--ref", ref), "diagnose needs the reference model itself")


def test_weights_in_a_hard_linked_file_are_read_as_the_scoring_commands_read_them(tmp_path):
    """onnx refuses external data in a file with several hard links (a package copied with cp -al), which
    onnxruntime and every scoring command read: diagnose's weight reads (the swap, --verify) refused it after
    60 s of work (issue 49 item 12); now the values are read, equal to the single-link file's, and a location
    outside the folder is still one line."""
    import os

    import numpy as np
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import convert_model_to_external_data

    from ortevals.errors import PackageError
    from ortevals.package.graph import tensor_array

    values = np.arange(4096, dtype=np.float32).reshape(64, 64)
    graph = onnx.helper.make_graph([], "g", [], [onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT,
                                                                                       [64, 64])],
                                   [numpy_helper.from_array(values, "w")])
    model = onnx.helper.make_model(graph)
    convert_model_to_external_data(model, location="model.onnx.data", size_threshold=0)
    onnx.save(model, str(tmp_path / "model.onnx"))
    tensor = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer[0]
    assert np.array_equal(tensor_array(tensor, tmp_path), values)  # control: one link reads
    os.link(tmp_path / "model.onnx.data", tmp_path / "twin.data")
    assert np.array_equal(tensor_array(tensor, tmp_path), values)
    outside = onnx.TensorProto()
    outside.CopyFrom(tensor)
    next(e for e in outside.external_data if e.key == "location").value = "../elsewhere.data"
    with pytest.raises(PackageError, match="outside") as caught:
        tensor_array(outside, tmp_path)
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value)
