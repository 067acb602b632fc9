"""Verifiers (issue 25): the ORM classifier against transformers on the same weights, P(True) on the
package against a plain onnxruntime pass, the question's prompt run once for its K answers (counted
tokens), the PRM adapter's steps, bad --verifier values as one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortevals.engine.generate.prm import TextPrm, split_steps
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.integrations.verify import OrmVerifier, Question, SelfVerifier, verify_run
from ortevals.runtime.reward import RewardModel

SHOTS = "".join(f"Question: what is {i} plus {i}?\nAnswer: {2 * i}\n\n" for i in range(10))
CONTEXT = SHOTS + "Question: what is the capital city of france?\nAnswer:"
ANSWERS = (" paris", " the river of berlin\n\nso rome", " two three four\n\nfive\n\nsix", " madrid", " paris")


def test_orm_scores_equal_transformers(tiny_orm):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf_dir, onnx_dir = tiny_orm
    texts = [CONTEXT + a for a in ANSWERS] + ["a"]
    got = RewardModel.open(onnx_dir).score(texts)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits.item() for t in texts]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.ptp(got) > 1e-2  # the scores tell the answers apart


def raw_ort_logprobs(pkg, ids: list[int]) -> np.ndarray:
    """log softmax ``[len(ids), V]`` from a plain onnxruntime session on the decoder (no ortevals code)."""
    import onnxruntime as ort

    dec = json.loads((pkg / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in (i for i in sess.get_inputs() if i.name.startswith("past_key_values")):
        feeds[i.name] = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
    x = sess.run(["logits"], feeds)[0][0].astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def oracle_p_true(lm, pkg, context: str, answer: str) -> float:
    """expit(log p(" (A)") - log p(" (B)")) after the P(True) prompt, each continuation split from the
    whole text's ids as lm-eval does, scored on one plain pass."""
    from scipy.special import expit

    from ortevals.integrations.self_eval import prompt

    ctx_text = prompt(context, answer)
    lls = []
    for option in (" (A)", " (B)"):
        ctx = lm.tok_encode(ctx_text)
        whole = lm.tok_encode(ctx_text + option)
        cont = whole[len(ctx):]
        lp = raw_ort_logprobs(pkg, whole[:-1])
        lls.append(sum(lp[len(ctx) - 1 + t, c] for t, c in enumerate(cont)))
    return float(expit(lls[0] - lls[1]))


def test_self_verifier_runs_the_prompt_once_and_scores_as_alone(tiny_pkg):
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg)))
    verifier = SelfVerifier(lm)
    out = verify_run(verifier, [Question(("t", 0), CONTEXT, ANSWERS)])
    want = [oracle_p_true(lm, tiny_pkg, CONTEXT, a) for a in ANSWERS]
    np.testing.assert_allclose(out.scores[("t", 0)], want, atol=1e-4)
    from ortevals.integrations.self_eval import prompt

    prompt_len = len(lm.tok_encode(CONTEXT))
    inputs = [len(lm.tok_encode(prompt(CONTEXT, a) + o)) - 1 for a in dict.fromkeys(ANSWERS) for o in (" (A)", " (B)")]
    alone = sum(inputs)  # every input run from its first token (the repeated answer's inputs once)
    shared = prompt_len + sum(n - prompt_len for n in inputs)  # the prompt once, then each input's own tokens
    # + at most 2 tokens per input: a pass on top of a cached prefix never runs one token (engine/score/prefix.py)
    assert shared <= out.tokens <= shared + 2 * len(inputs)
    assert out.tokens < 0.5 * alone


def test_orm_verifier_and_prm_steps(tiny_orm):
    verifier = OrmVerifier(RewardModel.open(tiny_orm[1]))
    out = verify_run(verifier, [Question(("t", 3), CONTEXT, ANSWERS)], prm=True)
    whole = RewardModel.open(tiny_orm[1]).score([CONTEXT + a for a in ANSWERS])
    np.testing.assert_allclose(out.scores[("t", 3)], whole)
    steps = out.steps[("t", 3)]
    assert [len(s) for s in steps] == [1, 2, 3, 1, 1]
    np.testing.assert_allclose([s[-1] for s in steps], whole, rtol=1e-6)  # last step = the whole answer
    first = RewardModel.open(tiny_orm[1]).score([CONTEXT + " the river of berlin\n\n"])[0]
    assert steps[1][0] == pytest.approx(first, rel=1e-6)  # a step's prefix keeps its separator


@pytest.mark.parametrize(("text", "sep", "want"), [
    ("a\n\nb\n\nc", "\n\n", ["a\n\n", "b\n\n", "c"]),
    ("a\n\nb\n\n", "\n\n", ["a\n\n", "b\n\n"]),
    ("", "\n\n", [""]),
    ("one. two. three", ". ", ["one. ", "two. ", "three"]),
    ("no separator", "\n\n", ["no separator"]),
])
def test_split_steps(text, sep, want):
    assert split_steps(text, sep) == want and "".join(want) == text


def test_text_prm_over_token_ids_scores_each_prefix():
    """StepScorer over ids: a scorer that returns each prefix's length shows which text each step got."""
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    prm = TextPrm(lambda ctx, texts: np.array([len(ctx) * 100 + len(t) for t in texts]), decode=decode)
    assert prm.score([0, 1], [[[2, 3], [4]], [[5]]]) == [[202.0, 203.0], [201.0]]


def test_bad_verifier_folders_are_one_line_errors(tmp_path, tiny_pkg):
    with pytest.raises(PackageError, match="model.onnx is missing"):
        RewardModel.open(tmp_path)
    with pytest.raises(PackageError, match="expected inputs"):
        RewardModel.open(tiny_pkg)  # a decoder, not a classifier
    with pytest.raises(OrtEvalsError, match="step_separator"):
        split_steps("x", "")
