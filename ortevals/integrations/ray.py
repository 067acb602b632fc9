"""Data-parallel evaluation on Ray: a pool of actors, each opening the package once.

Owns the only ``import ray`` (lazy, with an install hint). A run (:class:`ortevals.run.run.Run`)
hands its token requests (``score``) and generation requests (``generate``) to :class:`WorkerPool`
when ``workers`` or ``ray_address`` is set (``OrtLM.from_package`` gives the run its pool);
lm-eval itself keeps ``world_size`` 1 (the vLLM backend's pattern), so its rank split and
padding never apply on top. Each worker is a :class:`Worker` over a run of its own.

* **Cluster**: ``ray_address`` joins an existing cluster; otherwise a local one is started on
  first use and stopped at exit (a cluster already started in this process, as the tests do,
  is used and left running). ``ray.init`` takes over SIGTERM: the handler in place before it
  is put back.
* **Resources first**: ``ray.cluster_resources()`` is read before any actor is created; GPUs or
  CPUs asked for but missing are a one-line error, never a wait.
* **Workers**: one actor per worker, built per call (no actor outlives the request list it
  served). The driver opens no session (on a GPU it would take memory from worker 0): it
  holds the tokenizer and the package config; a decoder the runtime refuses is reported by the
  first worker's reply, in one line. Device providers: ``num_gpus=1``; Ray sets ``CUDA_VISIBLE_DEVICES``, so the session
  uses ``device_id=0``. CPU: ``num_cpus=k`` and ``threads=k`` (``threads``, else the cluster's
  CPUs split evenly: :meth:`WorkerPool.cpu_threads`, asked when the run opens, so the driver's scope
  records the threads the workers run with). Every other model argument is the driver's as it resolved
  them (``run.args``), so every worker computes in the driver's scope; workers never open the result store.
* **Sharding**: :mod:`ortevals.engine.shard` plans chunks (a question's choices together; a
  shared few-shot header to as few workers as possible); free workers pull chunks; the prefix
  KV a worker computed last is kept between its chunks (:class:`WarmPrefix`).
* **Nothing lost**: the driver is the only writer of the store; ``on_done`` stores each answer
  and ``after_chunk`` commits as each chunk returns. A worker that dies is restarted
  (``max_restarts``) and its chunk goes back to the queue; duplicates are dropped by
  :func:`ortevals.engine.shard.merge`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ortevals.engine.score.prefill import Score, TokenRequest
from ortevals.engine.score.scoring import NonFiniteScore, input_window
from ortevals.engine.shard import Dispatcher, merge, plan_shards
from ortevals.errors import OrtEvalsError
from ortevals.options import parse_model_args
from ortevals.run.run import Run

log = logging.getLogger(__name__)
MAX_RESTARTS = 3  # per actor: a worker that keeps dying is a bug, not bad luck
RESTART_WAIT_S = 300.0  # how long an actor Ray is restarting may stay unavailable before the run gives up
RETRY_S = 0.25  # the pause before a chunk goes back to an actor Ray is restarting
CRASH_MARKER = "ORTEVALS_RAY_CRASH_MARKER"  # tests: a worker that finds this file deletes it and exits mid-chunk


def crash_once_if_marked() -> None:
    """Tests only (``CRASH_MARKER``): the one worker that removes the marker file exits mid-chunk."""
    marker = os.environ.get(CRASH_MARKER)
    if not marker:
        return
    try:
        os.unlink(marker)  # the claim itself: of two workers that both see the file, one unlinks it
    except FileNotFoundError:
        return  # no marker, or the other worker took it (an exists() check first raced under load)
    os._exit(1)


def import_ray():
    try:
        import ray
    except ImportError:
        raise OrtEvalsError("workers/ray_address need Ray: pip install 'ortevals[ray]'") from None
    return ray


@dataclass(frozen=True)
class Placement:
    """What one worker asks Ray for and how its session is opened."""

    num_cpus: float
    num_gpus: float
    overrides: dict  # model args that differ from the driver's (threads on CPU, device_id on devices)


def placement(on_device: bool, workers: int, threads: int | None, cluster_cpus: float) -> Placement:
    """Device providers: one GPU, the session on device 0 (Ray sets CUDA_VISIBLE_DEVICES). CPU: k cores, k threads."""
    if on_device:
        return Placement(1, 1, {"device_id": "0"})
    k = threads or max(1, int(cluster_cpus // workers))
    return Placement(k, 0, {"threads": k})


def check_resources(resources: dict, workers: int, place: Placement, where: str) -> None:
    """One line when the cluster lacks what ``workers`` workers need (Ray itself would wait forever)."""
    for key, per in (("GPU", place.num_gpus), ("CPU", place.num_cpus)):
        need, have = per * workers, float(resources.get(key, 0))
        if need > have:
            raise OrtEvalsError(f"workers={workers} needs {need:g} {key}s ({per:g} per worker) but the Ray cluster "
                                f"{where} has {have:g}")


def _worker_count(ray, args, on_device: bool, resources: dict) -> int:
    """``workers``, else every GPU of the cluster (devices) or one worker per live node (CPU); 1 at least."""
    found = args.workers or (int(resources.get("GPU", 0)) if on_device else
                             len([n for n in ray.nodes() if n.get("Alive")]))
    return max(found, 1)


class WarmPrefix:
    """A runner whose last prefix pass (no past, KV wanted) is kept: a worker's next chunk under the same
    few-shot header reuses it instead of recomputing it. Same ids, same KV: numbers cannot change."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._key: bytes | None = None
        self._value = None

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, input_ids, attention_mask, past=None, want_present=False, *rest):
        if past is not None or not want_present:
            return self._runner.forward(input_ids, attention_mask, past, want_present, *rest)
        # rest: a derived graph's positions (the engine's prefix passes ask for one): part of the key
        key = b"|".join(a.tobytes() + str(a.shape).encode() for a in (input_ids, attention_mask, *rest))
        if key != self._key:
            self._key, self._value = key, self._runner.forward(input_ids, attention_mask, past, want_present, *rest)
        return self._value


class Worker:
    """The actor body: one run without a store; scores or generates one chunk per call."""

    def __init__(self, model_args: dict) -> None:
        self.failed: str | None = None
        try:  # the driver opened no session (issue 20): a package the runtime refuses is first seen here
            self.run = Run.open(parse_model_args(model_args))
        except OrtEvalsError as e:  # said by the driver in one line, not as an actor that died 3 times
            self.failed = str(e)

    def where(self) -> tuple[str | None, str | None]:
        """(CUDA_VISIBLE_DEVICES Ray gave this actor, the device id its session uses)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES"), self.run.backends.provider.options.get("device_id")

    def score(self, requests: list[tuple[tuple, tuple]]):
        crash_once_if_marked()
        if self.failed:
            return "error", self.failed, None
        engine = self.run.engine
        if hasattr(engine, "runner") and not isinstance(engine.runner, WarmPrefix):
            engine.runner = WarmPrefix(engine.runner)
        try:
            scores = engine.score([TokenRequest(c, x) for c, x in requests])
        except NonFiniteScore as e:
            return "nonfinite", str(e), e.index
        except OrtEvalsError as e:
            return "error", str(e), None
        return "ok", [(s.logprob, s.greedy) for s in scores], getattr(engine, "mode", "incremental")

    def generate(self, args: list[tuple], keys: list[list]):
        """("ok", [(text, log-prob or None, tokens, scored tokens, self-certainty or None)] per request, None):
        best-of-k needs each sample's log-prob (EOS included, over the scored tokens), which only the raw path
        computes; best-of-N by self-certainty its self-certainty (raw and og paths)."""
        crash_once_if_marked()
        if self.failed:
            return "error", self.failed, None
        try:
            texts = self.run.generate([_Req(a) for a in args], keys, lambda i, text: None, True)
        except OrtEvalsError as e:
            return "error", str(e), None
        found = [json.dumps(k, default=str) for k in keys]
        metas = [(*self.run.sample_logprobs.get(k, (None, 0, 0)), self.run.sample_certainty.get(k)) for k in found]
        return "ok", [(text, *meta) for text, meta in zip(texts, metas, strict=True)], None


@dataclass(frozen=True)
class _Req:
    """What ``Run.generate`` reads of an lm-eval Instance."""

    args: tuple


class WorkerPool:
    """The driver's side: cluster, actors per call, dispatch, merge; see the module docstring."""

    def __init__(self, args, on_device: bool) -> None:
        self.args = args
        self.on_device = on_device
        self.modes: list[str] = []
        self.workers = 0  # actors started by the last call

    # --- cluster ---------------------------------------------------------------
    def _ray(self):
        ray = import_ray()
        if not ray.is_initialized():
            before = signal.getsignal(signal.SIGTERM)
            if self.args.ray_address:
                ray.init(address=self.args.ray_address, logging_level=logging.WARNING)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this process only
                ray.init(include_dashboard=False, logging_level=logging.WARNING)
                atexit.register(ray.shutdown)
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        return ray

    @staticmethod
    def cpu_threads(args) -> int:
        """The threads each CPU worker's sessions run with (``threads``, else the cluster's CPUs split evenly over
        the workers); starts or joins the cluster."""
        ray = WorkerPool(args, False)._ray()
        resources = ray.cluster_resources()
        return int(placement(False, _worker_count(ray, args, False, resources), args.threads,
                             float(resources.get("CPU", 0))).num_cpus)

    def _actors(self, ray):
        resources = ray.cluster_resources()
        workers = _worker_count(ray, self.args, self.on_device, resources)
        self.workers = workers  # what the run summary reports
        place = placement(self.on_device, workers, self.args.threads, float(resources.get("CPU", 0)))
        check_resources(resources, workers, place, self.args.ray_address or "(local)")
        model_args = self.worker_args(place)
        env = {CRASH_MARKER: os.environ[CRASH_MARKER]} if os.environ.get(CRASH_MARKER) else {}
        remote = ray.remote(Worker).options(num_cpus=place.num_cpus, num_gpus=place.num_gpus,
                                            max_restarts=MAX_RESTARTS, runtime_env={"env_vars": env})
        return [remote.remote(model_args) for _ in range(workers)]

    def worker_args(self, place: Placement) -> dict:
        """The model args each worker opens its run with: the driver's, no store, ``place``'s overrides."""
        model_args = {k: v for k, v in asdict(self.args).items() if v not in (None, ())}
        model_args.update(store=None, workers=None, ray_address=None, **place.overrides)
        if "device_id" in place.overrides:  # a provider option, not a model arg
            model_args.pop("device_id")
            model_args["provider_options"] = (*self.args.provider_options, "device_id=0")
        return model_args

    # --- work --------------------------------------------------------------------
    def score(self, requests: Sequence, max_length: int, on_done: Callable, after_chunk: Callable[[], None]) -> list:
        """``Score``s of token requests in order; ``on_done(index, Score)`` as each chunk returns."""
        inputs = [input_window(r.context, r.continuation, max_length) for r in requests]  # what the engine runs
        units = [r.context for r in requests]  # a question's choices: one context, never split
        payload = [(r.context, r.continuation) for r in requests]

        def finish(chunk, reply):
            status, value, extra = reply
            if status == "nonfinite":
                raise NonFiniteScore(value.replace(f"request {extra}", f"request {chunk.requests[extra]}", 1),
                                     chunk.requests[extra])
            if status == "error":
                raise OrtEvalsError(value)
            self.modes.append(extra)
            out = []
            for index, (lp, greedy) in zip(chunk.requests, value):
                out.append((index, Score(lp, greedy)))
                on_done(index, out[-1][1])
            return out

        out = self._run(inputs, units, lambda a, c: a.score.remote([payload[i] for i in c.requests]), finish,
                        after_chunk, len(requests))
        if len(set(self.modes)) > 1:  # each worker ran its own invariance canary: say so if they disagreed
            log.warning("workers ran in different modes: %s", sorted(set(self.modes)))
        return out

    def generate(self, args: Sequence[tuple], keys: Sequence[list], prompts: Sequence[Sequence[int]],
                 on_done: Callable[[int, str, float | None, int, int, float | None], None],
                 after_chunk: Callable[[], None]) -> list[str]:
        """Generated texts in order; identical prompts (samples of one prompt) stay in one chunk.
        ``on_done(index, text, log-prob or None, tokens, scored tokens, self-certainty or None)`` as each
        chunk returns."""
        def finish(chunk, reply):
            status, value, _ = reply
            if status == "error":
                raise OrtEvalsError(value)
            for index, (text, logprob, tokens, scored, certainty) in zip(chunk.requests, value, strict=True):
                on_done(index, text, logprob, tokens, scored, certainty)
            return [(index, row[0]) for index, row in zip(chunk.requests, value, strict=True)]

        return self._run([tuple(p) for p in prompts], [tuple(p) for p in prompts],
                         lambda a, c: a.generate.remote([args[i] for i in c.requests], [keys[i] for i in c.requests]),
                         finish, after_chunk, len(args))

    def _run(self, inputs, units, submit, finish, after_chunk, n: int) -> list:
        if not n:
            return []
        ray = self._ray()
        actors = self._actors(ray)
        try:
            return merge(n, self._loop(ray, actors, plan_shards(inputs, len(actors), units), submit, finish,
                                       after_chunk))
        finally:
            for a in actors:
                ray.kill(a)

    def _loop(self, ray, actors, plan, submit, finish, after_chunk):
        """Pull loop: each free actor gets its next chunk; a dead actor's chunk is queued again. An actor Ray is
        still restarting answers ``ActorUnavailableError`` (Ray >= 2.x) until it is back: its chunk is queued again
        after a pause, not counted as a death (under load a restart takes seconds, and counting each refusal
        exhausted ``MAX_RESTARTS`` while the actor was coming back)."""
        dispatch = Dispatcher(plan.chunks)
        pending: dict = {}
        lost, waited = 0, {}  # waited: seconds each actor Ray is restarting has been unavailable
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())

        def give(w: int) -> None:
            chunk = dispatch.next(w)
            if chunk is not None:
                pending[submit(actors[w], chunk)] = (w, chunk)

        for w in range(len(actors)):
            give(w)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            w, chunk = pending.pop(ready[0])
            try:
                reply = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                if isinstance(e, unavailable):  # restarting: wait for it, bounded
                    if w not in waited:  # the chunk it was running is lost with it (Ray 2.60 says so this way)
                        log.warning("worker %d died mid-chunk (%d requests; Ray is restarting it); the chunk goes "
                                    "back to the queue", w, len(chunk.requests))
                    waited[w] = waited.get(w, 0.0) + RETRY_S
                    if waited[w] > RESTART_WAIT_S:
                        raise OrtEvalsError(f"Ray worker {w} stayed unavailable (restarting) for {RESTART_WAIT_S:.0f} "
                                            f"s; last: {e}") from None
                    time.sleep(RETRY_S)
                else:
                    lost += 1
                    if lost > MAX_RESTARTS * len(actors):
                        raise OrtEvalsError(f"Ray workers died {lost} times; last: {e}") from None
                    log.warning("worker %d died mid-chunk (%d requests); the chunk goes back to the queue", w,
                                len(chunk.requests))
                dispatch.requeue(chunk)
                give(w)  # the restarted actor (max_restarts) takes work again
                continue
            waited.pop(w, None)  # back: its next restart gets the whole wait again
            yield from finish(chunk, reply)
            after_chunk()
            give(w)
