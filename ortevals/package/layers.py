"""A decoder's layers: the config's layer count and head sizes against the layers the graph has.

Owns ``check_layers``: ``model.decoder.num_hidden_layers``, ``num_key_value_heads``, ``num_attention_heads`` and
``head_size`` in ``genai_config.json`` checked against the KV inputs the loader read from the decoder graph
(:mod:`ortevals.package.loader`) and its attention nodes; and ``shared_kv``: the layers that own no KV cache and
attend to another layer's (Gemma 4 E2B/E4B: the last ``num_kv_shared_layers`` layers read the present KV of the
last earlier layer of their type, so only 15 of E2B's 35 layers have past inputs). Such a layer's KV is its source
layer's, computed in the same pass from the same past: carrying the source layers' KV carries theirs, so every
path that reuses or cuts a past reuses theirs exactly. Protobuf facts only, no runtime.
"""

from __future__ import annotations

from pathlib import Path

from ortevals.errors import PackageError
from ortevals.package.graph import graph_facts
from ortevals.package.state import layer_of


def shared_kv(decoder, kv_layers: list[int]) -> tuple[tuple[int, int], ...]:
    """``(layer, source layer)`` for each attention node of ``decoder`` (a loader ``ModelFile``) that attends to a
    KV layer's present KV instead of a cache of its own, numbered after the KV layers in graph order (Gemma 4's
    shared layers are its last ones); empty for a decoder without KV sharing."""
    patterns = [decoder.outputs.get(k, d) for k, d in (("present_key_names", "present.%d.key"),
                                                       ("present_value_names", "present.%d.value"))]
    sources = []
    for _, output in graph_facts(decoder.path).reads_outputs:
        layer = next((i for i in (layer_of(output, p) for p in patterns) if i is not None), None)
        if layer is not None and layer in kv_layers:
            sources.append(layer)
    return tuple((len(kv_layers) + i, source) for i, source in enumerate(sources))


def check_layers(specs: list, section: dict, decoder, where: Path,
                 state_layers: set[int] = frozenset(), shared: tuple[tuple[int, int], ...] = ()) -> None:
    layers = section.get("num_hidden_layers")
    found = {s.layer for s in specs} | set(state_layers) | {layer for layer, _ in shared}
    if isinstance(layers, int) and (layers != len(found) or found != set(range(layers))):
        what = "past KV or recurrent state" if state_layers else "past KV"
        also = f" and {len(shared)} attending to another layer's KV" if shared else ""
        raise PackageError(f"{where}: model.decoder.num_hidden_layers={layers} but {decoder.path.name} "
                           f"has {len(found) - len(shared)} layers of {what} inputs{also}; config and graph must agree")
    heads = section.get("num_key_value_heads")
    if isinstance(heads, int) and specs and all(s.kv_heads != heads for s in specs):
        raise PackageError(f"{where}: model.decoder.num_key_value_heads={heads} but {decoder.path.name} "
                           f"declares {sorted({s.kv_heads for s in specs})} KV heads; config and graph must agree")
    attention = graph_facts(decoder.path).attention_heads
    query_heads = section.get("num_attention_heads")
    if isinstance(query_heads, int) and attention and query_heads not in attention:
        raise PackageError(f"{where}: model.decoder.num_attention_heads={query_heads} but {decoder.path.name}'s "
                           f"attention nodes have num_heads {sorted(attention)}; config and graph must agree")
    size = section.get("head_size")
    if isinstance(size, int) and specs and all(s.head_size != size and s.head_size != _packed(s, size) for s in specs):
        raise PackageError(f"{where}: model.decoder.head_size={size} but {decoder.path.name} declares "
                           f"head sizes {sorted({s.head_size for s in specs})}; config and graph must agree")


def _packed(spec, size: int) -> int | None:
    """The last dim of an int4 KV cache of head size ``size``: two values a byte (the builder's int4 KV schemes
    store ``uint8 [B, H, past, ceil(size / 2)]``); None for any other cache type."""
    return (size + 1) // 2 if spec.dtype == "uint8" else None
