"""generate_until where it could go silently wrong: multimodal packages (text-only opening) and
non-finite logits (a NaN pushed through the real engine, the batched path and the CLI)."""

import re
from pathlib import Path

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM

# each continues past the 16-token sliding window and changes token there (no single-token loop)
GEMMA_PROMPTS = ["A. the\nB. of\nC.", "Question: what is the river of the city? Answer: the river",
                 "Seven eight nine ten"]
MEDIA_TOKENS = range(3, 10)  # <image> … <audio>: transformers' Gemma 4 embeds them differently from the package


def gen(lm, prompts, kwargs):
    return lm.generate_until([Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)],
                             disable_tqdm=True)


def oracle_greedy(pkg_dir: Path, prompt: str, max_new: int) -> tuple[list[int], list[int], str]:
    """Greedy decoding by hand: the package's tokenizer.json, then embedding.onnx → decoder.onnx on
    raw onnxruntime, recomputing the whole sequence every step; stops at EOS or max_new.
    Returns (prompt ids, generated ids, generated text)."""
    from tokenizers import Tokenizer

    from tests.fixtures.gemma4 import EOS_ID, ort_logits

    tok = Tokenizer.from_file(str(pkg_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids  # the post-processor adds <bos>, as lm-eval's hf backend would
    out: list[int] = []
    while len(out) < max_new:
        nxt = int(np.argmax(ort_logits(pkg_dir, ids + out)[-1]))
        if nxt == EOS_ID:
            break
        out.append(nxt)
    return ids, out, tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("windowed", [False, True], ids=["full-kv", "windowed-kv"])
def test_generate_until_on_gemma4_layout_equals_raw_ort_and_pytorch(fixture_cache, windowed):
    """og used to load vision.onnx (garbage here) for text requests: "Load model from …/vision.onnx failed"."""
    from tests.fixtures.gemma4 import build_gemma4, reference_logprobs

    hf_dir, pkg_dir = build_gemma4(fixture_cache / "gemma4", windowed=windowed)
    lm = OrtLM.from_package(ModelArgs(pkg=str(pkg_dir), max_length=256))
    ours = gen(lm, GEMMA_PROMPTS, {"until": [], "max_gen_toks": 32})
    for prompt, text in zip(GEMMA_PROMPTS, ours, strict=True):
        ids, out, expected = oracle_greedy(pkg_dir, prompt, 32)
        assert text == expected
        assert len(ids) + len(out) > 16 + 8 and len(set(out)) >= 3  # well past the window, not one token
        assert not set(ids + out) & set(MEDIA_TOKENS)  # else PyTorch is no reference (see MEDIA_TOKENS)
        # PyTorch agrees: each generated token is transformers' argmax after the tokens before it
        # (up to near-ties: ORT and PyTorch differ by ~1e-5 here)
        lp = reference_logprobs(hf_dir, [ids + out])[0][len(ids) - 1:-1]
        assert np.all(lp.max(-1) - lp[np.arange(len(out)), out] <= 1e-4)


# --- NaN logits -------------------------------------------------------------------------------

POISONED_TOKEN = 437  # "Question" in the tiny tokenizer: in PROMPTS[1] and in every MMLU-Pro prompt
PROMPTS = ["The capital of France is", "Question: one two three. Answer:", "Paris france berlin germany"]


@pytest.fixture()
def poisoned(tiny_pkg, copy_pkg) -> Path:
    """The tiny package with token 437's embedding row set to NaN (bytes patched in model.onnx.data)."""
    import onnx

    pkg = copy_pkg(tiny_pkg)
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    table = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    where = {e.key: e.value for e in table.external_data}
    assert table.data_type == onnx.TensorProto.FLOAT and where["location"] == "model.onnx.data"
    hidden = table.dims[1]
    with open(pkg / where["location"], "r+b") as f:
        f.seek(int(where["offset"]) + POISONED_TOKEN * hidden * 4)
        f.write(np.full(hidden, np.nan, dtype=np.float32).tobytes())
    return pkg


@pytest.mark.parametrize("kwargs", [{"do_sample": False}, {"do_sample": True, "temperature": 0.8},
                                    {"do_sample": False, "gen_batch_size": 4},
                                    {"do_sample": True, "temperature": 0.8, "gen_path": "raw"}],
                         ids=["greedy", "sampled", "batched", "raw-sampled"])
def test_nan_logits_stop_generation_naming_the_request(poisoned, kwargs, caplog):
    kwargs = dict(kwargs)
    width = kwargs.pop("gen_batch_size", 1)
    path = kwargs.pop("gen_path", "og")
    lm = OrtLM.from_package(ModelArgs(pkg=str(poisoned), max_length=256, gen_batch_size=width, gen_path=path))
    assert gen(lm, [PROMPTS[0], PROMPTS[2]], {"until": [], "max_gen_toks": 4, **kwargs})  # clean prompts run
    with pytest.raises(OrtEvalsError) as err, caplog.at_level("INFO", logger="ortevals"):
        gen(lm, PROMPTS, {"until": [], "max_gen_toks": 4, **kwargs})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("non-finite logits (NaN) at generated token 1 for request #1 (prompt 'Question: one")
    meant = "on the raw shared-prompt path" if path == "raw" else \
        f"({3 if width > 1 else 0} in batches of up to {width})"
    assert meant in caplog.text  # the path meant


def test_nan_logits_through_the_cli_exit_2_in_one_line(poisoned, tmp_path):
    from click.testing import CliRunner

    from ortevals.cli import cli

    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(poisoned), "--data", "bundled", "--limit", "1",
                                      "--cot", "--max-gen-toks", "4", "--no-resume", "--truncate", "left"],
                                catch_exceptions=False)
    # progress bars and datasets' "Repo card metadata" lines come before it: the error is the last line
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert [ln for ln in lines if ln.startswith("Error")] == lines[-1:], lines
    assert re.fullmatch(r"Error: non-finite logits \(NaN\) at generated token 1 for request #\d+ "
                        r"\(task mmlu_pro_\w+, doc 0; prompt 'The following are .*…'\); .*fp16.*", lines[-1]), lines
