"""Files ortevals writes: the cache location, atomic writes, file sets, strict JSON.

Owns where derived artefacts live (``$ORTEVALS_CACHE``, else
``~/.cache/ortevals``; never the user's package folder), writing through a
temp file in the target's folder, fsync and rename, so a crash or Ctrl-C never
leaves a half-written file (with the permissions a plain ``open`` would give:
0666 less the umask, as lm-eval's files), checking an output folder before a
run starts, a run's files published as one set (:func:`staged` then
:func:`publish`: the earlier set or the new one, never a mix), and JSON text
that strict parsers accept (NaN and infinities become ``null``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError, OutputError

CACHE_ENV = "ORTEVALS_CACHE"
STAGE_PREFIX = ".ortevals-new-"  # a run's files before they are published (inside the output folder)
# the least an output folder's disk must have free before a command starts: a run's results.json, samples and
# plots for a few hundred questions (a full disk is refused before the work, not after it)
MIN_FREE = 16 * 2**20
log = logging.getLogger(__name__)


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


def check_writable_folder(path: Path, flag: str, files: Sequence[str] = (), need: int | None = None) -> None:
    """Before any work: ``path`` is a folder this process can write (created if missing), with ``need`` bytes
    (default :data:`MIN_FREE`) free on its disk, and nothing there matching the ``files`` patterns (what the
    command will replace) is a folder; else one line.

    Checked by doing it (create the folder, write and remove a temp file): permission bits say nothing for
    root, read-only mounts or /proc."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OrtEvalsError(f"{flag} {path}: is a file; expected a folder (it is created if missing)")
    for blocked in (p for pattern in files for p in sorted(path.glob(pattern)) if p.is_dir()):
        raise OrtEvalsError(f"{flag} {path}: {blocked.name} there is a folder, so it cannot be replaced by the file "
                            "of that name; remove or rename it, or give another folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OrtEvalsError(f"{flag} {path}: not writable ({e.strerror or type(e).__name__}); expected a folder "
                            "this user can write") from None
    free, need = shutil.disk_usage(path).free, MIN_FREE if need is None else need
    if free < need:
        raise OutputError(f"{flag} {path}: {free / 2**20:.1f} MiB free on its disk, and this command writes up to "
                          f"{need / 2**20:.0f} MiB there; free some space, or give a folder on another disk",
                          path, "not enough free space")


def check_writable_file(path: Path, flag: str) -> None:
    """Before any work: ``path`` is a file (or a new file) in a folder this process can write; else one line
    naming the file."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OrtEvalsError(f"{flag} {path}: is a folder; expected a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.exists():
            with open(path, "ab"):
                pass
    except OSError as e:
        raise OrtEvalsError(f"{flag} {path}: not writable ({e.strerror or type(e).__name__}); expected a file path "
                            "in a folder this user can write") from None


@contextlib.contextmanager
def staged(folder: Path | None, flag: str = "--output") -> Iterator[Path | None]:
    """A fresh folder inside ``folder`` (None: None) where a command writes its files before :func:`publish`
    moves them into ``folder`` as one set; removed on leaving, with whatever was not published. A file of the
    set that cannot be written (:class:`OutputError`) is one line naming ``flag``, ``folder`` and the file:
    nothing of the set reached ``folder``."""
    if folder is None:
        yield None
        return
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder, prefix=STAGE_PREFIX))
    try:
        yield stage
    except OutputError as e:
        if e.path is None or Path(e.path).parent != stage:
            raise
        raise OutputError(f"{flag} {folder}: could not write {Path(e.path).name} ({e.reason}); nothing of this "
                          "set was written there, the earlier files are as they were", folder, e.reason) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(stage: Path, folder: Path, flag: str, remove: Sequence[str] = (), last: str = "results.json"
            ) -> list[Path]:
    """Move every file of ``stage`` into ``folder`` and take ``remove`` (names) out of it, as one set: ``last``
    (the file a reader trusts) moves last. Each file it replaces or removes is first moved aside; on any
    failure every step is undone, so ``folder`` keeps the earlier set exactly, and one line names the file.
    Renames within one folder: milliseconds for the whole set. Returns the published paths."""
    names = sorted((p.name for p in stage.iterdir() if p.is_file()), key=lambda n: (n == last, n))
    for name in (*names, *remove):
        if (folder / name).is_dir():
            raise OrtEvalsError(f"{flag} {folder}: {name} there is a folder, so it cannot be replaced; remove or "
                                "rename it (nothing was changed)")
    aside = Path(tempfile.mkdtemp(dir=stage, prefix="earlier-"))
    steps = [(n, True) for n in names if n != last] + [(n, False) for n in remove if n not in names]
    steps += [(n, True) for n in names if n == last]
    done: list[tuple[str, bool]] = []  # (name, an earlier file was moved aside)
    try:
        for name, new in steps:
            target = folder / name
            had = os.path.lexists(target)
            if had:
                os.rename(target, aside / name)
            done.append((name, had))
            if new:
                os.rename(stage / name, target)
        _sync(folder)
    except OSError as e:
        _undo(done, folder, stage, aside)
        raise OrtEvalsError(f"{flag} {folder}: could not write {name} ({e.strerror or e}); nothing "
                            "there was changed (the earlier files are as they were)") from None
    return [folder / n for n in names]


def _undo(done: list[tuple[str, bool]], folder: Path, stage: Path, aside: Path) -> None:
    """Put back every file :func:`publish` moved aside; a new file whose name had none is removed."""
    for name, had in reversed(done):
        try:
            if had:
                os.replace(aside / name, folder / name)
            elif (folder / name).exists() and not (stage / name).exists():
                os.rename(folder / name, stage / name)
        except OSError as e:  # cannot happen short of the disk going away: say what is where
            log.error("could not restore %s from %s: %s", folder / name, aside / name, e)


def _sync(folder: Path) -> None:
    """The folder's entries (the renames) on disk."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OutputError(f"{path}: could not write it ({reason}); nothing was written there", path, reason) \
            from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), _mode())  # mkstemp makes 0600; a result file is as readable as any other
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a folder gone read-only: nothing half-written is left, one line
        Path(tmp).unlink(missing_ok=True)
        reason = e.strerror or type(e).__name__
        raise OutputError(f"{path}: could not write it ({reason}); nothing was written there", path, reason) \
            from None
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
