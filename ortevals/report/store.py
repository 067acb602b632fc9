"""The result store: finished requests survive a crash, a kill or Ctrl-C.

Owns a SQLite file (WAL journal, so a SIGKILL loses no committed row) that maps
a key to a request's answer, and the :class:`Scope` every key is made in (defined
in :mod:`ortevals.report.scope`, re-exported here). The key is
``sha256(scope digest, kind, request)``; the scope covers every package file
that defines a number (config, models, external data, tokenizer files, chat
template), every setting that can change a number, and the ortevals (source
included), onnxruntime and onnxruntime-genai versions, so a changed file,
setting or version never reuses an old score. Each scope's description is kept
in a ``scopes`` table (digest -> JSON) and every answer row names its scope, so
``ortevals cache info`` can list what a store holds.

Rows are committed every ``commit_every`` results or ``commit_seconds``, so a
kill costs at most that much work. Only JSON goes in and out; nothing is
unpickled.

Several processes may use one store at once (two runs in two terminals, a sweep):
answers wait in memory and go to disk in one short ``BEGIN IMMEDIATE`` transaction
per commit, so no connection holds SQLite's write lock between commits, and every
read runs outside a transaction, so it sees what the other runs have committed
(same scope: their answers are reused). Holding a transaction open from one put to
the next made a second run die with "database is locked": its read snapshot went
stale as soon as the first run committed.

A store that cannot be used (a corrupt or non-SQLite file, a folder, a folder that
cannot be created) is a :class:`~ortevals.errors.StoreError`: one line naming the file
and the way out (``ortevals cache clear``, or removing the file), wherever SQLite
raises it (opening, reading or committing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

from ortevals.errors import StoreError, first_line
from ortevals.report.scope import Scope

__all__ = ["ResultStore", "Scope", "store_scopes"]
log = logging.getLogger(__name__)
BUSY_SECONDS = 60  # how long a commit waits for another run's commit (each holds the lock for milliseconds)


@contextlib.contextmanager
def guarded(path: Path):
    """SQLite's and the file system's errors on the store file ``path`` as one :class:`StoreError` line."""
    try:
        yield
    except (sqlite3.Error, OSError) as e:
        raise store_error(path, first_line(e)) from None


def store_error(path: Path, reason: str) -> StoreError:
    return StoreError(f"{path}: result store unusable ({reason}); expected an ortevals result store (SQLite) "
                      "file: `ortevals cache clear` removes the stores in the ortevals cache, or remove it "
                      "(--model-args store=none runs without one)")


class ResultStore:
    """Persistent answers keyed by (scope, kind, request). Build with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, scope: Scope, commit_every: int = 64,
                 commit_seconds: float = 2.0) -> None:
        self.conn = conn
        self.path = path
        self.scope = scope
        self.commit_every = commit_every
        self.commit_seconds = commit_seconds
        self._pending: dict[str, str] = {}  # key -> JSON value, not yet on disk
        self._last_commit = time.monotonic()
        self.hits = 0
        self.writes = 0

    @classmethod
    def open(cls, path: Path, scope: Scope) -> ResultStore:
        if path.is_dir():
            raise store_error(path, "a folder")
        with guarded(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            return cls._open(path, scope)

    @classmethod
    def _open(cls, path: Path, scope: Scope) -> ResultStore:
        # autocommit (isolation_level None): no statement opens a transaction that outlives it
        conn = sqlite3.connect(str(path), timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        columns = [r[1] for r in conn.execute("PRAGMA table_info(answers)")]
        if columns and "scope" not in columns:  # an older ortevals' store: its keys can never match a Scope
            log.warning("%s: result store from an older ortevals; its answers are dropped", path)
            conn.execute("DROP TABLE answers")
        conn.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, value TEXT NOT NULL, scope TEXT)")
        conn.execute("CREATE TABLE IF NOT EXISTS scopes (digest TEXT PRIMARY KEY, description TEXT NOT NULL)")
        conn.execute("INSERT OR REPLACE INTO scopes (digest, description) VALUES (?, ?)",
                     (scope.digest, json.dumps(scope.describe(), sort_keys=True)))
        return cls(conn, path, scope)

    def rescope(self, scope: Scope) -> None:
        """Key answers under ``scope`` from now on (what is pending is committed under the old one first)."""
        self.commit()
        with guarded(self.path):
            self.conn.execute("INSERT OR REPLACE INTO scopes (digest, description) VALUES (?, ?)",
                              (scope.digest, json.dumps(scope.describe(), sort_keys=True)))
        self.scope = scope

    def key(self, kind: str, request: Any) -> str:
        body = json.dumps([self.scope.digest, kind, request], ensure_ascii=False, default=str)
        return hashlib.sha256(body.encode("utf-8")).hexdigest()

    def get(self, kind: str, request: Any) -> Any | None:
        """This run's answer not yet committed, else the latest committed one (any run's), else None."""
        key = self.key(kind, request)
        text = self._pending.get(key)
        if text is None:
            with guarded(self.path):
                row = self.conn.execute("SELECT value FROM answers WHERE key = ?", (key,)).fetchone()
            text = row[0] if row is not None else None
        if text is None:
            return None
        self.hits += 1
        return json.loads(text)

    def put(self, kind: str, request: Any, value: Any) -> None:
        self._pending[self.key(kind, request)] = json.dumps(value)
        self.writes += 1
        if len(self._pending) >= self.commit_every or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit()

    def commit(self) -> None:
        """Write the pending answers in one short transaction (the write lock is held only for it)."""
        self._last_commit = time.monotonic()
        if not self._pending:
            return
        rows = [(key, value, self.scope.digest) for key, value in self._pending.items()]
        with guarded(self.path):
            self.conn.execute("BEGIN IMMEDIATE")  # waits (busy timeout) while another run commits
            try:
                self.conn.executemany("INSERT OR REPLACE INTO answers (key, value, scope) VALUES (?, ?, ?)", rows)
                self.conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
                raise
        self._pending.clear()

    def close(self) -> None:
        try:
            self.commit()
        finally:
            self.conn.close()


def store_scopes(path: Path) -> list[tuple[dict[str, Any], int]]:
    """(scope description, answer rows) for each scope a store file holds; read-only, nothing unpickled."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    try:
        rows = conn.execute("SELECT s.description, count(a.key) FROM scopes s LEFT JOIN answers a "
                            "ON a.scope = s.digest GROUP BY s.digest ORDER BY s.rowid").fetchall()
    finally:
        conn.close()
    return [(json.loads(d), n) for d, n in rows]
