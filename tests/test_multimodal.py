"""Image and audio requests (issue 13): og's pipeline against a raw-onnxruntime oracle, lm-eval end to end,
media conversion, and every one-line error.

The oracle (tests/fixtures/gemma4_mm.py ``ort_oracle``) runs vision → speech → embedding → decoder with
onnxruntime directly on og's processor outputs; the engine's numbers come from og's own Generator.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.media.og import MediaEngine, MediaRequest, split_context
from ortevals.engine.media.paths import open_media
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.package.loader import ModelPackage
from ortevals.package.media import Media, to_media, to_media_list
from ortevals.package.tokenizer import Tokenizer
from tests.fixtures.gemma4_mm import chirp_wav, image_path, ort_oracle

TOL = 1e-5


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def engine(gemma4_mm):
    """onnxruntime-genai's own pipeline (processor → vision/speech → embedding → decoder)."""
    pkg = ModelPackage.load(gemma4_mm[1])
    return open_media(pkg, Tokenizer.load(pkg), path="og")


@pytest.fixture(scope="module")
def fast_engine(gemma4_mm):
    pkg = ModelPackage.load(gemma4_mm[1])
    return open_media(pkg, Tokenizer.load(pkg), path="fast")


@pytest.fixture(scope="module")
def windowed_engine(gemma4_mm_windowed):
    pkg = ModelPackage.load(gemma4_mm_windowed[1])
    return open_media(pkg, Tokenizer.load(pkg))  # auto: the windowed cache keeps it on og's path


def oracle_loglikelihood(engine: MediaEngine, req: MediaRequest, oracle=ort_oracle) -> tuple[float, bool]:
    """Sum of log-softmax over the continuation, from one raw-ORT pass (``oracle``) over prompt + continuation."""
    context, cont_text = split_context(req.context, req.continuation)
    processed = engine.runner.process(engine.prompt(context, req.media), req.media)
    cont = engine.continuation_ids(context, cont_text)
    feeds = processed.numpy()
    n = feeds["input_ids"].shape[1]
    feeds["input_ids"] = np.concatenate([feeds["input_ids"], np.asarray([cont], feeds["input_ids"].dtype)], 1)
    rows = _log_softmax(oracle(engine.package.root, feeds)[n - 1:n - 1 + len(cont)])
    return float(sum(rows[j, t] for j, t in enumerate(cont))), bool(all(rows[j].argmax() == t for j, t in
                                                                       enumerate(cont)))


IMAGES = {"one image": ("astronaut.png",), "two images": ("astronaut.png", "chelsea.png"),
          "grayscale": ("camera.png",), "grayscale text": ("text.png",)}


@pytest.mark.parametrize("names", list(IMAGES.values()), ids=list(IMAGES))
def test_prefill_logits_equal_oracle(engine, names):
    """og's logits over every prompt position (vision → embedding → decoder) equal the raw-ORT oracle."""
    media = tuple(to_media(image_path(n)) for n in names)
    processed = engine.runner.process(engine.prompt("What is shown here?", media), media)
    feeds = processed.numpy()
    assert feeds["input_ids"][0, 0] == engine.tokenizer.special.bos_id  # BOS as on the text path
    assert int((feeds["input_ids"] == 3).sum()) == int(feeds["num_image_tokens"].sum()) >= 10 * len(names)
    gen = engine.runner.generator(processed, len(processed.input_ids) + 4)
    got = np.asarray(gen.get_output("logits"))[0]
    ref = ort_oracle(engine.package.root, feeds)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL
    # the image changes the numbers (the features are not silently dropped)
    other = to_media(image_path("coffee.png"))
    feeds2 = engine.runner.process(engine.prompt("What is shown here?", (other,) * len(names)), (other,) * len(names))
    if feeds2.input_ids == processed.input_ids:
        assert np.abs(ort_oracle(engine.package.root, feeds2.numpy()) - ref).max() > 1e-2


def test_audio_logits_equal_oracle(engine):
    media = (to_media(chirp_wav(1.0)),)
    processed = engine.runner.process(engine.prompt("Transcribe:", media), media)
    feeds = processed.numpy()
    assert int((feeds["input_ids"] == 9).sum()) == int(feeds["audio_sizes"].sum()) == 25  # ceil(99 frames / 4)
    gen = engine.runner.generator(processed, len(processed.input_ids) + 4)
    assert np.abs(np.asarray(gen.get_output("logits"))[0] - ort_oracle(engine.package.root, feeds)).max() <= TOL


@pytest.mark.parametrize("which", ["full", "windowed"])
def test_loglikelihood_with_rewind_equals_oracle(request, which):
    """One-token and longer continuations of one context + image, and one with audio: equal to the oracle.
    The full cache rewinds (one Generator per group); the windowed one gets fresh Generators."""
    engine = request.getfixturevalue("engine" if which == "full" else "windowed_engine")
    img, aud = to_media(image_path("astronaut.png")), to_media(chirp_wav(0.5))
    reqs = [MediaRequest("Question: what is it?\nAnswer:", " a cat", (img,)),
            MediaRequest("Question: what is it?\nAnswer:", " the", (img,)),  # one token: the prefill's logits
            MediaRequest("Question: what is it?\nAnswer: ", "the man in space", (img,)),
            MediaRequest("Question: what is it?\nAnswer:", " a man in a white suit", (img,)),
            MediaRequest("Listen:", " hello there", (aud,))]
    before = (engine.runner.generators_created, engine.runner.processed)
    got = engine.loglikelihood(reqs)
    made = engine.runner.generators_created - before[0]
    assert engine.runner.processed - before[1] == 2  # one processor run per (context, media)
    # full: one Generator per group; windowed: each multi-token continuation after the first starts again
    assert made == (2 if which == "full" else 4)
    assert len(engine.continuation_ids("Answer:", " the")) == 1
    for req, (lp, greedy) in zip(reqs, got, strict=True):
        ref_lp, ref_greedy = oracle_loglikelihood(engine, req)
        assert abs(lp - ref_lp) <= TOL and greedy == ref_greedy


def test_generate_greedy_equals_oracle_and_seeds(engine):
    img = to_media(image_path("chelsea.png"))
    s = GenSettings(max_gen_toks=6)
    text = engine.generate([MediaRequest("Describe:", None, (img,), s)])[0]
    # greedy by hand: the oracle over the growing sequence, argmax each step
    processed = engine.runner.process(engine.prompt("Describe:", (img,)), (img,))
    feeds, out = processed.numpy(), []
    for _ in range(6):
        nxt = int(ort_oracle(engine.package.root, feeds)[-1].argmax())
        if nxt in engine.eos_ids:
            break
        out.append(nxt)
        feeds["input_ids"] = np.concatenate([feeds["input_ids"], [[nxt]]], 1).astype(feeds["input_ids"].dtype)
    assert text == engine.tokenizer.decode(out, skip_special_tokens=True)
    sampled = GenSettings(max_gen_toks=8, do_sample=True)
    reqs = [MediaRequest("Describe:", None, (img,), sampled)] * 2
    a, b = engine.generate(reqs), engine.generate(reqs)
    assert a == b and a[0] != a[1]  # seeded per request and repeat: reproducible, repeats differ


def test_generate_applies_the_repetition_penalty_over_prompt_and_output(engine):
    """repetition_penalty on a media prompt: greedy over the oracle's logits after transformers'
    RepetitionPenaltyLogitsProcessor, whose history is the processor's ids (image tokens included)
    + the tokens generated so far (as on the text path)."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    img = to_media(image_path("chelsea.png"))
    s = GenSettings(max_gen_toks=8, repetition_penalty=3.0)
    text = engine.generate([MediaRequest("Describe:", None, (img,), s)])[0]
    penalty = RepetitionPenaltyLogitsProcessor(3.0)
    processed = engine.runner.process(engine.prompt("Describe:", (img,)), (img,))
    feeds, out = processed.numpy(), []
    for _ in range(8):
        ids = torch.as_tensor(feeds["input_ids"], dtype=torch.long)
        logits = torch.as_tensor(ort_oracle(engine.package.root, feeds)[-1:], dtype=torch.float32)
        nxt = int(penalty(ids, logits)[0].argmax())
        if nxt in engine.eos_ids:
            break
        out.append(nxt)
        feeds["input_ids"] = np.concatenate([feeds["input_ids"], [[nxt]]], 1).astype(feeds["input_ids"].dtype)
    assert text == engine.tokenizer.decode(out, skip_special_tokens=True)
    assert text != engine.generate([MediaRequest("Describe:", None, (img,), GenSettings(max_gen_toks=8))])[0]


# --- lm-eval end to end ------------------------------------------------------------------------

CHOICES = ["a man in space", "a cat", "a cup of coffee"]


def _tasks(parquet) -> tuple[dict, dict]:
    """Two local tasks in lm-eval's YAML schema (dicts: no task index to build)."""
    common = {"dataset_path": "parquet", "dataset_kwargs": {"data_files": {"test": str(parquet)}},
              "test_split": "test", "doc_to_image": ["image"], "doc_to_text": "<image>What is shown?\nAnswer:"}
    mc = {"task": "tiny_mm_mc", "output_type": "multiple_choice", "doc_to_choice": CHOICES,
          "doc_to_target": "label", "metric_list": [{"metric": "acc"}], **common}
    gen = {"task": "tiny_mm_gen", "output_type": "generate_until", "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}], **common}
    return mc, gen


def test_lm_eval_run_on_local_multimodal_task(gemma4_mm, tmp_path):
    """lm-eval (ortevals' evaluate → simple_evaluate) on a local parquet image task: multiple choice by
    log-likelihood and generate_until.
    The log-likelihoods lm-eval records equal the raw-ORT oracle; the text requests path stays closed."""
    from datasets import Dataset, Features, Image, Value

    from ortevals.evaluate import RunSpec, evaluate
    from ortevals.integrations.lm import ModelArgs, OrtLM

    names = ["astronaut.png", "chelsea.png", "coffee.png"]
    ds = Dataset.from_dict({"image": [str(image_path(n)) for n in names], "label": [0, 1, 2],
                           "answer": CHOICES}, features=Features({"image": Image(), "label": Value("int64"),
                                                                  "answer": Value("string")}))
    ds.to_parquet(str(tmp_path / "test.parquet"))
    lm = OrtLM.from_package(ModelArgs(pkg=str(gemma4_mm[1])))
    # torch_random_seed=None: lm-eval would import torch only to seed it (the run never touches torch)
    outcome = evaluate(lm, RunSpec(tasks=_tasks(tmp_path / "test.parquet"), extra={"torch_random_seed": None}))
    samples = outcome.results["samples"]
    assert len(samples["tiny_mm_mc"]) == 3 and len(samples["tiny_mm_gen"]) == 3
    assert lm.stats["media_requests"] == 3 * 3 + 3
    assert "genai" not in vars(lm.backends)  # the text path's og model (text-only) was never opened
    pkg = ModelPackage.load(gemma4_mm[1])
    engine = open_media(pkg, Tokenizer.load(pkg))
    correct = 0
    for s in sorted(samples["tiny_mm_mc"], key=lambda s: s["doc_id"]):
        img = (to_media(image_path(names[s["doc_id"]])),)
        ref = [oracle_loglikelihood(engine, MediaRequest("What is shown?\nAnswer:", " " + c, img))[0]
               for c in CHOICES]
        got = [float(r[0][0]) for r in s["resps"]]
        assert np.abs(np.asarray(got) - ref).max() <= TOL
        correct += int(np.argmax(ref) == s["doc_id"])
        assert s["acc"] == float(np.argmax(ref) == s["doc_id"])
    assert correct in range(4)


# --- markers ---------------------------------------------------------------------------------------


def test_markers_placed_kept_or_replaced(engine):
    from ortevals.package.multimodal import MARKERS, MultimodalSpec, place_markers

    img, aud = to_media(image_path("coffee.png")), to_media(chirp_wav(0.3))
    assert engine.prompt("Look.", (img, img)) == "<bos><|image|><|image|>Look."  # the model places them
    assert engine.prompt("<bos>A <|image|> B <|image|>", (img, img)) == "<bos>A <|image|> B <|image|>"  # as is
    assert engine.prompt("<image>What? <image>", (img, img, aud)) == "<bos><|audio|><|image|>What? <|image|>"
    phi = MultimodalSpec("phi4mm", *MARKERS["phi4mm"], "v", "c", "s", "sc")
    assert place_markers(phi, "<image> and <image>", 2, 1) == "<|audio_1|><|image_1|> and <|image_2|>"
    assert place_markers(phi, "<|image_1|> x <|image_2|>", 2, 0) == "<|image_1|> x <|image_2|>"
    qwen = MultimodalSpec("qwen2_5_vl", *MARKERS["qwen2_5_vl"], "v", "c", None, None)
    assert place_markers(qwen, "Q", 1, 0) == "<|vision_start|><|image_pad|><|vision_end|>Q"


@pytest.mark.parametrize("context, n, needle", [
    ("<|image|> and <|image|>", 1, "holds 2 image marker(s) '<|image|>' but the request has 1"),
    ("<image> <image> <image>", 2, "holds 3 '<image>' placeholder(s) but the request has 2"),
])
def test_marker_count_mismatch_is_one_line(engine, context, n, needle):
    img = to_media(image_path("coffee.png"))
    with pytest.raises(OrtEvalsError) as e:
        engine.loglikelihood([MediaRequest(context, " x", (img,) * n)])
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- validation at load ----------------------------------------------------------------------------


def _edit(path, fn) -> None:
    cfg = json.loads((path / "genai_config.json").read_text())
    fn(cfg["model"])
    (path / "genai_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("break_it, needle", [
    (lambda p: (p / "processor_config.json").unlink(),
     "model.vision.config_filename='processor_config.json' not found"),
    (lambda p: _edit(p, lambda m: m["speech"].update(filename="nope.onnx")),
     "model.speech.filename='nope.onnx' not found"),
    (lambda p: _edit(p, lambda m: m["speech"].update(config_filename="processor_config.json")),
     "named by field model.speech.config_filename but has no 'feature_extraction' section"),
    (lambda p: _edit(p, lambda m: m["vision"].update(config_filename="audio_feature_extraction.json")),
     "named by field model.vision.config_filename but has no 'processor' section"),
    (lambda p: _edit(p, lambda m: m["speech"].update(filename="")), "model.speech.config_filename="),
    (lambda p: _edit(p, lambda m: m.update(type="mistral3")), "field model.type='mistral3' is not a multimodal type"),
], ids=["no processor_config", "speech filename", "speech config mismatch", "vision config mismatch",
        "speech config without model", "model.type"])
def test_bad_package_is_one_line_at_load(gemma4_mm, copy_pkg, break_it, needle):
    pkg_dir = copy_pkg(gemma4_mm[1])
    break_it(pkg_dir)
    pkg = ModelPackage.load(pkg_dir)  # text benchmarks still load it
    with pytest.raises(PackageError) as e:
        open_media(pkg, Tokenizer.load(pkg))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_audio_without_speech_model_and_upsampling_are_one_line(gemma4_mm, copy_pkg, engine):
    pkg_dir = copy_pkg(gemma4_mm[1])
    _edit(pkg_dir, lambda m: m.update(speech={"config_filename": ""}))
    pkg = ModelPackage.load(pkg_dir)
    no_speech = open_media(pkg, Tokenizer.load(pkg))
    with pytest.raises(OrtEvalsError, match=r"no speech model, but the request has 1 audio clip"):
        no_speech.loglikelihood([MediaRequest("Hear:", " x", (to_media(chirp_wav(0.2)),))])
    with pytest.raises(OrtEvalsError) as e:  # og's decoder only down-samples to 16 kHz
        engine.loglikelihood([MediaRequest("Hear:", " x", (to_media(chirp_wav(0.2, rate=8000)),))])
    assert "processor refused" in str(e.value) and "down-sampling" in str(e.value) and "\n" not in str(e.value)


# --- media conversion ------------------------------------------------------------------------------


def _pixels(media: Media) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(media.data)).convert("RGB"))


def test_images_from_pil_path_bytes_and_other_formats_are_the_same_pixels():
    from PIL import Image

    path = image_path("chelsea.png")
    ref = np.asarray(Image.open(path).convert("RGB"))
    forms = {"pil": Image.open(path), "path": path, "str": str(path), "bytes": path.read_bytes(),
             "dict bytes": {"bytes": path.read_bytes(), "path": None}, "dict path": {"path": str(path)}}
    for name, obj in forms.items():
        m = to_media(obj)
        assert m.kind == "image" and np.array_equal(_pixels(m), ref), name
    for fmt in ("BMP", "GIF", "TIFF"):  # not PNG/JPEG: re-encoded as PNG, same pixels (GIF: its palette)
        buf = io.BytesIO()
        Image.open(path).save(buf, format=fmt)
        m = to_media(buf.getvalue())
        assert m.data[:4] == b"\x89PNG" and np.array_equal(_pixels(m), np.asarray(
            Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))), fmt
    gray = to_media(Image.open(image_path("camera.png")))
    assert Image.open(io.BytesIO(gray.data)).mode == "L"


def test_audio_from_array_dict_decoder_and_bytes():
    from scipy.io import wavfile

    wav = chirp_wav(0.25)
    rate, pcm = wavfile.read(io.BytesIO(wav))
    x = pcm.astype(np.float32) / 32768
    m = to_media({"array": x, "sampling_rate": rate})
    got_rate, got = wavfile.read(io.BytesIO(m.data))
    assert m.kind == "audio" and got_rate == rate and got.dtype == np.float32 and np.array_equal(got, x)

    class Samples:  # what torchcodec's AudioDecoder.get_all_samples() returns: data [channels, samples]
        data, sample_rate = x[None, :], rate

    class AudioDecoder:
        def get_all_samples(self):
            return Samples()

    assert to_media(AudioDecoder()).data == m.data
    assert to_media(wav) == Media("audio", wav) and to_media_list([wav, None and wav]) == (Media("audio", wav),)


@pytest.mark.parametrize("obj", [
    "clip.mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(16), b"\x1aE\xdf\xa3" + bytes(16),
    type("VideoReader", (), {})(),
], ids=["path", "mp4 bytes", "webm bytes", "decoder"])
def test_video_is_one_line_not_supported(obj):
    with pytest.raises(OrtEvalsError) as e:
        to_media(obj)
    assert "not supported" in str(e.value) and "video" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("obj, needle", [
    ({"array": [0.0, 0.1]}, "no 'sampling_rate'"), ({"foo": 1}, "keys ['foo'] is not supported"),
    (b"hello world", "not a recognised image or audio format"), (3.5, "cannot use float as media"),
    ("missing.png", "media file not found"),
])
def test_bad_media_is_one_line(obj, needle):
    with pytest.raises(OrtEvalsError) as e:
        to_media(obj)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_info_shows_vision_speech_and_processor_without_opening(gemma4_mm, copy_pkg):
    from click.testing import CliRunner

    from ortevals.cli import cli

    pkg_dir = copy_pkg(gemma4_mm[1])
    for name in ("vision.onnx", "speech.onnx"):  # garbage: info must not open them
        (pkg_dir / name).write_bytes(b"not an onnx model")
    out = CliRunner().invoke(cli, ["info", "--pkg", str(pkg_dir)], catch_exceptions=False).output
    assert "vision    vision.onnx" in out and "inputs: pixel_values, pixel_position_ids" in out
    assert "config processor_config.json: DecodeImage, Gemma4ImageTransform(max_soft_tokens=16" in out
    assert "speech    speech.onnx" in out and "Gemma4LogMel(sampling_rate=16000" in out
    assert "media     images and audio via onnxruntime-genai's processor; markers <|image|> <|audio|>" in out
    (pkg_dir / "processor_config.json").unlink()
    out = CliRunner().invoke(cli, ["info", "--pkg", str(pkg_dir)], catch_exceptions=False).output
    assert "config processor_config.json: missing" in out and "image/audio requests cannot run:" in out


# --- the fast path (issue 13 §3) -------------------------------------------------------------------


def test_fast_path_equals_og_path_and_reuses_the_text_prefix(engine, fast_engine, windowed_engine):
    from ortevals.engine.media.fast import FastMediaEngine

    assert type(fast_engine) is FastMediaEngine and type(windowed_engine) is MediaEngine
    header = "You answer questions about pictures. Be brief and exact.\n\n"
    imgs = [to_media(image_path(n)) for n in ("astronaut.png", "chelsea.png", "camera.png")]
    reqs = [MediaRequest(f"{header}<image>Question: what is it?\nAnswer:", c, (img,))
            for img in imgs for c in (" the", " a cat", " a man in a white suit")]
    reqs.append(MediaRequest("Listen: <|audio|> Words:", " hello there", (to_media(chirp_wav(0.4)),)))
    reqs.append(MediaRequest(f"{header}<image><image>Both?", " yes they are", tuple(imgs[:2])))
    og_scores, fast_scores = engine.loglikelihood(reqs), fast_engine.loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(og_scores, fast_scores, strict=True):
        assert abs(a - b) <= TOL and ga == gb
    # the header (+ BOS, "\n\n<|image>") ran once for the four image contexts; the audio prompt has its own
    assert fast_engine.prefixes.misses == 2 and fast_engine.prefixes.hits == 3
    gen = [MediaRequest(f"{header}<image>Describe:", None, (imgs[1],), GenSettings(max_gen_toks=6)),
           MediaRequest(f"{header}<image>Describe:", None, (imgs[1],), GenSettings(max_gen_toks=6, do_sample=True))]
    assert engine.generate(gen) == fast_engine.generate(gen)


@pytest.fixture(scope="module")
def mm_dynquant(gemma4_mm, fixture_cache):
    from tests.fixtures.dynquant import build_dynquant_mm

    return build_dynquant_mm(gemma4_mm[1], fixture_cache / "gemma4")


def test_fast_path_honours_exact_mode_on_a_batch_dependent_decoder(mm_dynquant):
    """Issue 22 §6: a dynamically quantized decoder's numbers depend on the pass, so the fast path may not
    reuse the text prefix's or the context's KV: every score equals one raw-ORT pass over the whole input
    (before: the prefix cut at the first image token and the continuations on the context's KV moved them)."""
    from lm_eval.api.instance import Instance
    from PIL import Image

    from ortevals.integrations.lm import ModelArgs, OrtLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(mm_dynquant), media_path="fast"))
    header = "You answer questions about pictures. Be brief and exact.\n\n"
    pairs = [(f"{header}<image>Question: what is it?\nAnswer:", c, name) for name in ("astronaut.png", "chelsea.png")
             for c in (" the", " a cat on a mat", " a man in a white suit")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont, {"visual": [Image.open(image_path(n))]}), i)
                            for i, (ctx, cont, n) in enumerate(pairs)], disable_tqdm=True)
    engine = lm.media.engine
    assert type(engine).__name__ == "FastMediaEngine" and engine.exact and engine.prefixes.hits == 0
    for (ctx, cont_text, name), (lp, _) in zip(pairs, got, strict=True):
        media = (to_media(image_path(name)),)
        feeds = engine.runner.process(engine.prompt(ctx, media), media).numpy()
        cont = engine.continuation_ids(*split_context(ctx, cont_text))
        n = feeds["input_ids"].shape[1]  # the model's input is context + continuation but its last token (hf's)
        feeds["input_ids"] = np.concatenate([feeds["input_ids"], np.asarray([cont[:-1]], np.int64)], 1)
        rows = _log_softmax(ort_oracle(mm_dynquant, feeds)[n - 1:])
        assert abs(lp - sum(rows[j, t] for j, t in enumerate(cont))) <= TOL, (ctx, cont_text)


def test_fast_path_refused_where_the_layout_does_not_allow(gemma4_mm_windowed):
    pkg = ModelPackage.load(gemma4_mm_windowed[1])
    with pytest.raises(OrtEvalsError, match=r"media_path=fast: .* cannot take the fast media path \(a windowed"):
        open_media(pkg, Tokenizer.load(pkg), path="fast")


def test_ortlm_routes_media_and_keeps_text_on_the_text_path(gemma4_mm, engine):
    """Instances with media go to the media engine; text ones (also with lm-eval's empty media argument)
    to the text path, which opens no vision or speech model."""
    from lm_eval.api.instance import Instance
    from PIL import Image

    from ortevals.integrations.lm import ModelArgs, OrtLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(gemma4_mm[1])))
    text = [Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0),
            Instance("loglikelihood", {}, ("The cat sat on the", " mat", {"visual": []}), 1)]
    a, b = lm.loglikelihood(text, disable_tqdm=True)
    assert a == b and lm.media._engine is None  # no media: the media engine was never built
    pil = Image.open(image_path("chelsea.png"))
    mixed = [*text, Instance("loglikelihood", {}, ("<image>What is it?\nAnswer:", " a cat", {"visual": [pil]}), 2)]
    got = lm.loglikelihood(mixed, disable_tqdm=True)
    assert got[:2] == [a, b]
    ref = oracle_loglikelihood(engine, MediaRequest("What is it?\nAnswer:", " a cat", (to_media(pil),)))
    assert abs(got[2][0] - ref[0]) <= TOL and got[2][1] == ref[1]


def test_rolling_loglikelihood_with_media_is_one_line_and_the_empty_media_argument_is_dropped(gemma4_mm):
    from lm_eval.api.instance import Instance
    from PIL import Image

    from ortevals.integrations.lm import ModelArgs, OrtLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(gemma4_mm[1])))
    plain, empty = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("The cat sat on the mat.",), 0),
                                             Instance("loglikelihood_rolling", {}, ("The cat sat on the mat.",
                                                                                     {"visual": []}), 1)],
                                            disable_tqdm=True)
    assert plain == empty and plain < 0
    pil = Image.open(image_path("chelsea.png"))
    with pytest.raises(OrtEvalsError, match="^request 0: loglikelihood_rolling with images or audio is not "):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("A cat.", {"visual": [pil]}), 0)])
    assert lm.media._engine is None


def test_media_answers_are_stored_by_content_and_resumed(gemma4_mm, tmp_path):
    from lm_eval.api.instance import Instance
    from PIL import Image

    from ortevals.integrations.lm import ModelArgs, OrtLM

    def run(path: str):
        lm = OrtLM.from_package(ModelArgs(pkg=str(gemma4_mm[1]), store=str(tmp_path / "s.sqlite")))
        img = Image.open(image_path(path))  # a new PIL object each run: the key is the pixels, not the object
        reqs = [Instance("generate_until", {}, ("<image>Say:", {"until": ["\n"], "max_gen_toks": 4},
                                                {"visual": [img]}), 0),
                Instance("loglikelihood", {}, ("<image>Say:", " a cat", {"visual": [img]}), 1)]
        return lm.generate_until(reqs[:1], disable_tqdm=True), lm.loglikelihood(reqs[1:], disable_tqdm=True), lm

    gen1, ll1, lm1 = run("chelsea.png")
    gen2, ll2, lm2 = run("chelsea.png")
    assert (gen1, ll1) == (gen2, ll2) and lm1.stats["reused"] == 0 and lm2.stats["reused"] == 2
    _, ll3, lm3 = run("coffee.png")  # another image: same text, new key
    assert lm3.stats["reused"] == 0 and ll3 != ll1
