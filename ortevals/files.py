"""Files ortevals writes: the cache location, atomic writes, strict JSON.

Owns where derived artefacts live (``$ORTEVALS_CACHE``, else
``~/.cache/ortevals``; never the user's package folder), writing through a
temp file in the target's folder, fsync and rename, so a crash or Ctrl-C never
leaves a half-written file (with the permissions a plain ``open`` would give:
0666 less the umask, as lm-eval's files), checking an output folder before a
run starts, and JSON text that strict parsers accept (NaN and infinities
become ``null``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError

CACHE_ENV = "ORTEVALS_CACHE"


def cache_root() -> Path:
    """``$ORTEVALS_CACHE``, else ``~/.cache/ortevals``; a path that exists and is not a folder is an error."""
    value = os.environ.get(CACHE_ENV)
    root = Path(value).expanduser() if value else Path.home() / ".cache" / "ortevals"
    if root.exists() and not root.is_dir():
        where = f"{CACHE_ENV}={value}" if value else str(root)
        raise OrtEvalsError(f"{where}: the ortevals cache must be a folder, but this is a file; "
                            f"point {CACHE_ENV} at a folder (it is created if missing)")
    return root


def store_path(package_dir: str | Path) -> Path:
    """The result store of a package folder: one SQLite file per folder, inside the cache."""
    import hashlib

    digest = hashlib.sha256(str(Path(package_dir).resolve()).encode()).hexdigest()[:16]
    return cache_root() / "runs" / f"{Path(package_dir).name}-{digest}.sqlite"


def check_writable_folder(path: Path, flag: str) -> None:
    """Before any work: ``path`` is a folder this process can write (created if missing); else one line.

    Checked by doing it (create the folder, write and remove a temp file): permission bits say nothing for
    root, read-only mounts or /proc."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OrtEvalsError(f"{flag} {path}: is a file; expected a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OrtEvalsError(f"{flag} {path}: not writable ({e.strerror or type(e).__name__}); expected a folder "
                            "this user can write") from None


def check_writable_file(path: Path, flag: str) -> None:
    """Before any work: ``path`` is a file (or a new file) in a folder this process can write; else one line."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OrtEvalsError(f"{flag} {path}: is a folder; expected a file path")
    check_writable_folder(path.parent, flag)
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            raise OrtEvalsError(f"{flag} {path}: not writable ({e.strerror or type(e).__name__})") from None


def _mode() -> int:
    """0666 less the process umask: what ``open(path, "w")`` gives."""
    try:  # Linux: read it without changing it (os.umask would, for a moment, for every thread)
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("Umask:"))
        mask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), _mode())  # mkstemp makes 0600; a result file is as readable as any other
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def finite(x: Any) -> Any:
    """``x`` with every NaN/inf float (numpy scalars included) replaced by None, recursively."""
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.ndarray):
        return finite(x.tolist())
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def json_text(obj: Any, **kwargs) -> str:
    """Strict JSON: no bare NaN/Infinity (they become null); ``default=str`` for other objects."""
    kwargs.setdefault("ensure_ascii", False)
    kwargs.setdefault("default", str)
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
