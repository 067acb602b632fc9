"""Data parallel on Ray (integrations/ray.py): the same numbers as one process, nothing lost.

One local cluster for the whole session (2 CPUs, 2 fake GPUs); skipped only where Ray is missing.
"""

import json
import os
import sqlite3
import time

import pytest
from click.testing import CliRunner
from lm_eval.api.instance import Instance

pytest.importorskip("ray")

from ortevals.cli import cli  # noqa: E402
from ortevals.errors import OrtEvalsError  # noqa: E402
from ortevals.integrations.lm import OrtLM  # noqa: E402
from ortevals.integrations.ray import CRASH_MARKER, WorkerPool, crash_once_if_marked  # noqa: E402
from ortevals.options import parse_model_args  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def ll_requests(n=10):
    """Questions under two shared headers, four one-token choices each (a few-shot benchmark's shape)."""
    heads = ["Header one: the answer follows each question. " * 12, "Header two, another subject entirely. " * 12]
    return [Instance("loglikelihood", {}, (heads[q % 2] + f"Question {q} about {q * 7}?\nAnswer:", f" {c}"), q)
            for q in range(n) for c in "ABCD"]


def run_cli(args):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_two_workers_give_the_same_results_json_and_samples(ray_cluster, tiny_pkg, tmp_path):
    base = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "6", "--truncate", "left",
            "--no-resume"]
    run_cli(base + ["--output", str(tmp_path / "one")])
    two_workers = run_cli(base + ["--output", str(tmp_path / "two"), "--workers", "2"])
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert one["results"] == two["results"]
    # issue 22: the console and results.json say the workers ran (a one-process run says nothing)
    assert "workers: 2 Ray workers on a local cluster" in two_workers.output
    assert two["ortevals"]["workers"] == "2 Ray workers on a local cluster" and one["ortevals"]["workers"] == ""
    s1, s2 = ((tmp_path / d / "samples_leaderboard_mmlu_pro.jsonl").read_text() for d in ("one", "two"))
    assert s1 == s2 and len(s1.splitlines()) == 6


def test_generation_on_two_workers_equals_one_process(ray_cluster, tiny_pkg):
    prompts = ["one two three four", "one two three five", "seven eight", "one two three four"]
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 6}), i)
            for i, p in enumerate(prompts)]
    reqs += [Instance("generate_until", {}, ("nine ten", {"do_sample": True, "temperature": 1.0, "max_gen_toks": 6}),
                      10 + i) for i in range(3)]  # three samples of one prompt: seeds by occurrence, kept together
    lm1 = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg)}))
    lm2 = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg), "workers": 2}))
    one, two = lm1.generate_until(reqs, disable_tqdm=True), lm2.generate_until(reqs, disable_tqdm=True)
    assert one == two
    assert len(set(one[-3:])) > 1  # the samples differ from one another, identically in both runs
    # best-of-k's input comes back from the workers: each sample's (log-prob, tokens), as one process has it
    assert len(lm1.sample_logprobs) == len(reqs)  # the raw path keeps every request's, keyed by occurrence
    assert lm2.sample_logprobs == lm1.sample_logprobs
    # and each sample's self-certainty (best-of-N by self-certainty), as one process has it
    assert len(lm1.sample_certainty) == len(reqs) and lm2.sample_certainty == lm1.sample_certainty
    assert lm2.stats["generated_tokens"] == lm1.stats["generated_tokens"] > 0


def store_rows(path) -> list:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT key FROM answers").fetchall()


def test_a_worker_that_dies_mid_chunk_leaves_complete_results(ray_cluster, tiny_pkg, tmp_path, monkeypatch, caplog):
    reqs = ll_requests()
    ref = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg)})).loglikelihood(reqs, disable_tqdm=True)
    marker = tmp_path / "crash-once"
    marker.write_text("")
    monkeypatch.setenv(CRASH_MARKER, str(marker))
    store = tmp_path / "store.sqlite"
    lm = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg), "workers": 2, "store": str(store)}))
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    assert not marker.exists()  # a worker found it and exited
    assert "died mid-chunk" in caplog.text
    assert got == ref
    keys = store_rows(store)
    assert len(keys) == len(keys) == len({k for (k,) in keys}) == len(reqs)  # no duplicate, none missing


class RestartingActors:
    """A stand-in for ``ray`` in WorkerPool's pull loop, with Ray's contract for an actor it restarts: the call the
    actor was running fails with ``ActorDiedError``, and every call while it restarts with ``ActorUnavailableError``
    ("The actor is temporarily unavailable ... The actor is restarting"), until it is back. Worker 0 dies on its
    first chunk and stays unavailable for ``restarting`` calls; worker 1 never dies."""

    def __init__(self, restarting: int) -> None:
        import ray

        self.exceptions = ray.exceptions
        self.restarting = restarting
        self.calls = {0: 0, 1: 0}

    def wait(self, refs, num_returns=1):
        return refs[:1], refs[1:]

    def get(self, ref):
        worker, chunk = ref
        self.calls[worker] += 1
        if worker == 0 and self.calls[0] == 1:
            raise self.exceptions.ActorDiedError()
        if worker == 0 and self.calls[0] <= 1 + self.restarting:
            raise self.exceptions.ActorUnavailableError("The actor is temporarily unavailable: IOError: The actor "
                                                        "is restarting.", None)
        return [(i, f"answer {i}") for i in chunk.requests]


def test_an_actor_ray_is_restarting_is_waited_for_not_counted_as_a_death(tiny_pkg, monkeypatch, caplog):
    """Under load a restart takes seconds; each refusal meanwhile was counted as a death, and the run failed with
    "Ray workers died 7 times" while the worker was coming back."""
    import ortevals.integrations.ray as module
    from ortevals.engine.shard import plan_shards

    monkeypatch.setattr(module, "RETRY_S", 0.001)
    fake = RestartingActors(restarting=4 * module.MAX_RESTARTS)
    pool = WorkerPool(parse_model_args({"pkg": str(tiny_pkg), "workers": 2}), on_device=False)
    plan = plan_shards([[i, i + 1, i + 2] for i in range(40)], 2)

    def finish(chunk, reply):
        yield from reply
    got = list(pool._loop(fake, [0, 1], plan, lambda actor, chunk: (actor, chunk), finish, lambda: None))
    assert sorted(i for i, _ in got) == list(range(40)) and len(got) == 40  # every request once
    assert fake.calls[0] > 1 + fake.restarting  # worker 0 came back and took work again
    assert "died mid-chunk" in caplog.text
    dead = RestartingActors(restarting=0)
    dead.get = lambda ref: (_ for _ in ()).throw(dead.exceptions.ActorDiedError())  # a worker that keeps dying
    with pytest.raises(OrtEvalsError, match="Ray workers died 7 times"):
        list(pool._loop(dead, [0, 1], plan, lambda actor, chunk: (actor, chunk), finish, lambda: None))


def test_interrupted_driver_resumes_from_the_store(ray_cluster, tiny_pkg, tmp_path):
    reqs = ll_requests(12)
    ref = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg)})).loglikelihood(reqs, disable_tqdm=True)
    args = parse_model_args({"pkg": str(tiny_pkg), "workers": 2, "store": str(tmp_path / "s.sqlite")})
    lm = OrtLM.from_package(args)
    commit = lm.run.commit

    def die_after_first_chunk():
        commit()
        raise KeyboardInterrupt  # the driver stops: what the chunk returned is already on disk

    lm.run.commit = die_after_first_chunk
    with pytest.raises(KeyboardInterrupt):
        lm.loglikelihood(reqs, disable_tqdm=True)
    kept = len(store_rows(tmp_path / "s.sqlite"))
    assert 0 < kept < len(reqs)
    again = OrtLM.from_package(args)
    assert again.loglikelihood(reqs, disable_tqdm=True) == ref
    assert again.stats["reused"] == kept and again.stats["requests"] == len(reqs) - kept


def test_fake_gpus_distinct_devices_each_session_on_device_zero(ray_cluster, tiny_pkg):
    pool = WorkerPool(parse_model_args({"pkg": str(tiny_pkg), "workers": 2}), on_device=True)
    actors = pool._actors(ray_cluster)
    try:
        seen = ray_cluster.get([a.where.remote() for a in actors])
    finally:
        for a in actors:
            ray_cluster.kill(a)
    assert sorted(cvd for cvd, _ in seen) == ["0", "1"]
    assert [dev for _, dev in seen] == ["0", "0"]


def test_more_gpus_than_the_cluster_has_is_one_line_at_once(ray_cluster, tiny_pkg):
    pool = WorkerPool(parse_model_args({"pkg": str(tiny_pkg), "workers": 3}), on_device=True)
    start = time.perf_counter()
    with pytest.raises(OrtEvalsError) as e:
        pool._actors(ray_cluster)
    assert time.perf_counter() - start < 5
    assert str(e.value) == "workers=3 needs 3 GPUs (1 per worker) but the Ray cluster (local) has 2"


def test_the_driver_opens_no_session_with_workers(ray_cluster, tiny_pkg, monkeypatch):
    """With workers the driver holds the tokenizer and the package config only: no onnxruntime
    InferenceSession (on a GPU it would take memory from worker 0) and no onnxruntime-genai model,
    through loading, log-likelihoods, rolling windows and generation; the answers are one process's."""
    import onnxruntime
    import onnxruntime_genai

    opened = []
    session_init, model_init = onnxruntime.InferenceSession.__init__, onnxruntime_genai.Model.__init__

    def spy_session(self, *args, **kwargs):
        opened.append(("InferenceSession", str(args[0] if args else kwargs.get("path_or_bytes"))[:80]))
        session_init(self, *args, **kwargs)

    config_init = onnxruntime_genai.Config.__init__

    def spy_config(self, path, *args):
        self.folder = str(path)  # which folder og was pointed at
        config_init(self, path, *args)

    def spy_model(self, config, *args, **kwargs):
        # og's own check of genai_config.json at load (package/og_config.py) asks og.Model for its verdict on
        # a copy of the config alone in a temporary folder, providers cleared: no model file, no device
        if getattr(config, "folder", "") == str(tiny_pkg):
            opened.append(("og.Model", config.folder))
        model_init(self, config, *args, **kwargs)

    monkeypatch.setattr(onnxruntime.InferenceSession, "__init__", spy_session)
    monkeypatch.setattr(onnxruntime_genai, "Config", type("SpyConfig", (onnxruntime_genai.Config,),
                                                          {"__init__": spy_config}))
    monkeypatch.setattr(onnxruntime_genai, "Model", type("SpyModel", (onnxruntime_genai.Model,),
                                                         {"__init__": spy_model}))
    reqs = ll_requests(4)
    rolling = [Instance("loglikelihood_rolling", {}, ("one two three four five six seven",), 0)]
    gen = [Instance("generate_until", {}, ("one two three", {"until": ["\n\n"], "max_gen_toks": 5}), 0)]
    lm = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg), "workers": 2}))
    got = (lm.loglikelihood(reqs, disable_tqdm=True), lm.loglikelihood_rolling(rolling, disable_tqdm=True),
           lm.generate_until(gen, disable_tqdm=True), lm.max_length)
    assert opened == []
    one = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg)}))
    assert opened  # the spy sees a single process open its sessions
    assert got == (one.loglikelihood(reqs, disable_tqdm=True), one.loglikelihood_rolling(rolling, disable_tqdm=True),
                   one.generate_until(gen, disable_tqdm=True), one.max_length)


def test_the_driver_scope_records_the_threads_the_workers_run_with(ray_cluster, tiny_pkg, tmp_path):
    """On CPU each worker runs ``num_cpus`` threads (the cluster's 2 CPUs over 2 workers: 1), not the driver's
    default (this machine's cores): the driver's store scope is the one a worker's run has (its threads
    included), so answers stored by one setting are never served to another."""
    from ortevals.integrations.ray import placement
    from ortevals.report.scope import results_scope
    from ortevals.run.run import Run, run_settings

    lm = OrtLM.from_package(parse_model_args({"pkg": str(tiny_pkg), "workers": 2,
                                              "store": str(tmp_path / "s.sqlite")}))
    settings = json.loads(lm.store.scope.settings)
    assert settings["threads"] == lm.run.args.threads == 1
    assert settings["path:raw sessions"]["intra_op_num_threads"] == 1
    worker = Run.open(parse_model_args(lm.pool.worker_args(placement(False, 2, lm.run.args.threads, 2))))
    assert worker.backends.provider.intra_op_threads == 1
    digest = results_scope(worker.package.root, worker.reads(), run_settings(worker.args, worker.backends)).digest
    assert digest == lm.store.scope.digest


def test_a_decoder_the_runtime_refuses_is_one_line_from_the_workers(ray_cluster, tiny_pkg, copy_pkg):
    """The driver no longer opens the decoder, so a package only the runtime refuses (a wrong head size
    the probe pass finds) is reported by the workers: the single process's one line, not a dead actor."""
    pkg = copy_pkg(tiny_pkg)
    cfg = json.loads((pkg / "genai_config.json").read_text())
    cfg["model"]["decoder"]["head_size"] = 8
    (pkg / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(OrtEvalsError) as alone:
        OrtLM.from_package(parse_model_args({"pkg": str(pkg)}))
    lm = OrtLM.from_package(parse_model_args({"pkg": str(pkg), "workers": 2}))
    with pytest.raises(OrtEvalsError) as pooled:
        lm.loglikelihood(ll_requests(2), disable_tqdm=True)
    assert str(pooled.value) == str(alone.value) and "\n" not in str(pooled.value)
    assert "refused past KV of that shape in a probe pass" in str(pooled.value)


def test_the_crash_marker_goes_to_one_worker_only(tmp_path, monkeypatch):
    """Two workers may both see the test's crash marker before either removes it: the one that loses the
    race goes on scoring (it used to raise FileNotFoundError from its unlink: a flaky Ray test under load)."""
    marker = tmp_path / "crash-once"
    monkeypatch.setenv(CRASH_MARKER, str(marker))
    monkeypatch.setattr(os.path, "exists", lambda path: True)  # the other worker removed it after our check
    crash_once_if_marked()  # returns: nothing to claim
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    marker.write_text("")
    crash_once_if_marked()
    assert exits == [1] and not marker.exists()
