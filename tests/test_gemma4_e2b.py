"""Gemma 4 E2B/E4B as Mobius exports them (issue 48 §2): per-layer inputs and KV-shared layers.

The packages (tests/fixtures/gemma4_e2b.py): ``text`` (one model, ``input_ids`` in, the per-layer embeddings
inside) and ``vision`` (an embedding model whose ``per_layer_inputs`` output the decoder takes, and a vision
model); both have past KV for layers 0-2 only, layers 3 and 4 attending to layers 1's and 2's KV. On the first
five MMLU-Pro questions as ``leaderboard_mmlu_pro`` asks them (5-shot, ~1,500 tokens a prompt, the shared
header far past the 16-token sliding window) every scoring path equals transformers through lm-eval's ``hf``
backend on the same weights, greedy generation equals transformers' text, K sampled rows equal onnxruntime-genai's
Generator drawing the same seeds, and image requests equal a plain onnxruntime pass over vision → embedding →
decoder.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage

TOL = 1e-4
PATHS = {"default": {}, "exact": {"exact": True}, "no_prefix_cache": {"prefix_cache": False},
         "incremental": {"path": "incremental"}}


@pytest.fixture(scope="module")
def e2b(fixture_cache) -> Path:
    from tests.fixtures.gemma4_e2b import build_e2b

    return build_e2b(fixture_cache / "gemma4")


@cache
def _lm(folder: str, which: str, path: str) -> OrtLM:
    from tests.fixtures.gemma4_e2b import MAX_LENGTH

    return OrtLM.from_package(ModelArgs(pkg=f"{folder}/{which}", max_length=MAX_LENGTH, **PATHS.get(path, {}),
                                        **({"gen_path": path[4:]} if path.startswith("gen_") else {})))


def _instances(kind: str, args: list) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("which", ["text", "vision"])
def test_the_layer_map_is_read_from_the_graph(e2b, which):
    """Past KV for layers 0-2 only; layers 3 and 4 read the KV of the last earlier layer of their type, as
    transformers' ``kv_sharing_modes`` says; the vision package's decoder takes the embedding's per-layer inputs."""
    from tests.fixtures.gemma4_e2b import LAYER_TYPES, SHARED_MAP

    pkg = ModelPackage.load(e2b / which)
    assert [s.layer for s in pkg.kv] == [0, 1, 2] and [s.head_size for s in pkg.kv] == [32, 32, 64]
    assert pkg.shared_kv == SHARED_MAP
    assert all(LAYER_TYPES[layer] == LAYER_TYPES[source] for layer, source in pkg.shared_kv)
    from ortevals.report.describe import describe_package

    assert "2 more layers attend to another layer's KV: 3<-1, 4<-2" in describe_package(pkg)  # ortevals info
    from ortevals.package.lint import lint

    # Mobius writes context_length 4096 whatever the checkpoint's max_position_embeddings (2048 here)
    assert lint(pkg) == [f"{pkg.root / 'genai_config.json'}: model.context_length=4096 but model.onnx's rotary table "
                         "has 2048 positions: a sequence past 2048 tokens has no rotation there (keep max_length at or "
                         "below 2048)"]
    if which == "vision":
        assert pkg.decoder.input("per_layer_inputs") is not None
        assert pkg.embedding.output("per_layer_inputs") is not None and pkg.skipped_models == ("vision",)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("which", ["text", "vision"])
def test_first_five_mmlu_pro_questions_equal_transformers(e2b, which, path):
    from tests.fixtures.gemma4_e2b import reference, requests

    lm = _lm(str(e2b), which, path)
    ref = reference(e2b)["requests"]
    pairs = requests()
    assert [list(x) for x in map(lambda p: lm._encode_pair(*p), pairs)] == \
        [[r["context_ids"], r["continuation_ids"]] for r in ref]  # lm-eval's own token ids
    got = lm.loglikelihood(_instances("loglikelihood", list(pairs)), disable_tqdm=True)
    delta = np.abs(np.array([lp for lp, _ in got]) - np.array([r["loglikelihood"] for r in ref]))
    print(f"gemma4 e2b {which} {path}: max |Δ| {delta.max():.3g} over {len(ref)} requests")  # pytest -s
    assert delta.max() <= TOL, f"{which} {path}: max |Δ| {delta.max():.3g}"
    assert [g for _, g in got] == [r["greedy"] for r in ref]
    if path == "default":  # the five-shot header ran once and its KV was reused (the prefill path's prefix plan)
        fed = sum(len(r["context_ids"]) + len(r["continuation_ids"]) - 1 for r in ref)
        assert lm.engine.tokens_run < fed / 4


@pytest.mark.parametrize("path", ["gen_raw", "gen_og"])
@pytest.mark.parametrize("which", ["text", "vision"])
def test_greedy_generation_equals_transformers(e2b, which, path):
    from tests.fixtures.gemma4_e2b import MAX_GEN_TOKS, STOP, gen_prompts, reference

    lm = _lm(str(e2b), which, path)
    kwargs = {"until": [STOP], "do_sample": False, "max_gen_toks": MAX_GEN_TOKS}
    outs = lm.generate_until(_instances("generate_until", [(p, dict(kwargs)) for p in gen_prompts()]),
                             disable_tqdm=True)
    assert outs == [g["text"] for g in reference(e2b)["generate"]]


def test_k_sampled_rows_equal_the_generator_and_the_models_own_log_prob(e2b):
    """K rows of one prompt decoded together on the raw path (their KV, shared layers' included, replicated from
    one prompt pass) draw what onnxruntime-genai's Generator draws for the same seeds, and each sample's summed
    log-prob is the model's over one pass without past."""
    from scipy.special import log_softmax

    from tests.test_sampler import SAMPLED, repeats, rows, sampler

    raw, og = _lm(str(e2b), "vision", "gen_raw"), _lm(str(e2b), "vision", "gen_og")
    prompt = "Question: Which of these is a prime number?\nA. 4\nB. 9\nC. 7\nAnswer:"
    reqs = repeats([prompt], SAMPLED, 4)
    ours = raw.generate_until(reqs, disable_tqdm=True)
    assert ours == og.generate_until(reqs, disable_tqdm=True) and len(set(ours)) == 4
    ctx = raw.tok_encode(prompt)
    for sample in rows(sampler(raw), raw, prompt, SAMPLED, [11, 12, 13]):
        seq = np.asarray([ctx + list(sample.ids)], dtype=np.int64)
        logits, _ = raw.run.generation.sampler().runner.forward(seq, np.ones_like(seq))
        lp = log_softmax(logits[0, len(ctx) - 1:-1].astype(np.float64), axis=-1)
        assert abs(sample.logprob - float(lp[np.arange(len(sample.ids)), sample.ids].sum())) < 1e-3


@pytest.mark.parametrize("media_path", ["og", "fast"])
def test_image_requests_equal_one_plain_pass(e2b, media_path):
    """Image requests on og's pipeline and on the fast path (vision, embedding with per-layer inputs, decoder on
    raw sessions, the text before the image run once) equal one plain onnxruntime pass over og's processor
    outputs: vision → embedding → decoder, per_layer_inputs handed from the embedding to the decoder."""
    from ortevals.engine.media.og import MediaRequest
    from ortevals.engine.media.paths import open_media
    from ortevals.package.media import to_media
    from ortevals.package.tokenizer import Tokenizer
    from tests.fixtures.gemma4_e2b import ort_oracle
    from tests.fixtures.gemma4_mm import image_path
    from tests.test_multimodal import oracle_loglikelihood

    pkg = ModelPackage.load(e2b / "vision")
    engine = open_media(pkg, Tokenizer.load(pkg), path=media_path)
    header = "Answer each question about the picture.\n\n"
    images = [to_media(image_path(n)) for n in ("astronaut.png", "chelsea.png")]
    reqs = [MediaRequest(f"{header}<image>Question: what is it?\nAnswer:", c, (img,))
            for img in images for c in (" A", " a cat", " B. the answer is")]
    for req, (lp, greedy) in zip(reqs, engine.loglikelihood(reqs), strict=True):
        expected, expected_greedy = oracle_loglikelihood(engine, req, ort_oracle)
        assert abs(lp - expected) <= 1e-4 and greedy == expected_greedy
    if media_path == "fast":
        assert engine.prefixes.hits >= 1  # the header's KV (and so the shared layers' source KV) reused



def _edit(pkg: Path, change) -> Path:
    import json

    path = pkg / "genai_config.json"
    config = json.loads(path.read_text())
    change(config["model"])
    path.write_text(json.dumps(config))
    return pkg


@pytest.mark.parametrize("which, change, needle", [
    ("text", lambda m: m["decoder"].update(num_hidden_layers=6),
     "num_hidden_layers=6 but model.onnx has 3 layers of past KV inputs and 2 attending to another layer's KV"),
    ("vision", lambda m: m["embedding"]["outputs"].update(per_layer_inputs="ple"),
     "model.decoder.inputs.per_layer_inputs='per_layer_inputs' but model.embedding.outputs.per_layer_inputs='ple' "
     "(not an output of the model)"),
], ids=["layer count", "renamed per-layer inputs"])
def test_a_config_that_disagrees_with_the_layer_map_is_one_line(e2b, copy_pkg, which, change, needle):
    from ortevals.errors import PackageError

    pkg = _edit(copy_pkg(e2b / which), change)
    with pytest.raises(PackageError) as err:
        ModelPackage.load(pkg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_type_mobius_writes_for_a_multimodal_export_is_refused_by_og_and_served_raw(e2b, copy_pkg):
    """Mobius 0.1.0 writes ``type: gemma4_text`` for a multimodal Gemma 4 built from a local folder; onnxruntime-genai
    refuses it ("Decoder-only CPU embedding requires the dynamic-batching Engine"). The og paths say what to set, in
    one line; the prefill path scores the package as it is."""
    from ortevals.errors import PackageError
    from tests.fixtures.gemma4_e2b import reference, requests

    pkg = _edit(copy_pkg(e2b / "vision"), lambda m: m.update(type="gemma4_text"))
    pairs, ref = list(requests())[:10], reference(e2b)["requests"][:10]
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), path="incremental"))
    with pytest.raises(PackageError, match="model.type is 'gemma4_text' but the package has an embedding model") as err:
        lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    assert "set model.type to 'gemma4'" in str(err.value) and "\n" not in str(err.value)
    got = OrtLM.from_package(ModelArgs(pkg=str(pkg))).loglikelihood(_instances("loglikelihood", pairs),
                                                                     disable_tqdm=True)
    assert np.abs(np.array([lp for lp, _ in got]) - [r["loglikelihood"] for r in ref]).max() <= TOL


def _without_windows(pkg: Path) -> Path:
    """``pkg`` with every attention node's sliding window taken out (the cascade rewrite refuses a window first)."""
    import onnx

    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "GroupQueryAttention" and a.name == "local_window_size":
                a.i = -1
    onnx.save(model, str(pkg / "model.onnx"))
    return pkg


def test_cascade_on_kv_shared_layers_is_refused_in_one_line(e2b, copy_pkg, tmp_path, caplog):
    """Layers 3 and 4 attend to layers 1's and 2's KV, which the cascade decode graph (each layer's attention split
    over that layer's own prompt KV and rows' KV) cannot rewrite: refused in one line naming the sharing, not a
    KeyError on ``present.1.key``. At the front door ``auto`` logs it once and samples what ``off`` samples;
    ``on`` is a one-line error."""
    import dataclasses

    from ortevals.errors import OrtEvalsError
    from ortevals.runtime.cascade import Refused, cascade_decoder
    from tests.fixtures.gemma4_e2b import MAX_LENGTH
    from tests.test_sampler import SAMPLED, repeats

    folder = _without_windows(copy_pkg(e2b / "text"))
    pkg = ModelPackage.load(folder)
    sharing = r"layers attend to another layer's KV \(KV sharing: 3<-1, 4<-2\)"
    with pytest.raises(Refused, match=f"^{sharing}$"):
        cascade_decoder(pkg, tmp_path / "cache")
    with pytest.raises(Refused, match="its past KV present.1.key is not a past input of the decoder"):
        cascade_decoder(dataclasses.replace(pkg, shared_kv=()), tmp_path / "cache")  # the graph's own check

    reqs = repeats(["Question: Which of these is a prime number?\nA. 4\nB. 9\nC. 7\nAnswer:"],
                   dict(SAMPLED, max_gen_toks=6), 3)

    def lm(cascade: str) -> OrtLM:
        return OrtLM.from_package(ModelArgs(pkg=str(folder), max_length=MAX_LENGTH, gen_path="raw", cascade=cascade))

    with caplog.at_level("INFO", logger="ortevals.engine.generate.rows.cascade_kv"):
        auto = lm("auto").generate_until(reqs, disable_tqdm=True)
    assert caplog.text.count("each decode row keeps its own copy") == 1
    assert "KV sharing: 3<-1, 4<-2" in caplog.text
    assert auto == lm("off").generate_until(reqs, disable_tqdm=True) and len(set(auto)) == 3
    with pytest.raises(OrtEvalsError, match=f"^cascade=on is impossible for this package: {sharing}$"):
        lm("on").generate_until(reqs, disable_tqdm=True)
