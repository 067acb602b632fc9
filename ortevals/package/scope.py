"""The scope of anything ortevals reuses: what a stored score or a derived graph depends on.

Owns :class:`Scope`, the one key behind the result store (:mod:`ortevals.report.store`,
which exposes it) and the derived scoring-graph cache
(:mod:`ortevals.runtime.derive`). A scope covers three things, and its
``digest`` changes when any of them does:

* **package files**: every file that defines a number
  (:meth:`ModelPackage.scope_files`: config, the models the run opens and their
  external data, tokenizer files, chat template, generation config). A file
  under 64 MiB is hashed by content. A larger one (weights) gets a cheap
  identity instead: size, mtime_ns and the sha256 of its first and last 64 KiB.
  Hashing gigabytes of weights on every run would cost seconds to minutes;
  rewriting weights changes their size or mtime, and only a deliberate edit that
  keeps size, mtime and both ends could slip through.
* **settings**: a plain JSON-able mapping from the caller, every setting that
  can change a number (canonical JSON; a value that is not JSON is refused).
* **versions**: ortevals' version plus a digest of its own ``.py`` source (so
  any code change, a fix to the graph rewrite included, invalidates stored
  scores and derived graphs), and the installed onnxruntime and
  onnxruntime-genai wheels, read from their metadata without importing them.

The folder path is shown by :meth:`Scope.describe` but not hashed: the same
bytes in another folder give the same numbers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ortevals.package.loader import ModelPackage

FULL_HASH_LIMIT = 64 << 20  # files below this are hashed by content
EDGE = 1 << 16  # bytes read at each end of a larger file
ORT_WHEELS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn",
              "onnxruntime-rocm", "onnxruntime-training")
OG_WHEELS = ("onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml", "onnxruntime-genai-rocm")


@dataclass(frozen=True)
class Scope:
    """What reused work depends on. Build with :meth:`build`; key with :attr:`digest`.

    ``files``: (path relative to the package folder, content digest or ``id:`` identity);
    ``settings``: canonical JSON of the caller's mapping; ``versions``: (component, version or None).
    """

    purpose: str  # "results" or "derived"
    package: str  # the folder, for display only
    files: tuple[tuple[str, str], ...]
    settings: str
    versions: tuple[tuple[str, str | None], ...]

    @classmethod
    def build(cls, purpose: str, package: ModelPackage, settings: Mapping[str, Any],
              files: Iterable[Path] | None = None) -> Scope:
        """``files`` defaults to every file that defines a number (:meth:`ModelPackage.scope_files`)."""
        paths = package.scope_files() if files is None else list(files)
        root = Path(os.path.abspath(package.root))
        entries = tuple((_relative(p, root), file_digest(p)) for p in paths)
        try:
            text = json.dumps(dict(settings), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except TypeError as e:  # a caller bug: never key on a repr
            raise TypeError(f"scope settings must be JSON: {e}") from None
        return cls(purpose, str(root), entries, text, tuple(sorted(versions().items())))

    @functools.cached_property
    def digest(self) -> str:
        """sha256 hex of everything but the folder path."""
        body = [self.purpose, [list(f) for f in self.files], self.settings, [list(v) for v in self.versions]]
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode("utf-8")).hexdigest()

    def describe(self) -> dict[str, Any]:
        """What went into the digest, as JSON (``ortevals cache info`` reads it back)."""
        return {"purpose": self.purpose, "digest": self.digest, "package": self.package,
                "files": dict(self.files), "settings": json.loads(self.settings), "versions": dict(self.versions)}


def file_digest(path: Path) -> str:
    """sha256 of the content below :data:`FULL_HASH_LIMIT`; above it ``id:`` + size, mtime and both ends."""
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as fh:
        if st.st_size < FULL_HASH_LIMIT:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest()
        h.update(fh.read(EDGE))
        fh.seek(-EDGE, os.SEEK_END)
        h.update(fh.read())
    return f"id:{st.st_size}:{st.st_mtime_ns}:{h.hexdigest()}"


def versions() -> dict[str, str | None]:
    """ortevals, its source digest, onnxruntime and onnxruntime-genai (wheel name and version, or None)."""
    return {"ortevals": ortevals_version(), "ortevals-source": source_digest(), **runtime_versions()}


def ortevals_version() -> str:
    from ortevals import __version__

    return __version__


SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the ortevals package, every layer


def source_files() -> list[Path]:
    """Every ``.py`` file of ortevals, in a stable order."""
    return sorted(SOURCE_ROOT.rglob("*.py"))


@functools.cache
def source_digest() -> str:
    """sha256 over ortevals' own ``.py`` files (path and bytes); computed once per process (~1 ms)."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.relative_to(SOURCE_ROOT).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def runtime_versions() -> dict[str, str | None]:
    """Installed runtime wheels from their metadata; the modules themselves are never imported here."""
    return {"onnxruntime": _wheels(ORT_WHEELS), "onnxruntime-genai": _wheels(OG_WHEELS)}


def _wheels(names: tuple[str, ...]) -> str | None:
    found = []
    for name in names:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ",".join(found) or None


def _relative(path: Path, root: Path) -> str:
    full = Path(os.path.abspath(path))
    return full.relative_to(root).as_posix() if full.is_relative_to(root) else full.as_posix()
