"""What a package's cached state may be reused for: the one rule every path's prefix reuse follows.

Prefix reuse (the prefill plan's shared prefixes, onnxruntime-genai's rewinding cursor, the sampler's
prompt-to-prompt reuse) is exact only where the reused state is what one pass over the whole sequence
computes. :class:`ReusePolicy`, derived from the package by :func:`reuse_policy` (config and graph, no
weights), says where that holds; the engines ask it and decide nothing of their own:

* **one-token passes** (:data:`MIN_PASS_TOKENS`): the builder's int4/int8 graphs (MatMulNBits,
  ``accuracy_level=4``) compute a token alone on a cached past differently from the same token inside a
  longer pass (0.5 in logits on SmolLM2 int4), while 2 or more new tokens match the full pass. So no path
  runs fewer than 2 new tokens on a cached past to score or to build reusable KV (decoding is one token a
  step by nature, as in onnxruntime-genai);
* **a length switch** (LongRoPE: Phi-3/3.5/4-mini): the graph picks its rotary factors per pass from the
  pass's total length, ``Greater(attention_mask width, original_max_position_embeddings)`` → ``If``
  (short factors up to the threshold, long past it), and applies them to that pass's new tokens. KV made by
  a pass of one length class is not the KV a one-pass run of a sequence in the other class has, so KV is
  reused only by sequences of the class of every pass that made it (:meth:`ReusePolicy.length_class`), and
  KV for the long class is made by passes longer than the threshold (:meth:`ReusePolicy.kv_width`);
* **windowed sliding-layer caches** (the builder's default: GroupQueryAttention ``sliding_window_cache=1``):
  a layer's buffer of ``C`` rows holds, after ``T`` tokens, the ``L(T)`` most recent positions in rows
  ``[0, L(T))`` (onnxruntime's contract, docs/contrib_ops/cpu/gqa.md: ``G = C - W + 1``, ``L(T) = T`` up to
  ``C``, else ``T - G * ceil((T - C) / G)``). A past made to exactly the prefix's length is the prefix's state
  in any longer sequence, as on a full-attention layer, so the prefill plan (each prefix computed to its own
  depth) reuses it as it is; a buffer can be cut back to ``d < T`` tokens only while the positions ``d``
  needs are still resident (:meth:`ReusePolicy.cut_exact`). Packages built with ``windowed_kv_cache=false``
  keep a full past on every layer and cut anywhere. One exception (:attr:`ReusePolicy.unshared`): on a graph
  whose MatMulNBits quantize their activations to int8 (``accuracy_level=4``, the builder's int4/int8 on
  CPU), no prefix is shared at all. onnxruntime's windowed attention reading a past from its buffer is not
  bit-identical to the same positions inside one pass (about 1e-7 in a layer's output; 2e-6 in fp32 logits
  on a tiny Gemma 3), and the next layer's int8 rounding turns that into a different quantization step now
  and then: 0.017 nats off one pass on the tiny Gemma 3 int4 of the parity matrix, with the canary clean;
* **quantized KV caches** (the builder's ``kv_cache_quant_scheme``: int8 or int4, per channel or per tensor,
  scales inside the graph): GroupQueryAttention attends to the quantized cache in the pass that writes it as
  in every later one, so a reused quantized past is the one-pass state and is reused as any other
  (tests/test_kvquant.py: every path equals one plain pass within 1e-5 with the shared prefix reused);
* **recurrent and convolution state** (hybrid decoders: LFM2's short convolutions, Qwen3.5's gated
  delta-net layers; package/state.py): the state after a token summarises every token before it, so it is
  the state of exactly the position where it was made and is never cut (:meth:`ReusePolicy.cut_exact`: only
  to its own length). The prefill plan computes each prefix to its own depth and reuses it as it is; raw
  generation keeps the state at the prompts' branch points; onnxruntime-genai rewinds it only to a
  ``snapshot_state``. Splitting a sequence into passes that hand the state on is exact (2 new tokens a pass
  at least, as for KV).

Policy objects are frozen and compare by value; they are part of the engines' settings, so canary verdicts
kept in the result store are keyed by them too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

MIN_PASS_TOKENS = 2  # new tokens a pass on a cached past runs at least, where the numbers must be exact
LENGTH_OPS = {"Greater": (0, 0), "GreaterOrEqual": (0, -1), "Less": (1, 0), "LessOrEqual": (1, -1)}
PASS_THROUGH = {"Shape", "Gather", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity", "ReduceMax"}


@dataclass(frozen=True)
class ReusePolicy:
    """Where cached KV may be reused (see the module docstring); the default reuses anything anywhere."""

    rope_switch: int | None = None  # sequences longer than this are rotated with other factors (LongRoPE)
    window: int | None = None  # W: the windowed-cache layers' local_window_size (None: full pasts only)
    capacity: int | None = None  # C: rows of a windowed layer's buffer as the raw path sizes it
    refused: str = ""  # why nothing may be reused (the graph switches on the length at a threshold not read)
    unshared: str = ""  # why no prefix's KV may serve later passes (windowed layers under int8 activations)
    recurrent: bool = False  # a hybrid's recurrent/convolution state: valid only where it was made, never cut

    def length_class(self, total: int) -> int:
        """0 for sequences of up to ``rope_switch`` tokens (or any without a switch), 1 past it."""
        return int(self.rope_switch is not None and total > self.rope_switch)

    def same_class(self, a: int, b: int) -> bool:
        return self.length_class(a) == self.length_class(b)

    def kv_width(self, depth: int, total: int) -> int:
        """Tokens a pass must hold for the KV of its first ``depth`` to be reused by sequences of ``total``
        tokens: past the switch, a pass longer than the threshold (the rest is cut off after the pass)."""
        if self.length_class(total) and depth <= self.rope_switch:
            return self.rope_switch + 1
        return depth

    def resident(self, total: int) -> int:
        """L(T): positions a windowed layer's buffer holds after ``total`` tokens (``total`` on a full past)."""
        if self.window is None or self.capacity is None or total <= self.capacity:
            return total
        block = self.capacity - self.window + 1
        return total - block * math.ceil((total - self.capacity) / block)

    def cut_exact(self, held: int, length: int) -> bool:
        """Whether a past of ``held`` tokens cut to its first ``length`` has every position a ``length``-token
        past holds: always on full pasts; on windowed layers while those positions are still resident; never
        to fewer tokens with recurrent state (the state after ``held`` tokens is not the one after ``length``)."""
        if self.recurrent and length != held:
            return False
        if self.window is None or length >= held:
            return length <= held
        return length - self.resident(length) >= held - self.resident(held)

    def describe(self) -> str:
        parts = [f"rotary factors switch past {self.rope_switch} tokens"] if self.rope_switch is not None else []
        if self.window is not None:
            parts.append(f"windowed sliding-layer cache (window {self.window}, {self.capacity} rows)")
        if self.recurrent:
            parts.append("recurrent state (reused only where it was made)")
        return "; ".join(parts + [r for r in (self.refused, self.unshared) if r]) or "plain KV cache"


def reuse_policy(package) -> ReusePolicy:
    """The policy of a :class:`~ortevals.package.loader.ModelPackage`: the decoder graph's length switch, its
    windowed layers (their buffers sized as the raw path sizes them: ``KVSpec.window`` rows) and whether it
    carries recurrent state."""
    switch, refused, windows, int8 = graph_switches(package.decoder.path)
    capacity = min((s.window for s in package.kv if s.window), default=None)
    window = min(windows, default=capacity) if capacity is not None else None
    unshared = ("windowed sliding-layer caches under int8 activations (MatMulNBits accuracy_level=4): a "
                "shared prefix's past is not bit-identical to one pass there" if window is not None and int8 else "")
    return ReusePolicy(switch, window, capacity, refused, unshared,
                       recurrent=bool(getattr(package, "recurrent", False)))


@functools.lru_cache(maxsize=16)
def graph_switches(path: Path) -> tuple[int | None, str, tuple[int, ...], bool]:
    """(length threshold of the graph's ``If`` on the sequence length or None, why it cannot be read or "",
    the ``local_window_size`` of its windowed-cache attention nodes, whether a MatMulNBits quantizes its
    activations to int8) from the ONNX protos (no weights)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = onnx.load(str(path), load_external_data=False).graph
    made = {o: n for n in graph.node for o in n.output}
    consts = {i.name: i for i in graph.initializer if i.data_location != 1}
    windows = tuple(sorted({helper.get_attribute_value(a) for n in graph.node if n.op_type == "GroupQueryAttention"
                            and _attr(n, "sliding_window_cache") for a in n.attribute
                            if a.name == "local_window_size"}))
    int8 = any(n.op_type == "MatMulNBits" and _attr(n, "accuracy_level") == 4 for n in graph.node)
    found: set[int] = set()
    for node in graph.node:
        if node.op_type != "If" or not _from_length(node.input[0], made, graph):
            continue
        cond = made.get(node.input[0])
        value = _threshold(cond, made, consts, graph, numpy_helper) if cond is not None else None
        if value is None:
            return None, (f"{path.name}: node {node.name!r} chooses on the sequence length at a threshold "
                          "ortevals cannot read"), windows, int8
        found.add(value)
    if len(found) > 1:
        return None, f"{path.name}: several length thresholds {sorted(found)}", windows, int8
    return (found.pop() if found else None), "", windows, int8


def _attr(node, name: str) -> int:
    return next((a.i for a in node.attribute if a.name == name), 0)


def _threshold(cond, made, consts, graph, numpy_helper) -> int | None:
    """T where ``cond`` is ``length > T`` (Greater / GreaterOrEqual / Less / LessOrEqual of the length and a
    constant), else None."""
    if cond.op_type not in LENGTH_OPS:
        return None
    side, shift = LENGTH_OPS[cond.op_type]
    if not _from_length(cond.input[side], made, graph):
        return None
    other = cond.input[1 - side]
    value = consts.get(other)
    array = numpy_helper.to_array(value) if value is not None else None
    node = made.get(other)
    if array is None and node is not None and node.op_type == "Constant" and node.attribute:
        array = numpy_helper.to_array(node.attribute[0].t)
    if array is None or array.size != 1:
        return None
    return int(array.reshape(())) + shift


def _from_length(name: str, made, graph, depth: int = 0) -> bool:
    """Whether ``name`` is computed from the attention mask's or the position ids' shape or values only."""
    if name in ("attention_mask", "position_ids"):
        return True
    node = made.get(name)
    if node is None or depth > 12:
        return False
    if node.op_type in LENGTH_OPS:
        return any(_from_length(i, made, graph, depth + 1) for i in node.input)
    if node.op_type not in PASS_THROUGH and node.op_type not in ("Sub", "Add"):
        return False
    return _from_length(node.input[0], made, graph, depth + 1)
