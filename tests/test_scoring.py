"""Scoring math on hand-made logits."""

import math

import numpy as np
import pytest

from ortevals.engine.score.scoring import check_finite, continuation_logprob, input_window, log_softmax
from ortevals.errors import OrtEvalsError


def test_log_softmax_matches_definition():
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    expected = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_softmax(x, np.float32), expected, atol=1e-6)
    assert log_softmax(np.array([[1000.0, 0.0]]), np.float32).max() == 0.0  # no overflow


def test_log_softmax_is_scipys_bit_for_bit():
    """The one log-softmax (issue 23) replaced scipy.special.log_softmax in report/ and fidelity/: the same
    float64 numbers, bit for bit, on choice distributions with -inf pads and on float32 logits."""
    from scipy.special import log_softmax as scipy_log_softmax

    rng = np.random.default_rng(3)
    choices = rng.normal(size=(200, 10)) * 5
    choices[rng.random(choices.shape) < 0.3] = -np.inf
    choices[:, 0] = rng.normal(size=200)  # every question has a choice
    logits = (rng.normal(size=(16, 4096)) * 4).astype(np.float32)
    for x in (choices, logits):
        assert np.array_equal(log_softmax(x, np.float64), scipy_log_softmax(np.asarray(x, np.float64), axis=-1))

def test_continuation_logprob_sums_target_rows():
    rows = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], dtype=np.float32))
    lp, greedy = continuation_logprob(rows, [0, 2])
    assert lp == pytest.approx(math.log(0.5) + math.log(0.8), abs=1e-6)
    assert greedy is True
    lp, greedy = continuation_logprob(rows, [1, 2])
    assert lp == pytest.approx(math.log(0.25) + math.log(0.8), abs=1e-6)
    assert greedy is False


def test_fp16_logits_are_scored_in_fp32():
    rows = np.array([[10.0, 0.0, -10.0]], dtype=np.float16)
    lp, _ = continuation_logprob(rows, [2])
    assert lp == pytest.approx(-20.0 - math.log(1 + math.exp(-10) + math.exp(-20)), abs=1e-3)


def test_row_count_must_match_targets():
    with pytest.raises(ValueError):
        continuation_logprob(np.zeros((2, 3)), [1])


def poison_token(pkg, token_id: int) -> None:
    """Set one row of the package's token-embedding table to NaN, in place in its external data."""
    import onnx

    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    table = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    info = {e.key: e.value for e in table.external_data}
    assert table.data_type == onnx.TensorProto.FLOAT and info["location"] == "model.onnx.data"
    row = table.dims[1] * 4
    with open(pkg / info["location"], "r+b") as f:
        f.seek(int(info.get("offset", 0)) + token_id * row)
        f.write(np.full(table.dims[1], np.nan, np.float32).tobytes())


THE = 353  # " the" in the tiny tokenizer
GOOD = [("one two three four five six", " seven"), ("paris berlin rome madrid", " france")]
POISONED = ("Answer the", " number")  # the shortest input: scored last, after both good ones


def test_non_finite_is_an_error_naming_the_request(tiny_pkg, copy_pkg, tmp_path):
    """A real NaN (one embedding row) through the engine, the store and the CLI.

    The engine must refuse the request whose input holds the token, name it,
    and record nothing for it; the requests scored before it keep their right
    scores in the store.
    """
    from click.testing import CliRunner
    from lm_eval.api.instance import Instance

    from ortevals.cli import cli
    from ortevals.integrations.lm import ModelArgs, OrtLM
    from tests.test_badinputs import assert_error_after_data

    pkg = copy_pkg(tiny_pkg)
    poison_token(pkg, THE)
    store = str(tmp_path / "store.sqlite")
    args = ModelArgs(pkg=str(pkg), batch_size=1, store=store)
    lm = OrtLM.from_package(args)
    assert THE in lm.tok_encode(POISONED[0]) and not any(THE in lm.tok_encode(c + x) for c, x in GOOD)
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate([*GOOD, POISONED])]
    with pytest.raises(OrtEvalsError, match=r"^non-finite log-likelihood \(nan\) for loglikelihood request "
                                            r"'Answer the number'; .* No score was recorded for it$"):
        lm.loglikelihood(reqs, disable_tqdm=True)
    clean = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), batch_size=1))
    want = clean.loglikelihood(reqs[:2], disable_tqdm=True)
    reopened = OrtLM.from_package(args).store  # what a rerun would find
    assert reopened.get("loglikelihood", list(POISONED)) is None
    for r, (lp, greedy) in zip(GOOD, want):
        stored = reopened.get("loglikelihood", list(r))
        assert stored is not None and stored[0] == pytest.approx(lp, abs=1e-5) and bool(stored[1]) == greedy
    # the CLI: an MMLU-Pro prompt holds " the": exit 2, one line naming the request, no traceback
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(pkg), "--data", "bundled", "--limit", "1",
                                      "--no-resume", "--truncate", "left"], catch_exceptions=False)
    assert_error_after_data(result, "non-finite log-likelihood (nan) for loglikelihood request '", "No score")
    assert check_finite(-1.5, "x") == -1.5


def test_input_window_truncates_left_like_hf():
    assert input_window((1, 2, 3), (4, 5), max_length=10) == (1, 2, 3, 4)
    # ctx+cont = 1..5, keep the last max_length+1 = 4 then drop the last
    assert input_window((1, 2, 3), (4, 5), max_length=3) == (2, 3, 4)
    with pytest.raises(OrtEvalsError):
        input_window((1,), (2, 3, 4), max_length=2)
