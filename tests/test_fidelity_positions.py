"""``ortevals fidelity --by-position`` (issue 51 item 1): the breakdown by context length.

Every position of every window is scored (the per-token numbers against a plain onnxruntime pass of each
whole window), each bucket's intervals equal the CR1 formula written out with numpy and scipy's t, the
growth equals scipy's one-sample t interval over windows, the verdict names the right bucket, the chunked
reduction equals the unchunked one, and the options are checked in one line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.fidelity import positions, trajectories, windows
from ortevals.fidelity.run import FidelityOptions, run_fidelity

CTX = 64


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from ortevals.fidelity.text import default_text

    f = tmp_path_factory.mktemp("pos") / "text.txt"
    f.write_text(default_text(max_chars=9000), encoding="utf-8")
    return f


@pytest.fixture(scope="module")
def int4_vs_fp32(tiny, tiny_int4, text_file, tmp_path_factory):
    ref_file = tmp_path_factory.mktemp("posref") / "ref.npz"
    opts = FidelityOptions(pkg=tiny_int4, ref=str(tiny[1]), text=text_file, ctx=CTX, tokens=6 * (CTX - 1),
                           by_position=True, buckets=(8, 32), kl_threshold=0.0, save_ref=ref_file)
    return run_fidelity(opts), ref_file


def cr1(x: np.ndarray, g: np.ndarray) -> tuple[float, float, float]:
    """Mean and its 95% interval, CR1 by hand: G/(G−1) · Σ_g (Σ_{i∈g} (x_i − x̄))² / N², t(G−1)."""
    from scipy.stats import t

    labels = np.unique(g)
    sums = np.array([(x[g == c] - x.mean()).sum() for c in labels])
    se = math.sqrt(len(labels) / (len(labels) - 1) * (sums**2).sum() / len(x) ** 2)
    half = t.ppf(0.975, len(labels) - 1) * se
    return x.mean(), x.mean() - half, x.mean() + half


def test_every_position_is_scored_as_a_plain_pass_of_the_window(tiny, tiny_int4, int4_vs_fp32):
    """The plan covers positions 0..62 of each window; log-probs of the actual tokens equal plain ORT passes."""
    from tests.test_fidelity import ort_session

    report, _ = int4_vs_fp32
    assert report.plan.every and report.summary["scored"] == "every position"
    assert report.summary["tokens"] == 6 * (CTX - 1) and report.summary["windows"] == 6
    ref_logits, cand_logits = ort_session(tiny[1]), ort_session(tiny_int4)
    lp_ref, lp_cand = [], []
    for w in range(6):
        ids = [1] + report.text_ids[w * (CTX - 1):(w + 1) * (CTX - 1)].tolist()  # BOS + 63 text tokens
        targets = np.array(ids[1:])
        lp_ref.append(log_softmax(ref_logits(ids), np.float64)[np.arange(CTX - 1), targets])
        lp_cand.append(log_softmax(cand_logits(ids), np.float64)[np.arange(CTX - 1), targets])
    np.testing.assert_allclose(report.stats.lp_ref, np.concatenate(lp_ref), atol=1e-5)
    np.testing.assert_allclose(report.stats.lp_cand, np.concatenate(lp_cand), atol=1e-5)
    assert report.plan.positions().tolist() == list(range(1, CTX)) * 6


def test_bucket_intervals_equal_cr1_by_hand(int4_vs_fp32):
    report, _ = int4_vs_fp32
    s, t = report.summary["by_position"], report.stats
    pos = np.tile(np.arange(1, CTX), 6)  # context lengths written out, not from the plan
    win = np.repeat(np.arange(6), CTX - 1)
    assert s["edges"] == [1, 8, 32, CTX]
    assert [(b["low"], b["high"], b["tokens"], b["windows"]) for b in s["buckets"]] == \
        [(1, 8, 42, 6), (8, 32, 144, 6), (32, 64, 192, 6)]
    for b in s["buckets"]:
        m = (pos >= b["low"]) & (pos < b["high"])
        for key, x in (("kl", t.kl), ("same_top1", t.same_top1.astype(float)), ("delta_logp", t.lp_cand - t.lp_ref)):
            mean, lo, hi = cr1(x[m], win[m])
            lo, hi = (max(lo, 0), min(hi, 1)) if key == "same_top1" else (lo, hi)  # a share's interval: in [0, 1]
            assert b[key]["mean"] == pytest.approx(mean, abs=1e-12)
            assert b[key]["ci95"] == pytest.approx([lo, hi], abs=1e-12)
    assert s["buckets"][0]["kl"]["mean"] > 0.001  # int4 against fp32: a loss to see


def test_growth_equals_scipys_one_sample_t_interval(int4_vs_fp32):
    from scipy.stats import ttest_1samp

    report, _ = int4_vs_fp32
    kl = report.stats.kl.reshape(6, CTX - 1)  # [window, position]: context length = index + 1
    d = kl[:, 31:].mean(axis=1) - kl[:, :7].mean(axis=1)  # contexts 32..63 minus 1..7, per window
    ci = ttest_1samp(d, 0.0).confidence_interval(0.95)
    g = report.summary["by_position"]["growth"]
    assert g["from"] == [1, 8] and g["to"] == [32, 64] and g["windows"] == 6
    assert g["mean"] == pytest.approx(d.mean(), abs=1e-12)
    assert g["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-12)


def test_a_shares_interval_stays_within_0_and_1():
    """Two windows, same top-1 in 19 of 20 tokens: t(1) makes the interval wider than the share's range."""
    same = np.array([1.0] * 10 + [1.0] * 9 + [0.0])
    (b,) = positions.by_position(np.zeros(20), same, np.zeros(20), np.repeat([0, 1], 10), np.arange(1, 21), (1, 21))
    _, lo, hi = cr1(same, np.repeat([0, 1], 10))
    assert hi > 1 and b["same_top1"]["ci95"] == [pytest.approx(lo), 1.0]


def test_the_verdict_names_the_first_bucket_over_the_threshold():
    def bucket(lo, hi, mean, low, high):
        return {"low": lo, "high": hi, "kl": {"mean": mean, "se": 0.0, "ci95": [low, high]}}

    buckets = [bucket(1, 128, 0.01, 0.005, 0.015), bucket(128, 512, 0.03, 0.01, 0.05),
               bucket(512, 1024, 0.06, 0.041, 0.08)]
    v = positions.verdict(buckets, 0.02)
    assert v["bucket"] == [128, 512] and not v["significant"]
    assert v["line"] == ("KL first exceeds 0.02 nats at context 128-511 tokens: 0.03 [0.01, 0.05] "
                         "(its 95% interval reaches below it)")
    v = positions.verdict(buckets, 0.04)
    assert v["bucket"] == [512, 1024] and v["significant"] and "the whole 95% interval above it" in v["line"]
    v = positions.verdict(buckets, 0.1)
    assert v["bucket"] is None
    assert v["line"] == "KL stays at or under 0.1 nats up to context 1023 tokens (highest: 0.06 at 512-1023)"


def test_chunked_reduction_equals_one_chunk(tiny, tiny_int4, text_file, monkeypatch):
    opts = FidelityOptions(pkg=tiny_int4, ref=str(tiny[1]), text=text_file, ctx=CTX, tokens=3 * (CTX - 1),
                           by_position=True)
    whole = run_fidelity(opts)
    monkeypatch.setattr(windows, "CHUNK_ROWS", 10)  # 63 rows a window: 7 chunks, the last of 3
    chunked = run_fidelity(opts)
    for f in ("kl", "lp_ref", "lp_cand", "overlap", "same_top1"):
        np.testing.assert_array_equal(getattr(chunked.stats, f), getattr(whole.stats, f))


def test_a_saved_reference_keeps_every_position(tiny_int4, int4_vs_fp32):
    direct, ref_file = int4_vs_fp32
    reused = run_fidelity(FidelityOptions(pkg=tiny_int4, ref=str(ref_file), by_position=True, buckets=(8, 32)))
    np.testing.assert_allclose(reused.stats.kl, direct.stats.kl, rtol=1e-5, atol=1e-9)  # float32 file
    assert reused.summary["by_position"]["edges"] == direct.summary["by_position"]["edges"]
    with pytest.raises(OrtEvalsError, match="saved with --by-position; pass --by-position"):
        run_fidelity(FidelityOptions(pkg=tiny_int4, ref=str(ref_file)))


@pytest.mark.parametrize("args,message", [
    (["--buckets", "8,32"], "--buckets needs --by-position"),
    (["--kl-threshold", "0.1"], "--kl-threshold needs --by-position"),
    (["--by-position", "--buckets", "32,8"], "--buckets 32,8: expected increasing context lengths between 2 and 63"),
    (["--by-position", "--buckets", "8,x"], "--buckets 8,x: expected comma-separated context lengths"),
    (["--by-position", "--buckets", "8,64"], "between 2 and 63"),
    (["--by-position", "--kl-threshold", "nan"], "--kl-threshold nan: expected a finite KL divergence >= 0"),
])
def test_bad_position_options_are_one_line(tiny, text_file, args, message):
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny[1]), "--ref", str(tiny[1]), "--text",
                                      str(text_file), "--ctx", str(CTX), "--tokens", "200", *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_the_command_prints_the_table_and_writes_json_and_plot(tiny, tiny_int4, text_file, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "p.png"
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny_int4), "--ref", str(tiny[1]), "--text",
                                      str(text_file), "--ctx", str(CTX), "--tokens", str(4 * (CTX - 1)),
                                      "--by-position", "--buckets", "16", "--kl-threshold", "0.01", "--json",
                                      str(out), "--plot", str(png)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "By context length" in result.output and "KL first exceeds 0.01 nats at context 1-15" in result.output
    s = json.loads(out.read_text())
    assert [b["low"] for b in s["by_position"]["buckets"]] == [1, 16] and s["by_position"]["verdict"]["bucket"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- --trajectories (issue 51 item 3)

def question(i: int) -> str:
    return f"Question {i}: the capital of france?\nAnswer:"


def generation_run(folder, outputs: list[str], prompts: list[str] | None = None, max_gen_toks: int | None = 64):
    folder.mkdir(parents=True, exist_ok=True)
    prompts = prompts or [question(i) for i in range(len(outputs))]
    kwargs = {"until": ["\n\n"]} | ({} if max_gen_toks is None else {"max_gen_toks": max_gen_toks})
    records = [{"doc_id": i, "doc": {}, "target": "A", "arguments": [[prompts[i], kwargs]],
                "resps": [[o]], "filtered_resps": ["A"], "filter": "none", "metrics": ["exact_match"],
                "exact_match": 1.0, "doc_hash": f"d{i}", "prompt_hash": f"p{i}"} for i, o in enumerate(outputs)]
    (folder / "results.json").write_text(json.dumps({"results": {"cot": {}}}))
    (folder / "samples_cot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_trajectories_follow_the_reference_outputs_as_plain_passes(tiny, tiny_int4, tmp_path):
    from transformers import AutoTokenizer

    from tests.test_fidelity import kl_full, ort_session

    outputs = ["The river of the city is a number one two three. " * 6, "Paris is the capital of france. " * 5,
               "Berlin rome madrid. " * 8]
    run = generation_run(tmp_path / "ref-run", outputs)
    report = run_fidelity(FidelityOptions(pkg=tiny_int4, ref=str(tiny[1]), trajectories=run, first=40,
                                          buckets=(8, 16), kl_threshold=0.0))
    tok = AutoTokenizer.from_pretrained(tiny[0])
    ref_logits, cand_logits = ort_session(tiny[1]), ort_session(tiny_int4)
    lp_ref, lp_cand, kl = [], [], []
    for i, text in enumerate(outputs):
        prompt = [1] + tok(question(i), add_special_tokens=False)["input_ids"]
        gen = tok(text, add_special_tokens=False)["input_ids"][:40]
        ids, rows = prompt + gen, np.arange(len(prompt) - 1, len(prompt) + len(gen) - 1)
        r, c = (log_softmax(f(ids), np.float64)[rows] for f in (ref_logits, cand_logits))
        lp_ref.append(r[np.arange(len(gen)), gen])
        lp_cand.append(c[np.arange(len(gen)), gen])
        kl.append(kl_full(r, c))
    np.testing.assert_allclose(report.stats.lp_ref, np.concatenate(lp_ref), atol=1e-5)
    np.testing.assert_allclose(report.stats.lp_cand, np.concatenate(lp_cand), atol=1e-5)
    assert (report.stats.kl <= np.concatenate(kl) + 1e-9).all()  # top-128 of 512 + tail: a lower bound
    s = report.summary
    assert s["windows"] == 3 and s["tokens"] == 120 and s["first"] == 40
    assert [(b["low"], b["high"], b["tokens"], b["windows"]) for b in s["by_position"]["buckets"]] == \
        [(1, 8, 21, 3), (8, 16, 24, 3), (16, 41, 75, 3)]
    assert s["by_position"]["verdict"]["line"].startswith("KL first exceeds 0 nats at generated tokens 1-7: ")
    text = "\n".join(trajectories.format_lines(s))
    assert "By generated token" in text and "clustered by question" in text


@pytest.mark.parametrize("extra,message", [
    (["--ctx", "64"], "--trajectories follows the reference run's outputs: --ctx does not apply"),
    (["--by-position"], "--by-position does not apply"),
])
def test_trajectory_options_are_one_line(tiny, tmp_path, extra, message):
    run = generation_run(tmp_path / "r", ["a b c"])
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny[1]), "--ref", str(tiny[1]), "--trajectories",
                                      str(run), *extra])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


def test_a_run_without_generations_is_one_line(tiny, tmp_path):
    from tests.test_compare import loglik, record, write_ortevals_run

    run = write_ortevals_run(tmp_path / "mc", [record(0, loglik("A"))])
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny[1]), "--ref", str(tiny[1]), "--trajectories",
                                      str(run)])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "no generation task in this run" in lines[0]


def test_trajectory_buckets_end_at_the_last_generated_token():
    """Default edges below --first only: with --first 64 the last bucket is 16-64, not a one-token 64-64."""
    from ortevals.fidelity.stats import TokenStats

    n = 64
    t = TokenStats(np.linspace(0, 1, 2 * n), np.ones(2 * n, bool), np.ones(2 * n), np.zeros(2 * n), np.zeros(2 * n))
    s = trajectories.trajectory_summary(t, np.repeat([0, 1], n), np.tile(np.arange(1, n + 1), 2), n, None, None)
    assert s["by_position"]["edges"] == [1, 16, 65]
    assert [(b["low"], b["high"], b["tokens"]) for b in s["by_position"]["buckets"]] == [(1, 16, 30), (16, 65, 98)]


# ---------------------------------------------------------------- --trajectories: the run's tokens (issue 55)

OUTPUTS = ["The river of the city is a number one two three. " * 6, "Paris is the capital of france. " * 5,
           "Berlin rome madrid. " * 8]


@pytest.fixture
def fed(monkeypatch):
    """The ids every model pass of ortevals' sources reads, in order."""
    seen, call = [], windows.OrtSource.__call__
    monkeypatch.setattr(windows.OrtSource, "__call__", lambda self, ids: (seen.append(list(ids)), call(self, ids))[1])
    return seen


def lm_eval_ids(tok, prompt: str) -> list[int]:
    """lm-eval's hf backend's rule, with transformers' tokenizer: no special tokens where the text starts
    with the BOS text (a chat template's), the tokenizer's own (BOS) otherwise."""
    return tok(prompt, add_special_tokens=not prompt.startswith(tok.bos_token))["input_ids"]


def test_a_prompt_starting_with_the_bos_text_is_fed_once_with_bos(tiny, tmp_path, fed):
    """A chat-template run: the prompt's text starts with <s>. Both models read the ids the run generated from
    (BOS once), then the output's tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    prompts = [f"{tok.bos_token}{question(0)}", question(1)]  # with and without the BOS text
    run = generation_run(tmp_path / "chat-run", OUTPUTS[:2], prompts)
    report = run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(tiny[1]), trajectories=run, first=20))
    want = [lm_eval_ids(tok, p) + tok(o, add_special_tokens=False)["input_ids"][:20] for p, o in zip(prompts, OUTPUTS)]
    assert want[0][:2] == [1, tok(question(0), add_special_tokens=False)["input_ids"][0]]  # one BOS
    assert fed == [want[0], want[0], want[1], want[1]]  # reference, candidate; question by question
    assert report.summary["tokens"] == 40


def test_tokens_caps_the_generated_tokens_followed_exactly(tiny, tmp_path, fed):
    """--tokens 50 with --first 40: 40 of the first output and 10 of the second, not 80."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    run = generation_run(tmp_path / "r", OUTPUTS)
    report = run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(tiny[1]), trajectories=run, first=40, tokens=50))
    assert report.summary["tokens"] == 50 and report.summary["windows"] == 2
    assert np.bincount(report.clusters).tolist() == [40, 10]
    want = [lm_eval_ids(tok, question(i)) + tok(OUTPUTS[i], add_special_tokens=False)["input_ids"][:n]
            for i, n in ((0, 40), (1, 10))]
    assert fed == [want[0], want[0], want[1], want[1]]


def test_a_question_longer_than_the_context_is_cut_as_the_run_cut_it(tiny, tmp_path, fed):
    """The tiny model's context is 1024 tokens. A prompt of ~1000 tokens with max_gen_toks 64: the run (truncate=left)
    generated from the prompt's last 960 tokens; those are fed, then the 64 tokens that fit. Without
    max_gen_toks in the request, the prompt leaves room for the --first tokens followed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    long_prompt = "The city of the river is old and the river is long. " * 49 + question(0)
    ids = lm_eval_ids(tok, long_prompt)
    gen = tok(OUTPUTS[0], add_special_tokens=False)["input_ids"]
    assert len(ids) + 64 > 1024 and len(ids) < 1024 and len(gen) > 64
    for mgt, first, want in ((64, 100, ids[-960:] + gen[:64]), (None, 60, ids[-(1024 - 60):] + gen[:60])):
        fed.clear()
        run = generation_run(tmp_path / f"long-{mgt}", [OUTPUTS[0], OUTPUTS[1]], [long_prompt, question(1)], mgt)
        out = tmp_path / f"s-{mgt}.json"
        result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny[1]), "--ref", str(tiny[1]), "--trajectories",
                                          str(run), "--first", str(first), "--json", str(out)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert fed[0] == want and len(fed[0]) == 1024
        assert fed[2] == lm_eval_ids(tok, question(1)) + tok(OUTPUTS[1], add_special_tokens=False)["input_ids"][:first]
        s = json.loads(out.read_text())
        assert s["cut"]["questions"] == 1 and s["cut"]["context"] == 1024
        assert "1 questions did not fit the models' context (1024 tokens, model.context_length in" in result.output


@pytest.mark.parametrize("args,message", [
    (["--by-position", "--buckets", "100000"], "--buckets 100000: expected increasing context lengths between 2 and"),
    (["--by-position", "--buckets", "2000"], "between 2 and 1023"),  # beyond the models' context (1024)
    (["--trajectories", "{tmp}/missing-run"], "missing-run: run not found"),
    (["--trajectories", "{run}", "--buckets", "300"], "--buckets 300: expected increasing generated-token indices "
                                                      "between 2 and 256"),
    (["--trajectories", "{run}", "--first", "32", "--buckets", "8,64"], "between 2 and 32"),
])
@pytest.mark.parametrize("ref", ["package", "checkpoint"])
def test_refusals_come_before_any_model_opens(tiny, tmp_path, monkeypatch, args, message, ref):
    from ortevals.fidelity import reference

    def opened(*a, **k):
        raise AssertionError("a model was opened before the refusal")

    monkeypatch.setattr(windows.OrtSource, "open", opened)
    monkeypatch.setattr(reference.TorchSource, "open", opened)
    run = generation_run(tmp_path / "r", ["a b c"])
    args = [a.format(tmp=tmp_path, run=run) for a in args]
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny[1]), "--ref",
                                      str(tiny[1] if ref == "package" else tiny[0]), *args])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert message in lines[0], lines[0]
