"""Passes run a few at a time (engine/score/parallel.py, model arg ``passes``): reports in order on the calling
thread, the same numbers as one pass at a time on every path of the prefill engine, and what ``auto`` resolves to."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from ortevals.engine.score.parallel import PassPool
from ortevals.engine.score.prefill import EngineSettings, PrefillEngine, TokenRequest
from ortevals.options import ModelArgs
from ortevals.runtime.meter import PassMeter


def test_pool_reports_in_order_on_the_calling_thread_with_at_most_two_per_worker_ahead():
    """Runs finish out of order on the workers; reports come in submission order, on the caller's thread,
    and no more than 2 × workers runs are started and not yet reported."""
    pool, reported, running, most = PassPool(2), [], set(), [0]
    caller = threading.current_thread().name

    def run(i):
        running.add(i)
        most[0] = max(most[0], len(running))
        time.sleep(0.002 * (8 - i % 8))  # later passes finish first
        return i, threading.current_thread().name

    def report(out):
        running.discard(out[0])
        reported.append((out[0], out[1], threading.current_thread().name))

    for i in range(20):
        pool.submit(lambda i=i: run(i), report)
    pool.drain()
    assert [r[0] for r in reported] == list(range(20))
    assert {r[2] for r in reported} == {caller} and {r[1] for r in reported} <= {"ortevals-pass_0", "ortevals-pass_1"}
    assert most[0] <= 4
    inline = PassPool(1)
    inline.submit(lambda: threading.current_thread().name, reported.append)
    assert reported[-1] == caller  # one worker: on the calling thread, at once


def test_pool_abandon_cancels_what_has_not_started_and_reports_nothing():
    pool, reported = PassPool(1 + 1), []

    def boom():
        raise ValueError("pass failed")

    pool.submit(boom, reported.append)
    for i in range(3):
        pool.submit(lambda i=i: time.sleep(0.05) or i, reported.append)
    with pytest.raises(ValueError, match="pass failed"):
        pool.drain()
    pool.abandon()
    assert reported == [] and pool.call(lambda: 7) == 7


def test_meter_counts_overlapping_passes_once():
    """Hand-computed: passes [0,10] and [1,11] are 11 s busy, 20 row-seconds; [1,9] recorded before [0,10] and a
    later [20,21]: 11 s."""
    m = PassMeter()
    m.record(1, 10, False, 0.0, 10.0)
    m.record(1, 10, True, 1.0, 10.0)
    assert m.counts().prefill_seconds == pytest.approx(11.0) and m.counts().prefill_row_seconds == pytest.approx(20)
    m = PassMeter()
    for start, seconds in ((1.0, 8.0), (0.0, 10.0), (20.0, 1.0)):
        m.record(1, 5, True, start, seconds)
    assert m.counts().prefill_seconds == pytest.approx(11.0)


def _requests(seed: int = 5) -> list[TokenRequest]:
    """Four questions under a 120-token header (three one-token choices each), two with a 70-token shared
    middle (a second cached prefix), and two inputs sharing nothing."""
    rng = np.random.default_rng(seed)
    toks = lambda n: tuple(int(t) for t in rng.integers(3, 500, n))  # noqa: E731
    header, middle = toks(120), toks(70)
    reqs = [TokenRequest(header + (middle if q < 2 else ()) + toks(10 + 3 * q), (int(c),))
            for q in range(4) for c in rng.integers(3, 500, 3)]
    return reqs + [TokenRequest(toks(40), toks(3)), TokenRequest(toks(25), (7,))]


@pytest.mark.parametrize("exact", [False, True])
def test_passes_at_once_give_the_one_at_a_time_numbers(tiny_pkg, exact):
    """The prefill engine on one-thread passes, two at a time on worker threads (shared prefixes, their
    extensions, plain batches, exact mode, the canary) gives bit for bit what one two-thread pass at a time
    gives; the passes did run on both workers."""
    from ortevals.package.loader import ModelPackage
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.sessions import DecoderRunner

    pkg, reqs, scores, threads = ModelPackage.load(tiny_pkg), _requests(), {}, set()
    for passes in (1, 2):
        runner = DecoderRunner.open(pkg, from_package({}, threads=3 - passes))
        call = runner.forward

        def spy(*a, _call=call, **k):
            threads.add(threading.current_thread().name)
            return _call(*a, **k)

        runner.forward = spy
        engine = PrefillEngine(runner, EngineSettings(max_length=512, vocab_size=512, passes=passes, exact=exact,
                                                      prefix_min_saving=16))
        scores[passes] = [(s.logprob, s.greedy) for s in engine.score(reqs)]
        if not exact:
            assert engine.canary.passed and engine.tokens_run < 400 + len(reqs) * 40  # prefixes were shared
    assert scores[2] == scores[1]
    assert {"ortevals-pass_0", "ortevals-pass_1"} <= threads


def test_auto_is_one_pass_per_core_of_one_thread_on_the_prefill_path_only(tiny_pkg, monkeypatch):
    """passes=auto: one per usable core with one onnxruntime thread each, unless threads is given; 1 where
    log-likelihoods go to onnxruntime-genai; an explicit count keeps the threads asked for."""
    import os

    from ortevals.package.loader import ModelPackage
    from ortevals.run.run import resolve_passes
    from ortevals.runtime.providers import from_package

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2}, raising=False)
    pkg, cpu = ModelPackage.load(tiny_pkg), from_package({})
    args = ModelArgs(pkg=str(tiny_pkg), passes=0)
    assert (resolve_passes(args, pkg, cpu).passes, resolve_passes(args, pkg, cpu).threads) == (3, 1)
    given = dataclasses.replace(args, threads=2)
    assert (resolve_passes(given, pkg, cpu).passes, resolve_passes(given, pkg, cpu).threads) == (1, 2)
    assert resolve_passes(dataclasses.replace(args, path="incremental"), pkg, cpu).passes == 1
    both = dataclasses.replace(args, passes=2, threads=2)
    assert (resolve_passes(both, pkg, cpu).passes, resolve_passes(both, pkg, cpu).threads) == (2, 2)
    assert (resolve_passes(ModelArgs(pkg=str(tiny_pkg)), pkg, cpu).passes,
            resolve_passes(ModelArgs(pkg=str(tiny_pkg)), pkg, cpu).threads) == (1, None)


def test_smollm2_one_thread_passes_at_once_equal_two_thread_passes(smollm2):
    """The real SmolLM2-135M package through OrtLM: a shared multi-question header, ten one-token choices a
    question; two one-thread passes at a time give bit for bit the default one two-thread pass at a time."""
    from lm_eval.api.instance import Instance

    from ortevals.integrations.lm import OrtLM

    header = "".join(f"Question: what is {i} plus {i + 1}?\nA. {2 * i + 1}\nB. {i}\nAnswer: A\n\n"
                     for i in range(12))
    docs = [f"{header}Question: which planet is number {q} from the sun?\n" + "".join(
        f"{c}. option {q}{c}\n" for c in "ABCDEFGHIJ") + "Answer:" for q in range(5)]
    reqs = [Instance("loglikelihood", {}, (d, f" {c}"), i, metadata=("t", q, 1))
            for q, d in enumerate(docs) for i, c in enumerate("ABCDEFGHIJ")]
    scores = {}
    for passes in (1, 2):
        lm = OrtLM.from_package(ModelArgs(pkg=str(smollm2[1]), passes=passes, store="none"))
        assert lm.run.args.threads == (1 if passes == 2 else None)  # two passes: one thread each
        scores[passes] = lm.loglikelihood(reqs, disable_tqdm=True)
    assert scores[2] == scores[1]


def test_passes_auto_runs_one_pass_per_core_on_cpu(tiny_pkg, tmp_path, monkeypatch):
    """``--passes auto`` on two usable cores: two one-thread passes; with --threads, one pass on the threads asked
    for. By default one pass at a time (the threads a run records are in its scope: a default run of any front
    door shares answers with the others)."""
    import os

    from click.testing import CliRunner

    from ortevals.cli import cli
    from ortevals.run import run as run_module

    seen, resolve = [], run_module.resolve_passes
    monkeypatch.setattr(run_module, "resolve_passes", lambda *a: seen.append(resolve(*a)) or seen[-1])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    cases = (((), (1, None)), (("--passes", "auto"), (2, 1)), (("--passes", "auto", "--threads", "2"), (1, 2)),
             (("--passes", "2"), (2, 1)))
    for extra, want in cases:
        out = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                                       "--no-resume", "--truncate", "left", "--output", str(tmp_path / "o"),
                                       *extra])
        assert out.exit_code == 0, out.output
        assert (seen[-1].passes, seen[-1].threads) == want, extra
