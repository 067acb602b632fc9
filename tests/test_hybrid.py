"""Hybrid decoders (issue 37 item 3): recurrent and convolution state beside attention KV, on every path.

The tiny LFM2 (short convolutions) and Qwen3.5 (gated delta-net) packages of tests/fixtures/hybrid.py,
scored against lm-eval's hf backend on the same weights and generated against transformers, on the raw
prefill path (shared prefixes: the state saved at the plan's branch points), the onnxruntime-genai path
(snapshots), and raw generation (K rows: the state replicated per row, kept where the next prompt
branches off, never cut). int4 against a plain one-pass onnxruntime session on the same package.
"""

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError, PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage

HEADER = ("The capital of France is paris. The capital of Germany is berlin. The river of the city is a number "
          "one two three. ") * 3  # ~94 tokens shared by the questions: a prefix the plan reuses
QUESTIONS = ["Question: the capital of italy? Answer:", "Question: the river of spain? Answer:",
             "Question: one two three four? Answer:"]
PAIRS = [(HEADER + q, c) for q in QUESTIONS for c in (" A", " B", " paris", " rome madrid")] + \
        [("", "The river of the city")]
PROMPTS = [HEADER + q for q in QUESTIONS] + ["Nine ten"]
GREEDY = {"until": ["\n\n\n"], "max_gen_toks": 12, "do_sample": False}
PATHS = {"default": {}, "batched": {"batch_size": 4}, "exact": {"exact": True}, "no-prefix": {"prefix_cache": False},
         "incremental": {"path": "incremental"}}


def requests(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


@pytest.fixture(scope="module")
def hf_scores(request):
    """lm-eval's hf backend on each model's checkpoint: log-likelihoods and greedy flags of PAIRS."""
    from lm_eval.models.huggingface import HFLM

    cache = {}

    def get(model: str):
        if model not in cache:
            hf_dir = request.getfixturevalue(model)[0]
            hf = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=1, dtype="float32", max_length=512)
            cache[model] = hf.loglikelihood(requests("loglikelihood", PAIRS))
        return cache[model]

    return get


@pytest.mark.parametrize("model,kv_layers,states", [
    ("lfm2", [1, 3], {(0, "conv"): (64, 2), (2, "conv"): (64, 2)}),
    ("qwen35", [1, 3], {(0, "conv"): (128, 3), (0, "recurrent"): (4, 16, 16), (2, "conv"): (128, 3),
                        (2, "recurrent"): (4, 16, 16)}),
])
def test_the_loader_reads_attention_and_recurrent_layers(request, model, kv_layers, states):
    """Shapes from the checkpoint's config: LFM2 conv [hidden, L_cache - 1]; Qwen3.5 conv [2 key dims + value dim,
    kernel - 1], recurrent [value heads, value dim, key dim]. Before: 'input past.0.conv is not an input
    genai_config.json names', though the config names it."""
    from ortevals.report.describe import describe_package

    pkg = ModelPackage.load(request.getfixturevalue(model)[1])
    assert [s.layer for s in pkg.kv] == kv_layers and pkg.recurrent
    assert {(s.layer, s.kind): s.shape for s in pkg.states} == states
    info = describe_package(pkg)  # ortevals info: the KV layers apart (1 and 3, not 1-3), then the state layers
    assert "  layers 1       float32" in info and "  layers 3       float32" in info
    assert "recurrent state: 2 layers" in info and "  layer 0        conv float32 [B, " in info


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model", ["lfm2", "qwen35"])
def test_loglikelihoods_equal_the_hf_backend(request, hf_scores, model, path):
    lm = OrtLM.from_package(ModelArgs(pkg=str(request.getfixturevalue(model)[1]), max_length=512, **PATHS[path]))
    ours = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    ref = hf_scores(model)
    assert max(abs(a - b) for (a, _), (b, _) in zip(ours, ref)) <= 1e-4
    assert [g for _, g in ours] == [g for _, g in ref]
    total = sum(len(lm.tok_encode(c + x)) for c, x in PAIRS)
    engine = lm.run.engine
    if path in ("default", "batched"):  # the header's state was computed once and reused from its branch point
        assert "exact" not in lm.run.stats["mode"] and engine.tokens_run - engine.canary_tokens < total - 500
    if path == "incremental" and model == "qwen35":  # og rewinds its recurrent state to the snapshot at the header
        assert engine.tokens_run < total - 500


def one_pass_logprobs(pkg_dir, ids: list[int]) -> np.ndarray:
    """Log-softmax ``[S,V]`` from a plain onnxruntime session: the whole sequence in one pass, zero state."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(pkg_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for inp in session.get_inputs():
        if inp.name.startswith("past_key_values"):
            feeds[inp.name] = np.zeros((1, inp.shape[1], 0, 16), np.float32)
        elif inp.name.startswith("past."):
            feeds[inp.name] = np.zeros((1, *inp.shape[1:]), np.float32)
    logits = session.run(["logits"], feeds)[0][0].astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)


@pytest.mark.parametrize("path", ["default", "incremental"])
def test_int4_equals_a_one_pass_session_on_the_same_package(lfm2_int4, path):
    lm = OrtLM.from_package(ModelArgs(pkg=str(lfm2_int4[1]), max_length=512, **PATHS[path]))
    ours = [lp for lp, _ in lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)]
    for (ctx, cont), got in zip(PAIRS, ours):
        whole, n = lm.tok_encode(ctx + cont), len(lm.tok_encode(ctx + cont)) - len(lm.tok_encode(ctx))
        lp = one_pass_logprobs(lfm2_int4[1], whole)
        assert abs(got - sum(lp[len(whole) - n - 1 + j, whole[len(whole) - n + j]] for j in range(n))) <= 1e-4


@pytest.fixture(scope="module")
def hf_greedy(request):
    """transformers' greedy generation of PROMPTS on each model's checkpoint, decoded as the hf backend does
    (special tokens skipped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}

    def get(model: str) -> list[str]:
        if model not in cache:
            hf_dir = request.getfixturevalue(model)[0]
            hf, tok = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), \
                AutoTokenizer.from_pretrained(hf_dir)
            cache[model] = []
            for prompt in PROMPTS:
                ids = tok(prompt, return_tensors="pt").input_ids
                new = hf.generate(ids, max_new_tokens=GREEDY["max_gen_toks"], do_sample=False, eos_token_id=None,
                                  pad_token_id=2)[0, ids.shape[1]:]
                cache[model].append(tok.decode(new.tolist(), skip_special_tokens=True))
        return cache[model]

    return get


@pytest.mark.parametrize("gen_path", ["raw", "og"])
@pytest.mark.parametrize("model", ["lfm2", "qwen35"])
def test_greedy_generation_equals_transformers(request, hf_greedy, model, gen_path):
    pkg = request.getfixturevalue(model)[1]
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512, gen_path=gen_path, gen_batch_size=4))
    ours = lm.generate_until(requests("generate_until", [(p, dict(GREEDY)) for p in PROMPTS]), disable_tqdm=True)
    assert ours == hf_greedy(model)
    assert "one row per pass" not in lm.run.stats["mode"]  # the canary kept the configured way
    if gen_path == "raw":  # the three header prompts: the header's state kept at its branch point and reused
        assert lm.run.generation.sampler().stats["reused_tokens"] >= 2 * 90


@pytest.mark.parametrize("model", ["lfm2", "qwen35"])
def test_sampled_rows_equal_each_row_alone(request, model):
    """4 sampled rows of each of 2 prompts decoded together (the prompt's state replicated per row, rows
    leaving at their own stop) give each row's text alone, and each row's log-prob is the model's."""
    from tests.test_sampler import oracle_logprob, repeats, rows, sampler

    pkg = request.getfixturevalue(model)[1]
    kwargs = {"until": ["e"], "max_gen_toks": 10, "do_sample": True, "temperature": 1.0}
    batched = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512, gen_path="raw"))
    alone = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512, gen_path="raw", exact=True))
    reqs = repeats(PROMPTS[:2], kwargs, 4)
    assert batched.generate_until(reqs, disable_tqdm=True) == alone.generate_until(reqs, disable_tqdm=True)
    s = batched.run.generation.sampler()
    assert "one row per pass" not in batched.run.stats["mode"] and s.stats["row_steps"] < 8 * 10  # rows left early
    together = rows(sampler(batched), batched, PROMPTS[0], dict(kwargs, until=[]), [11, 12, 13, 14])
    assert len({t.ids for t in together}) == 4
    for t in together:
        assert abs(t.logprob - oracle_logprob(batched, PROMPTS[0], t.ids)) < 1e-3


def test_a_recurrent_state_is_never_cut(lfm2):
    lm = OrtLM.from_package(ModelArgs(pkg=str(lfm2[1]), max_length=64))
    runner = lm.run.backends.prefill.runner
    ids = np.asarray([lm.tok_encode("one two three four five")], np.int64)
    _, kv = runner.forward(ids, np.ones_like(ids), want_present=True)
    assert len(kv.states) == 2 and runner.narrow_past(kv, kv.length) is kv
    with pytest.raises(PackageError, match="cannot be cut to .*: a recurrent state is the state after exactly"):
        runner.narrow_past(kv, kv.length - 2)


def test_state_rows_where_the_session_keeps_them(qwen35):
    """States bound where the session runs (OrtValues through IOBinding, as on a GPU) are replicated and
    gathered by the one-node graphs of runtime/replicate.py, of their own rank: the same logits as host arrays."""
    from ortevals.runtime.providers import ProviderConfig
    from ortevals.runtime.sessions import DecoderRunner

    pkg = ModelPackage.load(qwen35[1])
    ids = np.arange(5, 25, dtype=np.int64)[None]
    out = []
    for runner in (DecoderRunner.open(pkg, ProviderConfig("cpu")),
                   DecoderRunner.open(pkg, ProviderConfig("cpu"), io_binding=True)):
        _, kv = runner.forward(ids, np.ones_like(ids), want_present=True)
        rows = runner.repeat_past(kv, 3)
        _, rows = runner.forward(np.array([[7], [8], [9]]), np.ones((3, 21), np.int64), rows, want_present=True)
        logits, _ = runner.forward(np.array([[7], [10]]), np.ones((2, 22), np.int64), runner.keep_rows(rows, [0, 2]))
        out.append((type(kv.states[1]).__name__, logits))
    assert [kind for kind, _ in out] == ["ndarray", "OrtValue"]
    np.testing.assert_array_equal(out[0][1], out[1][1])


def test_cascade_on_is_refused_naming_the_recurrent_state(lfm2):
    lm = OrtLM.from_package(ModelArgs(pkg=str(lfm2[1]), max_length=512, gen_path="raw", cascade="on", check=False))
    from tests.test_sampler import repeats

    reqs = repeats(PROMPTS[:2], {"until": [], "max_gen_toks": 4, "do_sample": True}, 3)
    with pytest.raises(OrtEvalsError, match="cascade=on is impossible for this package: the decoder carries "
                                            "recurrent state") as err:
        lm.generate_until(reqs, disable_tqdm=True)
    assert "\n" not in str(err.value)


def edit_config(pkg, fn):
    import json

    path = pkg / "genai_config.json"
    cfg = json.loads(path.read_text())
    fn(cfg["model"]["decoder"])
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["inputs"].update(past_ssm_names=d["inputs"].pop("past_conv_names")),
     "input 'past.0.conv' is model.decoder.inputs.past_ssm_names in genai_config.json, an input ortevals does not "
     "feed"),
    (lambda d: d["outputs"].pop("present_conv_names"),
     "model.decoder.inputs.past_conv_names='past.%d.conv' is set but model.decoder.outputs.present_conv_names is "
     "None"),
], ids=["unknown state key", "no present names"])
def test_a_state_the_config_does_not_describe_is_one_line_naming_the_field(lfm2, copy_pkg, edit, message):
    pkg = copy_pkg(lfm2[1])
    edit_config(pkg, edit)
    with pytest.raises(OrtEvalsError) as err:
        ModelPackage.load(pkg)
    assert message in str(err.value) and "\n" not in str(err.value)
