"""What ``ortevals diagnose`` keeps between runs, so a rerun (after Ctrl-C, a failure, or with other options)
resumes instead of measuring again.

Owns the measurements kept in the cache (``$ORTEVALS_CACHE/derived/<digest>/``), each keyed by a
:class:`~ortevals.package.scope.Scope` of everything that can change it: the per-layer stage (both packages'
files, the text's token ids, the window plan, the provider), the saved reference ``reference.npz`` (the
reference package's files, the text's ids, the plan, the provider: reused from ``--output`` where its key file
says it was made so), and each token KL (the measured package's files, the reference file's content, the
provider). ortevals' source digest and the runtimes' versions are in every scope, so a changed ortevals or
onnxruntime measures again. Each entry is written whole (atomic writes) once its measurement is done; an
interrupted measurement leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ortevals.diagnose.layers import LayerStage
from ortevals.diagnose.measure import TokenKL
from ortevals.diagnose.stats import BlockRow
from ortevals.files import atomic_write, atomic_write_bytes, json_text
from ortevals.package.scope import Reads, Scope

log = logging.getLogger(__name__)
DISTS = ("onnxruntime", "numpy", "scipy")


def _files(package: Path) -> tuple[Path, ...]:
    """Every file of a package folder (a derived one's links included): a change to any of them measures again."""
    return tuple(sorted(p for p in Path(package).rglob("*") if p.is_file() and p.name != "scope.json"))


def _entry(cache: Path, what: str, package: Path, files: tuple[Path, ...], settings: dict) -> Path:
    """The cache folder of one measurement: ``what`` of ``package`` under everything that can change it."""
    scope = Scope.build("derived", package, [Reads(f"diagnose {what}", files, settings, DISTS)])
    return Path(cache) / "derived" / scope.digest[:32]


def ids_digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()


def token_kl(package: Path, reference_file: Path, ep: str | None, cache: Path | None,
             measure: Callable[[], TokenKL]) -> TokenKL:
    """``measure()`` (fidelity's token KL of ``package`` against ``reference_file``), or what it gave before."""
    if cache is None:
        return measure()
    folder = _entry(cache, "token KL", package, (*_files(package), Path(reference_file).resolve()), {"ep": ep})
    arrays, meta = folder / "token_kl.npz", folder / "token_kl.json"
    if arrays.is_file() and meta.is_file():
        with np.load(arrays) as data:
            s = json.loads(meta.read_text(encoding="utf-8"))
            return TokenKL(s["kl"], s["kl_se"], s["same_top1"], s["ppl_ratio"], data["per_token"], data["clusters"],
                           s["summary"])
    tk = measure()
    buf = _npz(per_token=tk.per_token, clusters=tk.clusters)
    atomic_write(meta, json_text({"kl": tk.kl, "kl_se": tk.kl_se, "same_top1": tk.same_top1,
                                  "ppl_ratio": tk.ppl_ratio, "summary": tk.summary}))
    atomic_write_bytes(arrays, buf)
    return tk


def layers(cand: Path, ref: Path, ids: np.ndarray, plan, ep: str | None, cache: Path,
           measure: Callable[[], LayerStage]) -> tuple[LayerStage, bool]:
    """The per-layer stage, measured or kept from before (then True)."""
    settings = {"ids": ids_digest(ids), "plan": [plan.n_ctx, plan.n_windows, plan.n_scored], "ep": ep}
    folder = _entry(cache, "per layer", cand, (*_files(cand), *_files(ref)), settings)
    path = folder / "layers.json"
    if path.is_file():
        s = json.loads(path.read_text(encoding="utf-8"))
        rows = tuple(BlockRow(**{k: (float("nan") if v is None and k not in ("layer",) else v) for k, v in r.items()})
                     for r in s["rows"])
        return LayerStage(rows, tuple(s["compared"]), tuple(s["missing"]), s["tokens"], s["windows"]), True
    stage = measure()
    atomic_write(path, json_text({"rows": [asdict(r) for r in stage.rows], "compared": list(stage.compared),
                                  "missing": list(stage.missing), "tokens": stage.tokens, "windows": stage.windows}))
    return stage, False


def reference_key(ref: Path, ids: np.ndarray, plan, ep: str | None) -> str:
    """What ``reference.npz`` was made from: the reference package's files, the text's ids, the plan, the provider."""
    settings = {"ids": ids_digest(ids), "plan": [plan.n_ctx, plan.n_windows, plan.n_scored], "ep": ep}
    return Scope.build("derived", ref, [Reads("diagnose reference", _files(ref), settings, DISTS)]).digest


def reference_kept(path: Path, key: str) -> bool:
    """``reference.npz`` in ``--output`` was made from exactly this (its key file says so)."""
    mark = path.with_name(path.name + ".key")
    return path.is_file() and mark.is_file() and mark.read_text(encoding="utf-8").strip() == key


def mark_reference(path: Path, key: str) -> None:
    atomic_write(path.with_name(path.name + ".key"), key + "\n")


def _npz(**arrays) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()
