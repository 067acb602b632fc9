"""The scope is what each path reads: change a file, an option or a library a path reads and nothing
stored is served; a file no path reads keeps what is stored (issue 22, item 4).

The multimodal tests run the real media paths (onnxruntime-genai's processor and model, and the fast
raw-onnxruntime path) on a copy of the tiny Gemma-4 multimodal package; every edit is one a user makes
(a re-quantized vision or speech model, another image processor or audio feature config) and changes
the number, checked against a fresh run with no store. ``test_every_file_a_run_opens_is_in_its_scope``
asks the kernel (strace) which package files a run opens or probes, every path included: none may be
missing from the scope.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from ortevals.engine.backends import Backends
from ortevals.engine.score.prefill import EngineSettings
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package import scope as scope_mod
from ortevals.package.loader import ModelPackage
from ortevals.report.scope import results_scope
from ortevals.runtime.providers import from_package
from tests.fixtures.gemma4_mm import chirp_wav, image_path


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "ortevals-cache"
    monkeypatch.setenv("ORTEVALS_CACHE", str(cache))
    return cache


def media_scores(pkg: Path, store: Path | None, media_path: str) -> tuple[tuple[float, float], OrtLM]:
    """(image log-likelihood, audio log-likelihood) through OrtLM, store closed after."""
    from PIL import Image

    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), store=str(store) if store else None, media_path=media_path))
    reqs = [Instance("loglikelihood", {}, ("Describe <image> now", " a cat",
                                           {"visual": [Image.open(image_path("astronaut.png"))]}), 0),
            Instance("loglikelihood", {}, ("Hear this", " a cat", {"audio": [chirp_wav()]}), 1)]
    out = tuple(lp for lp, _ in lm.loglikelihood(reqs, disable_tqdm=True))
    if lm.store is not None:
        lm.store.close()
    return out, lm


def _requantize(path: Path) -> None:
    """onnxruntime's own dynamic quantization of a model, written over it (as Olive's pass would)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = path.with_name(f"float-{path.name}")
    path.rename(src)
    quantize_dynamic(src, path, weight_type=QuantType.QUInt8)
    src.unlink()


def _edit_attr(path: Path, section: str, index: int, key: str, value) -> None:
    data = json.loads(path.read_text())
    ops = data[section]["transforms" if section == "processor" else "sequence"]
    ops[index]["operation"]["attrs"][key] = value
    path.write_text(json.dumps(data))


MEDIA_EDITS = {  # name -> (edit of the package folder, which score it moves: 0 image, 1 audio)
    "re-quantized vision model": (lambda p: _requantize(p / "vision.onnx"), 0),
    "image processor config": (lambda p: _edit_attr(p / "processor_config.json", "processor", 1,
                                                    "max_soft_tokens", 9), 0),
    "re-quantized speech model": (lambda p: _requantize(p / "speech.onnx"), 1),
    "audio feature config": (lambda p: _edit_attr(p / "audio_feature_extraction.json", "feature_extraction", 1,
                                                  "max_frequency", 6000.0), 1),
}


@pytest.mark.parametrize("media_path", ["og", "fast"])
@pytest.mark.parametrize("edit", list(MEDIA_EDITS))
def test_a_changed_media_file_is_not_served_from_the_store(edit, media_path, gemma4_mm, copy_pkg, tmp_path):
    """The issue's case: re-quantize the vision model, rerun the same command: before the fix the old
    image scores came back from the store."""
    pkg, store = copy_pkg(gemma4_mm[1]), tmp_path / "s.sqlite"
    first, _ = media_scores(pkg, store, media_path)
    change, moved = MEDIA_EDITS[edit]
    change(pkg)
    rerun, lm = media_scores(pkg, store, media_path)
    fresh, _ = media_scores(pkg, None, media_path)
    assert lm.stats["reused"] == 0, f"{edit}: stored answers served after the edit"
    assert rerun == fresh and abs(rerun[moved] - first[moved]) > 1e-3, (first, rerun, fresh)


def test_a_file_no_path_reads_keeps_the_stored_answers(tiny_pkg, copy_pkg, tmp_path):
    """Built from what the paths read, not from a list of names: files ortevals never opens for a text
    package change nothing, so they split nothing."""
    pkg, store = copy_pkg(tiny_pkg), tmp_path / "s.sqlite"
    req = [Instance("loglikelihood", {}, ("The city", " of"), 0)]

    def run() -> OrtLM:
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), store=str(store)))
        lm.loglikelihood(req, disable_tqdm=True)
        lm.store.close()
        return lm

    before = run()
    for name in ("README.md", "special_tokens_map.json", "generation_config.json", "config.json"):
        (pkg / name).write_text('{"temperature": 0.5}')
    after = run()
    assert after.store.scope.digest == before.store.scope.digest and after.stats["reused"] == 1


def _scope(pkg: Path, ep: str = "cpu", options: dict | None = None, **backend_kw):
    """The result store's scope of a run, computed without opening a session (a provider this
    machine lacks included)."""
    package = ModelPackage.load(pkg)
    provider = from_package(package.decoder.session_options, ep, options or {})
    settings = EngineSettings(max_length=256, vocab_size=package.vocab_size)
    return results_scope(package.root, Backends(package, provider, settings, **backend_kw).reads(), {})


def _path_settings(scope, name: str) -> dict:
    return json.loads(scope.settings).get(f"path:{name}")


def test_options_given_to_onnxruntime_genai_are_in_the_scope(tiny_pkg, gemma4_mm):
    """og gets every provider option (cuda graphs included); the raw sessions a safe subset. Each path's
    record holds what it is handed, so an og-only option splits the scope wherever og can run."""
    graph = {"enable_cuda_graph": "1"}
    with_og = _scope(tiny_pkg, "cuda", graph, gen_path="og")
    assert with_og.digest != _scope(tiny_pkg, "cuda", gen_path="og").digest
    # CUDA gets use_tf32=0 (PyTorch's fp32 matmuls are not TF32) and flash attention pinned as well
    cuda_defaults = {"use_tf32": "0", "sdpa_kernel": "3"}
    assert _path_settings(with_og, "onnxruntime-genai")["provider_options"] == {**graph, **cuda_defaults}
    assert _path_settings(with_og, "raw sessions")["provider_options"] == cuda_defaults  # graphs filtered out
    # a multimodal package always has og's media path
    assert _scope(gemma4_mm[1], "cuda", graph).digest != _scope(gemma4_mm[1], "cuda").digest
    # where nothing the run can open gets the option, it splits nothing
    assert _scope(tiny_pkg, "cuda", graph).digest == _scope(tiny_pkg, "cuda").digest
    assert _path_settings(_scope(tiny_pkg, "cuda", graph), "onnxruntime-genai") is None


@pytest.mark.parametrize("name", ["lm-eval", "tokenizers", "numpy", "onnx", "jinja2"])
def test_a_library_that_computes_a_number_misses_when_its_version_changes(name, tiny_pkg, tmp_path, monkeypatch):
    """lm-eval cuts context/continuation and rolling windows, tokenizers tokenizes, numpy draws samples
    and does the scoring maths, onnx parses graphs, jinja2 renders chat templates."""
    store = tmp_path / "s.sqlite"
    req = [Instance("loglikelihood", {}, ("The city", " of"), 0)]

    def run() -> OrtLM:
        lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), store=str(store)))
        lm.loglikelihood(req, disable_tqdm=True)
        lm.store.close()
        return lm

    before = run()
    assert run().stats["reused"] == 1  # control
    real = scope_mod.dist_version
    monkeypatch.setattr(scope_mod, "dist_version", lambda d: "99.0" if d == name else real(d))
    after = run()
    assert after.stats["reused"] == 0 and after.store.scope.describe()["versions"][name] == "99.0"
    assert before.store.scope.describe()["versions"][name] == real(name)


# --- what the kernel sees opened ---------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys
    from lm_eval.api.instance import Instance
    from PIL import Image
    from ortevals.integrations.lm import ModelArgs, OrtLM
    from tests.fixtures.gemma4_mm import chirp_wav, image_path

    pkg, store = sys.argv[1], sys.argv[2]
    img, wav = Image.open(image_path("astronaut.png")), chirp_wav(0.5)
    gen = {"until": ["\\n"], "max_gen_toks": 3}
    for kw in ({}, {"path": "incremental", "gen_path": "og", "media_path": "og"}):
        lm = OrtLM.from_package(ModelArgs(pkg=pkg, store=store, **kw))
        lm.loglikelihood([Instance("loglikelihood", {}, ("The city", " of"), 0),
                          Instance("loglikelihood", {}, ("<image> A", " cat", {"visual": [img]}), 1),
                          Instance("loglikelihood", {}, ("Hear", " a cat", {"audio": [wav]}), 2)], disable_tqdm=True)
        lm.generate_until([Instance("generate_until", {}, ("The city", gen), 0),
                           Instance("generate_until", {}, ("<image> A", gen, {"visual": [img]}), 1)],
                          disable_tqdm=True)
        lm.store.close()
        print("SCOPE " + json.dumps(lm.store.scope.describe()["files"]))
""")
SYSCALLS = "openat,open,stat,lstat,newfstatat,statx,access,faccessat,faccessat2,readlink"


def test_every_file_a_run_opens_is_in_its_scope(gemma4_mm, copy_pkg, tmp_path):
    """Every package file any path opens or looks for (og's manifest.json and tokenizer_module.json, the
    processor configs, ...) is in the scope: hashed when present, keyed as absent when not."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    pkg = copy_pkg(gemma4_mm[1])
    for name in ("special_tokens_map.json", "generation_config.json", "README.md"):  # read by nothing
        (pkg / name).write_text("{}")
    trace = tmp_path / "trace.txt"
    run = subprocess.run(["strace", "-f", "-qq", "-e", f"trace={SYSCALLS}", "-o", str(trace), sys.executable,
                          "-c", CHILD, str(pkg), str(tmp_path / "s.sqlite")], capture_output=True, text=True,
                         timeout=600)
    if "ptrace" in run.stderr and run.returncode != 0:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-3000:]
    scoped: dict[str, str] = {}
    for line in run.stdout.splitlines():
        if line.startswith("SCOPE "):
            scoped.update(json.loads(line[6:]))
    seen: dict[str, bool] = {}  # file -> opened (True) or only looked for
    root = str(pkg.resolve())
    for line in trace.read_text().splitlines():
        for name in re.findall(r'"(' + re.escape(root) + r'/[^"]+)"', line):
            rel = name[len(root) + 1:]
            seen[rel] = seen.get(rel, False) or "ENOENT" not in line
    assert seen, "strace saw no package file"
    missing = sorted(set(seen) - set(scoped))
    assert not missing, f"opened or probed but not in the scope: {missing}"
    assert not [f for f, opened in seen.items() if opened and scoped[f] == scope_mod.ABSENT]
    assert {"vision.onnx", "speech.onnx", "processor_config.json", "audio_feature_extraction.json",
            "manifest.json", "tokenizer_module.json"} <= set(seen)  # the run reached every path
    assert "README.md" not in seen and "README.md" not in scoped


def test_the_derived_graph_is_keyed_by_what_the_rewrite_opens(tiny_pkg, own_cache):
    """Python's audit hook sees every file the rewrite opens: exactly the derived scope's files."""
    from ortevals.runtime import derive

    package = ModelPackage.load(tiny_pkg)
    opened: list[str] = []
    watching = [True]

    def hook(event, args):
        if watching[0] and event == "open" and isinstance(args[0], str):
            opened.append(args[0])

    sys.addaudithook(hook)  # cannot be removed: it only records while watching
    try:
        assert derive._derive(package) is not None
    finally:
        watching[0] = False
    inside = {Path(p).resolve() for p in opened if Path(p).resolve().is_relative_to(tiny_pkg.resolve())}
    keyed = {(tiny_pkg / f).resolve() for f in dict(derive.derive_scope(package).files)}
    assert inside == keyed == {(tiny_pkg / "model.onnx").resolve()}
