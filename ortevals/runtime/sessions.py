"""Raw onnxruntime sessions for the full-logit prefill path.

Owns the decoder (and embedding, when the package has one) opened as
``onnxruntime.InferenceSession`` objects on the chosen execution provider
(opening and the provider check: :mod:`ortevals.runtime.opening`), and one
forward pass: ``input_ids [B,S]`` + right-padded ``attention_mask`` (+
optional past KV and, on hybrid decoders, recurrent state) → ``logits [B,S,V]`` (+ present KV and state).
Vision, speech and any
other model of the package are never opened. Buffers (past KV, element types)
live in :mod:`ortevals.runtime.buffers`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ortevals.errors import PackageError, first_line
from ortevals.install import import_ort
from ortevals.package.loader import ModelPackage
from ortevals.package.reuse import reuse_policy
from ortevals.runtime.buffers import (
    NUMPY_NATIVE,
    KVCache,
    empty_like_input,
    empty_past,
    empty_state,
    feeds_len,
    host_float32,
)
from ortevals.runtime.cascade import PromptBinding, cascade_decoder
from ortevals.runtime.checks import check_dtypes, package_dtypes
from ortevals.runtime.derive import GREEDY, LOGPROBS, POSITIONS, TARGETS, derived_decoder
from ortevals.runtime.inplace import InplacePasses, past_length
from ortevals.runtime.meter import PassMeter
from ortevals.runtime.opening import open_session
from ortevals.runtime.pass_errors import kernel_limit, symbolic_mismatch
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.replicate import Replicator

log = logging.getLogger(__name__)


class DecoderRunner(InplacePasses):
    """Forward passes through embedding → decoder. Build with :meth:`open`."""

    def __init__(self, package: ModelPackage, decoder, embedding=None, bind_device: str | None = None,
                 device_id: int = 0, replicator=None, meter: PassMeter | None = None) -> None:
        self.package = package
        self.decoder = decoder
        self.embedding = embedding
        if bind_device is None and not package_dtypes(package) <= NUMPY_NATIVE:
            bind_device = "cpu"  # numpy cannot hold bfloat16: keep KV in OrtValues
        # with a device, IOBinding keeps present KV there (no host round trip) and copies only logits back
        self.bind_device = bind_device
        self.device_id = device_id
        self.replicator = replicator  # copies a prefix's past across a batch where it lives (replicate.py)
        self._dec_inputs = {i.name for i in decoder.get_inputs()}
        # a derived graph takes the positions whose logits are wanted, and scores targets there
        self.gathers_positions = POSITIONS in self._dec_inputs
        self.scores_in_graph = TARGETS in self._dec_inputs
        self._emb_passthrough = self._embedding_outputs() if embedding is not None else ()
        # every pass's tokens and seconds (runtime/meter.py), the probe's excluded; shared with the cascade runner
        self.meter = meter if meter is not None else PassMeter()
        self._prompts: PromptBinding | None = None  # the cascade graph's kept binding, on its first pass
        self.last_row_only = False  # the probe's pass returned one row of logits for two tokens (whatever declared)
        self.adapter_feeds: dict = {}  # a LoRA adapter's tensors fed to every pass (runtime/adapters.py)

    @classmethod
    def open(cls, package: ModelPackage, provider: ProviderConfig, cache: Path | None = None,
             io_binding: bool | None = None, graph: Path | None = None, adapter=None) -> DecoderRunner:
        """Open the sessions; with ``cache``, use (and build once) the derived scoring graph there.

        io_binding: None binds on accelerators only (on CPU a plain run is as fast). graph: another
        rewritten copy of the decoder to open instead, its weights read from the package folder
        (runtime/taps.py's extra outputs). adapter: a :class:`~ortevals.runtime.adapters.Adapter` active on every
        pass (the probe's included).
        """
        check_dtypes(package, provider)
        emb = open_session(package.embedding, provider) if package.embedding is not None else None
        derived = graph or (derived_decoder(package, cache) if cache is not None else None)
        dec = open_session(package.decoder, provider, derived)
        log.info("opened %s on %s%s", package.decoder.path.name, provider.ort_name,
                 f" with {package.embedding.path.name}" if emb is not None else "")
        bind = provider.on_device if io_binding is None else io_binding
        device = BIND_DEVICES.get(provider.name, "cpu") if bind else None
        device_id = int(provider.raw_options.get("device_id", 0) or 0)
        runner = cls(package, dec, emb, device, device_id, Replicator(provider, device or "cpu", device_id))
        runner.adapter_feeds = adapter.feeds(device, device_id) if adapter is not None else {}
        runner.probe()
        runner.meter.reset()  # the probe is start-up, not work
        return runner

    def probe(self) -> None:
        """One 2-token pass: symbolic dims are only checkable against real outputs, and so is how many
        positions' logits a pass returns (:attr:`last_row_only`).

        Where the config filled a symbolic KV dim with a wrong value, onnxruntime
        itself refuses the probe's past buffers (GroupQueryAttention checks them)
        before any output exists: that failure is reported as the config-vs-graph
        mismatch it is, naming the fields and the graph's symbolic dims.
        """
        cfg = self.package.root / "genai_config.json"
        try:
            logits, present = self.forward(np.zeros((1, 2), np.int64), np.ones((1, 2), np.int64), want_present=True)
        except PackageError as e:
            said = getattr(e, "ort_message", None)  # runtime/pass_errors.py: a kernel's limit, or the config
            raise kernel_limit(self.package, self.decoder, said) or symbolic_mismatch(self.package, said) or e from None
        self.last_row_only = logits.shape[1] < 2  # the real shape: a pruned head declared [B,S,V] or not at all
        if logits.shape[-1] != self.package.vocab_size:
            raise PackageError(f"{cfg}: model.vocab_size={self.package.vocab_size} but the decoder returned "
                               f"logits of width {logits.shape[-1]}; config and graph must agree")
        for spec, (key, _) in zip(self.package.kv, present.layers):
            shape = key.shape if isinstance(key, np.ndarray) else key.shape()
            got = (int(shape[1]), int(shape[3]))
            if got != (spec.kv_heads, spec.head_size):
                raise PackageError(
                    f"{cfg}: layer {spec.layer} KV is [heads={spec.kv_heads}, head_size={spec.head_size}] by "
                    f"model.decoder.num_key_value_heads/head_size but the decoder returned {tuple(shape)} for "
                    f"{spec.present_key_name}; config and graph must agree")

    def _embedding_outputs(self) -> tuple[str, ...]:
        """Embedding outputs that the decoder also takes (inputs_embeds, per-layer inputs …)."""
        outs = tuple(o.name for o in self.embedding.get_outputs() if o.name in self._dec_inputs)
        if not outs:
            raise PackageError(f"{self.package.embedding.path}: no output of the embedding model is an "
                               f"input of {self.package.decoder.path.name}")
        return outs

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        past: KVCache | None = None,
        want_present: bool = False,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, KVCache | None]:
        """Run one pass.

        input_ids: ``[B,S]`` int64, right-padded. attention_mask: ``[B, P+S]``
        int64 where P is the past length (0 without ``past``). positions:
        ``[B,K]`` int64 indices into S whose logits are wanted (every position
        when None); only a derived graph can honour it.
        Returns logits ``[B,S,V]`` or ``[B,K,V]`` (the graph's dtype) and, if
        asked, present KV (with a hybrid's state after each row's last token: padding
        included, so only an unpadded row's state is its tokens').
        """
        names = [self.package.logits_name]
        if want_present:
            names += [n for s in self.package.kv for n in (s.present_key_name, s.present_value_name)]
            names += [s.present_name for s in self.package.states]
        outs = self._run(names, 1, input_ids, attention_mask, past, positions)
        present = None
        if want_present:
            kv, states = outs[1:1 + 2 * len(self.package.kv)], outs[1 + 2 * len(self.package.kv):]
            it = iter(kv)
            present = KVCache(tuple(zip(it, it)), feeds_len(attention_mask), tuple(states))
        return outs[0], present

    def outputs(self, input_ids: np.ndarray, attention_mask: np.ndarray, names: list[str]) -> list[np.ndarray]:
        """One pass with no past returning the named graph outputs on the host (a rewritten graph's extra
        outputs: runtime/taps.py)."""
        return self._run(list(names), len(names), input_ids, attention_mask, None, None)

    def score(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: KVCache | None,
              positions: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One pass scored in the derived graph: only the scores come back to the host.

        positions ``[B,K]`` as in :meth:`forward`; targets ``[B,K,M]`` int64: the token whose
        log-probability is wanted at each position, for each of M continuations. Returns
        log-probabilities ``[B,K,M]`` float32 (log-softmax in float32 on the device) and whether
        each target is the argmax ``[B,K,M]`` bool.
        """
        lp, greedy = self._run([LOGPROBS, GREEDY], 2, input_ids, attention_mask, past, positions, targets)
        return lp, greedy

    def _run(self, names: list[str], host: int, input_ids, attention_mask, past, positions, targets=None) -> list:
        """Feed one pass and run it; the first ``host`` outputs come back as numpy, the rest stay bound."""
        feeds = self._token_feeds(input_ids) | self._gather_feeds(input_ids, positions, targets)
        feeds.update(self._mask_feeds(input_ids.shape, attention_mask, past))
        feeds.update(self._past_feeds(input_ids.shape[0], past))
        feeds.update(self.adapter_feeds)
        started, clock = self.meter.start(), time.perf_counter()
        try:
            if self.bind_device:
                outs = self._run_bound(names, host, feeds)
            else:
                outs = self.decoder.run(names, feeds)
            self.meter.record(*input_ids.shape, past_length(past) > 0, started, time.perf_counter() - clock)
            return outs
        except Exception as e:  # onnxruntime's own error types; name the model and the likely cause
            limit = kernel_limit(self.package, self.decoder, first_line(e))
            err = limit or PackageError(f"{self.package.decoder.path}: onnxruntime failed to run the decoder: "
                                        f"{first_line(e)} (does genai_config.json match the graph?)")
            err.ort_message = first_line(e)  # the probe turns it into a config-vs-graph message
            raise err from None

    def _gather_feeds(self, input_ids: np.ndarray, positions=None, targets=None) -> dict[str, np.ndarray]:
        """A derived graph's positions ``[B,K,1]`` (every position when None) and targets ``[B,K,M]``."""
        if not self.gathers_positions:
            if positions is not None:
                raise ValueError("positions need the derived scoring graph")
            return {}
        if positions is None:
            positions = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int64), input_ids.shape)
        feeds = {POSITIONS: np.ascontiguousarray(positions, dtype=np.int64)[:, :, None]}
        if self.scores_in_graph:  # a logits-only pass still feeds the graph's targets input
            feeds[TARGETS] = (np.zeros((*positions.shape, 1), np.int64) if targets is None
                              else np.ascontiguousarray(targets, dtype=np.int64))
        return feeds

    def _run_bound(self, names: list[str], host: int, feeds: dict) -> list:
        """One run through IOBinding: the first ``host`` outputs to the host, the rest (present KV) left on
        ``bind_device``. OrtValue feeds (device KV, the embedding's outputs) are bound where they are."""
        ort = import_ort()
        binding = self.decoder.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for i, name in enumerate(names):
            if i < host:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_output(name, self.bind_device, self.device_id)
        self.decoder.run_with_iobinding(binding)
        outs = binding.get_outputs()
        return [host_float32(o) for o in outs[:host]] + outs[host:]

    def cascade(self, provider: ProviderConfig, cache: Path) -> DecoderRunner:
        """This runner over the cascade decode graph (runtime/cascade.py: decode rows attend to one shared
        prompt KV), built once under ``cache``; the same package, embedding session and KV device.
        Raises :class:`~ortevals.runtime.cascade.Refused` where the graph cannot be rewritten exactly."""
        session = open_session(self.package.decoder, provider, cascade_decoder(self.package, cache),
                               stop_spinning=True)
        log.info("opened the cascade decode graph of %s", self.package.decoder.path.name)
        return CascadeRunner(self, session)

    def repeat_past(self, past: KVCache, batch: int) -> KVCache:
        """``past`` of one row (``[1,H,T,D]`` per layer) replicated to ``[batch,H,T,D]``.

        Host arrays with ``np.repeat``; OrtValues where they live (no host round trip).
        """
        if batch == 1:
            return past
        return past.rows(lambda t: np.repeat(t, batch, axis=0) if isinstance(t, np.ndarray)
                         else self._replicator().expand(t, batch))

    def keep_rows(self, past: KVCache, rows) -> KVCache:
        """Rows ``rows`` of a ``[B,H,T,D]`` past (finished samples leave a decode batch), where it lives."""
        return past.rows(lambda t: np.ascontiguousarray(t[rows]) if isinstance(t, np.ndarray)
                         else self._replicator().gather(t, rows))

    def narrow_past(self, past: KVCache, length: int) -> KVCache:
        """The first ``length`` tokens of a past (a shared prompt prefix). A windowed sliding layer's buffer keeps
        its rows and holds the last positions a ``length``-token past holds (onnxruntime's layout,
        package/reuse.py), where they were not evicted (``cut_exact``); a recurrent state is the state after all
        its tokens and is never cut; otherwise the cut is refused."""
        if length == past.length:
            return past
        reuse = reuse_policy(self.package)
        if not reuse.cut_exact(past.length, length):
            why = ("a recurrent state is the state after exactly its tokens" if reuse.recurrent else
                   "positions it needs were evicted")
            raise PackageError(f"{self.package.decoder.path.name}: a past holding {past.length} tokens cannot be "
                               f"cut to {length}: {why}")
        first = (length - reuse.resident(length)) - (past.length - reuse.resident(past.length))
        rows = (first, reuse.resident(length))  # the windowed layers' rows kept, and where they go
        return KVCache(tuple(tuple(_cut(t, length, rows if spec.window else None, self._replicator) for t in pair)
                             for spec, pair in zip(self.package.kv, past.layers, strict=True)), length)

    def _replicator(self) -> Replicator:
        if self.replicator is None:
            self.replicator = Replicator(ProviderConfig("cpu"), self.bind_device or "cpu", self.device_id)
        return self.replicator

    def _token_feeds(self, input_ids: np.ndarray) -> dict:
        """The decoder's token inputs: ``input_ids``, or the embedding model's outputs for them.

        With ``bind_device`` the embedding runs through IOBinding and its outputs stay where the
        decoder runs: they come back as OrtValues that :meth:`_run_bound` binds into the decoder
        as they are (no copy to the host and back between the two sessions).
        """
        ids_name = self.package.decoder.inputs.get("input_ids", "input_ids")
        if self.embedding is None:
            return {ids_name: input_ids}
        emb_cfg = self.package.embedding
        feeds = {}
        for inp in self.embedding.get_inputs():
            if inp.name == emb_cfg.inputs.get("input_ids", "input_ids"):
                feeds[inp.name] = input_ids
            else:  # image/audio features: none for text benchmarks
                feeds[inp.name] = empty_like_input(inp, emb_cfg)
        if not self.bind_device:
            return dict(zip(self._emb_passthrough, self.embedding.run(list(self._emb_passthrough), feeds)))
        binding = self.embedding.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self._emb_passthrough:
            binding.bind_output(name, self.bind_device, self.device_id)
        self.embedding.run_with_iobinding(binding)
        return dict(zip(self._emb_passthrough, binding.get_outputs()))

    def _mask_feeds(self, shape, attention_mask: np.ndarray, past: KVCache | None) -> dict[str, np.ndarray]:
        batch, seq = shape
        past_len = past.length if past is not None else 0
        if past is None and self.package.windowed:
            # windowed GQA rejects a padded first-pass mask; all ones is exact for right
            # padding, because causal attention never lets a real token see a later pad
            attention_mask = np.ones_like(attention_mask)
        feeds = {self.package.decoder.inputs.get("attention_mask", "attention_mask"): attention_mask}
        if self.package.has_position_ids:
            # right padding: real tokens sit at past_len + 0..n-1; pad positions are never read
            name = self.package.decoder.inputs.get("position_ids", "position_ids")
            pos = np.broadcast_to(np.arange(past_len, past_len + seq, dtype=np.int64), (batch, seq))
            if len(self.package.decoder.input(name).shape) == 3:  # M-RoPE [3,B,S] (Qwen3.5): text has t = h = w
                pos = np.broadcast_to(pos, (3, batch, seq))
            feeds[name] = pos
        return feeds

    def _past_feeds(self, batch: int, past: KVCache | None) -> dict[str, np.ndarray]:
        feeds = {}
        clear = self._replicator().zero if self.bind_device else None  # a first pass's zeros made on the device
        for i, spec in enumerate(self.package.kv):
            if past is not None:
                k, v = past.layers[i]
            else:
                k = v = empty_past(spec, batch, self.bind_device, self.device_id, clear)
            feeds[spec.key_name] = k
            feeds[spec.value_name] = v
        for i, spec in enumerate(self.package.states):  # the state after the past's tokens; zeros on a first pass
            feeds[spec.name] = past.states[i] if past is not None else empty_state(spec, batch, self.bind_device,
                                                                                    self.device_id, clear)
        return feeds


def _cut(t, length: int, rows: tuple[int, int] | None, replicator):
    """The first ``length`` positions of one past tensor: sliced, or for a windowed buffer (``rows``: the first row
    kept and how many) those rows moved to its start, zeros after them, in a buffer of the same rows."""
    if rows is None:
        return np.ascontiguousarray(t[:, :, :length]) if isinstance(t, np.ndarray) else replicator().narrow(t, length)
    if not isinstance(t, np.ndarray):
        raise PackageError("cutting a windowed sliding-layer buffer where the session runs is not supported; "
                           "prefix_cache=false scores without it")
    first, count = rows
    out = np.zeros_like(t)
    out[:, :, :count] = t[:, :, first:first + count]
    return out


BIND_DEVICES = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda", "nvtensorrtrtx": "cuda", "rocm": "cuda",
                "dml": "dml"}


class CascadeRunner(DecoderRunner):
    """A runner over the cascade decode graph whose passes are metered with its parent's (the run's meter, even
    when the run hands the parent another meter after the cascade opened): the same package and sessions."""

    def __init__(self, parent: DecoderRunner, session) -> None:
        self._parent = parent  # first: the constructor below sets ``meter`` (the parent's own, unchanged)
        super().__init__(parent.package, session, parent.embedding, parent.bind_device, parent.device_id,
                         parent.replicator, parent.meter)
        self.adapter_feeds = parent.adapter_feeds  # the same adapter on the cascade graph's passes

    @property
    def meter(self) -> PassMeter:
        return self._parent.meter

    @meter.setter
    def meter(self, value: PassMeter) -> None:
        self._parent.meter = value
