"""Where a package's config and its decoder graph disagree in a way that changes numbers (``ortevals info``).

Each finding is one warning line:

* a sliding window ``genai_config.json`` declares (``model.decoder.sliding_window``) that no attention node
  applies, or windowed layers and sizes in the graph other than those it declares (a graph window with no
  declared window at all is what the builder's ``windowed_kv_cache=false`` and Mobius write: the attention
  node applies it, so nothing changes and nothing is said);
* layers of one type (the same window and head size) that rotate differently: another rotary table (compared by
  value), interleaving or rotary dimension;
* a ``model.context_length`` beyond the rotary table: positions past the table's rows have no rotation.

The rotary tables are the ``cos_cache`` inputs of GroupQueryAttention (fused rotary) and of RotaryEmbedding
nodes (com.microsoft, or onnx's opset-23 op fed a ``Gather`` of the table by position). Reads the decoder's
protobuf; the tables' values only where two layers of one type name different tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortevals.package.graph import tensor_array

LAYER = re.compile(r"layers\.(\d+)[/.]")


@dataclass
class _Layer:
    window: int = 0  # the attention node's local_window_size (0: none)
    head_size: int = 0
    rotary: set = field(default_factory=set)  # (cos table name, interleaved, rotary dim)


def lint(package) -> list[str]:
    """One line per disagreement between ``package``'s config (a loader ``ModelPackage``) and its decoder graph."""
    import onnx

    model = onnx.load(str(package.decoder.path), load_external_data=False)
    config = package.config.get("model", {})
    layers, rows = _layers(model.graph)
    where = package.root / "genai_config.json"
    out = _windows(layers, config.get("decoder", {}).get("sliding_window"), where, package.decoder.path.name)
    out += _rotary_types(layers, model.graph, package.decoder.path.parent)
    context = config.get("context_length")
    if rows and isinstance(context, int) and context > min(rows):
        out.append(f"{where}: model.context_length={context} but {package.decoder.path.name}'s rotary table has "
                   f"{min(rows)} positions: a sequence past {min(rows)} tokens has no rotation there (keep max_length "
                   f"at or below {min(rows)})")
    return out


def _layers(graph) -> tuple[dict[int, _Layer], list[int]]:
    """Per decoder layer (from node names ``…layers.N/…``): its attention's window and head size and the rotary
    settings its nodes use; and every rotary table's row count."""
    from onnx import helper

    dims = {t.name: list(t.dims) for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    layers: dict[int, _Layer] = {}
    rows = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        found = LAYER.search(node.name)
        layer = layers.setdefault(int(found.group(1)), _Layer()) if found else _Layer()
        cos = None
        if node.op_type == "GroupQueryAttention":
            layer.window = max(int(attrs.get("local_window_size", -1)), 0)
            if attrs.get("do_rotary") and len(node.input) > 7:
                cos = node.input[7]
            interleaved, dim = attrs.get("rotary_interleaved", 0), attrs.get("rotary_embedding_dim", 0)
        elif node.op_type == "RotaryEmbedding":
            cos = node.input[2] if node.domain == "com.microsoft" else node.input[1]
            interleaved, dim = attrs.get("interleaved", 0), attrs.get("rotary_embedding_dim", 0)
        if cos and cos in producer and producer[cos].op_type == "Gather":  # a table gathered by position
            cos = producer[cos].input[0]
        if cos and len(dims.get(cos, ())) == 2:
            layer.rotary.add((cos, int(interleaved), int(dim)))
            layer.head_size = layer.head_size or 2 * dims[cos][1]
            rows.append(dims[cos][0])
    return layers, rows


def _windows(layers: dict[int, _Layer], declared, where: Path, name: str) -> list[str]:
    graph = {i: lay.window for i, lay in layers.items() if lay.window}
    if not isinstance(declared, dict) or not isinstance(declared.get("window_size"), int):
        return []
    size, listed = declared["window_size"], declared.get("layers")
    if not graph:
        return [f"{where}: model.decoder.sliding_window declares a {size}-token window that no attention node of "
                f"{name} applies (every layer attends to the whole past)"]
    expected = {i: size for i in (listed if isinstance(listed, list) and listed else graph)}
    if expected == graph:
        return []
    shown = ", ".join(f"layer {i}: {w}" for i, w in sorted(graph.items()))
    return [f"{where}: model.decoder.sliding_window declares {size}-token windows on layers "
            f"{sorted(expected)} but {name}'s attention applies {shown}"]


def _rotary_types(layers: dict[int, _Layer], graph, folder: Path) -> list[str]:
    """Layers of one type (window, head size) whose rotary settings differ (tables compared by value)."""
    tables = {t.name: t for t in graph.initializer}
    out = []
    kinds: dict[tuple[int, int], dict[int, frozenset]] = {}
    for i, lay in sorted(layers.items()):
        if lay.rotary:
            kinds.setdefault((lay.window, lay.head_size), {})[i] = frozenset(lay.rotary)
    for (window, _), members in kinds.items():
        settings = list(dict.fromkeys(members.values()))
        if len(settings) < 2 or _same_values(settings, tables, folder):
            continue
        kind = f"{window}-token window" if window else "full attention"
        groups = "; ".join(f"layers {[i for i, s in members.items() if s == one]}: "
                           + ", ".join(f"{n} (interleaved {a}, dim {d})" for n, a, d in sorted(one))
                           for one in settings)
        out.append(f"layers of one type ({kind}) rotate differently: {groups}")
    return out


def _same_values(settings: list, tables: dict, folder: Path) -> bool:
    """Whether every setting names tables of equal values with equal attributes."""
    def key(one):
        return sorted((a, d) for _, a, d in one), [tensor_array(tables[n], folder) for n, _, _ in sorted(one)]

    first_attrs, first_tables = key(settings[0])
    for one in settings[1:]:
        attrs, values = key(one)
        if attrs != first_attrs or len(values) != len(first_tables) or \
                not all(np.array_equal(a, b) for a, b in zip(values, first_tables)):
            return False
    return True
