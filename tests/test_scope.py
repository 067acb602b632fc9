"""Nothing stale is served: change any input of a scope and the store and the derived-graph cache miss.

Every run here is the real engine on the tiny package (a copy, where a test edits it), with the
ortevals cache in tmp_path so derived graphs and stores from other tests never leak in.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from lm_eval.api.instance import Instance

from ortevals.cli import cli
from ortevals.files import store_path
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package import scope as scope_mod
from ortevals.package.loader import ModelPackage
from ortevals.runtime.derive import derived_decoder, derived_path

REQ = ("The city", " of")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "ortevals-cache"
    monkeypatch.setenv("ORTEVALS_CACHE", str(cache))
    return cache


def score(pkg: Path, store: Path | None = None, req=REQ, **kw) -> tuple[float, OrtLM]:
    """One log-likelihood through OrtLM (store closed after), and the model (its store's scope and hits)."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), store=str(store) if store else None, **kw))
    [(lp, _)] = lm.loglikelihood([Instance("loglikelihood", {}, req, 0)], disable_tqdm=True)
    if lm.store is not None:
        lm.store.close()
    return lp, lm


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_tokenizer_json_edit_is_not_served_from_the_store(tiny_pkg, copy_pkg, tmp_path):
    """The issue's reproduction: drop the post-processor (no BOS any more) and rerun the same command."""
    pkg, store = copy_pkg(tiny_pkg), tmp_path / "s.sqlite"
    first, lm = score(pkg, store)
    assert lm.tok_encode(REQ[0])[0] == 1  # BOS from the post-processor
    edit_json(pkg / "tokenizer.json", lambda d: d.update(post_processor=None))
    rerun, lm = score(pkg, store)
    fresh, _ = score(pkg)
    assert lm.store.hits == 0 and lm.tok_encode(REQ[0])[0] != 1
    assert rerun == fresh and abs(rerun - first) > 1e-3, (first, rerun, fresh)


def test_tokenizer_config_edit_is_not_served_from_the_store(tiny_pkg, copy_pkg, tmp_path):
    """bos_token "</s>" in tokenizer_config.json: an empty context is now scored after id 2, not 1."""
    pkg, store = copy_pkg(tiny_pkg), tmp_path / "s.sqlite"
    req = ("", " of the city")
    first, lm = score(pkg, store, req)
    assert lm.prefix_token_id == 1
    edit_json(pkg / "tokenizer_config.json", lambda d: d.update(bos_token="</s>"))
    rerun, lm = score(pkg, store, req)
    fresh, _ = score(pkg, None, req)
    assert lm.store.hits == 0 and lm.prefix_token_id == 2
    assert rerun == fresh and abs(rerun - first) > 1e-3, (first, rerun, fresh)


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TEMPLATE_EDITS = {  # the two places Tokenizer.load takes a chat template from
    "tokenizer_config.json": lambda p: edit_json(p / "tokenizer_config.json",
                                                 lambda d: d.update(chat_template=CHAT_TEMPLATE)),
    "chat_template.jinja": lambda p: (p / "chat_template.jinja").write_text(CHAT_TEMPLATE),
}


@pytest.mark.parametrize("where", list(TEMPLATE_EDITS))
def test_a_chat_template_edit_is_not_served_from_the_store(where, tiny_pkg, copy_pkg, tmp_path):
    """--apply_chat_template prompts change with the template: an answer stored under the old one is stale."""
    pkg, store = copy_pkg(tiny_pkg), tmp_path / "s.sqlite"
    messages = [{"role": "user", "content": "The city"}]

    def run() -> tuple[float, OrtLM]:
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), store=str(store)))
        context = lm.apply_chat_template(messages) if lm.tokenizer.chat_template else "The city"
        [(lp, _)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, " of"), 0)], disable_tqdm=True)
        lm.store.close()
        return lp, lm

    run()
    TEMPLATE_EDITS[where](pkg)
    _, lm = run()
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE and lm.stats["reused"] == 0


def _bump(name: str):
    """A replacement for the scope's version function behind ``name``."""
    if name == "ortevals":
        return "ortevals_version", lambda: "99.0.0"
    if name == "ortevals source":
        return "source_digest", lambda: "0" * 64
    real = scope_mod.runtime_versions()
    return "runtime_versions", lambda: {**real, name: f"{name}==99.0.0"}


@pytest.mark.parametrize("name", ["ortevals", "ortevals source", "onnxruntime", "onnxruntime-genai"])
def test_a_version_bump_misses(name, tiny_pkg, tmp_path, monkeypatch):
    """onnxruntime-genai computes only where a path runs on it: here generation (the text package's
    log-likelihoods and raw generation never open it; tests/test_scope_paths.py has the other libraries)."""
    store = tmp_path / "s.sqlite"
    kw = {"gen_path": "og"} if name == "onnxruntime-genai" else {}
    _, before = score(tiny_pkg, store, **kw)
    _, same = score(tiny_pkg, store, **kw)
    assert same.store.hits == 1  # control: nothing else differs between runs
    monkeypatch.setattr(scope_mod, *_bump(name))
    _, after = score(tiny_pkg, store, **kw)
    assert after.store.scope.digest != before.store.scope.digest and after.store.hits == 0
    key = "ortevals-source" if name == "ortevals source" else name
    assert after.store.scope.describe()["versions"][key] != before.store.scope.describe()["versions"][key]


# a changed value for every ModelArgs field that can change a number (all but pkg and store, for now)
CHANGED = {"ep": "cpu", "batch_size": 1, "max_length": 64, "threads": 1, "provider_options": ("use_arena=0",),
           "add_bos_token": False, "memory_budget_mb": 512, "prefix_cache": False, "prefix_budget_mb": 256,
           "scoring_graph": False, "path": "incremental", "max_gen_toks": 32, "gen_batch_size": 2, "seed": 7,
           "exact": True, "check": False, "truncate": "left", "media_path": "og", "gen_path": "og",
           "cascade": "off", "decode_budget_mb": 64,
           "allow_cpu_fallback": True, "shared_prefix_batch": "on"}


NOT_SCOPED = {"pkg", "store", "workers", "ray_address",  # where requests run never changes a number (issue 15)
              "samples",  # the store keys each sample, so raising K reuses the first K (issue 14)
              # issue 24: P(True) requests are keyed by their own text; the temperature is fitted after the run
              "self_eval", "temperature_fit",
              # issue 25: verifiers score after the run (P(True) requests keyed by their text, the ORM not stored)
              "verifier", "prm", "step_separator", "prm_aggregation",
              # with --search, in the search's own scope (run/search.py search_scope; tests/test_search_store.py)
              "search", "search_n", "search_width", "search_max_steps",
              "resume",  # issue 26: whether stored answers are read, not what they are
              # which thread runs a pass changes none of its numbers (tests/test_parallel.py); the threads each
              # session gets are scoped as `threads`
              "passes",
              # issue 57: in the scope through what it reads, the adapter file's content (tests/test_adapters.py)
              "adapter"}


def test_every_scoped_model_argument_is_covered():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(ModelArgs)} - NOT_SCOPED


def test_where_requests_run_is_not_in_the_scope():
    from ortevals.options import scoped_settings

    assert scoped_settings(ModelArgs(pkg="x", workers=8, ray_address="10.0.0.1:6379")) == \
        scoped_settings(ModelArgs(pkg="x"))


@pytest.fixture(scope="module")
def base_store(tiny_pkg, tmp_path_factory) -> tuple[Path, str]:
    """A store holding REQ under default arguments, and that scope's digest."""
    store = tmp_path_factory.mktemp("base") / "s.sqlite"
    _, lm = score(tiny_pkg, store)
    return store, lm.store.scope.digest


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_model_argument_changes_the_scope(field, base_store, tiny_pkg):
    store, base = base_store
    assert CHANGED[field] != getattr(ModelArgs(pkg="x"), field)
    if field == "allow_cpu_fallback":  # refused on the CPU provider (it does nothing there): its settings part
        from ortevals.options import scoped_settings

        changed = scoped_settings(ModelArgs(pkg="x", allow_cpu_fallback=True))
        assert changed != scoped_settings(ModelArgs(pkg="x")) and changed[field] is True
        return
    _, lm = score(tiny_pkg, store, **{field: CHANGED[field]})
    assert lm.store.scope.digest != base and lm.store.hits == 0
    settings = json.loads(lm.store.scope.settings)
    if field == "provider_options":  # scoped as what the sessions get, not as typed
        assert settings["path:raw sessions"]["provider_options"] == {"use_arena": "0"}
    else:
        assert settings[field] == json.loads(json.dumps(CHANGED[field]))


def test_derived_graph_follows_source_and_decoder_not_settings(tiny_pkg, copy_pkg, own_cache, monkeypatch):
    pkg = copy_pkg(tiny_pkg)
    score(pkg, batch_size=1)
    score(pkg, batch_size=2, max_length=64, seed=3)  # settings that do not shape the graph: one copy
    built = [p for p in (own_cache / "derived").iterdir()]
    assert len(built) == 1 and (built[0] / "model.onnx").is_file()
    assert json.loads((built[0] / "scope.json").read_text())["package"] == str(pkg)
    package = ModelPackage.load(pkg)
    before = derived_path(package, own_cache)
    assert before == built[0] / "model.onnx"
    with monkeypatch.context() as m:  # a fix to the rewrite reaches packages derived before it
        m.setattr(scope_mod, "source_digest", lambda: "0" * 64)
        fixed = derived_decoder(package, own_cache)
        assert fixed != before and fixed.is_file()
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    model.doc_string = "re-exported"
    onnx.save(model, str(pkg / "model.onnx"))
    assert derived_path(ModelPackage.load(pkg), own_cache) not in (before, fixed)


def test_new_weights_keep_the_derived_graph_but_not_the_stored_scores(tiny_pkg, copy_pkg, own_cache, tmp_path):
    """The rewrite reads the decoder's graph, not its weights (the session reads those from the package):
    new weights under the same graph reuse the derived graph, and the scores follow the new weights."""
    pkg, store = copy_pkg(tiny_pkg), tmp_path / "s.sqlite"
    first, _ = score(pkg, store)
    before = derived_path(ModelPackage.load(pkg), own_cache)
    data = np.frombuffer((pkg / "model.onnx.data").read_bytes(), dtype=np.float32).copy()
    data *= 1.25  # every weight: the model changes, the graph file does not
    (pkg / "model.onnx.data").write_bytes(data.tobytes())
    rerun, lm = score(pkg, store)
    fresh, _ = score(pkg)
    assert derived_path(ModelPackage.load(pkg), own_cache) == before and len(list(before.parent.parent.iterdir())) == 1
    assert lm.store.hits == 0 and rerun == fresh and abs(rerun - first) > 1e-3, (first, rerun, fresh)


def test_cache_info_and_clear(tiny_pkg, own_cache):
    store = store_path(tiny_pkg)
    score(tiny_pkg, store)
    score(tiny_pkg, store, max_length=64)
    (own_cache / "examples" / "pkg").mkdir(parents=True)
    (own_cache / "examples" / "pkg" / "w.bin").write_bytes(b"x" * 3000)
    runner = CliRunner()
    out = runner.invoke(cli, ["cache", "info"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert f"cache root {own_cache}" in text and "runs/: 1 entries" in text and "derived/: 1 entries" in text
    assert "examples/: 1 entries, 2.9 KiB" in text
    versions = scope_mod.versions()
    scopes = [ln for ln in text.splitlines() if ln.strip().startswith("scope ")]
    # per scope: the answer and the canary's verdict
    assert len(scopes) == 2 and all(str(tiny_pkg) in ln and "2 rows" in ln for ln in scopes)
    assert [ln.endswith(s) for ln, s in zip(scopes, ("max_length=null", "max_length=64"))] == [True, True]
    # onnxruntime-genai is not in these scopes: nothing this run can open runs on it
    assert all(versions["onnxruntime"] in ln and ", None" not in ln for ln in scopes)

    out = runner.invoke(cli, ["cache", "clear"])
    assert out.exit_code == 0 and "removed" in out.output, out.output
    assert not (own_cache / "runs").exists() and not (own_cache / "derived").exists()
    assert (own_cache / "examples" / "pkg" / "w.bin").is_file()  # kept unless asked
    out = runner.invoke(cli, ["cache", "clear", "--examples"])
    assert out.exit_code == 0 and f"removed {own_cache / 'examples'}: 1 entries" in out.output
    assert not (own_cache / "examples").exists() and own_cache.is_dir()
    assert "nothing in" in runner.invoke(cli, ["cache", "clear", "--all"]).output


def test_source_digest_covers_every_module_of_every_layer():
    import ortevals

    root = Path(ortevals.__file__).resolve().parent
    hashed = {p.relative_to(root).as_posix() for p in scope_mod.source_files()}
    modules = {p.relative_to(root).as_posix() for p in root.rglob("*.py")}
    assert hashed == modules and {"cli.py", "engine/score/prefill.py", "runtime/derive.py", "report/store.py"} <= hashed


def test_samples_leaves_the_scope_alone(base_store, tiny_pkg):
    """--samples K only sets the tasks' repeats: stored samples stay reusable when K grows."""
    store, base = base_store
    _, lm = score(tiny_pkg, store, samples=8)
    assert lm.store.scope.digest == base and lm.store.hits == 1


def test_the_lm_eval_route_resumes_like_the_cli(tiny_pkg, own_cache, caplog):
    """New-user item 15: ``simple_evaluate(model="ortevals")`` uses the CLI's result store, under the same
    scope for the same settings: what the CLI finished is reused, and the other way round."""
    import logging

    import lm_eval

    from ortevals.integrations.lm_eval_plugin import register
    from ortevals.presets import PRESETS, resolve_data, task_specs
    from ortevals.tasks import task_manager

    register()
    out = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "2",
                                   "--truncate", "left"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    tasks = task_specs(PRESETS["mmlu-pro"], resolve_data(PRESETS["mmlu-pro"], "bundled"), None)
    model_args = f"pkg={tiny_pkg},truncate=left"
    with caplog.at_level(logging.INFO, logger="ortevals"):
        lm_eval.simple_evaluate(model="ortevals", model_args=model_args, tasks=tasks, limit=2,
                                task_manager=task_manager(None, defaults=False))
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming: ")]
    assert len(resumed) == 1 and resumed[0].endswith(f"loglikelihood requests reused from {store_path(tiny_pkg)}")
    n, _, total = resumed[0].split()[1:4]  # "resuming: N of M ...": all of them
    assert n == total and int(n) > 0
    lm = OrtLM.create_from_arg_string(model_args)
    cli_lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), truncate="left", store=str(store_path(tiny_pkg))))
    assert lm.store.path == store_path(tiny_pkg) and lm.store.scope.digest == cli_lm.store.scope.digest
    assert OrtLM.create_from_arg_string(f"{model_args},store=none").store is None  # opting out
