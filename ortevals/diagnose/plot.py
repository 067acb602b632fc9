"""``diagnose.png``: where the error enters, and what keeping weights in higher precision buys.

Owns one figure drawn from ``diagnose.json``'s summary (:func:`ortevals.diagnose.report.summary`):
the residual stream's relative L2 error after each layer's attention and MLP blocks (cosine
similarity on a second axis), the error each block adds (bars with their standard errors), and the
token KL against the bytes added (each group alone, the greedy's measured cumulative sets, the
budget, and half the candidate's KL). matplotlib through :mod:`ortevals.report.plots`.
"""

from __future__ import annotations

import numpy as np

from ortevals.report import plots


def _layer_series(blocks: list[dict], block: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [b for b in blocks if b["block"] == block]
    return np.array([b["layer"] for b in rows], float), np.array([b[key] for b in rows], float)


def _errors(ax, s: dict) -> None:
    blocks = s["layers"]["blocks"]
    for block, label in (("attn", "after attention"), ("mlp", "after the layer (MLP)")):
        x, y = _layer_series(blocks, block, "rel_l2")
        ax.plot(x, y, marker="o", ms=3, lw=1.2, label=label)
    emb = [b for b in blocks if b["block"] == "embeddings"]
    if emb:
        ax.plot([-1], [emb[0]["rel_l2"]], marker="s", color="grey", ls="none", label="embeddings")
    twin = ax.twinx()
    x, c = _layer_series(blocks, "mlp", "cosine")
    twin.plot(x, c, color="black", lw=0.8, ls=":", label="cosine after the layer")
    twin.set_ylabel("cosine similarity", fontsize=8)
    ax.set_ylabel("relative L2 error")
    ax.set_xlabel("layer (embeddings at -1)", fontsize=8)
    ax.set_title("residual stream against the reference (mean over tokens)", fontsize=10)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")


def _added(ax, s: dict) -> None:
    blocks = s["layers"]["blocks"]
    for j, (block, label) in enumerate((("attn", "attention block"), ("mlp", "MLP block"))):
        rows = [b for b in blocks if b["block"] == block]
        x = np.array([b["layer"] for b in rows], float) + (j - 0.5) * 0.4
        ax.bar(x, [b["added"] for b in rows], width=0.4, yerr=[b["added_se"] for b in rows], label=label,
               error_kw={"lw": 0.6})
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error added")
    ax.legend(fontsize=7)


def _curve(ax, s: dict) -> None:
    base = s["token_kl"]["candidate"]["mean"]
    ax.axhline(base / 2, color="grey", lw=0.8, ls=":", label="half the candidate's KL")
    groups = s["sensitivity"]["groups"]
    if groups:
        ax.scatter([g["bytes_added"] / 1e6 for g in groups], [g["kl"] for g in groups], s=14, color="tab:grey",
                   label="one group alone", zorder=2)
    steps = s["greedy"]
    xs = [0.0] + [c["bytes_added"] / 1e6 for c in steps]
    ys = [base] + [c["kl"] for c in steps]
    es = [s["token_kl"]["candidate"]["se"]] + [c["kl_se"] for c in steps]
    ax.errorbar(xs, ys, yerr=es, marker="o", ms=4, lw=1.4, color="tab:red", label="greedy steps (measured)")
    for c in steps:  # each step labelled with the group it adds
        ax.annotate("+" + c["units"][-1], (c["bytes_added"] / 1e6, c["kl"]), fontsize=6, xytext=(2, -10),
                    textcoords="offset points", rotation=-20)
    ax.axvline(s["budget"]["bytes"] / 1e6, color="tab:green", lw=0.8, ls="--",
               label=f"budget (+{s['budget']['percent']:g}%)")
    ax.set_xlabel("size added (MB)")
    ax.set_ylabel("token KL to the reference (nats)")
    ax.set_ylim(bottom=0)
    ax.set_title("KL left against size added", fontsize=10)
    ax.legend(fontsize=7)


def diagnose_png(s: dict) -> bytes:
    """The figure of a diagnose summary, as PNG bytes."""
    plt, fig, axes = plots.figure(8.0, 10.0, rows=3)
    _errors(axes[0], s)
    _added(axes[1], s)
    axes[1].sharex(axes[0])
    _curve(axes[2], s)
    return plots.png(plt, fig)
