"""Scoring math on hand-made logits."""

import math

import numpy as np
import pytest

from ortevals.errors import OrtEvalsError
from ortevals.scoring import check_finite, continuation_logprob, input_window, log_softmax


def test_log_softmax_matches_definition():
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    expected = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_softmax(x), expected, atol=1e-6)
    assert log_softmax(np.array([[1000.0, 0.0]])).max() == 0.0  # no overflow


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


def test_non_finite_is_an_error_naming_the_request():
    with pytest.raises(OrtEvalsError, match="request 7"):
        check_finite(float("nan"), "request 7")
    assert check_finite(-1.5, "x") == -1.5


def test_input_window_truncates_left_like_hf():
    assert input_window((1, 2, 3), (4, 5), max_length=10) == (1, 2, 3, 4)
    # ctx+cont = 1..5, keep the last max_length+1 = 4 then drop the last
    assert input_window((1, 2, 3), (4, 5), max_length=3) == (2, 3, 4)
    with pytest.raises(OrtEvalsError):
        input_window((1,), (2, 3, 4), max_length=2)
