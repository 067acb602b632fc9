"""ortevals fidelity: statistics by hand, package vs itself, package vs its PyTorch checkpoint (oracle),
saved references, tokenizer mismatches, and memory bounded to one window."""

import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from ortevals.engine.score.scoring import log_softmax
from ortevals.errors import OrtEvalsError
from ortevals.fidelity import stats
from ortevals.fidelity.run import FidelityOptions, run_fidelity
from ortevals.fidelity.windows import OrtSource, plan_windows

REPO = Path(__file__).resolve().parent.parent


def lp(p):
    return np.log(np.asarray(p, np.float64))


def kl_full(p_logp, q_logp):
    """The full-vocabulary KL(p‖q) per row, written out: Σ_v p_v (log p_v − log q_v)."""
    return (np.exp(p_logp) * (p_logp - q_logp)).sum(axis=-1)


# ---------------------------------------------------------------- (a) statistics by hand

def test_kl_of_two_small_distributions_by_hand():
    p, q = lp([[0.5, 0.25, 0.25]]), lp([[0.25, 0.25, 0.5]])
    ref = stats.reduce_reference(p, np.array([0]), k=3)
    t = stats.compare_window(ref, q, np.array([0]))
    # 0.5 ln 2 + 0.25 ln 1 + 0.25 ln 0.5 = 0.25 ln 2
    assert t.kl[0] == pytest.approx(0.25 * math.log(2), abs=1e-12)
    assert not t.same_top1[0] and t.overlap[0] == 1.0
    assert t.lp_ref[0] == pytest.approx(math.log(0.5)) and t.lp_cand[0] == pytest.approx(math.log(0.25))


def test_topk_with_tail_by_hand_is_a_lower_bound():
    p, q = lp([[0.5, 0.3, 0.2]]), lp([[0.4, 0.4, 0.2]])
    ref = stats.reduce_reference(p, np.array([1]), k=1)
    assert ref.topk_ids.tolist() == [[0]] and ref.tail_logp[0] == pytest.approx(math.log(0.5))
    t = stats.compare_window(ref, q, np.array([1]))
    # outcomes {0}, {1,2}: 0.5 ln(0.5/0.4) + 0.5 ln(0.5/0.6)
    assert t.kl[0] == pytest.approx(0.5 * math.log(1.25) + 0.5 * math.log(0.5 / 0.6), abs=1e-12)
    full = 0.5 * math.log(1.25) + 0.3 * math.log(0.75)
    assert full == pytest.approx(kl_full(p, q)[0]) and t.kl[0] < full


def test_topk_with_tail_equals_full_kl_when_k_is_v_and_bounds_it_when_smaller():
    rng = np.random.default_rng(0)
    v = 300
    p = log_softmax(rng.normal(size=(20, v)) * 3, np.float64)
    q = log_softmax(np.asarray(p) + rng.normal(size=(20, v)) * 0.5, np.float64)
    targets = rng.integers(0, v, 20)
    full = kl_full(p, q)
    exact = stats.compare_window(stats.reduce_reference(p, targets, k=v), q, targets)
    np.testing.assert_allclose(exact.kl, full, rtol=1e-10, atol=1e-14)
    assert (exact.overlap == 1).all()
    bound = stats.compare_window(stats.reduce_reference(p, targets, k=64), q, targets)
    assert (bound.kl <= full + 1e-12).all() and (bound.kl > 0.5 * full).all()
    assert (bound.kl < full - 1e-6).any()  # strictly below somewhere: the tail merges outcomes


def test_clustered_standard_error_two_clusters_by_hand():
    x, g = np.array([1.0, 2.0, 3.0, 6.0]), np.array([0, 0, 1, 1])
    mean, se = stats.clustered_mean(x, g)
    # residuals (-2,-1 | 0,3): cluster sums -3, 3; G/(G-1) * (9 + 9) / N^2 = 2 * 18 / 16 = 2.25
    assert mean == 3.0 and se == pytest.approx(1.5, abs=1e-12)
    iid = x.std(ddof=1) / 2  # what llama.cpp would print: tokens as independent
    assert iid == pytest.approx(math.sqrt(14 / 3) / 2) and iid < se
    assert math.isnan(stats.clustered_mean(x, np.zeros(4))[1])


def test_ppl_ratio_paired_and_clustered_by_hand():
    lp_ref = np.array([-1.0, -2.0, -1.0, -2.0])
    lp_cand = np.array([-1.1, -2.2, -1.4, -2.5])  # differences 0.1 0.2 | 0.4 0.5
    r = stats.ppl_ratio(lp_ref, lp_cand, np.array([0, 0, 1, 1]))
    # mean 0.3; residual sums -0.3, 0.3 -> var = 2 * 0.18 / 16 = 0.0225 -> se 0.15
    assert r["log_ratio"] == pytest.approx(0.3) and r["log_ratio_se"] == pytest.approx(0.15)
    assert r["ratio"] == pytest.approx(math.exp(0.3)) and r["ratio_se"] == pytest.approx(math.exp(0.3) * 0.15)
    # 2 windows: t with 1 degree of freedom (Cauchy), 97.5% quantile tan(pi * 0.475) = 12.706
    t1 = math.tan(math.pi * 0.475)
    assert r["ratio_ci95"] == pytest.approx([math.exp(0.3 - t1 * 0.15), math.exp(0.3 + t1 * 0.15)])
    assert r["ppl_ref"] == pytest.approx(math.exp(1.5)) and r["ppl_cand"] == pytest.approx(math.exp(1.8))


def test_window_plan_follows_llama_cpp():
    text = np.arange(100, 130)  # 30 text tokens
    plan = plan_windows(len(text), n_ctx=8, bos_id=1, max_scored=None)
    assert (plan.n_windows, plan.first, plan.scored_per_window, plan.n_scored) == (4, 4, 3, 12)
    ids, targets = plan.window(text, 1)
    assert ids.tolist() == [1, 107, 108, 109, 110, 111, 112, 113]  # BOS + the next 7 text tokens
    assert targets.tolist() == [111, 112, 113]  # logits at 4, 5, 6 predict positions 5, 6, 7
    capped = plan_windows(len(text), n_ctx=8, bos_id=None, max_scored=7)
    assert (capped.n_windows, capped.n_scored, capped.scored_in(2)) == (3, 7, 1)
    assert capped.window(text, 2)[0].tolist() == list(range(116, 124))
    assert capped.clusters().tolist() == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(OrtEvalsError, match="one window of --ctx 64 needs 63"):
        plan_windows(30, n_ctx=64, bos_id=1, max_scored=None)


# ---------------------------------------------------------------- (b) package vs itself

def test_package_against_itself_is_zero(tiny_pkg, tmp_path):
    out = tmp_path / "s.json"
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny_pkg), "--ref", str(tiny_pkg), "--ctx", "64",
                                      "--tokens", "300", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Mean    KLD" in result.output and "Same top p" in result.output
    s = json.loads(out.read_text())
    assert s["tokens"] == 300 and s["windows"] == math.ceil(300 / 31) and s["n_ctx"] == 64
    assert abs(s["kl"]["max"]) <= 1e-12 and s["same_top1"]["mean"] == 1.0 and s["topk_overlap"]["mean"] == 1.0
    assert s["ppl"]["ratio"] == pytest.approx(1.0, abs=1e-12) and s["delta_p"]["rms"] <= 1e-12
    assert s["ppl"]["ppl_ref"] > 1 and s["ppl"]["ppl_cand"] == pytest.approx(s["ppl"]["ppl_ref"], rel=1e-12)


def test_the_window_bar_is_drawn_on_stderr_off_a_terminal(tiny_pkg):
    """Issue 55 item 10b: fidelity's windows (also diagnose's token-KL stage) drew a bar on a terminal only, a minute
    of silence in a log; now tqdm's bar on stderr counting the windows (300 tokens, 31 scored a window of 64)."""
    import re

    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(tiny_pkg), "--ref", str(tiny_pkg), "--ctx", "64",
                                      "--tokens", "300"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    drawn = [tuple(map(int, m)) for m in re.findall(r"fidelity: +(\d+)%\|[^|]*\| (\d+)/(\d+) ", result.stderr)]
    windows = math.ceil(300 / 31)
    assert drawn and drawn[-1] == (100, windows, windows) and all(t == windows for _, _, t in drawn), drawn
    assert all(p == round(100 * n / t) for p, n, t in drawn) and "%|" not in result.stdout


# ---------------------------------------------------------------- (c) package vs its PyTorch checkpoint

def ort_session(pkg_dir: Path):
    """Raw onnxruntime, no ortevals: a function ids -> logits [S,V] of one sequence with empty past."""
    import onnxruntime as ort

    dec = json.loads((pkg_dir / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(pkg_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)

    def logits(ids):
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
        feeds.update({i.name: empty for i in sess.get_inputs() if i.name.startswith("past_key_values")})
        return sess.run(["logits"], feeds)[0][0]

    return logits


@pytest.fixture(scope="module")
def oracle(tiny, tmp_path_factory):
    """The text, windows and per-token numbers computed without ortevals: transformers + raw ORT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ortevals.fidelity.text import default_text

    hf_dir, pkg_dir = tiny
    text_file = tmp_path_factory.mktemp("fid") / "text.txt"
    text_file.write_text(default_text(max_chars=12000), encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(hf_dir)(text_file.read_text(encoding="utf-8"),
                                               add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ort_logits = ort_session(pkg_dir)
    per = 63  # n_ctx 64: BOS (id 1) + 63 text tokens; logits 32..62 predict tokens 33..63
    kl, top1, lp_ref, lp_cand = [], [], [], []
    for w in range(len(ids) // per):
        window = [1] + ids[w * per:(w + 1) * per]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), -1).numpy()[32:63]
        cand = log_softmax(ort_logits(window), np.float64)[32:63]
        targets = np.array(window[33:64])
        kl.append(kl_full(ref, cand))
        top1.append(ref.argmax(-1) == cand.argmax(-1))
        lp_ref.append(ref[np.arange(31), targets])
        lp_cand.append(cand[np.arange(31), targets])
    return text_file, np.array(ids), {k: np.concatenate(v) for k, v in
                                      (("kl", kl), ("top1", top1), ("lp_ref", lp_ref), ("lp_cand", lp_cand))}


@pytest.fixture(scope="module")
def vs_torch(tiny, oracle, tmp_path_factory):
    ref_file = tmp_path_factory.mktemp("fidref") / "ref.npz"
    opts = FidelityOptions(pkg=tiny[1], ref=str(tiny[0]), text=oracle[0], ctx=64, tokens=10**6, save_ref=ref_file)
    return run_fidelity(opts), ref_file


def test_package_against_pytorch_checkpoint_matches_the_oracle(oracle, vs_torch):
    _, ids, o = oracle
    report, _ = vs_torch
    n = len(o["kl"])
    assert n >= 300 and report.summary["tokens"] == n
    np.testing.assert_array_equal(report.text_ids, ids[:len(report.text_ids)])  # same tokenization as transformers
    np.testing.assert_allclose(report.stats.lp_ref, o["lp_ref"], atol=1e-5)  # same windows, same targets
    np.testing.assert_allclose(report.stats.lp_cand, o["lp_cand"], atol=1e-5)
    assert (report.stats.kl <= o["kl"] + 1e-12).all()  # top-128 of 512 + tail: a lower bound ...
    np.testing.assert_allclose(report.stats.kl, o["kl"], atol=1e-9)  # ... and a tight one here
    np.testing.assert_array_equal(report.stats.same_top1, o["top1"])
    assert o["kl"].mean() < 1e-6 and o["top1"].mean() >= 0.999
    assert report.summary["kl"]["mean"] < 1e-6 and report.summary["same_top1"]["mean"] >= 0.999
    assert report.summary["ppl"]["ratio"] == pytest.approx(1.0, abs=1e-4)


# ---------------------------------------------------------------- (d) saved reference

def test_saved_reference_gives_the_same_statistics(tiny, vs_torch):
    direct, ref_file = vs_torch
    reused = run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(ref_file)))
    np.testing.assert_allclose(reused.stats.kl, direct.stats.kl, atol=1e-10)
    np.testing.assert_allclose(reused.stats.lp_ref, direct.stats.lp_ref, rtol=1e-6)
    np.testing.assert_array_equal(reused.stats.same_top1, direct.stats.same_top1)
    np.testing.assert_array_equal(reused.stats.overlap, direct.stats.overlap)
    for key in ("mean", "p50", "p99", "max"):
        assert reused.summary["kl"][key] == pytest.approx(direct.summary["kl"][key], abs=1e-10)
    assert reused.summary["ppl"]["ratio"] == pytest.approx(direct.summary["ppl"]["ratio"], abs=1e-6)
    prefix = run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(ref_file), tokens=100))  # the first 100 tokens
    assert prefix.summary["tokens"] == 100 and prefix.summary["windows"] == 4
    np.testing.assert_allclose(prefix.stats.kl, direct.stats.kl[:100], atol=1e-10)
    np.testing.assert_array_equal(prefix.stats.lp_cand, reused.stats.lp_cand[:100])
    with np.load(ref_file, allow_pickle=False) as z:
        assert z["topk_ids"].dtype == np.int32 and z["topk_logp"].dtype == np.float32
        assert z["topk_ids"].shape == (direct.summary["tokens"], 128)


def test_saved_reference_with_another_tokenizer_is_one_line(tiny, vs_torch, copy_pkg):
    _, ref_file = vs_torch
    other = copy_pkg(tiny[1])
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["post_processor"] = None  # no BOS any more: other token ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    result = CliRunner().invoke(cli, ["fidelity", "--pkg", str(other), "--ref", str(ref_file)])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: different tokenizers")
    assert str(ref_file) in lines[0] and str(other) in lines[0]


def test_saved_reference_with_another_text_is_one_line(tiny, vs_torch, tmp_path):
    _, ref_file = vs_torch
    text = tmp_path / "other.txt"
    text.write_text("The river of the city is a number. " * 400)
    with pytest.raises(OrtEvalsError, match="token ids of the text"):
        run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(ref_file), text=text))
    with pytest.raises(OrtEvalsError, match="scored tokens; got --tokens 1000000"):
        run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(ref_file), tokens=10**6))
    with pytest.raises(OrtEvalsError, match="saved with --ctx 64; got --ctx 128"):
        run_fidelity(FidelityOptions(pkg=tiny[1], ref=str(ref_file), ctx=128))


# ---------------------------------------------------------------- (e) memory bounded

def _run_traced(monkeypatch, pkg, text, windows):
    shapes = []
    original = OrtSource.__call__

    def counting(self, ids):
        out = original(self, ids)
        shapes.append(out.shape)
        return out

    monkeypatch.setattr(OrtSource, "__call__", counting)
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        report = run_fidelity(FidelityOptions(pkg=pkg, ref=str(pkg), text=text, ctx=512, tokens=255 * windows))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return report, shapes, peak


def test_memory_stays_one_window_however_long_the_text(tiny_pkg, tmp_path, monkeypatch):
    from ortevals.fidelity.text import default_text

    text = tmp_path / "long.txt"
    text.write_text(default_text(max_chars=80000), encoding="utf-8")
    window_bytes = 512 * 512 * 4  # one window's logits [n_ctx, V] float32
    short, short_shapes, short_peak = _run_traced(monkeypatch, tiny_pkg, text, 2)
    long, shapes, peak = _run_traced(monkeypatch, tiny_pkg, text, 20)
    assert long.summary["windows"] == 20 and long.summary["tokens"] == 20 * 255
    assert len(shapes) == 2 * 20 and set(shapes) == {(512, 512)}  # one [n_ctx, V] pass per window and model
    # 18 more windows would hold 36+ MiB of logits if kept; per-token scalars add ~0.2 MiB
    assert peak - short_peak < window_bytes, (peak, short_peak)
    assert peak < 12 * window_bytes


# ---------------------------------------------------------------- imports and bad inputs

def test_package_path_never_imports_torch(tiny_pkg):
    code = ("import sys; from pathlib import Path; import ortevals, ortevals.cli, ortevals.fidelity.reference\n"
            "from ortevals.fidelity.run import FidelityOptions, run_fidelity\n"
            f"p = Path({str(tiny_pkg)!r}); run_fidelity(FidelityOptions(pkg=p, ref=str(p), ctx=64, tokens=31))\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["--ref", "{pkg}"], "pass --pkg"),
    (["--pkg", "{pkg}"], "pass --ref"),
    (["--pkg", "{pkg}", "--ref", "{pkg}", "--top-k", "10"], "--top-k must be between 64 and 256"),
    (["--pkg", "{pkg}", "--ref", "{pkg}", "--ctx", "63"], "--ctx must be an even number"),
    (["--pkg", "{pkg}", "--ref", "{pkg}", "--ctx", "4096"], "longer than the models' context (1024"),
    (["--pkg", "{pkg}", "--ref", "/nonexistent/ref"], "/nonexistent/ref: --ref must be"),
    (["--pkg", "{pkg}", "--ref", "{pkg}", "--text", "a.txt", "--data", "bundled"], "not both"),
    (["--pkg", "{pkg}", "--ref", "{pkg}/genai_config.json"], "not an ortevals fidelity reference file"),
])
def test_bad_inputs_are_one_line(tiny_pkg, args, needle):
    result = CliRunner().invoke(cli, ["fidelity", *(a.format(pkg=tiny_pkg) for a in args)])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert needle in lines[0], lines[0]


def test_help_has_examples():
    result = CliRunner().invoke(cli, ["fidelity", "--help"])
    assert result.exit_code == 0 and "Examples:" in result.output and "--save-ref" in result.output
