"""MBR selection (engine/generate/search/mbr.py) on hand-made candidate sets."""

import pytest
from sacrebleu.metrics import CHRF

from ortevals.engine.generate.search.mbr import mbr_select, utility_matrix
from ortevals.errors import OrtEvalsError


def test_exact_majority_wins_and_ties_go_first():
    # A agrees with 2 of the 4 others: 0.5; B and C agree with none: 0
    got = mbr_select(["A", "B", "A", "C", "A"], "exact")
    assert got.index == 0 and got.expected == (0.5, 0.0, 0.5, 0.0, 0.5)
    assert mbr_select(["B", "A", "A", "B"], "exact").index == 0  # B and A tie at 1/3: the earlier
    assert mbr_select(["only"], "exact").index == 0


def test_rouge_by_hand():
    """rougeL F1 = 2PR/(P+R), P = LCS/len(hyp), R = LCS/len(ref), by hand:
    u(0,1): LCS(a b c d, a b c)=3, P 3/4 R 1 -> 6/7;  u(0,2): LCS(a b c d, a b x d)=3 -> 3/4;  u(0,3)=0
    u(1,0)=6/7;  u(1,2): LCS(a b c, a b x d)=2, P 2/3 R 1/2 -> 4/7;  u(2,0)=3/4;  u(2,1)=4/7.
    E = ((6/7+3/4)/3, (6/7+4/7)/3, (3/4+4/7)/3, 0) = (.5357, .4762, .4405, 0): candidate 0."""
    got = mbr_select(["a b c d", "a b c", "a b x d", "q r s"], "rouge")
    assert got.index == 0
    assert got.expected == pytest.approx([(6 / 7 + 3 / 4) / 3, (6 / 7 + 4 / 7) / 3, (3 / 4 + 4 / 7) / 3, 0.0])


def test_chrf_matches_sacrebleu_and_picks_the_consensus():
    cands = ["a dog ran far away", "the cat sat on the mat", "the cat sat on a mat", "the cat sat on the mat."]
    chrf = CHRF()
    want = [sum(chrf.sentence_score(c, [r]).score / 100 for r in cands if r is not c) / 3 for c in cands]
    got = mbr_select(cands, "chrf")
    assert got.expected == pytest.approx(want)
    assert got.index == max(range(4), key=lambda i: want[i]) == 3  # the variant with "." recalls the most
    assert min(range(4), key=lambda i: got.expected[i]) == 0  # the outlier scores lowest
    # a duplicated candidate has one perfect match (chrF 1) where the others have none: it wins,
    # and of the two equal copies the earlier one
    dup = mbr_select(["x y z", "the cat sat", "the cat sat", "the dog sat"], "chrf")
    assert dup.index == 1 and dup.expected[1] == dup.expected[2] > dup.expected[3]
    m = utility_matrix(cands, "chrf")
    assert m[1, 3] != m[3, 1]  # chrF is asymmetric: hypothesis vs reference roles are kept


def test_bad_metric_and_empty_set():
    with pytest.raises(OrtEvalsError, match="mbr_metric"):
        mbr_select(["a", "b"], "bleu")
    with pytest.raises(OrtEvalsError, match="candidate"):
        mbr_select([], "exact")
