"""The scope of anything ortevals reuses, built from what each path of a run reads.

Owns :class:`Reads`, the record of one path (raw onnxruntime sessions, onnxruntime-genai's
text model, its multimodal model and processor, the tokenizer, the derived scoring graph,
lm-eval's request handling): the files it opens (or would open when present), the settings
it hands to a runtime, and the distributions whose code computes its numbers. Each opener
builds its record with the same function it opens with (``session_reads`` in
:mod:`ortevals.runtime.sessions`, ``genai_reads`` in :mod:`ortevals.runtime.genai`, ...), so
a file or an option reaches a runtime only through a record.

Owns :class:`Scope`, the one key behind the result store (:mod:`ortevals.report.store`),
canary verdicts and the derived scoring-graph cache (:mod:`ortevals.runtime.derive`),
built from those records only. Its ``digest`` changes when any of these does:

* **files**: every file a record names. A file under 64 MiB is hashed by content. A
  larger one (weights) gets a cheap identity instead: size, mtime_ns and the sha256 of
  its first and last 64 KiB. Hashing gigabytes of weights on every run would cost seconds
  to minutes; rewriting weights changes their size or mtime, and only a deliberate edit
  that keeps size, mtime and both ends could slip through. A file a path would open if
  present but that is not there is keyed as ``absent``: adding it is a change.
* **settings**: the caller's mapping (the run's options) plus each record's settings under
  ``path:<name>`` (canonical JSON; a value that is not JSON is refused).
* **versions**: ortevals' version plus a digest of its own ``.py`` source (so any code
  change, a fix to the graph rewrite included, invalidates stored scores and derived
  graphs), and every distribution a record names (onnxruntime, onnxruntime-genai,
  tokenizers, numpy, lm-eval, ...), read from their metadata without importing them.

The folder path is shown by :meth:`Scope.describe` but not hashed: the same bytes in
another folder give the same numbers. Pure apart from reading the named files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ortevals.install import OG_WHEELS, ORT_WHEELS
from ortevals.version import __version__

FULL_HASH_LIMIT = 64 << 20  # files below this are hashed by content
EDGE = 1 << 16  # bytes read at each end of a larger file
ABSENT = "absent"


@dataclass(frozen=True)
class Reads:
    """What one path reads. ``files``: absolute or package-relative paths it opens, or would open when
    present; ``settings``: JSON-able values it hands to a runtime; ``dists``: distributions (PyPI names)
    whose code computes its numbers."""

    path: str
    files: tuple[Path, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    dists: tuple[str, ...] = ()


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
    def build(cls, purpose: str, root: Path, reads: Sequence[Reads], settings: Mapping[str, Any] | None = None
              ) -> Scope:
        """The scope of everything ``reads`` names, plus the caller's ``settings``; ``root``: the package folder."""
        root = Path(os.path.abspath(root))
        paths = {Path(os.path.abspath(root / p)) for r in reads for p in r.files}
        entries = tuple(sorted((_relative(p, root), file_digest(p) if p.is_file() else ABSENT) for p in paths))
        merged = dict(settings or {})
        for r in reads:
            if r.settings:
                key = f"path:{r.path}"
                if key in merged and merged[key] != r.settings:
                    raise ValueError(f"two records of path {r.path!r} pass different settings")
                merged[key] = dict(r.settings)
        try:
            text = json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except TypeError as e:  # a caller bug: never key on a repr
            raise TypeError(f"scope settings must be JSON: {e}") from None
        dists = sorted({d for r in reads for d in r.dists})
        return cls(purpose, str(root), entries, text, tuple(sorted(versions(dists).items())))

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


def versions(dists: Sequence[str] = ("onnxruntime", "onnxruntime-genai")) -> dict[str, str | None]:
    """ortevals, its source digest, and each of ``dists`` (installed version, or None)."""
    runtimes = runtime_versions()
    found = {d: runtimes[d] if d in runtimes else dist_version(d) for d in dists}
    return {"ortevals": ortevals_version(), "ortevals-source": source_digest(), **found}


def dist_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (the module is never imported)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def ortevals_version() -> str:
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
    return {"onnxruntime": _wheels(ORT_WHEELS), "onnxruntime-genai": _wheels(tuple(OG_WHEELS))}


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


def package_reads(package) -> Reads:
    """What :meth:`ModelPackage.load` reads: ``genai_config.json`` and the decoder's and embedding's graph
    protobufs (signatures, KV specs; no weights), parsed by ``onnx``; in a model package also its
    ``manifest.json`` and the variant it chose (package/manifest.py)."""
    models = [m.path for m in (package.embedding, package.decoder) if m is not None]
    manifest = getattr(package, "manifest", None)
    extra = (manifest.root / "manifest.json",) if manifest is not None else ()
    settings = {"variant": package.variant.name} if getattr(package, "variant", None) is not None else {}
    return Reads("package", (package.root / "genai_config.json", *models, *extra), settings, ("onnx",))
