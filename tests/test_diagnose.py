"""``ortevals diagnose`` (issue 41): its statistics, the graph roles, the residual taps against PyTorch, the weight
swap against the builder's own ``nodes_to_exclude`` export, and whole runs on tiny packages with planted errors."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from ortevals.cli import cli
from ortevals.diagnose.stats import Gain, block_rows, greedy_steps, ranked, token_errors
from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.roles import residual_points, weight_units

DOWN1 = "/model/layers.1/mlp/down_proj/MatMul"


@pytest.fixture(scope="session")
def tiny_int4_down1(fixture_cache):
    """The builder's int4 export with layer 1's down projection left in fp32 (``nodes_to_exclude``)."""
    from tests.fixtures.tiny import build_tiny_int4

    return build_tiny_int4(fixture_cache, (DOWN1,))


# --- pure statistics, against hand-computed values ---

def test_token_errors_by_hand():
    rel, cos = token_errors(np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]]), np.array([[3.0, 0.0], [2.0, 0.0],
                                                                                    [0.0, 0.0]]))
    np.testing.assert_allclose(rel, [4 / 5, 1.0, 0.0])
    np.testing.assert_allclose(cos, [9 / 15, 1.0, 1.0])


def test_block_rows_added_error_and_clustered_se_by_hand():
    clusters = np.array([0, 0, 1, 1])
    rel = {"embed": np.array([0.1, 0.1, 0.1, 0.1]), "attn.0": np.array([0.2, 0.4, 0.3, 0.5]),
           "out.0": np.array([0.3, 0.4, 0.6, 0.9])}
    cos = {k: np.ones(4) for k in rel}
    rows = {r.name: r for r in block_rows(rel, cos, clusters, 1)}
    assert list(rows) == ["embeddings", "layers.0.attn", "layers.0.mlp"]
    assert rows["layers.0.attn"].added == pytest.approx(0.25)  # mean of 0.1, 0.3, 0.2, 0.4
    d = np.array([0.1, 0.0, 0.3, 0.4])  # out.0 − attn.0: mean 0.2
    assert rows["layers.0.mlp"].added == pytest.approx(0.2)
    # CR1 over 2 windows: G/(G−1) · Σ_g (Σ_i (x_i − x̄))² / N² = 2 · ((−0.1)² + (0.3)²) / 16
    assert rows["layers.0.mlp"].added_se == pytest.approx(math.sqrt(2 * ((d[:2] - 0.2).sum() ** 2
                                                                       + (d[2:] - 0.2).sum() ** 2) / 16))
    assert [r.name for r in ranked(list(rows.values()))] == ["layers.0.attn", "layers.0.mlp", "embeddings"]


def test_greedy_takes_kl_per_megabyte_within_the_budget():
    gains = [Gain("A", 0.5, 1_000_000),      # recovers 0.5 at 0.5 / MB
             Gain("B", 0.7, 200_000),        # 0.3 at 1.5 / MB
             Gain("C", 0.8, 5_000_000),      # 0.2, larger than the budget
             Gain("D", 1.1, 100_000),        # worse than the candidate: never
             Gain("E", 0.99, 0)]             # free and helps: first
    assert greedy_steps(1.0, gains, 3_000_000) == ["E", "B", "A"]
    assert greedy_steps(1.0, gains, 1_000_000) == ["E", "B"]


# --- graph roles ---

def test_units_are_the_builders_exclusion_names(tiny_int4, tiny_int4_down1):
    """The float name diagnose reads off a quantized node is the one the builder's nodes_to_exclude took."""
    units = weight_units(onnx.load(str(tiny_int4 / "model.onnx"), load_external_data=False).graph)
    assert units["layers.1.down"].nodes == (DOWN1,)
    assert units["layers.0.gate_up"].nodes == ("/model/layers.0/mlp/gate_proj/MatMul",
                                               "/model/layers.0/mlp/up_proj/MatMul")
    excluded = onnx.load(str(tiny_int4_down1 / "model.onnx"), load_external_data=False).graph
    assert any(n.name == DOWN1 and n.op_type == "MatMul" for n in excluded.node)


def test_residual_points_of_llama_and_gemma_layouts(tiny_pkg, gemma4):
    llama = residual_points(onnx.load(str(tiny_pkg / "model.onnx"), load_external_data=False).graph)
    assert sorted(llama) == ["attn.0", "attn.1", "embed", "out.0", "out.1"]
    assert llama["out.1"].node == "/model/layers.2/final_norm_layernorm/SkipLayerNorm" and llama["out.1"].slot == 3
    gemma = residual_points(onnx.load(str(gemma4[1] / "decoder.onnx"), load_external_data=False).graph)
    assert gemma["embed"].tensor == "inputs_embeds"
    assert gemma["attn.0"].node == "/model/layers.0/pre_feedforward_layernorm/SkipLayerNorm"


# --- the residual taps against PyTorch on the same weights ---

def test_taps_equal_pytorch_hidden_states(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from ortevals.runtime.sessions import DecoderRunner
    from ortevals.runtime.taps import TapRunner

    hf_dir, pkg_dir = tiny
    package = ModelPackage.load(pkg_dir)
    taps = TapRunner.open(package, ProviderConfig("cpu"), tmp_path)
    ids = np.array([1, 57, 300, 12, 99, 4, 250, 17, 8, 401], np.int64)
    logits, points = taps(ids)
    plain, _ = DecoderRunner.open(package, ProviderConfig("cpu")).forward(ids[None], np.ones((1, len(ids)), np.int64))
    np.testing.assert_array_equal(logits, plain[0])  # the extra outputs change nothing
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seen = {}

    def keep(name):
        def pre(module, args, kwargs):  # a block's input
            seen[name] = (args[0] if args else kwargs["hidden_states"]).clone()
        return pre

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(keep(f"in.{i}"), with_kwargs=True)
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(f"attn_out.{i}", out[0]))
    model.model.norm.register_forward_pre_hook(keep("final"), with_kwargs=True)
    with torch.no_grad():
        model(torch.from_numpy(ids)[None])
    expect = {"embed": seen["in.0"], "attn.0": seen["in.0"] + seen["attn_out.0"], "out.0": seen["in.1"],
              "attn.1": seen["in.1"] + seen["attn_out.1"], "out.1": seen["final"]}
    for point, value in expect.items():
        np.testing.assert_allclose(points[point], value[0].numpy(), atol=2e-4, rtol=1e-4, err_msg=point)


# --- the weight swap against the builder's own export ---

def test_swap_equals_the_builders_exclusion(tiny_int4, tiny_int4_down1, tiny_pkg, tmp_path):
    from ortevals.runtime.sessions import DecoderRunner
    from ortevals.runtime.swap import Refused, size_delta, swapped_package

    def listing():
        return sorted((str(f), f.stat().st_mtime_ns) for d in (tiny_int4, tiny_pkg) for f in d.rglob("*"))

    before = listing()
    cand, ref = ModelPackage.load(tiny_int4), ModelPackage.load(tiny_pkg)
    folder = swapped_package(cand, ref, (DOWN1,), tmp_path)
    ids = (np.arange(1, 120) * 37 % 512)[None]
    logits = {}
    for name, pkg in (("swapped", folder), ("built", tiny_int4_down1), ("candidate", tiny_int4)):
        runner = DecoderRunner.open(ModelPackage.load(pkg), ProviderConfig("cpu"))
        logits[name] = runner.forward(ids, np.ones_like(ids))[0]
    np.testing.assert_array_equal(logits["swapped"], logits["built"])
    assert np.abs(logits["candidate"] - logits["built"]).max() > 0.01  # the swap did change something
    built = onnx.load(str(tiny_int4_down1 / "model.onnx"), load_external_data=False).graph
    ours = onnx.load(str(tiny_int4 / "model.onnx"), load_external_data=False).graph

    def weight_bytes(graph):
        return sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                   for t in graph.initializer)

    assert size_delta(cand, ref, (DOWN1,)) == weight_bytes(built) - weight_bytes(ours)
    with pytest.raises(Refused, match="full precision already"):
        size_delta(cand, ref, ("/model/embed_tokens/Gather",))
    assert listing() == before and (folder / "scope.json").is_file()  # the package folders are never written


# --- whole runs ---

def diagnose(tmp_path, *args):
    out = tmp_path / "diag"
    result = CliRunner().invoke(cli, ["diagnose", *map(str, args), "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads((out / "diagnose.json").read_text()), result.output, out


def plant(src, dst, name: str, edit) -> None:
    """A copy of package ``src`` whose initializer ``name`` is ``edit(array)``."""
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"))
    tensor = next(t for t in model.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(edit(numpy_helper.to_array(tensor)), name))
    (dst / "model.onnx.data").unlink()
    onnx.save(model, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data")


@pytest.mark.parametrize("layer,block,weight", [(0, "mlp", "mlp.down_proj"), (1, "attn", "attn.o_proj")])
def test_a_planted_error_is_named_first(tmp_path, tiny_pkg, layer, block, weight):
    rng = np.random.default_rng(0)
    cand = tmp_path / "planted"
    plant(tiny_pkg, cand, f"model.layers.{layer}.{weight}.MatMul.weight",
          lambda w: w + rng.normal(0, 3 * w.std(), w.shape).astype(w.dtype))
    s, text, _ = diagnose(tmp_path, "--pkg", cand, "--ref", tiny_pkg, "--tokens", 256, "--questions", 0)
    assert s["layers"]["ranked"][0] == f"layers.{layer}.{block}"
    assert f"largest added error: layers.{layer}.{block}" in text
    assert s["recommendation"] is None and not s["sensitivity"]["groups"]  # an fp32 candidate: nothing to swap


def test_a_planted_quantization_error_is_found_and_recovered(tmp_path, tiny_int4, tiny_pkg):
    cand = tmp_path / "planted"
    plant(tiny_int4, cand, "model.layers.1.attn.o_proj.MatMul.weight_scales", lambda s: s * 4)
    s, _, out = diagnose(tmp_path, "--pkg", cand, "--ref", tiny_pkg, "--tokens", 512, "--questions", 0,
                         "--budget", 30)
    assert s["layers"]["ranked"][0] == "layers.1.attn"
    assert s["greedy"][0]["units"] == ["layers.1.o"]
    assert s["recommendation"]["nodes"][0] == "/model/layers.1/attn/o_proj/MatMul"
    assert s["recommendation"]["recovered_share"] > 0.8
    assert (out / "diagnose.png").read_bytes()[:4] == b"\x89PNG" and (out / "reference.npz").is_file()


def short_mmlu(tmp_path):
    """The bundled MMLU-Pro with every text cut short, so 5-shot prompts fit the tiny model's 1024 tokens."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ortevals.presets import BUNDLED

    dst = tmp_path / "mmlu"
    shutil.copytree(BUNDLED / "mmlu_pro", dst)
    for path in (dst / "data").glob("*.parquet"):
        table = pq.read_table(path)
        for col in ("question", "cot_content"):
            table = table.set_column(table.column_names.index(col), col, pc.utf8_slice_codeunits(table[col], 0, 60))
        options = pa.array([[o[:12] for o in row] for row in table["options"].to_pylist()], pa.list_(pa.string()))
        pq.write_table(table.set_column(table.column_names.index("options"), "options", options), path)
    return dst


def fidelity_kl(tmp_path, pkg, ref, tokens: int, data) -> dict:
    out = tmp_path / f"fidelity-{pkg.name}.json"
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(pkg), "--ref", str(ref), "--tokens", str(tokens),
                                      "--data", str(data), "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["kl"]


def test_predicted_kl_is_what_fidelity_measures_on_the_builders_export(tmp_path, tiny, tiny_int4, tiny_int4_down1):
    """The sensitivity stage's KL of a group (made by swapping weights) against ``ortevals fidelity`` on the
    builder's export with that group excluded; then --verify builds the recommendation and measures it; and the
    choice-KL path on two questions."""
    hf_dir, ref = tiny
    s, text, out = diagnose(tmp_path, "--pkg", tiny_int4, "--ref", ref, "--checkpoint", hf_dir, "--verify",
                            "--tokens", 512, "--budget", 12, "--questions", 2, "--data", short_mmlu(tmp_path))
    group = next(g for g in s["sensitivity"]["groups"] if g["label"] == "layers.1.down")
    measured = fidelity_kl(tmp_path, tiny_int4_down1, ref, 512, tmp_path / "mmlu")
    assert abs(group["kl"] - measured["mean"]) <= 1.96 * measured["se"]
    assert group["kl"] == pytest.approx(measured["mean"], abs=1e-6)  # the same logits: equal but for float32 storage
    rec, v = s["recommendation"], s["verify"]
    assert rec["units"] == ["layers.0.qkv"] and rec["size_percent"] <= 12
    built = fidelity_kl(tmp_path, out / "recommended", ref, 512, tmp_path / "mmlu")
    assert rec["kl"] == pytest.approx(built["mean"], abs=1e-6) and v["kl"] == pytest.approx(built["mean"], abs=1e-6)
    assert "bit for bit" in v["same_weights"]
    assert v["builder_command"].split("--extra_options")[1] == rec["builder_command"].split("--extra_options")[1]
    assert 0 < v["size_percent"] <= 12
    assert s["choice"]["questions"] == 2 and v["choice"]["questions"] == 2 and rec["choice"] is not None
    assert "Verified: built" in text


def test_the_olive_pass_hands_the_builder_the_command_lines_options(monkeypatch, tiny_int4):
    """The printed Olive pass's ``extra_options`` reach the builder, through ortevals' mended ModelBuilder pass, as
    the same KEY=VALUE strings the printed command line gives it."""
    pytest.importorskip("olive")
    from onnxruntime_genai.models import builder

    from ortevals.diagnose.recommend import build_settings, builder_command, olive_pass
    from ortevals.integrations.olive_builder import builder_api

    settings = build_settings(ModelPackage.load(tiny_int4))
    nodes = (DOWN1, "/lm_head/MatMul")
    seen = {}

    def parse_extra_options(model_name, input_path, output_dir, precision, execution_provider, cache_dir,
                            extra_options):
        seen["items"] = extra_options
        return {"hf_details": None}

    monkeypatch.setattr(builder, "parse_extra_options", parse_extra_options)
    monkeypatch.setattr(builder, "create_model", lambda *a, **k: seen.setdefault("built", (a, k)))
    pass_config = olive_pass(settings, nodes)
    with builder_api():  # what Olive's ModelBuilder calls: create_model(..., **extra_args) with extra_options merged
        builder.create_model("m", "in", "out", pass_config["precision"], settings.ep, "cache",
                             **pass_config["extra_options"])
    cmd = builder_command(settings, nodes, "HF", "OUT")
    assert seen["items"] == cmd[cmd.index("--extra_options") + 1:]
    assert seen["items"] == [f"nodes_to_exclude={DOWN1},/lm_head/MatMul"]
    assert cmd[cmd.index("-p") + 1] == pass_config["precision"] == "int4" and cmd[cmd.index("-e") + 1] == "cpu"


def test_a_checkpoint_reference_is_built_once_into_the_builders_fp32_package(tmp_path, tiny, tiny_int4):
    """--ref HF_DIR: the builder's fp32 package of the checkpoint, built into the cache, gives the numbers the
    same package gives as --ref (the tiny fp32 fixture is that build)."""
    hf_dir, fp32 = tiny
    a, _, _ = diagnose(tmp_path / "a", "--pkg", tiny_int4, "--ref", hf_dir, "--tokens", 256, "--questions", 0,
                       "--candidates", 1)
    b, _, _ = diagnose(tmp_path / "b", "--pkg", tiny_int4, "--ref", fp32, "--tokens", 256, "--questions", 0,
                       "--candidates", 1)
    assert "/derived/" in a["reference"]["path"] and a["reference"]["precision"] == "float32"
    assert a["layers"]["blocks"] == b["layers"]["blocks"]
    assert a["token_kl"]["candidate"]["mean"] == pytest.approx(b["token_kl"]["candidate"]["mean"], abs=1e-9)
    assert str(hf_dir) in a["recommendation"]["builder_command"]  # the checkpoint doubles as --checkpoint


def test_the_build_settings_read_back_rebuild_the_candidate_bit_for_bit(fixture_cache, tiny, tiny_int4, tmp_path):
    """A candidate built with non-default builder settings: diagnose reads them back from the graph, and the
    builder run with them (plus an exclusion) reproduces every other weight bit for bit; the default build does
    not (the check can fail)."""
    from ortevals.diagnose.recommend import build_settings
    from ortevals.diagnose.verify import build, same_weights
    from ortevals.package.examples import build_genai_package

    hf_dir, _ = tiny
    cand_dir = fixture_cache / "tiny-int4-b64-asym"
    if not (cand_dir / "genai_config.json").is_file():
        build_genai_package(hf_dir, cand_dir, "int4", fixture_cache / "builder-cache",
                            extra=["block_size=64", "accuracy_level=1", "is_symmetric=false"])
    cand = ModelPackage.load(cand_dir)
    settings = build_settings(cand)
    assert (settings.precision, settings.ep) == ("int4", "cpu")
    assert sorted(settings.extra) == ["accuracy_level=1", "block_size=64", "is_symmetric=false"]
    command = build(settings, (DOWN1,), hf_dir, tmp_path / "rebuilt", tmp_path)
    assert command[command.index("--extra_options") + 1:] == (f"nodes_to_exclude={DOWN1}", *settings.extra)
    assert "bit for bit" in same_weights(cand, ModelPackage.load(tmp_path / "rebuilt"))
    assert "differ from the candidate's" in same_weights(cand, ModelPackage.load(tiny_int4))


def test_layers_whose_points_are_not_named_are_listed(tmp_path, tiny_int4, tiny_pkg):
    """A candidate whose layer-1 middle norm lost its builder name: layer 0 is compared, layer 1 is said not to be."""
    cand = tmp_path / "renamed"
    shutil.copytree(tiny_int4, cand)
    model = onnx.load(str(cand / "model.onnx"), load_external_data=False)
    next(n for n in model.graph.node if n.name == "/model/layers.1/post_attention_layernorm/SkipLayerNorm").name = "x"
    onnx.save(model, str(cand / "model.onnx"))
    s, text, _ = diagnose(tmp_path, "--pkg", cand, "--ref", tiny_pkg, "--tokens", 256, "--questions", 0,
                          "--candidates", 1)
    assert s["layers"]["compared"] == [0] and s["layers"]["not_compared"] == [1]
    assert [b["name"] for b in s["layers"]["blocks"]] == ["embeddings", "layers.0.attn", "layers.0.mlp"]
    assert "compared layers 0; not compared: 1 (their residual tensors are not named the builder's way" in text


@pytest.mark.parametrize("stop,code,said", [(OrtEvalsError("the builder failed: no space left"), 2, "failed"),
                                            (KeyboardInterrupt(), 130, "interrupted")])
def test_a_late_failure_keeps_what_was_measured(tmp_path, tiny, tiny_int4, monkeypatch, stop, code, said):
    """Issue 49 items 5 and 13: a failure (or Ctrl-C) in --verify's build came after the per-layer, token KL and
    sensitivity stages and left no diagnose.json; now it holds those stages, a note says where it stopped, and
    the command still ends as the error says."""
    def fail(*a, **k):
        raise stop

    monkeypatch.setattr("ortevals.diagnose.verify.build", fail)
    hf_dir, ref = tiny
    out = tmp_path / "diag"
    result = CliRunner().invoke(cli, ["diagnose", "--pkg", str(tiny_int4), "--ref", str(ref), "--checkpoint",
                                      str(hf_dir), "--verify", "--tokens", "256", "--questions", "0", "--candidates",
                                      "1", "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    s = json.loads((out / "diagnose.json").read_text())
    assert s["sensitivity"]["groups"] and s["recommendation"] is not None and s["verify"] is None
    assert any(n.startswith(f"stopped: the --verify stage {said}") for n in s["notes"])
    kept = next(line for line in result.output.splitlines() if line.startswith(f"the --verify stage {said}"))
    assert f": kept what was measured before it in {out / 'diagnose.json'}; " in kept, kept
    assert kept.endswith("the same command resumes from them"), kept


def test_a_candidate_that_is_not_quantized_says_so_first_and_skips_the_sensitivity_stage(tmp_path, tiny_pkg):
    """Issue 49 item 12: an fp32 candidate ran every stage and printed one 'not measured' line per weight group
    (122 of 205 lines on a real model); now it is said first, the sensitivity stage is skipped, and --verify
    (nothing to build) is refused before any work."""
    cand = tmp_path / "planted"  # another fp32 model (the reference itself as --pkg is refused)
    plant(tiny_pkg, cand, "model.layers.0.mlp.down_proj.MatMul.weight", lambda w: w * 1.5)
    s, text, _ = diagnose(tmp_path, "--pkg", cand, "--ref", tiny_pkg, "--tokens", 256, "--questions", 0)
    lines = text.splitlines()
    assert lines[0].startswith("the candidate holds no quantized weights") and "not measured" not in text
    assert not s["sensitivity"]["groups"] and not s["sensitivity"]["skipped"] and s["recommendation"] is None
    assert any(n.startswith("the candidate holds no quantized weights") for n in s["notes"])
    from tests.test_cli import assert_one_line_error

    assert_one_line_error(CliRunner().invoke(cli, ["diagnose", "--pkg", str(cand), "--ref", str(tiny_pkg),
                                                   "--checkpoint", str(tiny_pkg.parent / "tiny-hf"), "--verify",
                                                   "--output", str(tmp_path / "v")]),
                          "--verify: the candidate", "holds no quantized weights")


def test_the_per_layer_stage_draws_a_bar_of_its_windows_on_stderr(tmp_path, tiny_pkg, monkeypatch):
    """Issue 55 item 10b: the per-layer stage drew its bar on a terminal only (a minute of silence in a log on a
    large --tokens); now tqdm's bar on stderr, as the scoring bar, counting the windows the stage runs (each window
    runs through both packages' tap graphs: the calls counted here)."""
    import re

    from ortevals.runtime.taps import TapRunner

    calls: list[int] = []
    real = TapRunner.__call__
    monkeypatch.setattr(TapRunner, "__call__", lambda self, ids: calls.append(len(ids)) or real(self, ids))
    cand = tmp_path / "planted"
    plant(tiny_pkg, cand, "model.layers.0.mlp.down_proj.MatMul.weight", lambda w: w * 1.5)
    result = CliRunner().invoke(cli, ["diagnose", "--pkg", str(cand), "--ref", str(tiny_pkg), "--tokens", "600",
                                      "--questions", "0", "--output", str(tmp_path / "diag")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    windows = len(calls) // 2
    drawn = [tuple(map(int, m)) for m in re.findall(r"per layer: +(\d+)%\|[^|]*\| (\d+)/(\d+) ", result.stderr)]
    assert windows == 3 and len(calls) == 2 * windows, calls
    assert drawn and drawn[-1] == (100, windows, windows) and all(t == windows for _, _, t in drawn), drawn
    assert all(p == round(100 * n / t) for p, n, t in drawn) and "%|" not in result.stdout


def test_tokens_beyond_the_text_are_said_to_be_capped(tmp_path, tiny_int4, tiny_pkg):
    """Issue 49 item 12: `--tokens` beyond the text scored what the text held without a word; now the cap is said
    before the per-layer stage and noted in diagnose.json."""
    text = tmp_path / "short.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    s, out, _ = diagnose(tmp_path, "--pkg", tiny_int4, "--ref", tiny_pkg, "--text", text, "--tokens", 100000,
                         "--questions", 0, "--candidates", 1)
    scored = s["text"]["tokens_scored"]
    assert 0 < scored < 100000
    said = f"--tokens 100000: the text holds {scored} tokens to score"
    assert said in out and any(n.startswith(said) for n in s["notes"])


def test_an_interrupted_diagnose_resumes_from_what_it_measured(tmp_path, tiny_int4, tiny_pkg, monkeypatch):
    """Issue 49 item 13: Ctrl-C during the sensitivity stage, then the same command: the per-layer stage, the saved
    reference and the groups measured before are not measured again, and the numbers equal a fresh run's (the
    rerun redid all of it, 56 s on SmolLM2)."""
    import ortevals.diagnose.sensitivity as sens

    args = ["diagnose", "--pkg", str(tiny_int4), "--ref", str(tiny_pkg), "--tokens", "256", "--questions", "0",
            "--candidates", "2", "--budget", "30"]
    real = sens.token_kl
    before: list = []

    def stop_at_the_second(package, *a, **k):
        if before:
            raise KeyboardInterrupt
        before.append(package)
        return real(package, *a, **k)

    def invoke(cache, out):
        return CliRunner(env={"ORTEVALS_CACHE": str(tmp_path / cache)}).invoke(
            cli, [*args, "--output", str(tmp_path / out)], catch_exceptions=False)

    monkeypatch.setattr(sens, "token_kl", stop_at_the_second)
    first = invoke("cache", "out")
    assert first.exit_code == 130 and "the same command resumes from them" in first.output, first.output
    measured: list = []
    monkeypatch.setattr(sens, "token_kl", lambda package, *a, **k: measured.append(package) or real(package, *a, **k))

    def refuse(*a, **k):
        raise AssertionError("measured again")

    for name in ("measure_layers", "save_reference", "token_kl"):
        monkeypatch.setattr(f"ortevals.diagnose.run.{name}", refuse)
    second = invoke("cache", "out")
    assert second.exit_code == 0, second.output
    assert "kept from an earlier run" in second.output and before[0] not in measured and measured
    monkeypatch.undo()
    fresh = invoke("cache2", "out2")
    assert fresh.exit_code == 0, fresh.output
    got, want = (json.loads((tmp_path / o / "diagnose.json").read_text()) for o in ("out", "out2"))
    for key in ("layers", "token_kl", "sensitivity", "greedy"):
        assert json.dumps(got[key]).replace(str(tmp_path / "cache"), "C") == \
            json.dumps(want[key]).replace(str(tmp_path / "cache2"), "C"), key
