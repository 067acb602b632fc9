"""The decoder with its residual stream as extra outputs: hidden states after each block, on real text.

Owns the derived copy of a decoder graph whose outputs also carry the residual points that
:func:`ortevals.runtime.roles.residual_points` finds by the builder's node names (``embed``,
``attn.{i}``, ``out.{i}``): a skip norm's output 3 (the residual sum, computed by the fused op
whether or not it is named) is named ``ortevals_tap/<point>`` where the builder left it unnamed
(the final norm), and every point becomes a graph output; the embeddings are read through an
``Identity`` (they may be a graph input). Nothing is recomputed: the numbers are the ones the
unmodified graph computes, and its logits and present KV are unchanged.

The derived ``model.onnx`` is cached under ``<cache>/derived/<scope>/`` like the derived scoring
graph (:mod:`ortevals.runtime.derive`): a :class:`~ortevals.package.scope.Scope` of exactly what the
rewrite reads (:func:`taps_reads`: the decoder's graph protobuf, not its weights; the rewrite's
version) and the versions. Its weights are read from the package folder, which is never written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.files import atomic_write, atomic_write_bytes
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, Scope
from ortevals.runtime.providers import ProviderConfig
from ortevals.runtime.roles import residual_points
from ortevals.runtime.sessions import DecoderRunner

log = logging.getLogger(__name__)
PREFIX = "ortevals_tap/"
REWRITE = {"rewrite": "residual-taps/1"}


def taps_reads(package: ModelPackage) -> Reads:
    """What :func:`_rewrite` reads: the decoder's graph without its external data; the rewrite's version."""
    return Reads("taps graph", (package.decoder.path,), dict(REWRITE), ("onnx",))


def taps_scope(package: ModelPackage) -> Scope:
    return Scope.build("derived", package.root, [taps_reads(package)])


def _rewrite(package: ModelPackage) -> tuple[object, dict[str, str]]:
    """The graph with every residual point as an output; point → output name."""
    import onnx
    from onnx import helper

    model = onnx.load(str(package.decoder.path), load_external_data=False)
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    elem = _io_type(graph)
    names: dict[str, str] = {}
    for point, src in sorted(residual_points(graph).items()):
        out = f"{PREFIX}{point}"
        if src.node is None:  # a tensor (maybe a graph input): read through an Identity
            graph.node.append(helper.make_node("Identity", [src.tensor], [out], name=f"{PREFIX}{point}/Identity"))
        else:
            node = nodes[src.node]
            while len(node.output) <= src.slot:
                node.output.append("")
            if node.output[src.slot]:
                out = node.output[src.slot]
            else:
                node.output[src.slot] = out
        names[point] = out
        graph.output.append(helper.make_tensor_value_info(out, elem, None))
    return model, names


def _io_type(graph) -> int:
    """The element type of the residual stream: the type of the first layer norm's weight."""
    inits = {i.name: i for i in graph.initializer}
    for node in graph.node:
        if "layernorm" in node.name and len(node.input) > 1:
            for name in node.input[1:]:
                if name in inits:
                    return inits[name].data_type
    return 1  # float32


def taps_decoder(package: ModelPackage, cache: Path) -> tuple[Path, dict[str, str]]:
    """Path of the derived decoder (written once) and point → output name."""
    scope = taps_scope(package)
    target = cache / "derived" / scope.digest[:32] / package.decoder.path.name
    model, names = _rewrite(package)
    if not names:
        raise OrtEvalsError(f"{package.decoder.path}: no residual stream found by the builder's node names "
                            "(/model/layers.N/…_layernorm/…); the graph was not written by the onnxruntime-genai "
                            "model builder")
    if not target.is_file():
        atomic_write_bytes(target, model.SerializeToString())
        atomic_write(target.parent / "scope.json", json.dumps(scope.describe(), indent=1))
        log.info("residual taps graph written to %s", target)
    return target, names


@dataclass
class TapRunner:
    """A package's decoder with its residual points as outputs: one pass → logits and point → hidden states."""

    runner: DecoderRunner
    names: dict[str, str]

    @classmethod
    def open(cls, package: ModelPackage, provider: ProviderConfig, cache: Path) -> TapRunner:
        path, names = taps_decoder(package, cache)
        return cls(DecoderRunner.open(package, provider, graph=path), names)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One unpadded sequence ``[S]`` → logits ``[S,V]`` and each point's hidden states ``[S,H]``."""
        ids = np.asarray(ids, np.int64)[None]
        points = sorted(self.names)
        outs = self.runner.outputs(ids, np.ones_like(ids), [self.runner.package.logits_name,
                                                            *(self.names[p] for p in points)])
        return outs[0][0], {p: np.asarray(o)[0] for p, o in zip(points, outs[1:])}
