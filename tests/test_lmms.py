"""ortevals as an lmms-eval 0.7.x model: registration, the two traps, and end-to-end offline runs.

The oracle is lm-eval's ``hf`` backend (PyTorch) on the tiny model's own weights: the
multiple-choice pick must be the choice with the highest PyTorch log-likelihood, and the
generated texts must be PyTorch's greedy texts. lmms-eval is imported once per module (slow).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lmms_eval")

from lm_eval.api.instance import Instance as LmInstance  # noqa: E402
from lmms_eval.api.instance import Instance, unwrap_generation_output  # noqa: E402

from ortevals.errors import OrtEvalsError  # noqa: E402
from ortevals.integrations.lmms import OrtLMMS, OrtLMMSChat  # noqa: E402
from tests.fixtures.lmms_tasks import CHOICES, IMAGES, write_image_parquet, write_tasks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(task folder, {kind: task name}) of the text-only tasks over the image parquet."""
    root = tmp_path_factory.mktemp("lmms")
    parquet = write_image_parquet(root / "data" / "images.parquet")
    return root / "tasks", write_tasks(root / "tasks", parquet, "ortevals_text", visual=False)


def evaluate(lm, folder: Path, names: list[str]) -> dict:
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    return simple_evaluate(model=lm, tasks=names, task_manager=tm, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """lmms-eval's route resumes like the CLI (a result store in the ortevals cache): each run of this
    module starts from an empty cache of its own, so every request is computed here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTEVALS_CACHE", str(tmp_path_factory.mktemp("ortevals-cache")))
        yield


@pytest.fixture(scope="module")
def simple_lm(tiny_pkg) -> OrtLMMS:
    # built as lmms-eval builds it: the model args string plus its batch_size/device extras
    return OrtLMMS.create_from_arg_string(f"pretrained={tiny_pkg},max_length=256",
                                          {"batch_size": 1, "max_batch_size": None, "device": "cuda"})


@pytest.fixture(scope="module")
def run(simple_lm, tasks) -> dict:
    folder, names = tasks
    return evaluate(simple_lm, folder, [names["gen"], names["mc"]])


@pytest.fixture(scope="module")
def hflm(tiny):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)


def hf_loglikelihoods(hflm, pairs) -> list[float]:
    reqs = [LmInstance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    return [lp for lp, _ in hflm.loglikelihood(reqs, disable_tqdm=True)]


# --- registration --------------------------------------------------------------------
def test_manifest_resolves_chat_by_default_and_simple_on_request():
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from ortevals.integrations.lmms_plugin import manifest

    registry = ModelRegistryV2()
    registry.register_manifest(manifest())
    assert registry.get_model_class("ortevals") is OrtLMMSChat  # also checks is_simple against the kind
    assert registry.get_model_class("ortevals", force_simple=True) is OrtLMMS


def test_pyproject_entry_point_loads_the_manifest():
    """CI catches a wrong path here even where the package is not installed with its metadata."""
    from lmms_eval.models.registry_v2 import ModelManifest, ModelRegistryV2

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lmms_eval.models"]
    module, _, attr = eps["ortevals"].partition(":")
    manifest = ModelRegistryV2()._coerce_payload_to_manifests(getattr(importlib.import_module(module), attr))[0]
    assert isinstance(manifest, ModelManifest) and manifest.model_id == "ortevals"
    for path in (manifest.simple_class_path, manifest.chat_class_path):
        mod, _, cls = path.rpartition(".")
        assert getattr(importlib.import_module(mod), cls) in (OrtLMMS, OrtLMMSChat)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("lmms-eval") for r in extras["lmms"])


def test_installed_entry_point_is_found_by_lmms_eval():
    from importlib.metadata import entry_points

    if not any(ep.name == "ortevals" for ep in entry_points(group="lmms_eval.models")):
        pytest.skip("ortevals is installed without the lmms_eval.models entry point (reinstall with pip install -e)")
    from lmms_eval import models

    assert models.get_model("ortevals") is OrtLMMSChat
    assert models.get_model("ortevals", force_simple=True) is OrtLMMS


def test_entry_point_module_imports_neither_torch_nor_ortevals_engine():
    import subprocess

    # imported first (before lmms_eval.models), then resolved through lmms-eval's registry
    code = ("import sys, ortevals.integrations.lmms_plugin; "
            "print([m for m in ('torch', 'onnxruntime', 'lm_eval', 'lmms_eval', 'ortevals.integrations.lmms') "
            "if m in sys.modules]); "
            "from lmms_eval.models.registry_v2 import ModelRegistryV2; r = ModelRegistryV2(); "
            "r.register_manifest(ortevals.integrations.lmms_plugin.manifest()); "
            "print(r.resolve('ortevals').class_path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "ortevals.integrations.lmms.OrtLMMSChat"]
    assert "Failed to load" not in out.stdout + out.stderr


def test_model_args_are_ortevals_options(tiny_pkg):
    with pytest.raises(OrtEvalsError, match=r"unknown ortevals model_args \['temprature'\]"):
        OrtLMMS.create_from_arg_string(f"pretrained={tiny_pkg},temprature=0")
    with pytest.raises(OrtEvalsError, match="model_args needs pkg=PATH"):
        OrtLMMS.create_from_arg_string("max_length=64", {"batch_size": 1})
    with pytest.raises(OrtEvalsError, match="must look like key=value"):
        OrtLMMS.create_from_arg_string(f"pretrained={tiny_pkg},oops")


def test_lmms_eval_cli_runs_ortevals_offline_through_its_entry_point(tiny_pkg, tasks, run, tmp_path):
    """`lmms-eval eval --model ortevals --model_args pretrained=PKG`: no wrapper, the entry point only."""
    import json
    import subprocess
    from importlib.metadata import entry_points

    if not any(ep.name == "ortevals" for ep in entry_points(group="lmms_eval.models")):
        pytest.skip("ortevals is installed without the lmms_eval.models entry point (reinstall with pip install -e)")
    folder, names = tasks
    cli = "import sys; from lmms_eval.cli.dispatch import main; sys.argv[0] = 'lmms-eval'; sys.exit(main())"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", cli, "eval", "--model", "ortevals", "--force_simple",
                    "--model_args", f"pretrained={tiny_pkg},max_length=256", "--tasks", names["mc"],
                    "--include_path", str(folder), "--limit", "2", "--log_samples", "--output_path", str(tmp_path)],
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    [samples] = list(tmp_path.rglob(f"*_samples_{names['mc']}.jsonl"))
    rows = map(json.loads, samples.read_text().splitlines())  # lmms-eval's logger writes the numbers as text
    got = {d["doc_id"]: [float(r[0]) for r in d["filtered_resps"]] for d in rows}
    want = {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in run["samples"][names["mc"]]}
    assert sorted(got) == [0, 1]
    for doc_id, nll in got.items():
        np.testing.assert_allclose(nll, want[doc_id], atol=1e-6)  # the CLI run is the in-process run


# --- the two traps ------------------------------------------------------------------
def test_unwrap_trap_exists_upstream_and_the_wrapped_pair_survives_it(simple_lm):
    # lmms-eval 0.7.3 turns a bare (float, bool) into a string: this is why the pair is wrapped
    assert isinstance(unwrap_generation_output((-1.5, True))[0], str)
    simple_lm.task_dict = {"t": {"test": [{}]}}
    req = Instance("loglikelihood", ("The capital of France is", " paris", None, 0, "t", "test"), 0,
                   {"task": "t", "doc_id": 0, "repeats": 1})
    value, _ = unwrap_generation_output(simple_lm.loglikelihood([req])[0])
    assert isinstance(value, tuple) and isinstance(value[0], float) and isinstance(value[1], bool)
    assert value[0] > 0  # a negative log-likelihood


def test_multiple_choice_picks_the_lowest_nll_which_is_pytorchs_most_likely_choice(run, hflm):
    samples = run["samples"]["ortevals_text_mc"]
    assert len(samples) == len(IMAGES)
    picks_differ = 0
    for s in samples:
        args = s["arguments"]  # (ctx, continuation, doc_id, task, split) per choice
        pairs = [(args[i], args[i + 1]) for i in range(0, len(args), 5)]
        assert [c.strip() for _, c in pairs] == CHOICES
        ref = hf_loglikelihoods(hflm, pairs)
        nll = [r[0] for r in s["filtered_resps"]]
        np.testing.assert_allclose(nll, -np.asarray(ref), atol=1e-4)  # negative log-likelihoods
        pred = int(np.argmax(ref))
        assert s["acc"] == float(pred == s["target"])  # lmms-eval's argmin picked PyTorch's argmax
        picks_differ += int(np.argmin(ref) != pred)
    assert picks_differ == len(samples)  # returning +log p would have picked another choice every time
    assert run["results"]["ortevals_text_mc"]["acc,none"] == np.mean([s["acc"] for s in samples])


def test_generate_until_gives_pytorchs_greedy_texts(run, hflm):
    samples = run["samples"]["ortevals_text_gen"]
    reqs = [LmInstance("generate_until", {}, (s["arguments"][0], dict(s["arguments"][1])), i)
            for i, s in enumerate(samples)]
    ref = hflm.generate_until(reqs, disable_tqdm=True)
    assert [s["resps"][0][0] for s in samples] == ref
    assert all(len(t) > 3 for t in ref)


def test_chat_model_without_a_template_generates_what_the_simple_model_does(tiny_pkg, tasks, run):
    folder, names = tasks
    chat = OrtLMMSChat.create_from_arg_string(f"pretrained={tiny_pkg},max_length=256", {"batch_size": 1})
    out = evaluate(chat, folder, [names["gen"]])
    simple = [s["resps"][0][0] for s in run["samples"]["ortevals_text_gen"]]
    assert [s["resps"][0][0] for s in out["samples"]["ortevals_text_gen"]] == simple


def test_multi_round_calls_doc_to_text_per_round(simple_lm, hflm):
    calls = []

    def doc_to_text(doc, previous_output=None, round_idx=None, previous_round_info=None):
        calls.append((doc["q"], list(previous_output), round_idx, previous_round_info))
        if round_idx == 2:
            return None, None, True, previous_output, None
        return None, f"{doc['q']} then {previous_output[-1]}", False, previous_output, {"round": round_idx}

    docs = [{"q": "The capital of France is"}, {"q": "Question: one two three. Answer:"}]
    simple_lm.task_dict = {"t": {"test": docs}}
    gen = {"until": ["\n\n"], "max_new_tokens": 6}
    reqs = [Instance("generate_until_multi_round", (d["q"], dict(gen), None, doc_to_text, i, "t", "test"), 0,
                     {"task": "t", "doc_id": i, "repeats": 1}) for i, d in enumerate(docs)]
    out = simple_lm.generate_until_multi_round(reqs)

    def hf(ctx):
        return hflm.generate_until([LmInstance("generate_until", {}, (ctx, dict(gen)), 0)], disable_tqdm=True)[0]

    for doc, rounds in zip(docs, out):
        first = hf(doc["q"])
        assert rounds == [first, hf(f"{doc['q']} then {first}")]
        assert unwrap_generation_output(rounds)[0] == rounds  # a list of rounds passes through unchanged
    # rounds run in lockstep over the requests; round 2 got round 1's info back
    assert [(c[2], c[3]) for c in calls] == [(1, None), (1, None), (2, {"round": 1}), (2, {"round": 1})]


def test_a_missing_document_is_one_line(simple_lm):
    simple_lm.task_dict = {}
    req = Instance("generate_until", ("x", {}, None, 3, "nope", "test"), 0, {"task": "nope", "doc_id": 3, "repeats": 1})
    with pytest.raises(OrtEvalsError, match=r"task 'nope' split 'test' doc 3: no such document"):
        simple_lm.generate_until([req])


# --- images: the tiny Gemma-4 multimodal package --------------------------------------------------
@pytest.fixture(scope="module")
def image_tasks(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(task folder, {kind: task name}) of the same tasks with ``doc_to_visual: image``."""
    root = tmp_path_factory.mktemp("lmms-img")
    parquet = write_image_parquet(root / "data" / "images.parquet")
    return root / "tasks", write_tasks(root / "tasks", parquet, "ortevals_img", visual=True)


@pytest.fixture(scope="module")
def mm_engine(gemma4_mm):
    from ortevals.engine.media.paths import open_media
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer

    pkg = ModelPackage.load(gemma4_mm[1])
    return open_media(pkg, Tokenizer.load(pkg))


@pytest.fixture(scope="module")
def image_run(gemma4_mm, image_tasks) -> tuple[OrtLMMS, dict]:
    folder, names = image_tasks
    lm = OrtLMMS.create_from_arg_string(f"pretrained={gemma4_mm[1]}", {"batch_size": 1, "device": "cpu"})
    return lm, evaluate(lm, folder, [names["gen"], names["mc"]])


def image_of(doc_id: int):
    from ortevals.package.media import to_media
    from tests.fixtures.gemma4_mm import image_path

    return (to_media(image_path(f"{IMAGES[doc_id]}.png")),)


def test_image_multiple_choice_picks_the_lowest_nll_the_raw_ort_oracle_agrees(image_run, mm_engine):
    from ortevals.engine.media.og import MediaRequest
    from tests.test_multimodal import TOL, oracle_loglikelihood

    lm, run = image_run
    samples = run["samples"]["ortevals_img_mc"]
    assert len(samples) == len(IMAGES)
    for s in samples:
        args = s["arguments"]
        pairs = [(args[i], args[i + 1]) for i in range(0, len(args), 5)]
        ref = [oracle_loglikelihood(mm_engine, MediaRequest(ctx, cont, image_of(s["doc_id"])))[0]
               for ctx, cont in pairs]
        nll = [r[0] for r in s["filtered_resps"]]
        np.testing.assert_allclose(nll, -np.asarray(ref), atol=TOL)  # -log p with the image, raw-ORT oracle
        assert s["acc"] == float(int(np.argmax(ref)) == s["target"])
        assert np.argmin(ref) != np.argmax(ref)
    assert lm.lm.stats["media_requests"] == len(IMAGES) * (len(CHOICES) + 1)  # every request saw its image
    assert "genai" not in vars(lm.lm.backends)  # the text-only path never opened


def test_image_generate_until_gives_the_engines_texts(image_run, mm_engine):
    from ortevals.engine.media.og import MediaRequest
    from ortevals.run.generate import gen_settings

    lm, run = image_run
    samples = run["samples"]["ortevals_img_gen"]
    reqs = [MediaRequest(s["arguments"][0], None, image_of(s["doc_id"]), gen_settings(lm.lm.run, s["arguments"][1]))
            for s in samples]
    ref = mm_engine.generate(reqs)
    assert [s["resps"][0][0] for s in samples] == ref
    assert len(set(ref)) > 1  # the image changes the answer


def test_chat_model_renders_the_packages_template_with_its_image_marker(gemma4_mm, image_tasks, mm_engine):
    from ortevals.engine.media.og import MediaRequest
    from ortevals.run.generate import gen_settings

    folder, names = image_tasks
    chat = OrtLMMSChat.create_from_arg_string(f"pretrained={gemma4_mm[1]}", {"batch_size": 1})
    samples = evaluate(chat, folder, [names["gen"]])["samples"]["ortevals_img_gen"]
    for s in samples:
        question = f"What is in the picture of the {IMAGES[s['doc_id']]}?"
        prompt = chat.lm.tokenizer.render_chat(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}])
        assert prompt.count("<|image|>") == 1
        ref = mm_engine.generate([MediaRequest(prompt, None, image_of(s["doc_id"]),
                                               gen_settings(chat.lm.run, s["arguments"][1]))])
        assert s["resps"][0][0] == ref[0]


def test_video_and_unreadable_media_are_one_line(image_run):
    lm, _ = image_run
    lm.task_dict = {"t": {"test": [{"v": "/data/clip.mp4"}, {"v": b"not an image"}]}}
    for doc_id, needle in ((0, "video is not supported"), (1, "not a recognised image or audio format")):
        req = Instance("generate_until", ("x", {}, lambda d: [d["v"]], doc_id, "t", "test"), 0,
                       {"task": "t", "doc_id": doc_id, "repeats": 1})
        with pytest.raises(OrtEvalsError, match=f"task 't' doc {doc_id}: .*{needle}") as e:
            lm.generate_until([req])
        assert "\n" not in str(e.value)


def test_mutual_info_is_refused_in_one_line(simple_lm):
    # lmms-eval's unconditional request for acc_mutual_info: its argmax over loss differences would be wrong
    req = Instance("loglikelihood", ("", "a cat"), 0, {"task": "t", "doc_id": 0, "repeats": 1})
    with pytest.raises(OrtEvalsError, match="task 't': metric acc_mutual_info is not supported"):
        simple_lm.loglikelihood([req])


def test_a_multi_round_doc_to_text_of_the_wrong_shape_is_one_line(simple_lm):
    simple_lm.task_dict = {"t": {"test": [{"q": "The capital of France is"}]}}
    req = Instance("generate_until_multi_round", ("The capital of France is", {"max_new_tokens": 2}, None,
                                                  lambda doc, **kw: "just text", 0, "t", "test"), 0,
                   {"task": "t", "doc_id": 0, "repeats": 1})
    with pytest.raises(OrtEvalsError, match=r"task 't' doc 0: doc_to_text\(round_idx=1\) must return \(visuals, "):
        simple_lm.generate_until_multi_round([req])


def chirp_dict(seconds: float = 0.5, rate: int = 16000) -> dict:
    """Audio as lmms-eval's audio tasks hand it over (``datasets`` Audio, decoded)."""
    t = np.arange(int(seconds * rate)) / rate
    return {"array": (0.5 * np.sin(2 * np.pi * (200 * t + 400 * t * t))).astype(np.float32), "sampling_rate": rate}


def test_audio_documents_score_as_the_oracle_on_both_models(image_run, mm_engine):
    """An audio dict from doc_to_visual (simple) or in a message part lmms-eval labels "video" (chat)."""
    from ortevals.engine.media.og import MediaRequest
    from ortevals.package.media import to_media
    from ortevals.run.generate import gen_settings
    from tests.test_multimodal import TOL, oracle_loglikelihood

    lm, _ = image_run
    clip = chirp_dict()
    lm.task_dict = {"a": {"test": [{"audio": clip}]}}
    req = Instance("loglikelihood", ("What is this sound?", " a chirp", lambda d: [d["audio"]], 0, "a", "test"), 0,
                   {"task": "a", "doc_id": 0, "repeats": 1})
    [value] = [unwrap_generation_output(r)[0] for r in lm.loglikelihood([req])]
    ref, greedy = oracle_loglikelihood(mm_engine, MediaRequest("What is this sound?", " a chirp", (to_media(clip),)))
    assert abs(value[0] + ref) <= TOL and value[1] == greedy

    chat = OrtLMMSChat(lm.lm)
    chat.task_dict = lm.task_dict
    messages = [{"role": "user", "content": [{"type": "video", "url": clip}, {"type": "text", "text": "Hear?"}]}]
    gen = {"max_new_tokens": 4, "until": ["\n\n"]}
    req = Instance("generate_until", ("Hear?", lambda d: messages, dict(gen), 0, "a", "test"), 0,
                   {"task": "a", "doc_id": 0, "repeats": 1})
    [text] = [r.text for r in chat.generate_until([req])]
    prompt = chat.lm.tokenizer.render_chat([{"role": "user", "content": [{"type": "audio"},
                                                                          {"type": "text", "text": "Hear?"}]}])
    assert "<|audio|>" in prompt
    assert text == mm_engine.generate([MediaRequest(prompt, None, (to_media(clip),), gen_settings(lm.lm.run, gen))])[0]


def test_store_resumes_text_and_image_answers(gemma4_mm, tmp_path):
    """`store=PATH`: a second model on the same store answers from it (media keyed by content)."""
    from PIL import Image

    from tests.fixtures.gemma4_mm import image_path

    docs = [{"image": Image.open(image_path("coffee.png"))}, {"image": None}]
    reqs = [Instance("loglikelihood", ("What is shown?", " a cup", lambda d: [d["image"]], i, "t", "test"), 0,
                     {"task": "t", "doc_id": i, "repeats": 1}) for i in range(2)]
    answers = []
    for _ in range(2):
        lm = OrtLMMS.create_from_arg_string(f"pretrained={gemma4_mm[1]},store={tmp_path / 'store.db'}")
        lm.task_dict = {"t": {"test": docs}}
        answers.append([unwrap_generation_output(r)[0] for r in lm.loglikelihood(reqs)])
    assert lm.lm.stats["reused"] == 2 and "media_requests" not in lm.lm.stats  # nothing recomputed
    assert answers[0] == answers[1] and answers[0][0] != answers[0][1]  # the image changes the score


def test_a_multi_round_task_that_never_ends_is_one_line(simple_lm, monkeypatch):
    import ortevals.integrations.lmms as lmms_module

    monkeypatch.setattr(lmms_module, "MAX_ROUNDS", 2)
    simple_lm.task_dict = {"t": {"test": [{}]}}
    never = lambda doc, previous_output=None, **kw: (None, "again", False, previous_output, None)  # noqa: E731
    req = Instance("generate_until_multi_round", ("Once", {"max_new_tokens": 1}, None, never, 0, "t", "test"), 0,
                   {"task": "t", "doc_id": 0, "repeats": 1})
    with pytest.raises(OrtEvalsError, match="task 't' doc 0: generate_until_multi_round still not terminal after 2"):
        simple_lm.generate_until_multi_round([req])
