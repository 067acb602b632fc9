"""``ortevals compare`` by prompt length (issue 51 item 1) and the drift of generation runs (item 3).

Hand-made runs whose numbers are written out here with numpy and scipy: each bucket's accuracies, paired Δ
(CR1 by category, t(G−1), from five categories; per question, t(n−1), below) and choice-KL (t(n−1)); the
verdict; prompt lengths in tokens equal transformers' tokenizer (--tokenizer, or the runs' own; another model's
refused); generated lengths, the share at max_gen_toks, loops (against a brute-force search), extraction
failures, the ratio of mean lengths (scipy's paired bootstrap) and accuracy by length.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.report.drift import has_loop
from ortevals.report.lengths import format_lines
from tests.test_compare import loglik, record, write_lm_eval_run, write_ortevals_run

# eight questions: prompts of 10, 30, 60 and 120 characters (two each), two categories in every bucket
PROMPTS = ["p" * 9 + "?", "q" * 9 + "?", "r" * 29 + "?", "s" * 29 + "?", "t" * 59 + "?", "u" * 59 + "?",
           "v" * 119 + "?", "w" * 119 + "?"]
CATS = ["math", "law"] * 4
REF = "AAAABAAC"
RUN = "BACAAABB"
MARGINS = [1.0, 2.0, 0.5, 1.5, 1.0, 3.0, 0.2, 1.0]


def runs(tmp_path):
    def recs(answers, margins):
        return [record(i, loglik(a, m), category=c, prompt=p)
                for i, (a, m, c, p) in enumerate(zip(answers, margins, CATS, PROMPTS))]

    ref = write_ortevals_run(tmp_path / "ref", recs(REF, [1.0] * 8))
    run = write_lm_eval_run(tmp_path / "run", recs(RUN, MARGINS))
    return ref, run


def compare_json(tmp_path, *args) -> dict:
    out = tmp_path / "c.json"
    result = CliRunner().invoke(cli, ["compare", *args, "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (rec,) = json.loads(out.read_text())
    return rec, result.output


def choice_kl_by_hand(ref_answers, run_answers) -> np.ndarray:
    def probs(answer, margin):
        x = np.array(loglik(answer, margin))
        return np.exp(x - x.max()) / np.exp(x - x.max()).sum()

    return np.array([(probs(a, 1.0) * np.log(probs(a, 1.0) / probs(b, m))).sum()
                     for a, b, m in zip(ref_answers, run_answers, MARGINS)])


def test_buckets_by_prompt_length_by_hand(tmp_path):
    from scipy.stats import t

    ref, run = runs(tmp_path)
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run), "--by-length", "--length-buckets", "20,100",
                            "--kl-threshold", "0.24")
    bl = rec["by_length"]
    assert bl["unit"] == "characters" and [(b["low"], b["high"], b["n"]) for b in bl["buckets"]] == \
        [(0, 20, 2), (20, 100, 4), (100, 121, 2)]  # the last: to one past the longest
    ref_ok = np.array([a == "A" for a in REF], float)
    run_ok = np.array([a == "A" for a in RUN], float)
    kl = choice_kl_by_hand(REF, RUN)
    for b, m in zip(bl["buckets"], (slice(0, 2), slice(2, 6), slice(6, 8))):
        assert b["ref_accuracy"] == ref_ok[m].mean() and b["accuracy"] == run_ok[m].mean()
        d = run_ok[m] - ref_ok[m]  # two categories only: per question, t(n − 1) (not CR1 on one df)
        se, q = d.std(ddof=1) / math.sqrt(len(d)), t.ppf(0.975, len(d) - 1)
        assert b["delta"]["mean"] == pytest.approx(d.mean()) and b["delta"]["se"] == pytest.approx(se, abs=1e-12)
        assert b["delta"]["ci95"] == pytest.approx([d.mean() - q * se, d.mean() + q * se]) and b["delta_clusters"] == 0
        k = kl[m]
        half = t.ppf(0.975, len(k) - 1) * k.std(ddof=1) / math.sqrt(len(k))
        assert b["kl"]["mean"] == pytest.approx(k.mean(), abs=1e-12)
        assert b["kl"]["ci95"] == pytest.approx([k.mean() - half, k.mean() + half], abs=1e-12)
    assert [b["kl"]["mean"] > 0.24 for b in bl["buckets"]] == [False, True, True]  # 0.239, 0.246, 0.254
    assert bl["verdict"].startswith("choice-KL first exceeds 0.24 nats at prompts of 20-99 characters: 0.2458 ")
    assert "by prompt length (characters" in out and bl["verdict"] in out


def test_bucket_delta_clusters_only_on_enough_categories():
    from scipy.stats import t

    from ortevals.report.lengths import breakdown

    # bucket [0, 10): 8 questions in 2 categories, one correct->wrong flip in each: every category's mean Δ is the
    # overall mean, so CR1 by category gives SE 0 (a zero-width interval) though two of eight answers flipped
    ref0, run0 = np.ones(8), np.array([0, 1, 1, 1, 0, 1, 1, 1], float)
    cats0 = ["math"] * 4 + ["law"] * 4
    # bucket [10, 20): 10 questions in 5 categories: clustered, CR1 with t(4)
    ref1, run1 = np.array([1, 1, 0, 1, 1, 0, 1, 1, 0, 1], float), np.array([0, 1, 1, 1, 0, 0, 1, 1, 1, 0], float)
    cats1 = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    lengths = np.array([5] * 8 + [15] * 10)
    lb = breakdown(lengths, np.concatenate([ref0, ref1]), np.concatenate([run0, run1]), cats0 + cats1, None,
                   (0, 10, 20), "characters")
    few, many = lb.buckets
    d = run0 - ref0
    se = d.std(ddof=1) / np.sqrt(8)
    assert few.clusters == 0 and se > 0 and few.delta.se == pytest.approx(se)
    assert (few.delta.low, few.delta.high) == pytest.approx((d.mean() - t.ppf(0.975, 7) * se,
                                                             d.mean() + t.ppf(0.975, 7) * se))
    d, g = run1 - ref1, np.array(cats1)
    sums = np.array([(d[g == c] - d.mean()).sum() for c in "abcde"])
    se = np.sqrt(5 / 4 * (sums**2).sum() / len(d) ** 2)
    assert many.clusters == 5 and many.delta.se == pytest.approx(se)
    assert (many.delta.low, many.delta.high) == pytest.approx((d.mean() - t.ppf(0.975, 4) * se,
                                                               d.mean() + t.ppf(0.975, 4) * se))
    lines = format_lines(lb)
    assert "(per question: 2 categories)" in lines[1] and "(clustered by 5 categories)" in lines[2]


def test_prompt_lengths_in_tokens_equal_transformers(tiny, tmp_path):
    from transformers import AutoTokenizer

    ref, run = runs(tmp_path)
    rec, _ = compare_json(tmp_path, "--ref", str(ref), str(run), "--by-length", "--tokenizer", str(tiny[1]),
                          "--length-buckets", "1000")
    tok = AutoTokenizer.from_pretrained(tiny[0])
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    (b,) = rec["by_length"]["buckets"]
    assert rec["by_length"]["unit"] == "tokens" and b["low"] == 0 and b["high"] == max(lengths) + 1 and b["n"] == 8


@pytest.mark.parametrize("args,message", [
    (["--length-buckets", "20"], "--length-buckets needs --by-length"),
    (["--kl-threshold", "0.1"], "--kl-threshold needs --by-length"),
    (["--by-length", "--length-buckets", "20,10"], "--length-buckets 20,10: expected increasing positive lengths"),
    (["--by-length", "--kl-threshold", "-1"], "--kl-threshold -1: expected a finite KL divergence >= 0"),
    (["--by-length", "--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: expected a tokenizer.json"),
])
def test_bad_length_options_are_one_line(tmp_path, args, message):
    ref, run = runs(tmp_path)
    result = CliRunner().invoke(cli, ["compare", "--ref", str(ref), str(run), *args])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


# ---------------------------------------------------------------- drift of generation runs

def loops_by_brute_force(u: list, block: int = 4, copies: int = 3) -> bool:
    """Every start i and block length k >= block: u[i:i+k] == u[i+k:i+2k] == … (copies of them)."""
    n = len(u)
    return any(all(u[i + c * k:i + (c + 1) * k] == u[i:i + k] for c in range(1, copies))
               for k in range(block, n // copies + 1) for i in range(n - copies * k + 1))


def test_loops_equal_a_brute_force_search():
    rng = np.random.default_rng(0)
    cases = [[1, 2, 3, 4] * 3, [1, 2, 3, 4] * 2 + [1, 2, 3], [7] * 12, [7] * 11, [5, 1, 2, 3, 4, 5] * 3,
             list(range(20)), [1, 2, 3] * 6]
    for _ in range(300):  # random texts over a small alphabet, some with a planted repeat
        u = rng.integers(0, 3, rng.integers(5, 40)).tolist()
        if rng.random() < 0.3:
            k, at = int(rng.integers(3, 7)), int(rng.integers(0, len(u)))
            u = u[:at] + u[at:at + k] * int(rng.integers(2, 4)) + u[at:]
        cases.append(u)
    found = [has_loop(np.array(u)) for u in cases]
    assert found == [loops_by_brute_force(u) for u in cases]
    assert found[:7] == [True, False, True, False, True, False, True] and 20 < sum(found[7:]) < 280


def gen(i: int, outputs: list[str], answers: list, correct: float, tokens: list[int] | None, limit: int = 8) -> dict:
    rec = {"doc_id": i, "doc": {"category": "x"}, "target": "A",
           "arguments": [["Q?", {"until": ["\n\n"], "max_gen_toks": limit}]], "resps": [outputs],
           "filtered_resps": answers, "filter": "custom-extract", "metrics": ["exact_match"],
           "exact_match": correct, "doc_hash": f"d{i}", "prompt_hash": "p"}
    if tokens is not None:
        rec["sample_tokens"] = tokens
    return rec


LOOP = "the answer is the answer is the answer is"  # a block of 3 words: not a loop (block >= 4)
LOOP4 = "so we add one so we add one so we add one"  # a block of 4 words three times: a loop


def test_drift_of_generation_runs_by_hand(tmp_path):
    from scipy.stats import bootstrap

    ref_out = [["a b c", "a b"], ["a b c d", "x"], [LOOP, "y z"], ["one two", "three"]]
    run_out = [["a b c d e", "a b"], [LOOP4, "x y"], ["p q r s t u", "y z"], ["one two three", "w"]]
    ref_tok = [[3, 2], [4, 1], [8, 2], [2, 1]]
    run_tok = [[5, 2], [8, 2], [8, 2], [3, 1]]
    ref_ans = [["A", "A"], ["B", "[invalid]"], ["A", "A"], ["C", "C"]]
    run_ans = [["A", None], ["[invalid]", "B"], ["A", ""], ["C", "C"]]
    ref = write_ortevals_run(tmp_path / "ref", [gen(i, o, a, float(a[0] == "A"), t) for i, (o, a, t) in
                                                enumerate(zip(ref_out, ref_ans, ref_tok))], task="cot")
    run = write_ortevals_run(tmp_path / "run", [gen(i, o, a, float(a[0] == "A"), t) for i, (o, a, t) in
                                               enumerate(zip(run_out, run_ans, run_tok))], task="cot")
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run))
    d = rec["drift"]
    assert d["unit"] == "tokens" and d["counted_by"] == "the runs"
    flat_ref, flat_run = np.concatenate(ref_tok), np.concatenate(run_tok)
    assert d["length"]["mean"] == flat_run.mean() and d["ref_length"]["mean"] == flat_ref.mean()
    assert d["length"]["median"] == np.median(flat_run) and d["length"]["p95"] == np.percentile(flat_run, 95)
    assert d["hit_limit"] == 2 / 8 and d["ref_hit_limit"] == 1 / 8  # max_gen_toks 8
    assert d["loops"] == 1 / 8 and d["ref_loops"] == 0 and d["loop_unit"] == "words"
    assert d["extraction_failures"] == 3 / 8 and d["ref_extraction_failures"] == 1 / 8
    q_ref, q_run = np.array([np.mean(x) for x in ref_tok]), np.array([np.mean(x) for x in run_tok])
    ci = bootstrap((q_ref, q_run), lambda a, b, axis=-1: b.mean(axis=axis) / a.mean(axis=axis), paired=True,
                   vectorized=True, n_resamples=2000, confidence_level=0.95, method="percentile",
                   rng=np.random.default_rng(0)).confidence_interval
    assert d["ratio"]["mean"] == pytest.approx(q_run.mean() / q_ref.mean())
    assert d["ratio"]["ci95"] == pytest.approx([ci.low, ci.high])
    # accuracy by the first output's length: quartiles of [3, 4, 8, 2] + [5, 8, 8, 3] pooled
    cuts = np.quantile([3, 4, 8, 2, 5, 8, 8, 3], [0.25, 0.5, 0.75])
    assert [b["high"] for b in d["by_length"]][:-1] == pytest.approx(list(np.unique(cuts)))
    run_first, run_ok = np.array([5, 8, 8, 3]), np.array([1, 0, 1, 0])
    for b in d["by_length"]:
        m = (run_first > (b["low"] if b["low"] is not None else -np.inf)) & \
            (run_first <= (b["high"] if b["high"] is not None else np.inf))
        assert b["n"] == m.sum() and (b["n"] == 0 or b["accuracy"] == run_ok[m].mean())
    assert "generated length (tokens, counted by the runs)" in out and "hit max_gen_toks 25.0% (ref 12.5%)" in out


def test_drift_without_token_counts_is_in_characters(tmp_path):
    ref = write_ortevals_run(tmp_path / "ref", [gen(0, ["abc"], ["A"], 1, None), gen(1, ["abcdef"], ["B"], 0, None)],
                             task="cot")
    run = write_ortevals_run(tmp_path / "run", [gen(0, ["abcd"], ["A"], 1, None), gen(1, ["ab"], ["B"], 0, None)],
                             task="cot")
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run))
    d = rec["drift"]
    assert d["unit"] == "characters" and d["length"]["mean"] == 3 and d["ref_length"]["mean"] == 4.5
    assert d["hit_limit"] is None and "pass --tokenizer" in out


# ---------------------------------------------------------------- whose tokens count a length

def named_run(folder, records, pkg, task="cot"):
    """A run whose results.json names the package it scored, as ortevals writes it (report/model_info.py)."""
    write_ortevals_run(folder, records, task=task)
    config = {"model": "ortevals", "model_path": str(pkg), "model_type": "llama"} if pkg else {}
    (folder / "results.json").write_text(json.dumps({"results": {task: {}}, "config": config}))
    return folder


def test_drift_uses_the_runs_own_token_counts_even_with_tokenizer(tiny, tmp_path):
    # every output stopped at max_gen_toks (8 tokens by the runs' counts); the text re-tokenizes to fewer
    outs = ["so the answer", "is A, since"]
    ref = named_run(tmp_path / "ref", [gen(i, [o], ["A"], 1, [8]) for i, o in enumerate(outs)], tiny[1])
    run = named_run(tmp_path / "run", [gen(i, [o], ["A"], 1, [8]) for i, o in enumerate(outs)], tiny[1])
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run), "--tokenizer", str(tiny[1]))
    d = rec["drift"]
    assert d["counted_by"] == "the runs" and d["length"]["mean"] == 8 and d["ref_length"]["mean"] == 8
    assert d["hit_limit"] == 1.0 and d["ref_hit_limit"] == 1.0 and "hit max_gen_toks 100.0% (ref 100.0%)" in out
    assert d["loop_unit"] == "tokens"  # loops still look at --tokenizer's tokens


def other_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_tokenizer_of_another_model_is_refused(tiny, tmp_path):
    recs = [record(i, loglik(a), category=c, prompt=p) for i, (a, c, p) in enumerate(zip(REF, CATS, PROMPTS))]
    ref = named_run(tmp_path / "ref", recs, tiny[1], task="mmlu")
    run = named_run(tmp_path / "run", recs, tiny[1], task="mmlu")
    args = ["compare", "--ref", str(ref), str(run), "--by-length", "--tokenizer"]
    result = CliRunner().invoke(cli, [*args, str(other_tokenizer(tmp_path / "other.json"))])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "other.json: not the tokenizer of the compared runs' models" in lines[0]
    assert str(tiny[1] / "tokenizer.json") in lines[0]
    same = tmp_path / "reformatted.json"  # the package's tokenizer, formatted otherwise: the same tokens
    same.write_text(json.dumps(json.loads((tiny[1] / "tokenizer.json").read_text()), indent=4))
    assert CliRunner().invoke(cli, [*args, str(same)]).exit_code == 0


def test_lengths_default_to_the_runs_tokenizer(tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])

    def n_tokens(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    outs = [["so the answer is A", "A"], ["hmm, B or C? C."]]
    ref = named_run(tmp_path / "ref", [gen(i, o, ["A"] * len(o), 1, None) for i, o in enumerate(outs)], tiny[1])
    run = named_run(tmp_path / "run", [gen(i, o[::-1], ["A"] * len(o), 1, None) for i, o in enumerate(outs)],
                    tiny[1])
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run))
    d = rec["drift"]
    assert d["unit"] == "tokens" and d["counted_by"] == "the runs' tokenizer" and d["loop_unit"] == "tokens"
    assert d["ref_length"]["mean"] == pytest.approx(np.mean([n_tokens(o) for x in outs for o in x]))
    assert d["hit_limit"] is None and "hit max_gen_toks: n/a (the runs kept no token counts" in out
    # prompt lengths too: the same package named by both runs
    recs = [record(i, loglik(a), category=c, prompt=p) for i, (a, c, p) in enumerate(zip(REF, CATS, PROMPTS))]
    ref = named_run(tmp_path / "cref", recs, tiny[1], task="mmlu")
    run = named_run(tmp_path / "crun", recs, tiny[1], task="mmlu")
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run), "--by-length", "--length-buckets", "1000")
    (b,) = rec["by_length"]["buckets"]
    assert rec["by_length"]["counted_by"] == f"tokens of the runs' tokenizer {tiny[1] / 'tokenizer.json'}"
    assert b["high"] == max(n_tokens(p) for p in PROMPTS) + 1 and "by prompt length (tokens of the runs'" in out
    # a run naming no package (or another one): characters, and the report says so
    run = named_run(tmp_path / "crun", recs, None, task="mmlu")
    rec, out = compare_json(tmp_path, "--ref", str(ref), str(run), "--by-length", "--length-buckets", "1000")
    assert rec["by_length"]["counted_by"] == "characters" and rec["by_length"]["buckets"][0]["high"] == 121


def test_a_one_sample_generation_run_keeps_its_own_token_counts(tiny, tmp_path):
    """A greedy --cot run's samples file records each output's own token count (``sample_tokens``, as a
    --samples run's does), so compare's drift counts by the run (hit max_gen_toks is not n/a): the counts equal
    transformers' greedy generation on the same weights, from the same prompt ids (left-truncated to the
    1024-token context less max_gen_toks, as lm-eval's hf backend cuts them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny[1]), "--data", "bundled", "--limit", "3", "--cot",
                                      "--max-gen-toks", "6", "--model-args", "truncate=left", "--output", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for f in out.glob("samples_*.jsonl") for line in f.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny[0])
    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    compared = 0
    for r in records:
        ids = tok(r["arguments"][0][0], return_tensors="pt", add_special_tokens=False).input_ids[:, -(1024 - 6):]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2)
        new = new[0, ids.shape[1]:]
        new = [t for t in new.tolist() if t != 2]
        if tok.decode(new) == r["resps"][0][0]:  # not cut by a stop sequence: the count is the tokens generated
            assert r["sample_tokens"] == [len(new)], (r["sample_tokens"], new)
            compared += 1
    assert compared >= 1
