"""Files ortevals writes: the cache location and atomic writes.

Owns where derived artefacts live (``$ORTEVALS_CACHE``, else
``~/.cache/ortevals``; never the user's package folder) and writing through a
temp file in the target's folder, fsync and rename, so a crash or Ctrl-C never
leaves a half-written file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """``$ORTEVALS_CACHE``, else ``~/.cache/ortevals``."""
    return Path(os.environ.get("ORTEVALS_CACHE") or Path.home() / ".cache" / "ortevals")


def store_path(package_dir: str | Path) -> Path:
    """The result store of a package folder: one SQLite file per folder, inside the cache."""
    import hashlib

    digest = hashlib.sha256(str(Path(package_dir).resolve()).encode()).hexdigest()[:16]
    return cache_root() / "runs" / f"{Path(package_dir).name}-{digest}.sqlite"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
