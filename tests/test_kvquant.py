"""Quantized-KV packages (issue 51 item 2): every scoring path against one plain onnxruntime pass.

The builder's int8 and int4 KV caches (per channel and per tensor, tests/fixtures/kvquant.py) on the tiny
Llama with fp32 and int4 weights: each path's log-likelihoods equal the whole sequence in one plain
onnxruntime session of the same package within 1e-5, the shared prefix's quantized KV reused (the default
path runs hundreds of tokens fewer) and the quantization visible (the float-KV twin differs by far more than
1e-5). An fp8 cache on CPU and KV scales as graph inputs are refused in one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.errors import PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from tests.test_hybrid import PAIRS, requests

PATHS = {"default": {}, "exact": {"exact": True}, "no-prefix": {"prefix_cache": False},
         "incremental": {"path": "incremental"}}
CASES = [("fp32", "int8_per_channel"), ("fp32", "int8_per_tensor"), ("fp32", "int4_per_channel"),
         ("fp32", "int4_per_tensor"), ("int4", "int8_per_channel"), ("int4", "int4_per_channel")]


@pytest.fixture(scope="module")
def kv_packages(fixture_cache):
    from tests.fixtures.kvquant import build_kv_quant

    return {case: build_kv_quant(fixture_cache, *case) for case in CASES}


@functools.lru_cache(maxsize=16)
def plain_session(pkg: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])


def one_pass_logprobs(pkg: Path, ids: list[int]) -> np.ndarray:
    """log-softmax ``[S,V]`` of the whole sequence in one plain onnxruntime pass, empty past of the graph's type."""
    session = plain_session(pkg)
    dec = json.loads((pkg / "genai_config.json").read_text())["model"]["decoder"]
    types = {"tensor(float)": np.float32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}
    feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for inp in session.get_inputs():
        if inp.name.startswith("past_key_values"):
            size = dec["head_size"] if inp.type != "tensor(uint8)" else (dec["head_size"] + 1) // 2  # int4: 2 a byte
            feeds[inp.name] = np.zeros((1, dec["num_key_value_heads"], 0, size), types[inp.type])
    logits = session.run(["logits"], feeds)[0][0].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def one_pass_scores(lm, pkg: Path) -> list[float]:
    """Each pair's log-likelihood from :func:`one_pass_logprobs`, tokenized as lm-eval's ``TemplateLM`` does (an
    empty context is the prefix token: the tiny tokenizer adds it to every text, SmolLM2's to none)."""
    out = []
    for ctx, cont in PAIRS:
        if ctx:
            whole, n = lm.tok_encode(ctx + cont), len(lm.tok_encode(ctx + cont)) - len(lm.tok_encode(ctx))
        else:  # lm-eval 0.4.13's TemplateLM: the continuation without special tokens after the prefix token
            ids = lm.tok_encode(cont, add_special_tokens=False)
            whole, n = ([lm.prefix_token_id] if ids[0] != lm.prefix_token_id else []) + ids, len(ids) - \
                (ids[0] == lm.prefix_token_id)
        lp = one_pass_logprobs(pkg, whole)
        out.append(sum(lp[len(whole) - n - 1 + j, whole[len(whole) - n + j]] for j in range(n)))
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_every_path_equals_one_plain_pass(kv_packages, case, path):
    twin, pkg = kv_packages[case]
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512, **PATHS[path]))
    ours = np.array([lp for lp, _ in lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)])
    plain = np.array(one_pass_scores(lm, pkg))
    assert np.abs(ours - plain).max() <= 1e-5
    assert np.abs(plain - np.array(one_pass_scores(lm, twin))).max() > 1e-3  # the quantized cache is visible
    if path == "default":  # the shared header's quantized KV was computed once and reused
        total = sum(len(lm.tok_encode(c + x)) for c, x in PAIRS)
        engine = lm.run.engine
        assert "exact" not in lm.run.stats["mode"] and engine.tokens_run - engine.canary_tokens < total - 500


def one_line_error(result, *parts: str) -> str:
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line, line
    for p in parts:
        assert p in line, line
    return line


def test_an_fp8_cache_on_cpu_is_one_line(fixture_cache):
    from tests.fixtures.kvquant import build_kv_quant

    twin, pkg = build_kv_quant(fixture_cache, "fp32", "fp8_per_channel")
    with pytest.raises(PackageError, match="float8_e4m3fn KV cache needs an accelerator provider"):
        OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=512))
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(pkg), "--ref", str(twin), "--ctx", "64"])
    one_line_error(result, "float8_e4m3fn KV cache", "--ep cuda")


def test_kv_scales_as_graph_inputs_are_refused_in_one_line(fixture_cache):
    """The builder's per-token scheme (CUDA PagedAttention) makes the scales inputs; before, the error named
    the paged attention's block_table and not the scales."""
    from tests.fixtures.kvquant import build_per_token

    pkg = build_per_token(fixture_cache)
    result = CliRunner().invoke(cli, ["info", "--pkg", str(pkg)])
    one_line_error(result, "model.decoder.inputs.past_key_scale_names", "per channel or per tensor")
