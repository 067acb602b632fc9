"""The per-layer stage of ``ortevals diagnose``: where along the residual stream the candidate drifts.

Owns running both packages' residual-tap graphs (:mod:`ortevals.runtime.taps`) over the same
windows of real text, one window at a time, and reducing each window at once to per-token errors
(:func:`ortevals.diagnose.stats.token_errors`) of every residual point both graphs name; then the
block table (:func:`ortevals.diagnose.stats.block_rows`) and the line saying which layers were
compared. Every position of a window is compared (the windows are ``ortevals fidelity``'s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.diagnose.stats import BlockRow, block_rows, token_errors
from ortevals.fidelity.windows import WindowPlan
from ortevals.runtime.roles import layer_ranges

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerStage:
    rows: tuple[BlockRow, ...]
    compared: tuple[int, ...]  # layers whose three points both graphs name
    missing: tuple[int, ...]
    tokens: int
    windows: int

    def coverage(self, n_layers: int) -> str:
        """One line: which layers were compared and which were not."""
        if not self.missing:
            return f"compared all {n_layers} layers ({layer_ranges(self.compared)}) after attention and after the MLP"
        return (f"compared layers {layer_ranges(self.compared) or 'none'}; not compared: "
                f"{layer_ranges(self.missing)} (their residual tensors are not named the builder's way in both "
                "graphs)")


def layer_points(points: set[str], n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layers with their input, after-attention and output points all present; the others."""
    def complete(i: int) -> bool:
        return {("embed" if i == 0 else f"out.{i - 1}"), f"attn.{i}", f"out.{i}"} <= points

    done = tuple(i for i in range(n_layers) if complete(i))
    return done, tuple(i for i in range(n_layers) if i not in done)


def measure_layers(cand, ref, text_ids: np.ndarray, plan: WindowPlan, n_layers: int,
                   progress: Callable[[int], None] | None = None) -> LayerStage:
    """``cand``, ``ref``: :class:`~ortevals.runtime.taps.TapRunner` of each package (the same tokenizer)."""
    shared = sorted(set(cand.names) & set(ref.names))
    rel: dict[str, list] = {p: [] for p in shared}
    cos: dict[str, list] = {p: [] for p in shared}
    clusters = []
    for w in range(plan.n_windows):
        ids, _ = plan.window(text_ids, w)
        _, ref_points = ref(ids)
        _, cand_points = cand(ids)
        for p in shared:
            r, c = token_errors(ref_points[p], cand_points[p])
            rel[p].append(r)
            cos[p].append(c)
        clusters.append(np.full(len(ids), w, np.int32))
        if progress is not None:
            progress(w)
    flat = {p: np.concatenate(v) for p, v in rel.items()}
    flat_cos = {p: np.concatenate(v) for p, v in cos.items()}
    groups = np.concatenate(clusters)
    compared, missing = layer_points(set(shared), n_layers)
    rows = block_rows(flat, flat_cos, groups, n_layers)
    return LayerStage(tuple(rows), compared, missing, int(len(groups)), plan.n_windows)


def open_runners(cand_pkg, ref_pkg, ep: str | None, cache: Path):
    """Both packages' residual-tap runners, each on its own provider (or ``ep``), as ``ortevals fidelity`` opens
    them."""
    from ortevals.runtime.providers import from_package
    from ortevals.runtime.taps import TapRunner

    return tuple(TapRunner.open(p, from_package(p.decoder.session_options, ep), cache) for p in (cand_pkg, ref_pkg))
