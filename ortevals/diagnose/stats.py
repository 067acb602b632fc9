"""Pure statistics of ``ortevals diagnose``: hidden states and measured KLs in, numbers out.

Owns three things, each a function of numpy arrays or plain records:

* :func:`token_errors`: per token, the candidate's hidden state against the reference's: relative
  L2 error ``‖c − r‖ / ‖r‖`` and cosine similarity ``c·r / (‖c‖‖r‖)`` (float64);
* :func:`block_rows`: the residual stream's error after each block and the error each block
  *adds* (its output's relative error minus its input's, per token, then averaged): the attention
  block of layer i goes from ``out.{i-1}`` (``embed`` for layer 0) to ``attn.{i}``, its MLP block
  from ``attn.{i}`` to ``out.{i}``, and the embeddings from nothing (error 0) to ``embed``. Means
  carry standard errors clustered by window, the convention of ``ortevals fidelity``
  (:mod:`ortevals.report.stats`);
* :func:`greedy_steps`: which weight groups to keep at the reference's precision within a size
  budget: each group's measured KL recovery per megabyte, best first, each added while the total
  stays within the budget (the order the curve of measured cumulative sets follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.report.stats import clustered_mean

MB = 1e6


def token_errors(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[n,H]`` hidden states of both → relative L2 error ``[n]`` and cosine similarity ``[n]`` (float64).

    A reference row of norm 0 gives a relative error of ``inf`` (0 where the candidate's is 0 too) and a
    cosine of 1 where both are 0, else 0."""
    r, c = np.asarray(ref, np.float64), np.asarray(cand, np.float64)
    nr, nc = np.linalg.norm(r, axis=-1), np.linalg.norm(c, axis=-1)
    diff = np.linalg.norm(c - r, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(nr > 0, diff / np.where(nr > 0, nr, 1.0), np.where(diff > 0, np.inf, 0.0))
        cos = np.where((nr > 0) & (nc > 0), (r * c).sum(-1) / np.where((nr > 0) & (nc > 0), nr * nc, 1.0),
                       np.where((nr == 0) & (nc == 0), 1.0, 0.0))
    return rel, cos


@dataclass(frozen=True)
class BlockRow:
    """One block of the residual stream: its output's error against the reference and the error it adds."""

    name: str  # "embeddings", "layers.3.attn", "layers.3.mlp"
    layer: int | None
    block: str  # "embeddings", "attn", "mlp"
    rel_l2: float  # mean over tokens of ‖c − r‖/‖r‖ after the block
    rel_l2_se: float
    cosine: float  # mean cosine similarity after the block
    cosine_se: float
    added: float  # mean over tokens of (rel_l2 after − rel_l2 before)
    added_se: float


def _block_points(n_layers: int) -> list[tuple[str, int | None, str, str | None, str]]:
    """(name, layer, block, input point, output point) in graph order."""
    out = [("embeddings", None, "embeddings", None, "embed")]
    for i in range(n_layers):
        out.append((f"layers.{i}.attn", i, "attn", "embed" if i == 0 else f"out.{i - 1}", f"attn.{i}"))
        out.append((f"layers.{i}.mlp", i, "mlp", f"attn.{i}", f"out.{i}"))
    return out


def block_rows(rel: dict[str, np.ndarray], cos: dict[str, np.ndarray], clusters: np.ndarray,
               n_layers: int) -> list[BlockRow]:
    """Every block whose output point (and input point, for the added error) is in ``rel``, in graph order.

    rel, cos: point → ``[N]`` per-token values over the same N tokens; clusters ``[N]``: each token's window.
    """
    rows = []
    for name, layer, block, src, dst in _block_points(n_layers):
        if dst not in rel or (src is not None and src not in rel):
            continue
        before = rel[src] if src is not None else np.zeros_like(rel[dst])
        r, r_se = clustered_mean(rel[dst], clusters)
        c, c_se = clustered_mean(cos[dst], clusters)
        a, a_se = clustered_mean(rel[dst] - before, clusters)
        rows.append(BlockRow(name, layer, block, r, r_se, c, c_se, a, a_se))
    return rows


def ranked(rows: list[BlockRow]) -> list[BlockRow]:
    """Largest added error first (graph order among equals)."""
    order = {r.name: i for i, r in enumerate(rows)}
    return sorted(rows, key=lambda r: (-r.added, order[r.name]))


@dataclass(frozen=True)
class Gain:
    """A weight group measured alone: the KL it leaves and the bytes it adds."""

    unit: str
    kl: float
    bytes_added: int


def greedy_steps(baseline_kl: float, gains: list[Gain], budget_bytes: float) -> list[str]:
    """Units in the order the greedy adds them: KL recovered (``baseline_kl − kl``) per megabyte, best first;
    a unit that recovers nothing is never added, one that would pass the budget is passed over, and a group
    is taken once (``name`` or ``name@int8``, whichever comes first)."""
    def per_mb(g: Gain) -> float:
        recovered = baseline_kl - g.kl
        if g.bytes_added <= 0:  # free (or smaller): first if it helps at all
            return np.inf if recovered > 0 else -np.inf
        return recovered / (g.bytes_added / MB)

    chosen, groups, total = [], set(), 0
    for g in sorted(gains, key=lambda g: (-per_mb(g), g.bytes_added, g.unit)):
        group = g.unit.split("@")[0]
        if baseline_kl - g.kl > 0 and total + g.bytes_added <= budget_bytes and group not in groups:
            chosen.append(g.unit)
            groups.add(group)
            total += g.bytes_added
    return chosen


def recovered_share(baseline_kl: float, kl: float) -> float:
    """The share of the candidate's KL a change removes (1: all of it; NaN when the baseline is 0)."""
    return (baseline_kl - kl) / baseline_kl if baseline_kl > 0 else float("nan")
