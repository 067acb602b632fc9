"""LoRA adapters (issue 57 item 1): ``--adapter FILE[=NAME]`` active on every scoring and generation path.

The fixture (tests/fixtures/lora.py) is the tiny Llama exported by the onnxruntime-genai builder with a peft LoRA
(``adapter_path=DIR``) and run through Olive's ExtractAdapters: the LoRA weights are optional decoder inputs, the
adapters ``.onnx_adapter`` files. The oracle is transformers + peft on the same checkpoint and adapter (the adapter
active, unmerged): log-likelihoods within 1e-5 on the prefill path (the derived scoring graph, batched and exact;
the shared-prefix graph), on onnxruntime-genai (``path=incremental``), and greedy tokens equal on both generation
paths (raw, its cascade graph, og). Without ``--adapter`` the base model is scored, with a warning.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import OrtLM
from ortevals.options import parse_model_args
from tests.fixtures.lora import build_lora, peft_greedy, peft_logprobs

# a few-shot header shared by every context (> 64 tokens: its KV is computed once and shared by the inputs)
HEADER = ("Question: the capital of italy is which city? Answer: rome.\n\nQuestion: the river of the capital of "
          "france is which river? Answer: the river of paris.\n\nQuestion: one two three four, which number is "
          "next? Answer: five.\n\n")
PAIRS = [(HEADER + c, x) for c, x in [
    ("Question: the capital of France is", " paris"),
    ("Question: the capital of France is", " rome. The river of the city"),
    ("Question: one two three. Answer:", " B"),
    ("Question: one two three. Answer:", " C is the answer, four five six seven"),
    ("Nine ten ", "eleven twelve three four"),
    ("A model of the graph", " layer"),
]]


@pytest.fixture(scope="module")
def lora(fixture_cache):
    return build_lora(fixture_cache)


def open_lm(lora, adapter: int | None = 0, adapter_spec: str | None = None, **kw) -> OrtLM:
    args = dict(pkg=str(lora.pkg), max_length=256, store="none", **kw)
    if adapter is not None or adapter_spec is not None:
        args["adapter"] = adapter_spec or str(lora.adapters[adapter])
    return OrtLM.from_package(parse_model_args(args))


def tolerance(lm: OrtLM) -> np.ndarray:
    """1e-5 a continuation token: float32 sums of several log-probs of tens of nats round by a few 1e-6 each."""
    return 1e-5 * np.array([len(lm._encode_pair(c, x)[1]) for c, x in PAIRS])


def oracle(lora, lm: OrtLM, peft_dir) -> list[float]:
    """transformers (+ peft) log-likelihood of each pair's continuation, on the ids ortevals tokenized."""
    out = []
    for context, continuation in PAIRS:
        ctx, cont = lm._encode_pair(context, continuation)
        ids = list(ctx) + list(cont)
        logp = peft_logprobs(lora.hf_dir, peft_dir, [ids])[0]
        out.append(float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))))
    return out


def scores(lm: OrtLM) -> np.ndarray:
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    return np.array([lp for lp, _ in got])


@pytest.mark.parametrize("kw", [dict(path="prefill"), dict(path="prefill", exact=True),
                                dict(path="prefill", shared_prefix_batch="on"), dict(path="incremental")],
                         ids=["prefill", "exact", "shared-prefix", "incremental"])
def test_an_adapter_scores_as_transformers_and_peft(lora, kw, monkeypatch):
    from ortevals.runtime.prefix_runner import PrefixRunner

    passes = []
    score = PrefixRunner.score
    monkeypatch.setattr(PrefixRunner, "score", lambda self, *a: passes.append(1) or score(self, *a))
    lm = open_lm(lora, **kw)
    got = scores(lm)
    want = np.array(oracle(lora, lm, lora.peft_dirs[0]))
    base = np.array(oracle(lora, lm, None))
    assert np.abs(want - base).max() > 1.0  # the adapter moves the numbers: nats, not rounding
    assert (np.abs(got - want) <= tolerance(lm)).all(), (got, want)
    # the shared-prefix graph served the inputs on a shared context, carrying the adapter's inputs; batched passes
    # agree with one row a pass (the canary: a path without the adapter would fail it and fall back to exact)
    assert bool(passes) == (kw.get("shared_prefix_batch") == "on")
    mode = lm.run.stats["mode"]
    assert mode.startswith("exact") == bool(kw.get("exact")) and "canary failed" not in mode, mode


def test_the_second_adapter_is_its_own(lora):
    lm = open_lm(lora, adapter=1)
    assert (np.abs(scores(lm) - np.array(oracle(lora, lm, lora.peft_dirs[1]))) <= tolerance(lm)).all()


def test_without_adapter_the_base_model_is_scored_and_said(lora, caplog):
    with caplog.at_level(logging.WARNING):
        lm = open_lm(lora, adapter=None)
        got = scores(lm)
    said = [r.getMessage() for r in caplog.records if "adapter" in r.getMessage()]
    assert len(said) == 1 and "no --adapter was given: scoring the base model" in said[0], said
    assert (np.abs(got - np.array(oracle(lora, lm, None))) <= tolerance(lm)).all()


@pytest.mark.parametrize("kw", [dict(gen_path="raw", cascade="off"), dict(gen_path="og")], ids=["raw", "og"])
def test_greedy_generation_follows_the_adapter(lora, kw):
    lm = open_lm(lora, max_gen_toks=12, **kw)
    prompt = "The capital of France is"
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "do_sample": False}), 0)],
                                disable_tqdm=True)
    ids = lm.tok_encode(prompt)
    want = peft_greedy(lora.hf_dir, lora.peft_dirs[0], ids, 12)
    assert lm.tok_encode(prompt + text, add_special_tokens=True)[len(ids):] == want or \
        text == lm.tok_decode(want), (text, lm.tok_decode(want))


def test_sampled_rows_on_the_cascade_graph_carry_the_adapter(lora):
    """The cascade graph keeps the decoder's adapter inputs: its rows draw what the plain path (checked above
    against peft) draws, and ``cascade=on`` passes its check against the plain pass (else: one-line error)."""
    from tests.test_sampler import repeats

    reqs = repeats(["The capital of France is", "Question: one two three. Answer:"],
                   {"until": [], "max_gen_toks": 16, "do_sample": True, "temperature": 0.7}, 4)
    on = open_lm(lora, gen_path="raw", cascade="on")
    off = open_lm(lora, gen_path="raw", cascade="off")
    base = open_lm(lora, adapter=None, gen_path="raw", cascade="off")
    texts = on.generate_until(reqs, disable_tqdm=True)
    assert texts == off.generate_until(reqs, disable_tqdm=True)
    assert "cascade" in on.run.stats["mode"]
    assert texts != base.generate_until(reqs, disable_tqdm=True)  # the adapter changed what was drawn


# --- the result store's scope -------------------------------------------------------------------------------------

def test_another_adapter_is_another_scope_and_the_same_bytes_elsewhere_the_same(lora, tmp_path):
    import shutil

    store = str(tmp_path / "store.sqlite")
    copy = tmp_path / "renamed.onnx_adapter"
    shutil.copy(lora.adapters[0], copy)
    digests = {}
    for label, adapter in (("a", lora.adapters[0]), ("b", lora.adapters[1]), ("a-copy", copy), ("none", None)):
        args = dict(pkg=str(lora.pkg), max_length=256, store=store)
        if adapter is not None:
            args["adapter"] = (f"{adapter}=x",)
        lm = OrtLM.from_package(parse_model_args(args))
        digests[label] = lm.run.store.scope.digest
        if label == "a":
            first = scores(lm)
        if label == "b":  # nothing reused from adapter a's answers: its own numbers
            got = scores(lm)
            assert lm.run.stats["reused"] == 0 and np.abs(got - first).max() > 1.0
    assert len({digests["a"], digests["b"], digests["none"]}) == 3
    assert digests["a-copy"] == digests["a"]  # the file's content, not its path or name


# --- bad inputs: one line, exit 2, before any session opens ----------------------------------------------------------

def adapter_file(path, lora, edit):
    """An .onnx_adapter file holding adapter a's tensors edited by ``edit(dict name -> numpy)``."""
    import onnxruntime as ort

    params = {k: v.numpy() for k, v in ort.AdapterFormat.read_adapter(str(lora.adapters[0])).get_parameters().items()}
    out = ort.AdapterFormat()
    out.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in edit(params).items()})
    out.export_adapter(str(path))
    return path


A_INPUT = "model.layers.0.attn.q_proj.lora_A.MatMul.weight"


@pytest.mark.parametrize("make,needle", [
    (lambda tmp, lora: tmp / "missing.onnx_adapter", "missing.onnx_adapter: not found; expected an .onnx_adapter"),
    (lambda tmp, lora: lora.peft_dirs[0] / "adapter_model.safetensors", "not an .onnx_adapter file"),
    (lambda tmp, lora: (tmp / "junk.onnx_adapter").write_bytes(b"not flatbuffers") and tmp / "junk.onnx_adapter",
     "onnxruntime cannot read it as an .onnx_adapter file"),
    (lambda tmp, lora: adapter_file(tmp / "rank.onnx_adapter", lora, lambda p: p | {A_INPUT: p[A_INPUT][:32]}),
     f"{A_INPUT} is float [32, 4] but model.onnx takes float [64, 'lora_r']"),
    (lambda tmp, lora: adapter_file(tmp / "extra.onnx_adapter", lora, lambda p: p | {"lm_head.lora_A": p[A_INPUT]}),
     "1 tensor(s) are no adapter input of model.onnx (lm_head.lora_A)"),
    (lambda tmp, lora: adapter_file(tmp / "fewer.onnx_adapter", lora,
                                    lambda p: {k: v for k, v in p.items() if k != A_INPUT}),
     f"no tensor for 1 of the 28 adapter inputs of model.onnx ({A_INPUT})"),
], ids=["missing", "not-onnx-adapter", "unreadable", "shape", "unknown-tensor", "missing-tensor"])
def test_a_bad_adapter_is_one_line_before_any_session(lora, tmp_path, monkeypatch, make, needle):
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.runtime.sessions import DecoderRunner
    from tests.test_cli import assert_one_line_error

    path = make(tmp_path, lora)
    monkeypatch.setattr(DecoderRunner, "open", lambda *a, **k: pytest.fail("a session opened"))
    with pytest.raises(OrtEvalsError, match=re.escape(needle)):
        open_lm(lora, adapter=None, adapter_spec=str(path))
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(lora.pkg), "--data", "bundled", "--limit", "1",
                                      "--adapter", str(path)], catch_exceptions=False)
    assert_one_line_error(result, needle)


def test_an_adapter_on_a_package_without_adapter_inputs_and_two_adapters_are_one_line(lora, tiny_pkg):
    from click.testing import CliRunner

    from ortevals.cli import cli
    from tests.test_cli import assert_one_line_error

    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                                      "--adapter", str(lora.adapters[0])], catch_exceptions=False)
    assert_one_line_error(result, "model.onnx has no adapter inputs", "drop --adapter")
    with pytest.raises(OrtEvalsError, match="2 adapters given; one run scores one adapter"):  # lm-eval's route
        open_lm(lora, adapter_spec=f"{lora.adapters[0]}=a;{lora.adapters[1]}=b")
    with pytest.raises(OrtEvalsError, match="two adapters named 'x'"):
        parse_model_args({"pkg": str(lora.pkg), "adapter": f"{lora.adapters[0]}=x;{lora.adapters[1]}=x"})
    with pytest.raises(OrtEvalsError, match="a name after '='"):
        parse_model_args({"pkg": str(lora.pkg), "adapter": f"{lora.adapters[0]}="})


def test_info_lists_the_adapter_inputs_and_the_run_names_its_adapter(lora, tiny_pkg):
    import onnx
    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.report.model_info import describe

    graph = onnx.load(str(lora.pkg / "model.onnx"), load_external_data=False).graph
    defaults = {t.name for t in graph.initializer}
    optional = {i.name for i in graph.input if i.name in defaults}  # what Olive made optional: the oracle
    out = CliRunner().invoke(cli, ["info", "--pkg", str(lora.pkg)], catch_exceptions=False).output
    assert f"adapter inputs: {len(optional)} (LoRA weights" in out and len(optional) == 28
    assert "  model.layers.*.attn.q_proj.lora_A.MatMul.weight  float [64, lora_r]  layers 0-1" in out
    assert "adapter inputs" not in CliRunner().invoke(cli, ["info", "--pkg", str(tiny_pkg)]).output
    lm = open_lm(lora, adapter_spec=f"{lora.adapters[1]}=second")
    line = describe(lm.run.model_info())
    assert line.endswith(f", adapter second ({lora.adapters[1].resolve()})"), line


def test_an_adapter_on_a_package_with_media_models_is_one_line(lora):
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.adapters import run_adapter

    with pytest.raises(OrtEvalsError, match="has vision or speech models, and ortevals runs adapters on text packages"):
        run_adapter(ModelPackage.load(str(lora.pkg)), (str(lora.adapters[0]),), media=True)


# --- commands that take no --adapter: the base model, said once ---------------------------------------------------

def base_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "adapter" in r.getMessage()]


def test_profile_fidelity_and_diagnose_say_they_measure_the_base_model(lora, tiny_pkg, tmp_path, caplog, monkeypatch):
    """One warning line per LoRA package each command measures (the decoder's adapter inputs counted from the
    graph), none for a package without adapter inputs; diagnose's own scoring run adds no second line."""
    import onnx

    from ortevals.diagnose.inputs import DiagnoseOptions, check_inputs
    from ortevals.fidelity.run import FidelityOptions, run_fidelity
    from ortevals.run.profile import ProfileRequest, run_profile
    from ortevals.runtime import adapters

    graph = onnx.load(str(lora.pkg / "model.onnx"), load_external_data=False).graph
    n = len({i.name for i in graph.input} & {t.name for t in graph.initializer})  # Olive's optional inputs
    line = f"{lora.pkg / 'model.onnx'} has {n} LoRA adapter inputs; ortevals %s measures the base model"
    text = tmp_path / "text.txt"
    text.write_text(" ".join(HEADER for _ in range(4)))
    runs = {
        "profile": lambda: run_profile({"pkg": str(lora.pkg)}, ProfileRequest("1", "8", "2", 1, 0, tmp_path / "p")),
        "fidelity": lambda: run_fidelity(FidelityOptions(pkg=lora.pkg, ref=str(tiny_pkg), text=text, ctx=32,
                                                         tokens=32)),
        "fidelity-ref": lambda: run_fidelity(FidelityOptions(pkg=tiny_pkg, ref=str(lora.pkg), text=text, ctx=32,
                                                             tokens=32)),
        "diagnose": lambda: check_inputs(DiagnoseOptions(pkg=str(lora.pkg), ref=str(lora.hf_dir),
                                                         output=tmp_path / "d")),
    }
    for command, run in runs.items():
        monkeypatch.setattr(adapters, "_SAID", set())
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            try:
                run()
            except OrtEvalsError as e:  # diagnose refuses an fp32 candidate after the warning: not this test's
                assert command == "diagnose", e
        said = base_warnings(caplog)
        assert said == [line % command.split("-")[0] + " (its adapter inputs at their empty defaults) and takes "
                        "no --adapter"], (command, said)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_profile({"pkg": str(tiny_pkg)}, ProfileRequest("1", "8", "2", 1, 0, tmp_path / "p2"))
    assert base_warnings(caplog) == []
    lm_said = base_warnings(caplog)
    with caplog.at_level(logging.WARNING):  # a run opened inside diagnose (its choice-KL stage): nothing more said
        open_lm(lora, adapter=None)
    assert base_warnings(caplog) == lm_said
