"""Passes on a shared past/present buffer: the new tokens' KV written in place.

Owns :class:`InplacePasses`, the part of :class:`~ortevals.runtime.sessions.DecoderRunner` that runs a pass whose
past KV buffers are also its present outputs (GroupQueryAttention's shared buffer, as onnxruntime-genai runs it):
:meth:`InplacePasses.forward_inplace` (the sampler's decode steps, the cascade graph's shared prompts), the
buffers bound as past and present (``_bind_past``) and the all-ones or right-padded mask of such a pass.
"""

from __future__ import annotations

import time

import numpy as np

from ortevals.errors import PackageError, first_line
from ortevals.install import import_ort
from ortevals.package.graph import graph_facts
from ortevals.package.loader import ModelPackage
from ortevals.runtime.buffers import KVCache, KVView, bind_shared, device_buffer, host_float32
from ortevals.runtime.cascade import PromptBinding
from ortevals.runtime.derive import GREEDY, LOGPROBS


class InplacePasses:
    """Mixin of the decoder runner (uses its ``package``, ``decoder``, ``meter``, ``_prompts`` and its feeds)."""

    def forward_inplace(self, input_ids: np.ndarray, past: KVCache, positions: np.ndarray | None = None,
                        prompts: tuple | None = None, targets: np.ndarray | None = None):
        """One pass whose new tokens' KV is written into ``past``'s own buffers (GroupQueryAttention's
        shared past/present buffer, as onnxruntime-genai runs it): no copy of the whole cache per pass.

        past: ``[B,H,capacity,D]`` per layer (host numpy, or a :class:`~ortevals.runtime.buffers.KVView`
        where the session runs) holding ``past.length`` valid tokens (capacity >= length + S).
        input_ids ``[B,S]``, no padding. Returns logits ``[B,S,V]`` (or ``[B,K,V]`` with ``positions``);
        the caller's cache then holds ``past.length + S`` tokens. Only graphs whose attention shares
        the buffer can run it: the sampler checks that once against :meth:`forward`.

        prompts: the cascade decode graph's shared prompts (runtime/cascade.py), ``((prompt, rows, held), ...)``
        in batch order, each prompt ``[1,H,P,D]`` per layer bound as it is for its ``rows`` rows, which hold
        ``held`` tokens of their own in ``past`` (after their prompt); row b's mask then spans ``P_b + held_b +
        S`` (right-padded). targets: ``[B,K,M]`` on a derived scoring graph: returns its (log-probabilities,
        argmax flags) ``[B,K,M]`` instead of logits (input_ids may then end in padding: it is causal-invisible).
        """
        if self.package.recurrent:  # state read and written in one buffer: never checked (rows/kv.py: CopyKV)
            raise PackageError(f"{self.package.decoder.path}: no shared past/present buffer with recurrent state")
        feeds = self._token_feeds(input_ids) | self._gather_feeds(input_ids, positions, targets)
        feeds.update(self._mask_feeds(input_ids.shape, _inplace_mask(input_ids, past, prompts), past))
        if prompts is None:
            binding = self.decoder.io_binding()
        else:  # the shared prompts stay bound from pass to pass (runtime/cascade.py)
            self._prompts = self._prompts or PromptBinding(self.package, self.decoder)
            binding = self._prompts.bind(prompts)
        outputs = [self.package.logits_name] if targets is None else [LOGPROBS, GREEDY]
        for name in outputs:
            binding.bind_output(name, "cpu")
        bind_feeds(binding, feeds | self.adapter_feeds)  # a LoRA adapter's tensors (runtime/adapters.py)
        _bind_past(binding, self.package, past)
        started, clock = self.meter.start(), time.perf_counter()
        try:  # a pass over shared prompts reads their KV: a decode step even where the rows hold no token yet
            self.decoder.run_with_iobinding(binding)
            self.meter.record(*input_ids.shape, past_length(past) > 0 or bool(prompts), started,
                              time.perf_counter() - clock)
        except Exception as e:
            raise PackageError(f"{self.package.decoder.path}: onnxruntime failed to run the decoder with a "
                               f"shared KV buffer: {first_line(e)}") from None
        outs = binding.get_outputs()
        return host_float32(outs[0]) if targets is None else (host_float32(outs[0]), outs[1].numpy())

    @property
    def scores_in_place(self) -> bool:
        """Whether scoring passes may write their tokens into a held prefix's buffer (:meth:`held_in`): a derived
        scoring graph whose attention is GroupQueryAttention throughout (the shared past/present buffer is its
        contract; the standard ``Attention`` op refuses a past wider than the mask), no layer reading another's
        KV, no windowed sliding-layer buffers (their layout is the kernel's), no recurrent state."""
        package, facts = self.package, graph_facts(self.package.decoder.path)
        return (bool(getattr(self, "scores_in_graph", False)) and not package.windowed and not package.recurrent
                and facts.attention_ops == {"GroupQueryAttention"} and not facts.reads_outputs)

    def held_in(self, past: KVCache, capacity: int) -> KVCache:
        """A one-row ``past`` copied once into buffers of ``capacity`` positions where it lives (host arrays, or
        device buffers filled there), for passes that write their own tokens after it in place
        (:meth:`forward_inplace`): each pass then binds the buffer as past and present, with no copy of the past
        into a new present and no clearing of one. The copy holds ``past.length`` tokens."""
        return KVCache(tuple(tuple(self._widened(t, past.length, capacity) for t in pair) for pair in past.layers),
                       past.length)

    def _widened(self, t, length: int, capacity: int):
        if isinstance(t, np.ndarray):
            out = np.zeros((t.shape[0], t.shape[1], capacity, t.shape[3]), dtype=t.dtype)
            out[:, :, :length] = t[:, :, :length]
            return out
        shape = t.shape if isinstance(t, KVView) else tuple(t.shape())
        elem = t.elem_type if isinstance(t, KVView) else t.element_type()
        into = device_buffer((shape[0], shape[1], capacity, shape[3]), elem, self.bind_device or "cpu",
                             self.device_id)
        self._replicator().fit(t, length, into)
        return into


def bind_feeds(binding, feeds: dict) -> None:
    """A pass's inputs bound where they are: OrtValues (the embedding's outputs) and device views (a shared
    prompt's or prefix's KV) as they are, host arrays wrapped."""
    ort = import_ort()
    for name, value in feeds.items():
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
        elif isinstance(value, KVView):
            value.bind_input(binding, name)
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(value))


def _bind_past(binding, package: ModelPackage, past: KVCache) -> None:
    """Each KV layer's buffer (a host array or a device view) bound as both its past input and present output."""
    for spec, (k, v) in zip(package.kv, past.layers, strict=True):
        bind_shared(binding, spec.key_name, spec.present_key_name, k)
        bind_shared(binding, spec.value_name, spec.present_value_name, v)


def _inplace_mask(input_ids: np.ndarray, past, prompts) -> np.ndarray:
    """:meth:`DecoderRunner.forward_inplace`'s mask: all ones over past + new tokens, or with shared prompts each
    row's prompt + its own held tokens + the new ones, right-padded."""
    if prompts is None:
        return np.ones((input_ids.shape[0], past.length + input_ids.shape[1]), dtype=np.int64)
    lengths = np.repeat([p.length + held for p, _, held in prompts], [n for _, n, _ in prompts])
    lengths += input_ids.shape[1]
    return (np.arange(lengths.max()) < lengths[:, None]).astype(np.int64)


def past_length(past) -> int:
    """Valid past tokens of a pass's past (``KVCache`` / in-place arena), 0 without one."""
    return int(getattr(past, "length", 0) or 0) if past is not None else 0
