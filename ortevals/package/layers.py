"""A decoder's layers: the config's layer count and head sizes against the layers the graph has.

Owns ``check_layers``: ``model.decoder.num_hidden_layers``, ``num_key_value_heads``, ``num_attention_heads`` and
``head_size`` in ``genai_config.json`` checked against the KV inputs the loader read from the decoder graph
(:mod:`ortevals.package.loader`) and its attention nodes; protobuf facts only, no runtime.
"""

from __future__ import annotations

from pathlib import Path

from ortevals.errors import PackageError
from ortevals.package.graph import graph_facts


def check_layers(specs: list, section: dict, decoder, where: Path,
                 state_layers: set[int] = frozenset()) -> None:
    layers = section.get("num_hidden_layers")
    found = {s.layer for s in specs} | set(state_layers)
    if isinstance(layers, int) and (layers != len(found) or found != set(range(layers))):
        what = "past KV or recurrent state" if state_layers else "past KV"
        raise PackageError(f"{where}: model.decoder.num_hidden_layers={layers} but {decoder.path.name} "
                           f"has {len(found)} layers of {what} inputs; config and graph must agree")
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
    if isinstance(size, int) and specs and all(s.head_size != size for s in specs):
        raise PackageError(f"{where}: model.decoder.head_size={size} but {decoder.path.name} declares "
                           f"head sizes {sorted({s.head_size for s in specs})}; config and graph must agree")
