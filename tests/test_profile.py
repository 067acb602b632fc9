"""`ortevals profile` (issue 26) on the tiny package: the command runs, each setting makes the tokens it
should on both backends (the raw path's greedy tokens equal onnxruntime-genai's own Generator's), the
rates are the benchmark script's formulas, and bad inputs are one line with exit 2. No timed assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortevals.engine.profile import Setting, Trial, parse_list, prompt_ids, settings_for
from ortevals.errors import OrtEvalsError


def ortevals(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortevals.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_profile_runs_and_counts_tokens(tiny_pkg, tmp_path):
    out = tmp_path / "prof"
    proc = ortevals("profile", "--pkg", tiny_pkg, "--batch", "1,3", "--prompt-len", "8,21", "--gen-len", "6",
                    "--repeats", "2", "--warmup", "0", "--threads", "1", "--output", out)
    assert proc.returncode == 0, proc.stderr
    assert "prefill tok/s" in proc.stdout and "raw/og at batch 3, prompt 21, gen 6" in proc.stdout
    data = json.loads((out / "profile.json").read_text())
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["threads"] == 1 and data["skipped"] == {}
    seen = [(t["backend"], t["batch"], t["prompt_len"], t["gen_len"]) for t in data["trials"]]
    assert seen == [(k, b, p, 6) for b in (1, 3) for p in (8, 21) for k in ("raw", "og")]
    for t in data["trials"]:
        # both repeats, every row (counted from the sequences): EOS never ends a row early
        assert t["generated_per_row"] == [[6] * t["batch"]] * 2
        assert len(t["prefill_s"]) == len(t["first_token_s"]) == 2
        assert len(t["decode_s"]) == 2 * 5  # the first token comes with the prompt pass
        assert t["prefill_tok_s"] == pytest.approx(t["batch"] * t["prompt_len"] / np.mean(t["prefill_s"]))
        assert t["decode_tok_s"] == pytest.approx(t["batch"] / np.mean(t["decode_s"]))
        assert t["ttft_ms"] == pytest.approx(1e3 * np.mean(np.add(t["prefill_s"], t["first_token_s"])))
    assert len(data["ratios"]) == 4
    weights_mib = sum(f.stat().st_size for f in Path(tiny_pkg).glob("*.onnx*")) / 2**20
    for t in data["trials"]:  # each backend's own process holds at least the model it opened
        assert t["peak_mib"] >= weights_mib, t


def test_raw_tokens_equal_onnxruntime_genai(tiny_pkg):
    """The raw loop (sampler KV, batched prefill, EOS masked) makes og's own greedy tokens, row by row."""
    from ortevals.engine.profile import measure, open_backends
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package

    package = ModelPackage.load(tiny_pkg)
    provider = from_package(package.decoder.session_options, None, {}, 1)
    backends, skipped = open_backends(package, provider)
    assert [b.name for b in backends] == ["raw", "og"] and not skipped
    ids = prompt_ids(2, 19, package.vocab_size)
    raw, og = (measure(b, Setting(2, 19, 12), ids, repeats=1, warmup=0) for b in backends)
    assert len(raw.tokens) == 2 and all(len(row) == 12 for row in raw.tokens)
    assert raw.tokens == og.tokens
    assert raw.tokens[0] != raw.tokens[1]


def test_prompt_ids_are_benchmark_e2e_random_tokens():
    """Like the script's ``np.random.randint(100, size=(batch, prompt_length))``: that shape, ids below 100
    (or the vocabulary), rows that differ; and the same ids for the same setting (both backends, reruns)."""
    ids = prompt_ids(4, 300, vocab_size=49152)
    assert ids.shape == (4, 300) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() == 99 and len(np.unique(ids)) == 100
    assert len({tuple(row) for row in ids}) == 4
    np.testing.assert_array_equal(ids, prompt_ids(4, 300, vocab_size=49152))
    assert prompt_ids(2, 50, vocab_size=40).max() == 39


def test_greedy_masks_eos_as_og_min_length():
    """og's ``min_length`` keeps EOS from being chosen; the raw side's greedy must pick the best other id."""
    from ortevals.engine.profile import _greedy

    logits = np.array([[0.1, 5.0, 3.0, 4.0], [9.0, 1.0, 2.0, 8.0]], dtype=np.float32)
    np.testing.assert_array_equal(_greedy(logits, eos=(1, 0)), [3, 3])
    np.testing.assert_array_equal(_greedy(logits, eos=(2,)), [1, 0])
    assert logits[0, 1] == 5.0  # the caller's logits are left alone


def test_summary_formulas_by_hand():
    t = Trial("raw", Setting(4, 100, 3), prefill_s=[0.2, 0.3], first_token_s=[0.01, 0.03],
              decode_s=[0.05, 0.15, 0.1, 0.1], wall_s=[1.0, 2.0], generated=[[3] * 4] * 2)
    s = t.summary()
    assert s["prefill_tok_s"] == pytest.approx(4 * 100 / 0.25)
    assert s["ttft_ms"] == pytest.approx(270.0)
    assert s["tpot_ms"] == pytest.approx(100.0)
    assert s["decode_tok_s"] == pytest.approx(40.0)
    assert s["wall_s"] == pytest.approx(1.5)


def test_lists_and_context():
    assert parse_list("--batch", "1, 4,16,4") == (1, 4, 16)
    for bad in ("", "1,x", "0", "-2", "1,,2", "2.5"):
        with pytest.raises(OrtEvalsError, match="--batch"):
            parse_list("--batch", bad)
    assert settings_for((1, 2), (8,), (4, 5), context=13) == [Setting(b, 8, g) for b in (1, 2) for g in (4, 5)]
    with pytest.raises(OrtEvalsError, match="context_length is 12"):
        settings_for((1,), (8,), (5,), context=12)


@pytest.mark.parametrize("args, words", [
    ((), "pass --pkg PATH"),
    (("--batch", "1,two"), "--batch '1,two': expected comma-separated positive integers"),
    (("--prompt-len", "0"), "--prompt-len '0'"),
    (("--gen-len", "8", "--prompt-len", "1020"), "needs 1028 tokens; the package's context_length is 1024"),
    (("--repeats", "0"), "--repeats 0"),
    (("--threads", "x"), "threads must be an integer"),
    (("--ep", "nosuch"), "nosuch"),
])
def test_bad_inputs_one_line_exit_2(tiny_pkg, tmp_path, args, words):
    pkg = () if args == () else ("--pkg", tiny_pkg)
    proc = ortevals("profile", *pkg, *args, "--output", tmp_path / "o")
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_output_that_is_a_file(tiny_pkg, tmp_path):
    (tmp_path / "f").write_text("x")
    proc = ortevals("profile", "--pkg", tiny_pkg, "--output", tmp_path / "f")
    assert proc.returncode == 2 and "--output" in proc.stderr and "is a file" in proc.stderr


def test_a_batch_that_cannot_fit_is_one_line_with_its_estimate_before_any_work(tiny_pkg, tmp_path, monkeypatch):
    """Issue 38 item 17: was `internal error MemoryError` from the measuring process. The tiny package: vocab 512,
    2 layers x K and V x 2 KV heads x 16 x 4 bytes = 512 bytes of KV a token; 1 GiB free (pretended)."""
    from click.testing import CliRunner

    import ortevals.run.profile as run_profile
    import ortevals.runtime.memory as memory
    from ortevals.cli import cli

    monkeypatch.setattr(memory, "free_bytes", lambda device, device_id=0: 2**30)
    monkeypatch.setattr(run_profile, "profile_package", lambda *a, **k: pytest.fail("model work started"))
    result = CliRunner().invoke(cli, ["profile", "--pkg", str(tiny_pkg), "--batch", "1,4096", "--prompt-len", "512",
                                      "--gen-len", "8", "--output", str(tmp_path / "o")], catch_exceptions=False)
    logits, kv = 4096 * 512 * 512 * 4 / 2**30, 4096 * 520 * 512 / 2**30  # 4.0 and 1.0 GiB
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert (f"Error: --batch 4096 with --prompt-len 512 and --gen-len 8 needs at least {logits + kv:.1f} GiB "
            f"({logits:.1f} GiB of prompt logits [4096, 512, 512] + {kv:.1f} GiB of KV) but 1.0 GiB is free on the "
            "host; expected a smaller --batch or --prompt-len") in result.output


def test_ctrl_c_keeps_what_was_measured_and_gives_no_resume_advice(tiny_pkg, tmp_path, monkeypatch):
    """Issue 38 item 17: Ctrl-C while the second run measures. Was: the scoring runs' advice (result store,
    --no-resume: profile has neither) and nothing written."""
    from click.testing import CliRunner

    import ortevals.engine.profile as engine_profile
    from ortevals.cli import cli

    real, calls = engine_profile._in_fresh_process, []

    def interrupt_the_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(engine_profile, "_in_fresh_process", interrupt_the_second)
    out = tmp_path / "o"
    result = CliRunner().invoke(cli, ["profile", "--pkg", str(tiny_pkg), "--prompt-len", "8", "--gen-len", "4",
                                      "--repeats", "1", "--warmup", "0", "--threads", "1", "--output", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 130, result.output
    assert "Interrupted after 1 of 2 runs" in result.output and "result store" not in result.output
    data = json.loads((out / "profile.json").read_text())
    assert data["interrupted"] is True and [t["backend"] for t in data["trials"]] == ["raw"]
    assert data["trials"][0]["generated_per_row"] == [[4]] and (out / "profile.png").is_file()


def test_a_package_og_cannot_run_is_profiled_on_raw_with_og_skipped(tiny_pkg, copy_pkg):
    """Issue 49 item 15: a declared window the graph lacks stopped `profile` with og's advice `path=prefill and
    gen_path=raw`, options profile does not have; now og is skipped with the reason and raw is measured."""
    from ortevals.engine.profile import open_backends
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package
    from tests.test_badinputs import edit_config

    pkg = copy_pkg(tiny_pkg)
    edit_config(pkg, lambda c: c["model"]["decoder"].update(
        sliding_window={"window_size": 4, "slide_key_value_cache": False, "slide_inputs": False, "layers": [],
                        "cache_slack": 0}))
    package = ModelPackage.load(pkg)
    backends, skipped = open_backends(package, from_package(package.decoder.session_options, None, {}, 1))
    assert [b.name for b in backends] == ["raw"] and list(skipped) == ["og"]
    assert "sizes its KV cache to that window" in skipped["og"] and "path=" not in skipped["og"]
