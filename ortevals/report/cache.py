"""What ortevals keeps in its cache, and clearing it: the logic behind ``ortevals cache``.

The cache root (:func:`ortevals.files.cache_root`) holds three kinds of entry:

* ``runs/``: result stores, one SQLite file per package folder (plus its WAL
  and shared-memory files), each listing the scopes it holds;
* ``derived/``: derived scoring graphs, one folder per scope (``scope.json``);
* ``examples/``: the SmolLM2 example packages (a minute to rebuild).

Only those three folders are ever removed, never the root or anything else in it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.report.store import store_scopes

log = logging.getLogger(__name__)
KINDS = ("runs", "derived", "examples")


@dataclass(frozen=True)
class Entry:
    """One cached item: a store file or a folder; ``scopes``: (description, rows) of a store."""

    name: str
    bytes: int
    scopes: tuple[tuple[dict[str, Any], int], ...] = ()
    note: str = ""


def entries(root: Path, kind: str) -> list[Entry]:
    """The entries of one kind under ``root`` (empty when the folder does not exist)."""
    folder = root / kind
    if not folder.is_dir():
        return []
    if kind == "runs":
        return [_store_entry(p) for p in sorted(folder.glob("*.sqlite"))]
    return [Entry(p.name, _size(p), note=_derived_note(p) if kind == "derived" else "")
            for p in sorted(folder.iterdir()) if p.is_dir()]


def info_text(root: Path) -> str:
    """The text of ``ortevals cache info``."""
    lines = [f"cache root {root}"]
    for kind in KINDS:
        found = entries(root, kind)
        lines.append(f"{kind}/: {len(found)} entries, {_human(sum(e.bytes for e in found))}")
        for e in found:
            lines.append(f"  {e.name}  {_human(e.bytes)}{'  ' + e.note if e.note else ''}")
            differ = _differing_settings([d for d, _ in e.scopes])
            for desc, rows in e.scopes:
                v, settings = desc.get("versions", {}), desc.get("settings", {})
                lines.append(f"    scope {desc.get('digest', '?')[:12]}: {desc.get('package')}  {rows} rows  "
                             f"ortevals {v.get('ortevals')} (source {str(v.get('ortevals-source'))[:12]})"
                             + "".join(f", {v[k]}" for k in ("onnxruntime", "onnxruntime-genai") if k in v)
                             + "".join(f"  {k}={json.dumps(settings.get(k))}" for k in differ))
    return "\n".join(lines)


def _differing_settings(descriptions: list[dict[str, Any]]) -> list[str]:
    """Setting names whose values differ between a store's scopes: what tells them apart."""
    settings = [d.get("settings", {}) for d in descriptions]
    names = sorted({k for s in settings for k in s})
    return [k for k in names if len({json.dumps(s.get(k), sort_keys=True) for s in settings}) > 1]


def clear(root: Path, kinds: tuple[str, ...]) -> list[str]:
    """Remove the given kinds' folders under ``root``; one line per kind saying what went."""
    said = []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}")
        found = entries(root, kind)
        folder = root / kind
        if folder.is_dir():
            size = _size(folder)
            shutil.rmtree(folder)
            log.info("removed %s", folder)
            said.append(f"removed {folder}: {len(found)} entries, {_human(size)}")
        else:
            said.append(f"nothing in {folder}")
    return said


def _store_entry(path: Path) -> Entry:
    size = sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())  # -wal, -shm
    try:
        return Entry(path.name, size, tuple(store_scopes(path)))
    except (sqlite3.Error, json.JSONDecodeError) as e:
        return Entry(path.name, size, note=f"(unreadable: {e}; from an older ortevals?)")


def _derived_note(folder: Path) -> str:
    try:
        return str(json.loads((folder / "scope.json").read_text()).get("package"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return "(no scope.json)"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
