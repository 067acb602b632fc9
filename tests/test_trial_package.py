"""Issue 22, trial items 7–9: packages its runtime refuses, misnamed inputs and media tokens, symlinked packages.

The oracle for item 7 is onnxruntime-genai 0.18 itself, run on the whole mutated package (config, model
and a generated token), independently of ortevals: where it refuses, ortevals refuses at load in one line.
"""

import json

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import PackageError
from ortevals.package.loader import ModelPackage
from tests.test_cli import assert_one_line_error


def edit_config(pkg, edit):
    path = pkg / "genai_config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=4))
    return pkg


def og_generates(pkg) -> str | None:
    """None when onnxruntime-genai 0.18 loads the package and generates a token, else its error."""
    import onnxruntime_genai as og

    try:
        config = og.Config(str(pkg))
        config.clear_providers()
        model = og.Model(config)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=16)
        generator = og.Generator(model, params)
        generator.append_tokens([[1, 5, 6]])
        generator.generate_next_token()
    except Exception as e:
        return str(e)
    return None


def decoder(cfg):
    return cfg["model"]["decoder"]


@pytest.mark.parametrize("edit,needle", [
    (lambda c: decoder(c).update(num_hidden_layers="2"),
     "model:decoder:num_hidden_layers - Expected a number but saw a string"),
    (lambda c: c["model"].update(type="foobar"), "Unsupported model_type in config.json: foobar"),
    (lambda c: decoder(c).update(num_hidden_layers=2.5), "value 2.5 is not an integer"),
    (lambda c: decoder(c).update(hidden_sise=64), 'model:decoder: Unknown value "hidden_sise"'),
    (lambda c: c["search"].update(top_k="50"), "search:top_k - Expected a number but saw a string"),
], ids=["layers-as-text", "unknown-type", "fractional-layers", "unknown-key", "search-type"])
def test_a_config_onnxruntime_genai_refuses_is_refused_at_load(tiny_pkg, copy_pkg, edit, needle):
    pkg = edit_config(copy_pkg(tiny_pkg), edit)
    assert needle in (og_generates(pkg) or "og accepted it")  # the runtime's own verdict, on the real package
    with pytest.raises(PackageError) as e:
        ModelPackage.load(pkg)
    assert "onnxruntime-genai refuses this config" in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value) and "ortevals-config-" not in str(e.value)  # no temporary folder named
    assert_one_line_error(CliRunner().invoke(cli, ["info", "--pkg", str(pkg)]), needle)


def test_unmodified_fixtures_are_accepted_by_both(tiny_pkg, gemma4_mm):
    for pkg in (tiny_pkg, gemma4_mm[1]):
        assert ModelPackage.load(pkg).model_type  # ortevals loads it, og's verdict included
    assert og_generates(tiny_pkg) is None


def test_attention_heads_must_match_the_graph(tiny_pkg, copy_pkg):
    """og 0.18 ignores num_attention_heads on this graph (it generates); the graph's GroupQueryAttention says 4."""
    pkg = edit_config(copy_pkg(tiny_pkg), lambda c: decoder(c).update(num_attention_heads=0))
    assert og_generates(pkg) is None
    with pytest.raises(PackageError, match=r"model.decoder.num_attention_heads=0 but model.onnx's attention nodes "
                                           r"have num_heads \[4\]; config and graph must agree"):
        ModelPackage.load(pkg)


def rename_graph_input(model_path, old, new):
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)  # external data stays where it is
    for value in model.graph.input:
        if value.name == old:
            value.name = new
    for node in model.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
    onnx.save(model, str(model_path))


def test_a_renamed_decoder_input_is_named_at_load(tiny_pkg, copy_pkg):
    pkg = copy_pkg(tiny_pkg)
    rename_graph_input(pkg / "model.onnx", "input_ids", "ids")
    message = "input 'ids' is not an input genai_config.json names (model.decoder.inputs: "
    with pytest.raises(PackageError, match=message.replace("(", r"\(")):
        ModelPackage.load(pkg)
    assert_one_line_error(CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit",
                                                   "1", "--no-resume"]), "input 'ids' is not an input")


def test_an_image_token_that_is_ordinary_text_is_named_at_load(gemma4_mm, copy_pkg):
    """The embedding model puts image features where input_ids hold image_token_id: if that id is a text token
    ('e' here), text prompts fail inside the embedding model (before: internal error, ScatterND)."""
    pkg = copy_pkg(gemma4_mm[1])
    tok = json.loads((pkg / "tokenizer.json").read_text())
    image_id = json.loads((pkg / "genai_config.json").read_text())["model"]["image_token_id"]
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["id"] != image_id]
    vocab = tok["model"]["vocab"]
    vocab.pop(next(k for k, v in vocab.items() if v == image_id))
    vocab["e"] = image_id  # an ordinary byte-level token now has the image token's id
    (pkg / "tokenizer.json").write_text(json.dumps(tok))
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "1",
                                      "--truncate", "left", "--no-resume"])
    assert_one_line_error(result, f"field model.image_token_id={image_id} is the ordinary text token 'e' in "
                                  "tokenizer.json; expected a special token")



def hub_layout(src, root):
    """``src`` as a Hugging Face cache snapshot: each file a symlink to ``../../blobs/<sha256>``."""
    import hashlib

    blobs, snap = root / "blobs", root / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (blobs / digest).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return snap


@pytest.mark.parametrize("scoring_graph", [True, False], ids=["derived-graph", "package-graph"])
def test_a_package_of_symlinks_scores_as_the_real_files(tiny_pkg, tmp_path, scoring_graph):
    """onnxruntime refused the derived graph's data ("External data path escapes model directory")."""
    from lm_eval.api.instance import Instance

    from ortevals.integrations.lm import ModelArgs, OrtLM
    from tests.test_properties import REQS

    snap = hub_layout(tiny_pkg, tmp_path / "hub")
    assert (snap / "model.onnx.data").is_symlink()
    scores = []
    for pkg in (tiny_pkg, snap):
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), batch_size=2, scoring_graph=scoring_graph))
        scores.append(lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQS)],
                                       disable_tqdm=True))
    assert scores[0] == scores[1]  # the same files, byte for byte: the same numbers
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(snap), "--data", "bundled", "--limit", "1",
                                      "--truncate", "left", "--no-resume"], catch_exceptions=False)
    assert result.exit_code == 0 and "questions 1 " in result.output, result.output
