"""Verifiers (issue 25): the ORM classifier against transformers on the same weights, P(True) on the
package against a plain onnxruntime pass, the question's prompt run once for its K answers (counted
tokens), the PRM adapter's steps, bad --verifier values as one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortevals.engine.generate.search.prm import TextPrm, split_steps
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.integrations.verify import OrmVerifier, Question, SelfVerifier, verify_run
from ortevals.runtime.reward import RewardModel
from ortevals.tokens import common_prefix
from tests.test_sampler import raw_ort_logprobs

SHOTS = "".join(f"Question: what is {i} plus {i}?\nAnswer: {2 * i}\n\n" for i in range(10))
CONTEXT = SHOTS + "Question: what is the capital city of france?\nAnswer:"
ANSWERS = (" paris", " the river of berlin\n\nso rome", " two three four\n\nfive\n\nsix", " madrid", " paris")


def pipeline_scores(hf_dir, texts, label: str) -> list[float]:
    """transformers' text-classification pipeline on the same weights: its probability of ``label`` (its own
    function_to_apply: sigmoid for one label, softmax for several)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    classify = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(hf_dir),
                        top_k=None, device="cpu")
    return [next(r["score"] for r in found if r["label"] == label) for found in classify(texts)]


def test_orm_scores_are_the_probabilities_transformers_gives(tiny_orm):
    """One label: the sigmoid of the classifier's logit (weighted_maj@k sums scores, a PRM's prod multiplies them:
    a raw logit there elects the wrong answer)."""
    hf_dir, onnx_dir = tiny_orm
    texts = [CONTEXT + a for a in ANSWERS] + ["a"]
    model = RewardModel.open(onnx_dir)
    got = model.score(texts)
    np.testing.assert_allclose(got, pipeline_scores(hf_dir, texts, "LABEL_0"), rtol=1e-4, atol=1e-5)
    assert np.ptp(got) > 1e-3 and np.all((got > 0) & (got < 1))  # the scores tell the answers apart
    assert model.head.describe() == "sigmoid of the classifier's logit"


def test_two_label_classifier_scores_its_right_label_by_softmax(tiny_orm2, tmp_path):
    hf_dir, onnx_dir = tiny_orm2
    texts = [CONTEXT + a for a in ANSWERS]
    got = RewardModel.open(onnx_dir).score(texts)
    np.testing.assert_allclose(got, pipeline_scores(hf_dir, texts, "LABEL_1"), rtol=1e-4, atol=1e-5)
    # a config.json naming the labels: the one named as the right answer's, whichever index it has
    import shutil

    named = tmp_path / "named"
    shutil.copytree(onnx_dir, named)
    (named / "config.json").write_text(json.dumps({"id2label": {"0": "correct", "1": "incorrect"}}))
    np.testing.assert_allclose(RewardModel.open(named).score(texts), 1 - got, rtol=1e-5, atol=1e-6)
    (named / "config.json").write_text(json.dumps({"id2label": {"0": "a", "1": "b", "2": "c"}}))
    with pytest.raises(PackageError, match=r"config.json: 3 labels .* and not one of them named as the right"):
        RewardModel.open(named)
    (named / "config.json").write_text(json.dumps({"problem_type": "regression", "num_labels": 1}))
    with pytest.raises(PackageError, match=r"config.json: problem_type is regression, whose score is not a "
                                           r"probability"):
        RewardModel.open(named)


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
    verifier = SelfVerifier(lm.ptrue_model())
    out = verify_run(verifier, [Question(("t", 0), CONTEXT, ANSWERS)])
    want = [oracle_p_true(lm, tiny_pkg, CONTEXT, a) for a in ANSWERS]
    np.testing.assert_allclose(out.scores[("t", 0)], want, atol=1e-4)
    from ortevals.integrations.self_eval import prompt

    inputs = [lm.tok_encode(prompt(CONTEXT, a) + o)[:-1] for a in dict.fromkeys(ANSWERS) for o in (" (A)", " (B)")]
    alone = sum(map(len, inputs))  # every input run from its first token (the repeated answer's inputs once)
    tree = radix_tokens(inputs)  # the prompt once, each answer once, each (A)/(B) pair's common text once
    # + at most 2 tokens per input: a pass on top of a cached prefix never runs one token (engine/score/prefix.py)
    assert tree <= out.tokens <= tree + 2 * len(inputs)
    assert out.tokens < 0.3 * alone


def radix_tokens(inputs) -> int:
    """Tokens a radix tree over the inputs runs: each distinct token prefix once (independent of the plan)."""
    seqs = sorted(tuple(x) for x in inputs)
    return len(seqs[0]) + sum(len(b) - common_prefix(a, b) for a, b in zip(seqs, seqs[1:]))


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


def _cli(args):
    from click.testing import CliRunner

    from ortevals.cli import cli

    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_cli_verifier_selection_metrics_and_samples_fields(tiny_pkg, tiny_orm, tmp_path):
    """results.json's bon@4 / weighted_maj@4 / bon_prm_min@4 / bon_certainty@4 recomputed by hand from the
    samples file's K answers and scores (search-and-learn's rules: the first best; an answer's summed
    scores, no answer a vote, ties to the first seen); verifier_scores recomputed by the classifier on
    context + answer (a probability: the sigmoid of its logit)."""
    out = tmp_path / "run"
    result = _cli(["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "3",
                   "--max-gen-toks", "12", "--samples", "4", "--no-resume", "--truncate", "left",
                   "--verifier", str(tiny_orm[1]), "--model-args", "prm=true,step_separator=\\n",
                   "--output", str(out)])
    assert result.exit_code == 0, result.output
    body = json.loads((out / "results.json").read_text())
    res = body["results"]["mmlu_pro_business"]
    lines = [json.loads(x) for x in (out / "samples_mmlu_pro_business.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and body["verifier"]["tokens_run"] > 0 and body["verifier"]["cost_ratio"] > 0
    model = RewardModel.open(tiny_orm[1])
    bon, wmaj, prm_min = [], [], []
    for x in lines:
        assert len(x["sample_tokens"]) == len(x["verifier_scores"]) == len(x["filtered_resps"]) == 4
        args = x["arguments"]
        ctx = args["gen_args_0"]["arg_0"] if isinstance(args, dict) else args[0][0]
        np.testing.assert_allclose(x["verifier_scores"], model.score([ctx + t for t in x["resps"][0]]), rtol=1e-5)
        right = [a == x["target"] for a in x["filtered_resps"]]
        bon.append(right[int(np.argmax(x["verifier_scores"]))])
        sums: dict = {}  # search-and-learn's: an answer the regex could not extract (None) votes too
        for a, v in zip(x["filtered_resps"], x["verifier_scores"], strict=True):
            sums[a] = sums.get(a, 0.0) + v
        wmaj.append(max(sums, key=lambda a: sums[a]) == x["target"])
        step_min = [min(model.score([ctx + p for p in _prefixes(t, "\n")])) for t in x["resps"][0]]
        prm_min.append(right[int(np.argmax(step_min))])
    assert res["bon@4,custom-extract"] == pytest.approx(np.mean(bon))
    assert res["weighted_maj@4,custom-extract"] == pytest.approx(np.mean(wmaj))
    assert res["bon_prm_min@4,custom-extract"] == pytest.approx(np.mean(prm_min))
    assert "bon_certainty@4,custom-extract" in res and "bon@4_stderr,custom-extract" in res
    rows = {line.split()[2]: float(line.split()[3]) for line in result.output.splitlines()
            if line.startswith("mmlu_pro_business ")}  # the summary's lm-eval table
    assert rows["bon@4"] == pytest.approx(np.mean(bon), abs=1e-4) and "bon_prm_min@4" in rows
    assert rows["weighted_maj@4"] == pytest.approx(np.mean(wmaj), abs=1e-4)
    assert f"verifier {tiny_orm[1]}: 3 questions, {body['verifier']['tokens_run']} tokens run" in result.output


def _prefixes(text: str, sep: str) -> list[str]:
    """Each step's prefix, by hand: the text cut after each separator, and the whole text."""
    cuts = [i + len(sep) for i in range(len(text)) if text.startswith(sep, i)]
    return [text[:c] for c in cuts if c < len(text)] + [text] if cuts or text else [text]


@pytest.mark.parametrize(("extra", "needle"), [
    (["--verifier", "/nonexistent/orm"], "give --samples K"),
    (["--samples", "2", "--verifier", "/nonexistent/orm"], "/nonexistent/orm: no such folder"),
    (["--model-args", "verifier=self,prm_aggregation=max"], "prm_aggregation must be one of"),
    (["--model-args", "verifier=self,step_separator="], "step_separator"),
])
def test_bad_verifier_options_are_one_line_errors(tiny_pkg, extra, needle):
    result = _cli(["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "1",
                   "--max-gen-toks", "4", "--no-resume", *extra])
    assert result.exit_code == 2 and needle in result.output and len(result.output.strip().splitlines()) == 1, \
        result.output


def _wrapped(onnx_dir, tmp_path, name: str, ops: list[tuple[str, dict]], shape=None):
    """A copy of the classifier folder whose first output is its logits through ``ops`` ((op_type, attributes),
    each node's first input the previous output; Squeeze gets its axes input, Mul a constant 1), declared with
    ``shape``."""
    import shutil

    import onnx
    from onnx import TensorProto, helper

    out = tmp_path / name
    shutil.copytree(onnx_dir, out)
    proto = onnx.load(str(out / "model.onnx"))
    graph = proto.graph
    prev = graph.output[0].name
    for i, (op, attrs) in enumerate(ops):
        inputs = [prev]
        if op == "Squeeze":
            graph.initializer.append(helper.make_tensor(f"axes{i}", TensorProto.INT64, [1], [-1]))
            inputs.append(f"axes{i}")
        if op == "Mul":
            graph.initializer.append(helper.make_tensor(f"one{i}", TensorProto.FLOAT, [], [1.0]))
            inputs.append(f"one{i}")
        graph.node.append(helper.make_node(op, inputs, [f"out{i}"], **attrs))
        prev = f"out{i}"
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(prev, TensorProto.FLOAT, shape))
    onnx.save(proto, str(out / "model.onnx"))
    return out


def test_a_probability_through_shape_only_ops_is_not_squashed_again(tiny_orm, tiny_orm2, tmp_path):
    """Issue 49 item 1: `torch.sigmoid(logits).squeeze(-1)` exports Sigmoid → Squeeze, and a two-label head may
    end Softmax → Cast → Identity. Both are probabilities already: the scores equal transformers' pipeline on
    the same weights (today the second sigmoid/softmax put every score in (0.5, 0.73))."""
    hf_dir, onnx_dir = tiny_orm
    texts = [CONTEXT + a for a in ANSWERS]
    squeezed = RewardModel.open(_wrapped(onnx_dir, tmp_path, "sq", [("Sigmoid", {}), ("Squeeze", {})]))
    np.testing.assert_allclose(squeezed.score(texts), pipeline_scores(hf_dir, texts, "LABEL_0"), rtol=1e-4,
                               atol=1e-5)
    assert squeezed.head.mapping == "as is"
    hf2, onnx2 = tiny_orm2
    soft = RewardModel.open(_wrapped(onnx2, tmp_path, "sm", [("Softmax", {"axis": -1}),
                                                              ("Cast", {"to": 1}), ("Identity", {})],
                                        ["batch", 2]))
    np.testing.assert_allclose(soft.score(texts), pipeline_scores(hf2, texts, "LABEL_1"), rtol=1e-4, atol=1e-5)


def test_probabilities_the_graph_walk_cannot_see_are_refused_on_the_first_text(tiny_orm2, tmp_path):
    """A Softmax behind an op that changes values (here Mul by 1) is not seen by the walk: the first output, a
    probability vector, is refused in one line instead of squashed again."""
    _, onnx2 = tiny_orm2
    model = RewardModel.open(_wrapped(onnx2, tmp_path, "mul", [("Softmax", {"axis": -1}), ("Mul", {})],
                                          ["batch", 2]))
    with pytest.raises(PackageError, match=r"model.onnx: the first output looks like probabilities already"):
        model.score([CONTEXT + ANSWERS[0]])


def test_a_transformers_checkpoint_as_verifier_says_how_to_make_one(tiny, tiny_orm):
    """Issue 49 item 15: `--verifier <a transformers checkpoint>` said "expected an ONNX sequence classifier folder
    … model.onnx is missing" even for a causal LM; now it names the checkpoint and how to make a verifier of it."""
    from ortevals.integrations.verify import open_verifier

    with pytest.raises(PackageError, match=r"a transformers checkpoint \(LlamaForCausalLM\), not an ONNX model; .*"
                                           r"onnxruntime_genai.models.builder -i .* then --verifier OUT"):
        open_verifier(str(tiny[0]), None)
    with pytest.raises(PackageError, match=r"\(LlamaForSequenceClassification\), not an ONNX model; .*export the "
                                           r"classifier to ONNX"):
        open_verifier(str(tiny_orm[0]), None)
