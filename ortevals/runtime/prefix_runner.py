"""The shared-prefix scoring session: many rows scored in one pass on one bound copy of a prefix's KV.

Owns :class:`PrefixRunner`, the session of runtime/prefix_graph.py's graph opened beside a
:class:`~ortevals.runtime.sessions.DecoderRunner` (the same package, embedding session, KV device and pass
meter), and one pass: the rows' own tokens ``[B,S]`` (right-padded) on a one-row prefix ``KVCache``
(``[1,H_kv,P,D]`` per layer: host arrays, OrtValues or device views, each bound without its batch axis, by
pointer where it lives, never copied) → the targets' log-probabilities and argmax flags ``[B,K,M]``, the only
thing that comes back to the host. On CUDA, a float16/bfloat16 package's session runs its float32 attention
products in TF32 (``use_tf32=1``: the fp16 values cast to float32 are exact in TF32's mantissa, and the
probabilities are rounded as flash attention rounds them to fp16); the session's record says so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from ortevals.errors import PackageError, first_line
from ortevals.package.loader import ModelPackage
from ortevals.package.reuse import graph_switches, reuse_policy
from ortevals.package.scope import Reads
from ortevals.runtime.buffers import KVCache, KVView, host_float32
from ortevals.runtime.cascade import Refused
from ortevals.runtime.derive import GREEDY, LOGPROBS
from ortevals.runtime.inplace import bind_feeds
from ortevals.runtime.opening import open_session
from ortevals.runtime.prefix_graph import (
    PREFIX_KEY,
    PREFIX_LENGTH,
    PREFIX_RESIDENT,
    PREFIX_VALUE,
    prefix_decoder,
    prefix_graph_reads,
)
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.reads import session_reads

log = logging.getLogger(__name__)


def prefix_provider(package: ModelPackage, provider: ProviderConfig) -> ProviderConfig:
    """The provider the shared-prefix session runs on: the run's, with TF32 for a half-precision package's
    float32 attention on CUDA unless the user chose ``use_tf32``."""
    half = bool(package.kv) and package.kv[0].dtype in ("float16", "bfloat16")
    if provider.name != "cuda" or not half or "use_tf32" in provider.user_keys:
        return provider
    return dataclasses.replace(provider, options={**provider.options, "use_tf32": "1"})


def provider_refusal(package: ModelPackage, provider: ProviderConfig) -> str:
    """Why this provider must not score the package this way ('' where it may). On CPU a MatMulNBits that
    quantizes its activations to int8 (``accuracy_level=4``, the builder's int4/int8 default) rounds a float32
    difference of one ulp in the attention's output into a whole int8 step: the graph's prefix and own sums
    (added by log-sum-exp) are not bit-identical to onnxruntime's kernel, and such packages moved by up to
    0.04 nats (the parity matrix's tiny int4 packages) where their fp32 twins stay within 6e-6."""
    if provider.name == "cpu" and graph_switches(package.decoder.path)[3]:
        return ("its MatMulNBits quantize activations to int8 on CPU (accuracy_level=4), which turns the batched "
                "attention's float32 rounding into whole int8 steps")
    return ""


def prefix_reads(package: ModelPackage, provider: ProviderConfig) -> list[Reads]:
    """What the shared-prefix path reads: its graph's rewrite and its session's record (files and settings)."""
    graph = prefix_graph_reads(package)
    session = session_reads(package.decoder, prefix_provider(package, provider))
    return [graph, Reads("shared-prefix session", session.files, session.settings, session.dists)]


class PrefixRunner:
    """The shared-prefix graph's session beside ``parent``. Build with :meth:`open`."""

    def __init__(self, parent, session) -> None:
        self.parent = parent  # a DecoderRunner: token feeds, the derived graph's feeds, the KV device, the meter
        self.session = session
        self.package = parent.package
        self.reuse = reuse_policy(parent.package)
        self.inputs = {i.name for i in session.get_inputs()}

    @classmethod
    def open(cls, parent, provider: ProviderConfig, cache: Path) -> PrefixRunner:
        """Build (once, under ``cache``) and open the graph; :class:`~ortevals.runtime.cascade.Refused` where the
        package's attention cannot be rewritten."""
        why = provider_refusal(parent.package, provider)
        if why:
            raise Refused(why)
        path = prefix_decoder(parent.package, cache)
        session = open_session(parent.package.decoder, prefix_provider(parent.package, provider), path)
        log.info("opened the shared-prefix scoring graph of %s", parent.package.decoder.path.name)
        return cls(parent, session)

    def score(self, input_ids: np.ndarray, prefix: KVCache, positions: np.ndarray,
              targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One pass: row b's own tokens ``input_ids[b]`` at positions ``P + s`` after the one-row ``prefix``
        (``P = prefix.length``); positions ``[B,K]`` index each row's own tokens, targets ``[B,K,M]``. Returns
        log-probabilities ``[B,K,M]`` float32 and argmax flags ``[B,K,M]`` bool."""
        parent = self.parent
        feeds = parent._token_feeds(input_ids) | parent._gather_feeds(input_ids, positions, targets)
        # position_ids P + s and, where a standard Attention's mask is computed from it, attention_mask all ones
        ones = np.ones((len(input_ids), prefix.length + input_ids.shape[1]), np.int64)
        feeds |= {k: v for k, v in parent._mask_feeds(input_ids.shape, ones, prefix).items() if k in self.inputs}
        # the prefix's length, and the rows of a windowed layer's buffer that hold its last tokens (package/reuse.py)
        feeds[PREFIX_LENGTH] = np.array([prefix.length], np.int64)
        feeds[PREFIX_RESIDENT] = np.array([self.reuse.resident(prefix.length)], np.int64)
        started, clock = parent.meter.start(), time.perf_counter()
        try:
            binding = self.session.io_binding()
            bind_feeds(binding, feeds | getattr(parent, "adapter_feeds", {}))  # its LoRA adapter's tensors
            for spec, pair in zip(self.package.kv, prefix.layers, strict=True):
                for name, t in zip((PREFIX_KEY, PREFIX_VALUE), pair, strict=True):
                    _bind_heads(binding, name % spec.layer, t, parent)
            for name in (LOGPROBS, GREEDY):
                binding.bind_output(name, "cpu")
            self.session.run_with_iobinding(binding)
            lp, greedy = binding.get_outputs()
        except Exception as e:  # onnxruntime's own error types
            raise PackageError(f"{self.package.decoder.path}: onnxruntime failed to run the shared-prefix scoring "
                               f"graph: {first_line(e)}") from None
        parent.meter.record(*input_ids.shape, True, started, time.perf_counter() - clock)
        return host_float32(lp), greedy.numpy()


def _bind_heads(binding, name: str, t, parent) -> None:
    """A one-row ``[1,H,P,D]`` prefix tensor bound as ``[H,P,D]``, the same memory (a host array's view, an
    OrtValue or device view by pointer)."""
    if isinstance(t, np.ndarray):
        binding.bind_cpu_input(name, np.ascontiguousarray(t[0]))  # a view: the array is contiguous already
    elif isinstance(t, KVView):
        dataclasses.replace(t, shape=tuple(t.shape[1:])).bind_input(binding, name)
    else:  # an OrtValue where the session runs
        shape = t.shape()
        binding.bind_input(name, parent.bind_device or "cpu", parent.device_id, t.element_type(), list(shape[1:]),
                           t.data_ptr())
