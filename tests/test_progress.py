"""Whole-benchmark plumbing: tokenizing in batches (the same ids as one text at a time, the same pairs as
lm-eval's own tokenizing), the progress bar's questions and work-weighted ETA, the common-prefix helper."""

from __future__ import annotations

import random
import re

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM

from ortevals.integrations.lm import ENCODE_AHEAD, ModelArgs, OrtLM
from ortevals.package.loader import ModelPackage
from ortevals.package.tokenizer import Tokenizer
from ortevals.run.progress import PASS_TOKENS, Progress, request_work
from ortevals.tokens import common_prefix

TEXTS = ["Question: one two three. Answer: B", "", " leading space", "<s> starts with BOS", "<s>", "trailing \n\n",
         "Paris france berlin germany rome italy " * 30, "naïve café — ünïcödé 数字 123 4567", "A"]


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_encode_many_equals_encode_one_at_a_time(tiny_pkg, add_bos_token):
    """Tokenizer.encode_many: the ids :meth:`Tokenizer.encode` gives each text, for every BOS rule (the tiny
    tokenizer adds BOS itself; a text starting with it gets none added; add_bos_token forces it on or off)."""
    tok = Tokenizer.load(ModelPackage.load(tiny_pkg), add_bos_token=add_bos_token)
    for flag in (None, True, False):
        assert tok.encode_many(TEXTS, flag) == [tok.encode(t, flag) for t in TEXTS]
    assert tok.encode_many(TEXTS)[0][0] == (tok.special.bos_id if add_bos_token is not False else
                                            tok.encode(TEXTS[0], False)[0])


def test_encode_many_on_every_core_keeps_the_order(tiny_pkg, monkeypatch):
    """Many texts are encoded in one slice a core, on threads: the ids of each text, in order, whatever the
    number of cores (7 uneven slices here, and with the library's own thread pool off, as lm-eval's CLI sets)."""
    import threading

    import ortevals.package.tokenizer as tokenizer

    class Recorded:  # the library's tokenizer, its batch calls recorded: (texts, thread)
        def __init__(self, backend):
            self.backend, self.calls = backend, []

        def encode_batch_fast(self, texts, add_special_tokens):
            self.calls.append((len(texts), threading.current_thread().name))
            return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

        def __getattr__(self, name):
            return getattr(self.backend, name)

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(tokenizer, "_cores", lambda: 7)
    tokenizer._pool.cache_clear()
    tok = Tokenizer.load(ModelPackage.load(tiny_pkg))
    texts = [f"{i}: {TEXTS[i % len(TEXTS)]}" for i in range(500)]  # one BOS rule for all: one set of slices
    expected = [tok.encode(t) for t in texts]
    tok.backend = recorded = Recorded(tok.backend)
    try:
        assert tok.encode_many(texts) == expected
    finally:
        tokenizer._pool.cache_clear()
    assert sorted(n for n, _ in recorded.calls) == [71, 71, 71, 71, 72, 72, 72]
    assert len({name for _, name in recorded.calls}) > 1


def _lm_eval_pairs(lm, args):
    """What lm-eval's own TemplateLM.loglikelihood hands _loglikelihood_tokens."""
    seen = []
    lm._loglikelihood_tokens, saved = (lambda reqs, **k: seen.extend(reqs) or [(0.0, False)] * len(reqs)), \
        lm._loglikelihood_tokens
    try:
        TemplateLM.loglikelihood(lm, [Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)], True)
    finally:
        lm._loglikelihood_tokens = saved
    return seen


def test_pairs_equal_lm_evals_tokenizing_and_share_contexts(tiny_pkg):
    """OrtLM._pairs (texts encoded ahead in batches, chunks of ENCODE_AHEAD requests) gives exactly the
    (args, context ids, continuation ids) lm-eval's TemplateLM.loglikelihood builds: empty contexts (the
    prefix token), trailing spaces moved into the continuation, a context starting with BOS, multi-token
    continuations, contexts that span a chunk's end; requests with one (non-empty) context hold one tuple of its
    ids."""
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=128, batch_size=1))
    rng = random.Random(0)
    words = "paris france berlin one two three answer question the of river".split()
    args = [("", "The river of the city"), ("Nine ten ", "eleven twelve"), ("<s> Question: x", " A"),
            ("", "<s> paris")]
    for _ in range(2 * ENCODE_AHEAD // 4):
        context = "Question: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) + \
                  rng.choice(["\nAnswer:", "\nAnswer: ", " "])
        args += [(context, f" {c}") for c in "ABCDEFG"[: rng.randint(2, 7)]] + [(context, " france paris")]
    ref = _lm_eval_pairs(lm, args)
    ours = lm._pairs(args)
    assert len(args) > 2 * ENCODE_AHEAD
    assert [(a, list(c), list(x)) for a, c, x in ours] == [(a, list(c), list(x)) for a, c, x in ref]
    by_context: dict[str, set] = {}
    for (context, _), ids, _ in ours:
        if context:  # an empty context's ids are the continuation's first token or the prefix token
            by_context.setdefault(context, set()).add(id(ids))
    assert all(len(v) == 1 for v in by_context.values())


def test_request_work_counts_new_tokens_once_per_input():
    """Hand-computed: inputs sorted, each costs its tokens beyond the longest prefix shared with the one
    before it, plus PASS_TOKENS, split among the requests with that input."""
    header = tuple(range(100))
    a, b, c = header + (7, 8, 9), header + (7, 5), header + (1,) * 40
    inputs = [a, a, b, c, a]  # a: three requests, one input
    work = request_work(inputs)
    # sorted: c (…, 1, …), b (…, 7, 5), a (…, 7, 8, 9): c runs its 140 tokens, b 2 beyond the header, a 2 beyond
    # (…, 7) which b ran
    assert work == pytest.approx([(2 + PASS_TOKENS) / 3] * 2 + [2 + PASS_TOKENS, 140 + PASS_TOKENS,
                                                                  (2 + PASS_TOKENS) / 3])
    assert request_work([list(a), tuple(a)]) == pytest.approx([(103 + PASS_TOKENS) / 2] * 2)


def _shown(bar: Progress, elapsed: float) -> str:
    """The line the bar draws ``elapsed`` seconds after it started."""
    bar.bar.start_t = bar.bar._time() - elapsed
    return str(bar.bar)


def test_progress_counts_questions_and_its_eta_is_the_work_left_at_the_average_rate():
    """A question is done when its last request is; the percentage and the bar are the questions' (the count
    shown), and the ETA is elapsed × work left / work done (the average rate over work), whatever the order. The
    README's own run showed ``22%| 6/50 questions``: the percentage was the work's."""
    header = tuple(range(50))
    inputs = [header + (q,) * (10 + 300 * (q % 2)) for q in range(4) for _ in range(3)]
    units = [("task", q) for q in range(4) for _ in range(3)]
    bar = Progress(inputs, units)
    order = [3, 4, 5, 9, 0, 6, 10, 1, 7, 2, 8, 11]  # question 1 (a long one) first; then parts of 3, 0, 2
    work = request_work(inputs)
    total = sum(work)
    for k in range(1, len(order) + 1):
        bar.done(order[k - 1])
        finished = [q for q in range(4) if {3 * q, 3 * q + 1, 3 * q + 2} <= set(order[:k])]  # the oracle
        done = sum(work[i] for i in order[:k])
        line = _shown(bar, 600)  # as the bar would print it 10 minutes in
        shown = re.match(r"ortevals: +(\d+)%\|[^|]*\| (\d+)/(\d+) questions \[10:00<(\d\d):(\d\d)\]$", line)
        assert shown, line
        pct, n, of, minutes, seconds = map(int, shown.groups())
        assert (n, of) == (len(finished), 4) and pct == round(100 * len(finished) / 4), line
        eta = round(600 * (total - done) / done)
        assert abs(60 * minutes + seconds - eta) <= 1, (line, eta)
        if k == 3:  # question 1 done, 44% of the work: the old bar drew the work's percentage with 1/4
            assert line.startswith("ortevals:  25%|") and round(100 * done / total) == 44
    assert bar.done_units == 4
    bar.close()


def test_common_prefix_equals_the_plain_loop():
    def plain(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(1)
    for _ in range(3000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 80))]
        b = a[:rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 50))]
        for x, y in ((a, b), (b, a), (tuple(a), b), (tuple(a), tuple(b)), (range(len(a)), list(range(len(b))))):
            assert common_prefix(x, y) == plain(x, y)


def test_a_large_run_scores_in_parts_while_it_tokenizes_the_next(tiny_pkg, monkeypatch):
    """Past 2 x FIRST_PART requests, OrtLM tokenizes the next part while the run scores the one before (its
    tokenizing starts before that scoring ends), on one progress bar over all the questions; the scores are
    those of one part."""
    import threading

    import ortevals.integrations.lm as lm_module
    from ortevals.run import run as run_module

    rng = random.Random(1)
    words = "paris france berlin one two three answer question the of river".split()
    contexts = ["Question: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "\nAnswer:"
                for _ in range(12)]
    requests = [Instance("loglikelihood", {}, (c, f" {x}"), i, metadata=("t", q, 0))
                for i, (q, c, x) in enumerate((q, c, x) for q, c in enumerate(contexts) for x in "ABC")]
    whole = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=128, store="none"))
    expected = whole.loglikelihood(requests, disable_tqdm=True)
    monkeypatch.setattr(lm_module, "FIRST_PART", 4)  # parts of 4, then the other 32 requests
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=128, store="none"))
    events, bars = [], []
    real_pairs, real_score = lm._pairs, lm.run.score
    monkeypatch.setattr(lm, "_pairs", lambda args, *a: (events.append(("tokenize", len(args))), real_pairs(args))[1])

    def score(reqs, *a, **k):
        events.append(("score", len(reqs)))
        threading.Event().wait(0.3)  # time for the next part's tokenizing to start
        out = real_score(reqs, *a, **k)
        events.append(("scored", len(reqs)))
        bars.append(lm.run._progress)
        return out

    monkeypatch.setattr(lm.run, "score", score)
    made = []
    monkeypatch.setattr(run_module, "Progress", lambda *a, **k: made.append(k) or Progress(*a, **k))
    assert lm.loglikelihood(requests, disable_tqdm=True) == expected
    assert lm_module.waves(36) == [4, 36] and lm_module.waves(37) == [4, 20, 37]
    assert len(made) == 1 and made[0]["later"] == 32
    assert events.index(("tokenize", 32)) < events.index(("scored", 4))  # part 2 tokenized while part 1 scored
    assert bars[-1] is None  # the bar closed after the last part
