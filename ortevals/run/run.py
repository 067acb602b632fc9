"""The run object: package, tokenizer, engines, result store, canary verdicts, stats and modes.

Owns opening a run from the model arguments (:meth:`Run.open`: the package and tokenizer
loaded, the engines' settings, the log-likelihood path opened now unless workers will, the
result store opened under the scope of everything every path reads), the package's token
facts (EOS, BOS, context limit), answers read from and written to the store, scoring token
requests on the engine or a worker pool (:meth:`Run.score`), generation
(:mod:`ortevals.run.generate`), and the run's stats and mode per request kind. It knows no
front door: lm-eval's ``OrtLM`` (integrations/lm.py), the Ray workers (integrations/ray.py)
and the media router are adapters over it. ``Run(...)`` does no I/O; :meth:`Run.open` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ortevals.engine.backends import Backends, capability, loglikelihood_path
from ortevals.engine.generate.choice.settings import SEARCH_POLICY
from ortevals.engine.generate.rows.cascade_kv import decoder_bytes
from ortevals.engine.score.prefill import EngineSettings, Score, TokenRequest
from ortevals.engine.score.scoring import context_limit, effective_max_length
from ortevals.errors import OrtEvalsError
from ortevals.files import cache_root
from ortevals.options import ModelArgs, check_provider, scoped_settings
from ortevals.package.adapters import AdapterSpec
from ortevals.package.graph import graph_facts
from ortevals.package.loader import CONFIG_NAME, ModelPackage
from ortevals.package.multimodal import check_media_tokens, has_media_models
from ortevals.package.reuse import reuse_policy
from ortevals.package.scope import Reads
from ortevals.package.tokenizer import Tokenizer, tokenizer_reads
from ortevals.report import resume
from ortevals.report.model_info import model_info
from ortevals.report.scope import results_scope
from ortevals.report.store import ResultStore
from ortevals.run.generate import Generation, decode_plan
from ortevals.run.progress import Progress
from ortevals.runtime.adapters import run_adapter
from ortevals.runtime.buffers import kv_bytes_per_token
from ortevals.runtime.memory import total_bytes
from ortevals.runtime.meter import boot_clock
from ortevals.runtime.opening import check_available
from ortevals.runtime.providers import ProviderConfig, from_package, parse_options, provider_mode
from ortevals.runtime.sessions import BIND_DEVICES

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048
CPU_TOKEN_BUDGET = 1024  # auto batch on CPU: more tokens per pass only add memory traffic
DEVICE_SHARED_TOKENS = 16384  # own tokens a shared-prefix pass holds on a device (compute-bound: GPU_SCORING.md)
DEVICE_SHAPE_BUCKET = 32  # own-token widths on a device: shapes repeat (kernel plans, the arena), <= 8% padding
NO_STORE = ("none", "off", "false", "no")  # store=none: no result store (lm-eval's route has one by default)
# lm-eval's own code splits context/continuation (_encode_pair) and cuts rolling windows
LM_EVAL_READS = Reads("lm-eval requests", dists=("lm-eval",))
# request kinds whose compute tokenizes its requests before it needs a session (and calls Run.ready then)
TOKENIZE_FIRST = ("loglikelihood", "loglikelihood_rolling")
ENCODED_KEPT = 1024  # texts whose ids tok_encode keeps (tens of MB at most: two chunks of OrtLM's ENCODE_AHEAD)


class Run:
    """One run's state; see the module docstring."""

    def __init__(self, package: ModelPackage, tokenizer: Tokenizer, backends: Backends, args: ModelArgs,
                 store: ResultStore | None = None) -> None:
        self.package = package
        self.tokenizer = tokenizer
        self.backends = backends
        self.args = args
        self.store = store
        self.pool = None  # issue 15: a Ray WorkerPool when workers/ray_address is set (integrations/ray.py)
        self.stats = {"requests": 0, "seconds": 0.0, "generated_tokens": 0, "truncated": 0, "reused": 0}
        self.sample_logprobs: dict[str, tuple[float, int, int]] = {}  # key (JSON) → (log-prob, tokens, scored)
        self.sample_certainty: dict[str, float] = {}  # key (JSON) → self-certainty (raw and og paths)
        self.step_scorer = None  # issue 25 --search: the PRM (engine/generate/search/prm.py), set by the front door
        self.search_reward = "logit"  # the verifier's scores are probabilities (P(True), runtime/reward.py)
        self.search_verifier = None  # --search: the verifier behind step_scorer (integrations/verify.py)
        self._encoded: dict[tuple[str, bool | None], tuple[int, ...]] = {}  # tok_encode's last texts, oldest first
        self._modes: dict[str, str] = {}  # which mode ran and why, per request kind (stats["mode"] joins them)
        self.on_first_request = None  # called once when the first requests arrive (the CLI's collector, cli.py)
        self.generation = Generation(self)  # generate_until: its path, canary plans and the raw sampler
        self.min_saving: int | None = None  # tokens a shared prefix must save in this call (prefix_saving)
        self._progress: Progress | None = None  # the bar a run that scores in parts keeps open between them
        self._narrowed: tuple[list[Reads], dict] = ([], {})  # what narrow_scope added to the store's scope
        self._unshared = False  # the store's scope says shared_prefix_batch=off where it was refused (_follow)
        backends.on_shared_refused = self._follow

    @classmethod
    def open(cls, args: ModelArgs, open_soon: bool = False, worker_threads: Callable[[], int] | None = None) -> Run:
        """Load the package and tokenizer; open the log-likelihood path now (``open_soon``: on a thread while
        the caller loads its data, an error there raised at the first request), generation on first use.

        ``worker_threads``: with workers on CPU and no ``threads`` given, the threads each worker's sessions will
        run with (integrations/ray.py), so the scope records what computes the numbers. ``run.args`` holds what
        was resolved here (those threads, :func:`~ortevals.run.generate.decode_plan`'s budget and cascade)."""
        package = ModelPackage.load(args.pkg, args.ep)
        tokenizer = Tokenizer.load(package, add_bos_token=args.add_bos_token)
        check_media_tokens(package, tokenizer.backend)  # issue 22: a media token id that text produces
        adapter = run_adapter(package, args.adapter, has_media_models(package))  # before any session opens
        provider = from_package(package.decoder.session_options, args.ep, parse_options(args.provider_options),
                                args.threads, allow_cpu_fallback=args.allow_cpu_fallback)
        if worker_threads is not None and args.threads is None and not provider.on_device:
            args = dataclasses.replace(args, threads=worker_threads())
            provider = from_package(package.decoder.session_options, args.ep, parse_options(args.provider_options),
                                    args.threads, allow_cpu_fallback=args.allow_cpu_fallback)
        check_provider(args, provider.on_device, provider.name)  # allow_cpu_fallback on the CPU: one line
        args = resolve_passes(args, package, provider)
        if args.threads != provider.intra_op_threads and args.threads is not None:  # passes: one thread each
            provider = from_package(package.decoder.session_options, args.ep, parse_options(args.provider_options),
                                    args.threads, allow_cpu_fallback=args.allow_cpu_fallback)
        args = shared_prefix_plan(decode_plan(args, package, provider), package, provider)
        settings = engine_settings(package, provider, args)
        backends = Backends(package, provider, settings, args.path, cache_root() if args.scoring_graph else None,
                            args.gen_path, args.media_path, args.cascade, adapter)
        workers = bool(args.workers or args.ray_address)  # issue 20: the driver opens no session (workers do)
        if not workers:  # a provider this install lacks (a plugin offering no device): one line, on every path
            check_available(provider)
        if backends.loglikelihood_path == "prefill" and not workers:
            if open_soon:  # issue 26: opening overlaps lm-eval's data loading and tokenizing
                backends.open_soon()
            else:
                backends.prefill  # noqa: B018  (open now: a bad package fails before any data is loaded)
        log.info("loglikelihood requests go to the %s path%s", backends.loglikelihood_path,
                 f" ({backends.capability.reason})" if backends.capability.reason else "")
        store, unshared = None, bool(backends.shared_refused)  # (before the scope: a later refusal rescopes)
        if args.store and args.store.lower() not in NO_STORE:
            store = open_store(Path(args.store), package, tokenizer, backends, args)
        # resume=false: answers neither read nor written; the store still keeps the canary's verdicts (issue 26)
        run = cls(package, tokenizer, backends, args, store if args.resume else None)
        run._unshared = unshared
        if mode := provider_mode(provider):  # TF32 and the CPU fallback on a device provider
            run.set_mode("provider", mode)
        return run

    # --- the package's token facts -------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.special.eos_id
        if eos is None:
            raise OrtEvalsError(f"{self.package.root}: no eos token in tokenizer_config.json or genai_config.json")
        return eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.special.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.backends.settings.max_length  # not self.engine: that would open a session

    @property
    def max_gen_toks(self) -> int:
        return self.args.max_gen_toks

    @property
    def context_limit(self):
        """The context limit, where it came from (for the error) and the truncate policy."""
        return context_limit(self.max_length, self.args.max_length, self.package.context_length,
                             self.package.root / CONFIG_NAME, self.args.truncate)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None) -> list[int]:
        """The tokenizer's ids for ``string``, remembered for the last :data:`ENCODED_KEPT` texts: lm-eval's
        ``_encode_pair`` encodes a multiple-choice context once per choice (ten times for MMLU-Pro)."""
        key = (string, add_special_tokens)
        ids = self._encoded.get(key)
        if ids is None:
            ids = self._encoded[key] = tuple(self.tokenizer.encode(string, add_special_tokens))
            if len(self._encoded) > ENCODED_KEPT:
                del self._encoded[next(iter(self._encoded))]  # the oldest
        return list(ids)

    def encode_ahead(self, keys: list[tuple[str, bool | None]]) -> None:
        """Encode now, in one batch (:meth:`Tokenizer.encode_many`), the texts :meth:`tok_encode` will be
        asked for next, ``(text, add_special_tokens)`` each: they join its kept texts (at most
        :data:`ENCODED_KEPT`; those already kept move to the newest end). Only the time changes: a text asked
        for that is not kept is encoded then, alone."""
        self.keep_encoded(self.encode_texts([k for k in dict.fromkeys(keys) if k not in self._encoded]))
        for key in dict.fromkeys(keys):  # those already kept move to the newest end too
            if key in self._encoded:
                self._encoded[key] = self._encoded.pop(key)
        while len(self._encoded) > ENCODED_KEPT:
            del self._encoded[next(iter(self._encoded))]

    def encode_texts(self, keys: list[tuple[str, bool | None]]) -> dict[tuple[str, bool | None], tuple[int, ...]]:
        """``(text, add_special_tokens)`` → ids, each flag's texts in one batch (:meth:`Tokenizer.encode_many`, on
        every core). Keeps nothing: safe on another thread while this one works (:meth:`keep_encoded` keeps)."""
        keys = list(dict.fromkeys(keys))[-ENCODED_KEPT:]
        out = {}
        for flag in {f for _, f in keys}:
            texts = [t for t, f in keys if f == flag]
            out.update({(t, flag): tuple(ids) for t, ids in zip(texts, self.tokenizer.encode_many(texts, flag),
                                                                strict=True)})
        return out

    def keep_encoded(self, encoded: dict[tuple[str, bool | None], tuple[int, ...]]) -> None:
        """Texts :meth:`encode_texts` encoded join the kept ones (the oldest leave past :data:`ENCODED_KEPT`)."""
        self._encoded.update(encoded)
        while len(self._encoded) > ENCODED_KEPT:
            del self._encoded[next(iter(self._encoded))]

    def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens)

    def model_info(self) -> dict:
        """What was scored (report/model_info.py): package, precision, provider and every model argument."""
        return model_info(self.package, self.backends.provider, self.args)

    def use_adapter(self, value: str) -> None:
        """Another LoRA adapter (``FILE[=NAME]``, checked by the caller) from now on, on the sessions already open
        (engine/backends.py ``Backends.use_adapter``): its answers keyed under its own scope, and nothing made under
        the previous one (held prompt KV, canary verdicts and plans, samples' log-probs) serves it."""
        if self.pool is not None:
            raise OrtEvalsError("adapter: several adapters run in this process, not on workers; drop --workers")
        self.ready()
        self.backends.use_adapter(AdapterSpec.parse(value))
        self.args = dataclasses.replace(self.args, adapter=(value,))
        self.generation.restart()
        self.sample_logprobs.clear()
        self.sample_certainty.clear()
        self.narrow_scope(*self._narrowed)  # the store's scope holds the adapter file's content

    # --- the result store ----------------------------------------------------------------------
    def reads(self) -> list[Reads]:
        """What this run's paths read (the records its store's scope is built from)."""
        return run_reads(self.package, self.tokenizer, self.backends)

    def narrow_scope(self, reads: list[Reads], settings: dict) -> None:
        """From now on the store (answers and canary verdicts) keys under the run's scope plus ``reads`` and
        ``settings`` (issue 25: a --search run's answers depend on its search settings and its verifier)."""
        self._narrowed = (reads, settings)
        store = self.backends.verdicts.store
        if store is not None:
            base = run_settings(self.args, self.backends)
            store.rescope(results_scope(self.package.root, [*self.reads(), *reads], base | settings))

    def _follow(self) -> None:
        """shared_prefix_batch=on refused (its graph at open, or its first pass): every input ran one a pass, so
        answers and verdicts are kept under shared_prefix_batch=off's scope from now on (:func:`run_settings`)."""
        if self.backends.shared_refused and not self._unshared:
            self._unshared = True
            self.narrow_scope(*self._narrowed)

    def stored(self, kind: str, requests, compute, decode=lambda v: v, key_args=list) -> list:
        """Answers from the store where it has them; ``compute(todo, keys)`` runs (and stores) the rest.

        Sessions opening on a thread (``open_soon``) are waited for first, so their error comes before any
        request's own checks; log-likelihood kinds tokenize first (lm-eval's ``_encode_pair``, while the
        sessions still open) and wait in :meth:`ready`, called before their checks."""
        if self.on_first_request is not None:
            hook, self.on_first_request = self.on_first_request, None
            hook()
        if kind not in TOKENIZE_FIRST:
            self.ready()
        out = resume.answer(self.store, kind, requests, compute, decode, self.stats, key_args)
        self.ready()  # every request reused or sent elsewhere (media): the opening's error all the same
        return out

    def ready(self) -> None:
        """Wait for the sessions opening on a thread, if any, and raise their error (nothing otherwise)."""
        self.backends.ready()
        self._follow()  # the shared-prefix graph refused there, after the store's scope was made

    def put(self, kind: str, key: list, value) -> None:
        """One answer into the store (none when the run has no store)."""
        if self.store is not None:
            self.store.put(kind, key, value)

    def commit(self) -> None:
        """After each chunk a worker returns: its answers are on disk (issue 15)."""
        if self.store is not None:
            self.store.commit()

    # --- modes and scoring -----------------------------------------------------------------------
    @property
    def engine(self):
        """The engine serving log-likelihood requests."""
        return self.backends.scorer()

    def set_mode(self, kind: str, mode: str) -> None:
        if mode:
            self._modes[kind] = mode
        self.stats["mode"] = "; ".join(self._modes.values())

    @contextlib.contextmanager
    def prefix_saving(self, tokens: int):
        """While the block runs, the prefill engine gives every shared prefix that saves ``tokens`` a pass of
        its own (default: 64): P(True) requests share short runs (an answer's steps, an (A)/(B) pair)."""
        before, self.min_saving = self.min_saving, tokens
        try:
            yield
        finally:
            self.min_saving = before

    def score(self, token_reqs: list[TokenRequest], on_done, disable_tqdm: bool, units=None,
              later: int = 0) -> list[Score]:
        """Scores in order; ``on_done(index, Score)`` as each finishes (on the engine, or on the workers
        with ``pool``, whose answers come back and are stored here). ``units``: each request's question, which
        the progress bar counts (run/progress.py). ``later``: requests whose calls follow this one (the rest of
        a run that scores while it tokenizes them; ``units`` names theirs too): one progress bar over all."""
        inputs = [r.context if len(r.continuation) == 1 else r.context + r.continuation[:-1] for r in token_reqs]
        bar = self._progress
        offset = bar.more(inputs) if bar is not None else 0
        if bar is None:
            bar = self._progress = Progress(inputs, units, disable=disable_tqdm, later=later)
        del inputs

        def done(index: int, score: Score) -> None:
            on_done(index, score)
            bar.done(offset + index)

        start = time.perf_counter()
        self.begin()
        try:
            if self.pool is not None:  # issue 15: workers on Ray; answers come back (and are stored) here
                return self.pool.score(token_reqs, self.max_length, done, self.commit)
            if self.min_saving is None:
                return self.engine.score(token_reqs, done)
            return self.engine.score(token_reqs, done, min_saving=self.min_saving)
        except BaseException:
            bar.later = 0  # the calls that were to follow will not: the next call gets a bar of its own
            raise
        finally:
            if not bar.later:
                bar.close()
                self._progress = None
            self.stats["requests"] += len(token_reqs)
            self.stats["seconds"] += time.perf_counter() - start
            self.set_mode("loglikelihood", (self.pool.modes or ["batched"])[0] if self.pool is not None else
                          getattr(self.engine, "mode", "incremental"))  # which mode ran and why

    def generate(self, requests, keys: list[list], on_text, disable_tqdm: bool) -> list[str]:
        """Generated texts in order (:meth:`ortevals.run.generate.Generation.generate`)."""
        self.begin()
        return self.generation.generate(requests, keys, on_text, disable_tqdm)

    def begin(self) -> None:
        """The run computes from now (start-up ends here unless a metered pass came first): og's path, the media
        paths and Ray workers run no pass the run's meter sees (runtime/meter.py ``PassMeter.begin``)."""
        self.backends.meter.begin(boot_clock())


def resolve_passes(args: ModelArgs, package: ModelPackage, provider: ProviderConfig) -> ModelArgs:
    """``passes`` as this run uses it (engine/score/parallel.py): 1 on a device, with workers, or where
    log-likelihoods go to onnxruntime-genai; ``auto``: one per usable core unless ``threads`` is set. More than
    one pass at a time gives each one onnxruntime thread unless ``threads`` says otherwise."""
    passes = args.passes
    workers = bool(args.workers or args.ray_address)
    if provider.on_device or workers or loglikelihood_path(args.path, capability(package, provider)) != "prefill":
        passes = 1
    elif passes == 0:
        passes = len(os.sched_getaffinity(0)) if args.threads is None and hasattr(os, "sched_getaffinity") else 1
    threads = 1 if passes > 1 and args.threads is None else args.threads
    return dataclasses.replace(args, passes=max(1, passes), threads=threads)


def engine_settings(package: ModelPackage, provider: ProviderConfig, args: ModelArgs) -> EngineSettings:
    """The engines' settings from the model arguments, the package and where the provider runs."""
    return EngineSettings(
        max_length=effective_max_length(args.max_length, package.context_length, package.root / CONFIG_NAME,
                                        DEFAULT_MAX_LENGTH),
        vocab_size=package.vocab_size,
        batch_size=args.batch_size,
        pad_token_id=package.pad_token_id or 0,
        memory_budget_mb=args.memory_budget_mb,
        token_budget=0 if provider.on_device else CPU_TOKEN_BUDGET,
        prefix_cache=args.prefix_cache,
        reuse=reuse_policy(package),  # what cached KV may be reused for (package/reuse.py)
        prefix_budget_mb=args.prefix_budget_mb,
        # onnxruntime's GroupQueryAttention refuses several rows of several new tokens on a past, on CPU and CUDA
        # alike (group_query_attention_helper.h CheckInputs, docs/runtime-facts.md): never tried; inputs under one
        # prefix are batched by the shared-prefix graph instead (issue 46)
        prefix_batch=1,
        shared_prefix_batch=args.shared_prefix_batch == "on",  # resolved by shared_prefix_plan
        shared_buffer=True,  # one input a pass writes into the held prefix's buffer (bit-identical; no copy a pass)
        shape_bucket=DEVICE_SHAPE_BUCKET if provider.on_device else 1,
        shared_token_budget=DEVICE_SHARED_TOKENS if provider.on_device else CPU_TOKEN_BUDGET,
        attention_heads=max(graph_facts(package.decoder.path).attention_heads or {1}),
        rotary_rows=graph_facts(package.decoder.path).rotary_rows,  # a bucketed pass spans no more positions
        kv_bytes_per_token=kv_bytes_per_token(package),
        exact=args.exact, check=args.check,  # invariance switches (engine/score/invariance.py)
        passes=1 if provider.on_device else args.passes,
    )


def shared_prefix_plan(args: ModelArgs, package: ModelPackage, provider: ProviderConfig) -> ModelArgs:
    """``args`` with ``shared_prefix_batch`` resolved to on or off: off where the options leave it nothing to do
    (no prefix reuse, no scoring graph, exact mode); ``auto`` is on for a device provider unless its second
    session of the decoder would take more than half of the memory the device holds beside the first, and off
    on CPU (docs/benchmarks.md: 10% faster there, but the weights twice in memory, a later first result, and a
    question's numbers move by float32 rounding with the prefix it was batched under, so a resumed run equals
    a whole one within 1e-5, not bit for bit). The same on every run on one machine, and recorded in the
    run's scope (the resolved value, and the shared-prefix graph's reads where on)."""
    if not (args.prefix_cache and args.scoring_graph) or args.exact:
        return dataclasses.replace(args, shared_prefix_batch="off")
    if args.shared_prefix_batch != "auto":
        return args
    if not provider.on_device:
        return dataclasses.replace(args, shared_prefix_batch="off")
    device = BIND_DEVICES.get(provider.name, "cpu")
    total = total_bytes(device, int(provider.raw_options.get("device_id", 0) or 0))
    weights = decoder_bytes(package)
    if total is not None and 3 * weights > total:
        log.info("shared-prefix batches off: a second session of the decoder (%.1f MiB of weights) would take more "
                 "than half of the %.1f MiB the %s holds beside the first", weights / 2**20, total / 2**20, device)
        return dataclasses.replace(args, shared_prefix_batch="off")
    return dataclasses.replace(args, shared_prefix_batch="on")


def run_reads(package: ModelPackage, tokenizer: Tokenizer, backends: Backends) -> list[Reads]:
    """What every path of a run reads (files, the settings each hands its runtime, the libraries that compute)."""
    return [tokenizer_reads(package), LM_EVAL_READS, *backends.reads()]


def run_settings(args: ModelArgs, backends: Backends) -> dict:
    """Every option that can change a number, and what the run derived from them (shared_prefix_batch=off where
    the shared-prefix graph was refused: what ran)."""
    return scoped_settings(args) | {"effective_max_length": backends.settings.max_length,
                                    "search_policy": SEARCH_POLICY} | (
        {"shared_prefix_batch": "off"} if getattr(backends, "shared_refused", "") else {})


def open_store(path: Path, package: ModelPackage, tokenizer: Tokenizer, backends: Backends,
               args: ModelArgs) -> ResultStore:
    """The result store under this run's scope: what every path of the run reads (package/scope.py) and
    every option that can change a number. Canary verdicts are kept under the same scope (issue 22 §9)."""
    scope = results_scope(package.root, run_reads(package, tokenizer, backends), run_settings(args, backends))
    store = ResultStore.open(path, scope)
    backends.verdicts.store = store
    return store
