"""Which scoring path serves which request type, and opening each path once.

Owns the capability check made at load (can this package and provider return
logits for every position?), the user's ``path=auto|prefill|incremental`` and
``gen_path=auto|raw|og`` choices, lazy opening: the raw-ORT prefill sessions and
the onnxruntime-genai model are opened on first use, so a log-likelihood run
never holds the second copy of the weights that og would load (the prefill engine
may be opened on a thread while lm-eval loads data: :meth:`Backends.open_soon`), the
run's :class:`~ortevals.runtime.meter.PassMeter`, and
:meth:`Backends.reads`: what every path this run can open reads, from the same
functions the openers use (the result store's scope is built from it alone).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, replace

from ortevals.engine.score.incremental import STEPPING, IncrementalEngine
from ortevals.engine.score.invariance import Verdicts
from ortevals.engine.score.prefill import EngineSettings, PrefillEngine
from ortevals.errors import OrtEvalsError, PackageError
from ortevals.package.loader import ModelPackage
from ortevals.package.multimodal import has_media_models
from ortevals.package.scope import Reads, package_reads
from ortevals.runtime.adapters import adapter_reads
from ortevals.runtime.cascade import Refused, cascade_reads
from ortevals.runtime.genai import genai_reads
from ortevals.runtime.media import media_reads
from ortevals.runtime.meter import PassMeter
from ortevals.runtime.opening import check_available
from ortevals.runtime.prefix_runner import PrefixRunner, prefix_reads
from ortevals.runtime.providers import NPU_PROVIDERS, ProviderConfig
from ortevals.runtime.raw_steps import RawSteps
from ortevals.runtime.reads import runner_reads

log = logging.getLogger(__name__)
PATHS = ("auto", "prefill", "incremental")
# the engine's own maths (scoring, token choice, seeded draws) and MBR's utilities (engine/generate/search/mbr.py)
ENGINE_READS = (Reads("engine", dists=("numpy",)), Reads("mbr", dists=("sacrebleu", "rouge-score")))


@dataclass(frozen=True)
class Capability:
    full_logits: bool  # one pass can return logits for every position
    reason: str = ""


def capability(package: ModelPackage, provider: ProviderConfig) -> Capability:
    """Detected at load, from the graph's logits shape and the provider."""
    positions = package.logits_positions
    if positions == 1:
        return Capability(False, "the LM head is pruned to the last position (logits [B,1,V])")
    if isinstance(positions, int) and positions > 1:
        return Capability(False, f"logits have a fixed window of {positions} positions")
    if provider.name in NPU_PROVIDERS:
        return Capability(False, f"{provider.name} packages run through onnxruntime-genai")
    return Capability(True)


def loglikelihood_path(requested: str, cap: Capability) -> str:
    if requested not in PATHS:
        raise OrtEvalsError(f"path must be one of {', '.join(PATHS)}, got {requested!r}")
    if requested == "prefill" and not cap.full_logits:
        raise OrtEvalsError(f"path=prefill is impossible for this package: {cap.reason}")
    if requested == "auto":
        return "prefill" if cap.full_logits else "incremental"
    return requested


class Backends:
    """The package's scoring paths, each opened on first use."""

    def __init__(self, package: ModelPackage, provider: ProviderConfig, settings: EngineSettings,
                 path: str = "auto", derived_cache=None, gen_path: str = "auto", media_path: str = "auto",
                 cascade: str = "auto", adapter=None) -> None:
        self.package = package
        self.provider = provider
        self.settings = settings
        self.derived_cache = derived_cache
        self.capability = capability(package, provider)
        self.loglikelihood_path = loglikelihood_path(path, self.capability)
        self.gen_path = gen_path
        self.media_path = media_path
        self.cascade = cascade  # decode rows on one shared prompt KV (engine/generate/rows/cascade_kv.py)
        self.adapter = adapter  # a LoRA adapter active on every path (runtime/adapters.py), or None
        self.meter = PassMeter()  # tokens and seconds of every raw pass of the run (runtime/meter.py)
        self._opening: _Opening | None = None  # open_soon's thread
        self.verdicts = Verdicts()  # canary verdicts; OrtLM gives it the result store (engine/score/invariance.py)
        self.shared_refused = ""  # why shared_prefix_batch=on cannot serve this package (runtime/prefix_graph.py)
        self.on_shared_refused = None  # called (on the scoring thread) when the graph refuses the engine's first pass

    @functools.cached_property
    def prefill(self) -> PrefillEngine:
        """The prefill engine: the one :meth:`open_soon` is opening (waited for), else opened now."""
        opening, self._opening = self._opening, None
        if opening is None:
            return self._open_prefill()
        opening.join()
        if isinstance(opening.result, BaseException):
            raise opening.result
        return opening.result

    def open_soon(self) -> None:
        """Start opening the prefill engine on a thread (the derived graph, onnxruntime's session creation,
        which releases the GIL, and the probe) while lm-eval loads the data and tokenizes; :attr:`prefill`
        waits for it, and an error there is raised there. The settings are decided here, on this thread."""
        if "prefill" in self.__dict__ or self._opening is not None:
            return
        check_available(self.provider)  # a provider this install lacks: one line before any data is loaded
        self.prefill_choice  # noqa: B018  (decided once, before the thread reads it)
        self._opening = _Opening(self._open_prefill)

    def ready(self) -> None:
        """Wait for :meth:`open_soon`'s thread, if one is opening, and raise its error (nothing otherwise)."""
        if self._opening is not None:
            self.prefill  # noqa: B018

    def use_adapter(self, spec) -> None:
        """Another LoRA adapter (an :class:`~ortevals.package.adapters.AdapterSpec`, checked by the caller) from now
        on, on the sessions already open (runtime/adapters.py ``Adapter.switch``); the prefill engine's canary
        verdict and the pass meter start over, as in a run opened with it."""
        if self.adapter is None:
            raise OrtEvalsError(f"adapter {spec.path}: this run was opened without an adapter; open it with one")
        self.ready()
        self.adapter.switch(spec)
        engine = self.__dict__.get("prefill")
        if engine is not None:  # the settings and mode it was opened with, the canary not yet run
            (engine.settings, engine.mode), engine.canary = self.prefill_choice, None
        self.meter.reset()

    def _open_prefill(self) -> PrefillEngine:
        from ortevals.runtime.sessions import DecoderRunner

        settings, mode = self.prefill_choice
        runner = DecoderRunner.open(self.package, self.provider, self._derived(settings), adapter=self.adapter)
        runner.meter = self.meter  # one meter for the run's passes (runtime/meter.py)
        engine = PrefillEngine(runner, settings, self.verdicts, self._shared_runner(runner, settings))
        engine.mode, engine.shared_refused = mode, self.shared_refused
        engine.on_refused = self._refused
        return engine

    def _refused(self, why: str) -> None:
        """The shared-prefix graph refused the engine's first pass: every input ran one a pass, as with
        shared_prefix_batch=off (:meth:`reads` from now on; the run keys its answers so)."""
        self.shared_refused = why
        if self.on_shared_refused is not None:
            self.on_shared_refused()

    def _shared_runner(self, runner, settings: EngineSettings):
        """The shared-prefix scoring session (runtime/prefix_runner.py) where ``shared_prefix_batch`` resolved to
        on and the package's attention can be rewritten; None otherwise (one logged line saying why)."""
        if not settings.shared_prefix_batch or settings.exact or self._derived(settings) is None:
            return None
        try:
            return PrefixRunner.open(runner, self.provider, self.derived_cache)
        except (Refused, OrtEvalsError) as e:  # onnxruntime refusing the derived graph too: the plain path serves
            self.shared_refused = str(e)
            log.info("shared-prefix batches: not for this package (%s); one input a pass on shared prefixes", e)
            return None

    def _derived(self, settings: EngineSettings):
        # exact mode means the package's own decoder: the derived graph changes which rows the head sees
        return None if settings.exact else self.derived_cache

    @functools.cached_property
    def prefill_choice(self) -> tuple[EngineSettings, str]:
        """The prefill engine's settings and mode, decided once (graph detection reads the protos)."""
        return self._prefill_settings()

    @property
    def exact(self) -> bool:
        """One row per pass, no prefix reuse: asked for, detected in the graph, or the canary's verdict."""
        engine = self.__dict__.get("prefill")
        return engine.settings.exact if engine is not None else self.prefill_choice[0].exact

    def generation_path(self) -> tuple[str, str]:
        """(``raw`` or ``og``, why the raw path cannot serve this package or ""), from ``gen_path``."""
        from ortevals.engine.generate.rows.sampler import can_serve

        ok, why = can_serve(self.package, self.capability)
        if self.gen_path == "raw" and not ok:
            raise OrtEvalsError(f"gen_path=raw is impossible for this package: {why}; gen_path=og (or auto) "
                                "generates on onnxruntime-genai")
        return (self.gen_path if self.gen_path != "auto" else ("raw" if ok else "og")), why

    def reads(self) -> list[Reads]:
        """What every path this run can open reads: the package, the engine, log-likelihood and generation
        paths as chosen, and the media path where the package has vision or speech models."""
        out = [package_reads(self.package), *ENGINE_READS]
        if self.adapter is not None:  # every path runs with it: its file by content
            out += adapter_reads((self.adapter.spec,))
        try:
            gen = self.generation_path()[0]
        except OrtEvalsError:
            gen = "raw"  # refused at the first generate_until request
        if self.loglikelihood_path == "prefill" or gen == "raw":
            out += runner_reads(self.package, self.provider, self._derived(self.prefill_choice[0]))
        shared = self.prefill_choice[0].shared_prefix_batch and not self.shared_refused  # refused: nothing read
        if self.loglikelihood_path == "prefill" and shared:
            out += prefix_reads(self.package, self.provider)
        if gen == "raw" and self.cascade != "off":  # its session's record is the raw sessions' own
            out.append(cascade_reads(self.package))
        if self.loglikelihood_path == "incremental" or gen == "og":
            out.append(genai_reads(self.package, self.provider))
        if has_media_models(self.package):
            out.append(media_reads(self.package, self.provider))
            out += self._fast_media_reads()
        return out

    def _fast_media_reads(self) -> list[Reads]:
        from ortevals.engine.media.fast import fast_layout, fast_reads

        if self.media_path == "og" or not fast_layout(self.package)[0]:
            return []
        try:
            return fast_reads(self.package, self.provider)
        except PackageError:  # not a type the media path takes: its first request says so
            return []

    def _prefill_settings(self) -> tuple[EngineSettings, str]:
        """Settings for the prefill engine: exact mode when asked or when the graph mixes rows."""
        from ortevals.engine.score.invariance import detect

        out = self.package.decoder.output(self.package.logits_name)
        settings = replace(self.settings, dtype=out.dtype if out is not None else "float32")
        if settings.exact:
            return settings, "exact (forced: exact=true)"
        if settings.reuse.refused:  # a length switch whose threshold is unknown: no batch or prefix is safe
            log.warning("%s; scoring in exact mode: one row per pass, no prefix reuse", settings.reuse.refused)
            return replace(settings, exact=True), f"exact ({settings.reuse.refused})"
        models = [m.path for m in (self.package.embedding, self.package.decoder) if m is not None]
        found = detect(models, [self.package.decoder.inputs.get("attention_mask", "attention_mask")])
        if found.found:
            log.warning("%s: this graph's numbers depend on what else is in a pass (%s); scoring in exact mode: "
                        "one row per pass, no prefix reuse, full logits", self.package.decoder.path, found.reason)
            return replace(settings, exact=True), f"exact ({found.reason})"
        return settings, "batched" if settings.check else "batched (check=false: invariance not checked)"

    @functools.cached_property
    def genai(self):
        from ortevals.runtime.genai import GenaiRunner

        return GenaiRunner.open(self.package, self.provider, self.adapter)

    @functools.cached_property
    def incremental(self) -> IncrementalEngine:
        settings = replace(self.settings, exact=self.exact)  # asked for or detected: no rewind reuse
        return IncrementalEngine(self.genai, settings, full_logits=self.capability.full_logits)

    @functools.cached_property
    def stepping(self) -> IncrementalEngine:
        """The prefill path's sessions stepped as the incremental path steps (runtime/raw_steps.py), for a decoder
        whose probe returned one row of logits for two tokens: a pruned head declared ``[B,S,V]`` or undeclared.
        Whether a run steps follows from the decoder's graph and the provider, both in the result store's scope, so
        stepped answers are never mixed with full-logit ones."""
        declared = self.package.logits_positions
        log.warning("%s returned only the last position's logits on its first pass (its graph declares %s): "
                    "scoring by stepping, one pass per continuation token on the held KV",
                    self.package.decoder.path.name, f"[B, {declared}, V]" if declared is not None else "no shape")
        settings = replace(self.prefill.settings, exact=self.exact)
        engine = IncrementalEngine(RawSteps(self.prefill.runner), settings, full_logits=False)
        engine.mode = STEPPING.format("the decoder returns")  # the prefill path's sessions, stepped
        return engine

    def scorer(self):
        """The engine serving loglikelihood / loglikelihood_rolling: on the prefill path, the prefill engine, or
        :attr:`stepping` where its first pass showed the last position's logits alone."""
        if self.loglikelihood_path != "prefill":
            return self.incremental
        return self.stepping if self.prefill.runner.last_row_only else self.prefill


class _Opening(threading.Thread):
    """One call on its own thread; ``result`` is its return value or the exception it raised."""

    def __init__(self, fn) -> None:
        super().__init__(name="ortevals-open", daemon=False)  # never cut off inside onnxruntime at exit
        self.fn, self.result = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits for it)
            self.result = e
