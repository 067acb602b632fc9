"""--search answers in the result store (issue 25): stored and resumed under the run's scope narrowed by
the search's settings and what its verifier reads (run/search.py ``search_scope``, Run.narrow_scope).

A second identical run resumes every answer and runs no search pass; a change of any search setting, of
the verifier (kind, a file it reads, its folder's tokenizer) or of the seed gives another scope, so the
answers are computed again."""

from __future__ import annotations

import shutil

import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM

PROMPT = "Question: what is the river of the city? Answer: the river"
BASE = {"search": "particles", "search_n": 4, "search_width": 2, "search_max_steps": 3, "prm_aggregation": "min",
        "step_separator": "."}


@pytest.fixture()
def orm(tiny_orm, tmp_path):
    """A copy of the tiny ORM folder the test may edit."""
    return shutil.copytree(tiny_orm[1], tmp_path / "orm")


def open_lm(tiny_pkg, store, verifier, **changes):
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw", store=str(store),
                                        verifier=str(verifier), **{**BASE, **changes}))


def generate(lm) -> str:
    gen = {"until": ["Question:"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    return lm.generate_until([Instance("generate_until", {}, (PROMPT, gen), 0)], disable_tqdm=True)[0]


def test_a_second_search_run_resumes_and_a_changed_setting_recomputes(tiny_pkg, orm, tmp_path):
    store = tmp_path / "store.sqlite"
    first = open_lm(tiny_pkg, store, orm)
    text = generate(first)
    assert first.run.stats.get("search_tokens", 0) > 0
    first.run.commit()
    again = open_lm(tiny_pkg, store, orm)
    assert generate(again) == text
    assert again.run.stats.get("reused") == 1 and "search_tokens" not in again.run.stats  # no pass ran
    other = open_lm(tiny_pkg, store, orm, search_n=6)
    generate(other)
    assert other.run.stats.get("reused", 0) == 0 and other.run.stats.get("search_tokens", 0) > 0


def digest(tiny_pkg, store, verifier, **changes) -> str:
    return open_lm(tiny_pkg, store, verifier, **changes).run.store.scope.digest


def test_every_search_setting_and_the_verifier_are_in_the_scope(tiny_pkg, orm, tmp_path):
    import onnx

    store = tmp_path / "store.sqlite"
    base = digest(tiny_pkg, store, orm)
    assert digest(tiny_pkg, store, orm) == base
    changes = [{"search": "beam"}, {"search_n": 2}, {"search_width": 4, "search": "beam"},
               {"search_max_steps": 4}, {"prm_aggregation": "prod"}, {"step_separator": "\n"}, {"seed": 7}]
    seen = {base}
    for change in changes:
        d = digest(tiny_pkg, store, orm, **change)
        assert d not in seen, change
        seen.add(d)
    for verifier in ("self", tiny_pkg):  # P(True) on the package itself; the same package as a GenAI judge
        d = digest(tiny_pkg, store, verifier)
        assert d not in seen, verifier
        seen.add(d)
    model = onnx.load(orm / "model.onnx")
    model.doc_string = "edited"
    onnx.save(model, orm / "model.onnx")
    edited = digest(tiny_pkg, store, orm)
    assert edited not in seen
    (orm / "tokenizer.json").write_text((orm / "tokenizer.json").read_text().replace('"<unk>"', '"<unk2>"', 1))
    assert digest(tiny_pkg, store, orm) not in {*seen, edited}
