"""What decides which rows decode together is resolved when the run opens and kept in its scope (run/generate.py
``decode_plan``): the raw path's decode budget from the memory the device holds (never what happens to be free
when a batch starts), and ``cascade=auto``'s choice. On the cascade graph a row's log-probs move with the number
of rows sharing its prompt (measured on SmolLM2-135M fp32: up to ~3e-5, and a sampled token now and then), so a
stored sample is a function of the scope only if the batches are."""

from __future__ import annotations

import json

import pytest

from ortevals.engine.generate.rows.cascade_kv import decoder_bytes
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from tests.test_sampler import repeats


def opened(tiny_pkg, tmp_path, monkeypatch, total: int | None, **kw):
    from ortevals.run import generate

    monkeypatch.setattr(generate, "total_bytes", lambda device, device_id=0: total)
    return OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), store=str(tmp_path / "s.sqlite"), **kw))


def test_budget_and_cascade_are_resolved_from_what_the_device_holds_and_scoped(tiny_pkg, tmp_path, monkeypatch):
    cost = decoder_bytes(ModelPackage.load(tiny_pkg))
    roomy = opened(tiny_pkg, tmp_path, monkeypatch, 100 * cost)
    settings = json.loads(roomy.store.scope.settings)
    assert settings["decode_budget_mb"] == int(0.8 * 100 * cost // 2**20) == roomy.run.args.decode_budget_mb
    assert settings["cascade"] == "auto"
    # a second copy of the decoder would take more than half of what the first leaves: auto is off, in the scope
    tight = opened(tiny_pkg, tmp_path, monkeypatch, 3 * cost - 1)
    assert json.loads(tight.store.scope.settings)["cascade"] == "off"
    assert tight.store.scope.digest != roomy.store.scope.digest
    unknown = opened(tiny_pkg, tmp_path, monkeypatch, None)  # DirectML: a fixed budget, said in the scope
    assert json.loads(unknown.store.scope.settings)["decode_budget_mb"] == 4096
    given = opened(tiny_pkg, tmp_path, monkeypatch, 100 * cost, decode_budget_mb=64, cascade="on")
    assert {k: json.loads(given.store.scope.settings)[k] for k in ("decode_budget_mb", "cascade")} == \
        {"decode_budget_mb": 64, "cascade": "on"}


def test_sampling_never_reads_free_memory(tiny_pkg, tmp_path, monkeypatch):
    """K samples on the raw path, free memory unreadable (it would raise): the batches come from the scope."""
    from ortevals.runtime import memory

    def free(*args, **kwargs):
        raise AssertionError("free memory read while sampling")

    monkeypatch.setattr(memory, "free_bytes", free)
    monkeypatch.setattr("ortevals.run.generate.free_bytes", free, raising=False)
    lm = opened(tiny_pkg, tmp_path, monkeypatch, 2**30, gen_path="raw")
    kwargs = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 0.9}
    texts = lm.generate_until(repeats(["one two three", "four five six"], kwargs, 4), disable_tqdm=True)
    assert len(texts) == 8
    sampler = lm.run.generation.sampler()
    assert sampler.kv_budget == lm.run.args.decode_budget_mb * 2**20 == int(0.8 * 2**30) // 2**20 * 2**20


def test_a_bad_decode_budget_is_one_line():
    from ortevals.errors import OrtEvalsError
    from ortevals.options import parse_model_args

    with pytest.raises(OrtEvalsError, match=r"^decode_budget_mb must be > 0, got 0$"):
        parse_model_args({"pkg": "x", "decode_budget_mb": "0"})


def test_total_memory_reading():
    from ortevals.runtime import memory

    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    assert memory.total_bytes("cpu") == meminfo["MemTotal"]  # the same on every run on this machine
    assert memory.total_bytes("dml") is None
