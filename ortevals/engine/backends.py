"""Which scoring path serves which request type, and opening each path once.

Owns the capability check made at load (can this package and provider return
logits for every position?), the user's ``path=auto|prefill|incremental``
choice, and lazy opening: the raw-ORT prefill sessions and the
onnxruntime-genai model are opened on first use, so a log-likelihood run never
holds the second copy of the weights that og would load.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

from ortevals.engine.incremental import IncrementalEngine
from ortevals.engine.prefill import EngineSettings, PrefillEngine
from ortevals.errors import OrtEvalsError
from ortevals.package.loader import ModelPackage
from ortevals.runtime.providers import NPU_PROVIDERS, ProviderConfig

log = logging.getLogger(__name__)
PATHS = ("auto", "prefill", "incremental")


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
                 path: str = "auto", derived_cache=None) -> None:
        self.package = package
        self.provider = provider
        self.settings = settings
        self.derived_cache = derived_cache
        self.capability = capability(package, provider)
        self.loglikelihood_path = loglikelihood_path(path, self.capability)

    @functools.cached_property
    def prefill(self) -> PrefillEngine:
        from ortevals.runtime.sessions import DecoderRunner

        settings, mode = self._prefill_settings()
        # exact mode means the package's own decoder: the derived graph changes which rows the head sees
        cache = None if settings.exact else self.derived_cache
        engine = PrefillEngine(DecoderRunner.open(self.package, self.provider, cache), settings)
        engine.mode = mode
        return engine

    def _prefill_settings(self) -> tuple[EngineSettings, str]:
        """Settings for the prefill engine: exact mode when asked or when the graph mixes rows."""
        from ortevals.engine.invariance import detect

        out = self.package.decoder.output(self.package.logits_name)
        settings = replace(self.settings, dtype=out.dtype if out is not None else "float32")
        if settings.exact:
            return settings, "exact (forced: exact=true)"
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

        return GenaiRunner.open(self.package, self.provider)

    @functools.cached_property
    def incremental(self) -> IncrementalEngine:
        return IncrementalEngine(self.genai, self.settings, full_logits=self.capability.full_logits)

    def scorer(self):
        """The engine serving loglikelihood / loglikelihood_rolling."""
        return self.prefill if self.loglikelihood_path == "prefill" else self.incremental
