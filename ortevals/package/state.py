"""Recurrent and convolution state of hybrid decoders, as ``genai_config.json`` names it and the graph declares it.

Hybrid packages (LFM2's short convolutions, Qwen3.5's gated delta-net linear attention) carry, besides the
attention layers' KV, a fixed-size state per recurrent layer: ``past.<layer>.conv`` ``[batch, channels,
kernel - 1]`` and ``past.<layer>.recurrent`` ``[batch, heads, value dim, key dim]``, named by
``model.decoder.inputs.past_conv_names`` / ``past_recurrent_names`` and the matching ``present_*`` outputs.
Such a state summarises every token before it: it is the state of exactly the position where it was made,
never a prefix of it (it cannot be cut like KV), and a pass's present state is the state after the pass's
last token, padding included. :func:`state_specs` reads the specs from the graph (dims other than the
batch must be concrete); :func:`layer_of` reads a layer index out of a ``%d`` name pattern.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import PackageError

# (kind, model.decoder.inputs key, model.decoder.outputs key)
STATE_KINDS = (("conv", "past_conv_names", "present_conv_names"),
               ("recurrent", "past_recurrent_names", "present_recurrent_names"))


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state input: ``[batch, *shape]``, valid at exactly the position it was made."""

    layer: int
    kind: str  # "conv" or "recurrent"
    name: str
    present_name: str
    dtype: str
    shape: tuple[int, ...]  # the dims after the batch


def layer_of(name: str, pattern: str) -> int | None:
    """The layer index of ``name`` under a ``%d`` pattern (``past.%d.conv``), or None if it does not match."""
    if not isinstance(pattern, str) or pattern.count("%d") != 1:
        return None
    head, _, tail = pattern.partition("%d")
    if not (name.startswith(head) and name.endswith(tail)) or len(name) <= len(head) + len(tail):
        return None
    middle = name[len(head):len(name) - len(tail)]
    return int(middle) if middle.isdigit() else None


def state_specs(decoder, where: Path) -> tuple[StateSpec, ...]:
    """The state inputs of ``decoder`` (a loader ``ModelFile``) that the config names, by layer then kind."""
    specs = []
    for kind, past_key, present_key in STATE_KINDS:
        pattern = decoder.inputs.get(past_key)
        if pattern is None:
            continue
        present = decoder.outputs.get(present_key)
        if not isinstance(present, str) or present.count("%d") != 1:
            raise PackageError(f"{where}: model.decoder.inputs.{past_key}={pattern!r} is set but "
                               f"model.decoder.outputs.{present_key} is {present!r}; expected a name pattern with "
                               "one %d for the state each pass returns")
        for inp in decoder.graph_inputs:
            layer = layer_of(inp.name, pattern)
            if layer is not None:
                specs.append(_spec(decoder, inp, kind, layer, present % layer, where))
    return tuple(sorted(specs, key=lambda s: (s.layer, s.kind)))


def _spec(decoder, inp, kind: str, layer: int, present: str, where: Path) -> StateSpec:
    out = decoder.output(present)
    if out is None:
        raise PackageError(f"{decoder.path}: graph has state input {inp.name!r} but no output {present!r} "
                           f"(model.decoder.outputs.present_{kind}_names in {where.name}); config and graph must agree")
    dims = inp.shape[1:]
    if not inp.shape or not all(isinstance(d, int) and d > 0 for d in dims):
        raise PackageError(f"{decoder.path}: state input {inp.name!r} has shape {list(inp.shape)}; expected "
                           "[batch, ...] with every other dim fixed (a recurrent state has one size whatever the "
                           "sequence length)")
    if tuple(out.shape[1:]) != tuple(dims):
        raise PackageError(f"{decoder.path}: state input {inp.name!r} is {list(inp.shape)} but output {present!r} "
                           f"is {list(out.shape)}; a pass must return the state in the shape it takes")
    return StateSpec(layer, kind, inp.name, present, inp.dtype, tuple(dims))
