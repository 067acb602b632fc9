"""Several LoRA adapters over one loaded base (issue 57): ``--adapter`` given more than once in ``ortevals mmlu-pro``
and ``run``, and an adapter swapped on a run's open sessions (``OrtLM.use_adapter``).

The oracles: transformers + peft with the second adapter active (tests/fixtures/lora.py), and a run opened with that
adapter alone (a fresh process state and store): the swapped run's log-likelihoods equal it within 1e-6, its
greedy tokens equal peft's. The sessions open once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from lm_eval.api.instance import Instance

from ortevals.cli import cli
from tests.fixtures.lora import build_lora, peft_greedy
from tests.test_adapters import HEADER, open_lm, oracle, scores, tolerance


@pytest.fixture(scope="module")
def lora(fixture_cache):
    return build_lora(fixture_cache)


@pytest.fixture
def opened(monkeypatch):
    """Every DecoderRunner and GenaiRunner opened from now on."""
    from ortevals.runtime.genai import GenaiRunner
    from ortevals.runtime.sessions import DecoderRunner

    out = []
    for cls in (DecoderRunner, GenaiRunner):
        real = cls.open.__func__
        monkeypatch.setattr(cls, "open", classmethod(lambda c, *a, _r=real, **k: out.append(c.__name__)
                                                     or _r(c, *a, **k)))
    return out


@pytest.mark.parametrize("kw", [dict(path="prefill"), dict(path="prefill", shared_prefix_batch="on"),
                                dict(path="incremental")], ids=["prefill", "shared-prefix", "incremental"])
def test_a_swapped_adapter_scores_as_its_own_run_on_the_same_sessions(lora, kw, opened):
    lm = open_lm(lora, adapter_spec=f"{lora.adapters[0]}=A", **kw)
    first = scores(lm)
    lm.use_adapter(f"{lora.adapters[1]}=B")
    got = scores(lm)
    assert len(opened) == 1, opened  # one runner for both adapters
    want = np.array(oracle(lora, lm, lora.peft_dirs[1]))
    assert np.abs(got - first).max() > 1.0  # the swap changed the numbers by nats
    assert (np.abs(got - want) <= tolerance(lm)).all(), (got, want)
    alone = scores(open_lm(lora, adapter_spec=f"{lora.adapters[1]}=B", **kw))
    assert np.abs(got - alone).max() <= 1e-6, np.abs(got - alone).max()
    assert lm.args.adapter == (f"{lora.adapters[1]}=B",)  # results.json's config names the adapter scored


@pytest.mark.parametrize("kw", [dict(gen_path="raw", cascade="off"), dict(gen_path="og")], ids=["raw", "og"])
def test_after_a_swap_generation_holds_no_prompt_kv_of_the_previous_adapter(lora, kw):
    """The same prompt under A, then B: the raw sampler keeps the last prompt's KV for the next one sharing its
    prefix, and og loads each adapter under its name; B's tokens must be peft's with B."""
    lm = open_lm(lora, max_gen_toks=12, **kw, adapter_spec=f"{lora.adapters[0]}=A")
    prompt = HEADER + "Question: the capital of France is"  # > 16 tokens: the sampler reuses a held prompt's KV

    def greedy() -> str:
        (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "do_sample": False}), 0)],
                                    disable_tqdm=True)
        return text

    ids = lm.tok_encode(prompt)
    first = lm.tok_decode(peft_greedy(lora.hf_dir, lora.peft_dirs[0], ids, 12))
    assert greedy() == first
    lm.use_adapter(f"{lora.adapters[1]}=B")
    want = lm.tok_decode(peft_greedy(lora.hf_dir, lora.peft_dirs[1], ids, 12))
    assert want != first
    assert greedy() == want


def read_lls(folder: Path) -> dict:
    """(task, doc_id, choice) -> log-likelihood from a run folder's samples files."""
    out = {}
    for path in sorted(folder.glob("samples_*.jsonl")):
        for line in path.read_text().splitlines():
            s = json.loads(line)
            for j, resp in enumerate(s["filtered_resps"]):
                out[(path.name, s["doc_id"], j)] = float(resp[0])
    return out


def mmlu(lora, out: Path, *adapters: str):
    args = ["mmlu-pro", "--pkg", str(lora.pkg), "--data", "bundled", "--limit", "2", "--truncate", "left",
            "--output", str(out)]
    return CliRunner().invoke(cli, args + [w for a in adapters for w in ("--adapter", a)], catch_exceptions=False)


def test_two_adapters_in_one_invocation_equal_two_runs(lora, tmp_path, monkeypatch, opened):
    a, b = f"{lora.adapters[0]}=A", f"{lora.adapters[1]}=B"
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache-both"))
    result = mmlu(lora, tmp_path / "both", a, b)
    assert result.exit_code == 0, result.output
    assert opened == ["DecoderRunner"], opened  # one base loaded for both
    lines = result.stdout.splitlines()
    heads = [lines.index(f"adapter {n} ({f}):") for n, f in (("A", lora.adapters[0]), ("B", lora.adapters[1]))]
    assert heads[0] < heads[1] and all(lines[h + 1].startswith("category  questions") for h in heads), lines
    for name, value in (("A", a), ("B", b)):  # each its own store: nothing of the first run reused
        monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / f"cache-{name}"))
        alone = mmlu(lora, tmp_path / name, value)
        assert alone.exit_code == 0, alone.output
        together, single = read_lls(tmp_path / "both" / name), read_lls(tmp_path / name)
        assert together.keys() == single.keys() and len(single) >= 10
        assert max(abs(together[k] - single[k]) for k in single) <= 1e-6
        config = json.loads((tmp_path / "both" / name / "results.json").read_text())["config"]
        assert [x["name"] for x in config["adapter"]] == [name], config
    both = read_lls(tmp_path / "both" / "A"), read_lls(tmp_path / "both" / "B")
    assert max(abs(both[0][k] - both[1][k]) for k in both[0]) > 0.1  # two adapters, two sets of numbers


@pytest.mark.parametrize("extra,needle", [
    (["--adapter", "{a}=A", "--adapter", "{b}=B", "--limit", "1", "--workers", "2"],
     "--adapter given 2 times: the adapters are swapped on this process's sessions, not on workers"),
    (["--adapter", "{a}=A", "--adapter", "{b}=B", "--against", "{tmp}", "--decide", "1"],
     "--against decides one run, and --adapter was given 2 times"),
    (["--adapter", "{a}=.", "--adapter", "{b}=B", "--limit", "1"],
     "'.' names no folder for its results; give it a name (FILE=NAME)"),
    (["--adapter", "{a}=A", "--adapter", "{b}=B", "--adapter", "{tmp}/missing.onnx_adapter", "--limit", "1"],
     "missing.onnx_adapter: not found"),  # every adapter checked before the model, the third too
], ids=["workers", "against", "dot-name", "third-missing"])
def test_several_adapters_are_refused_in_one_line_before_the_model(lora, tmp_path, monkeypatch, extra, needle):
    from ortevals.runtime.sessions import DecoderRunner
    from tests.test_cli import assert_one_line_error

    monkeypatch.setattr(DecoderRunner, "open", lambda *a, **k: pytest.fail("a session opened"))
    words = [w.format(a=lora.adapters[0], b=lora.adapters[1], tmp=tmp_path) for w in extra]
    args = ["mmlu-pro", "--pkg", str(lora.pkg), "--data", "bundled", "--output", str(tmp_path / "o")]
    assert_one_line_error(CliRunner().invoke(cli, args + words, catch_exceptions=False), needle)


def test_bench_rows_per_adapter_and_a_bad_adapter_row_refused_before_any_run(lora, tiny_pkg, tmp_path):
    """``--pkg LABEL=PKG:adapter=FILE`` rows: the adapter travels in the row's model args (its process runs it, as
    ``ortevals mmlu-pro --adapter`` does); a row's adapter that does not fit its package is one line at planning."""
    from ortevals.bench.plan import plan
    from ortevals.bench.spec import BenchOptions
    from ortevals.errors import OrtEvalsError

    a, b = lora.adapters
    rows = plan(BenchOptions(pkgs=(f"base={lora.pkg}", f"A={lora.pkg}:adapter={a}", f"B={lora.pkg}:adapter={b}=bee"),
                             limit=1)).rows
    assert [(r.label, r.args) for r in rows] == [("base", ""), ("A", f"adapter={a}"), ("B", f"adapter={b}=bee")]
    missing = tmp_path / "missing.onnx_adapter"
    for pkg, adapter, needle in ((lora.pkg, missing, "missing.onnx_adapter: not found"),
                                 (tiny_pkg, a, "has no adapter inputs")):
        with pytest.raises(OrtEvalsError, match=needle) as e:
            plan(BenchOptions(pkgs=(f"base={lora.pkg}", f"A={pkg}:adapter={adapter}"), limit=1))
        assert str(e.value).startswith(f"--pkg {pkg}:adapter={adapter}: adapter "), e.value
