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
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

from ortevals.report.scope import Scope

__all__ = ["ResultStore", "Scope", "store_scopes"]
log = logging.getLogger(__name__)


class ResultStore:
    """Persistent answers keyed by (scope, kind, request). Build with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, scope: Scope, commit_every: int = 64,
                 commit_seconds: float = 2.0) -> None:
        self.conn = conn
        self.path = path
        self.scope = scope
        self.commit_every = commit_every
        self.commit_seconds = commit_seconds
        self._pending = 0
        self._last_commit = time.monotonic()
        self.hits = 0
        self.writes = 0

    @classmethod
    def open(cls, path: Path, scope: Scope) -> ResultStore:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        columns = [r[1] for r in conn.execute("PRAGMA table_info(answers)")]
        if columns and "scope" not in columns:  # an older ortevals' store: its keys can never match a Scope
            log.warning("%s: result store from an older ortevals; its answers are dropped", path)
            conn.execute("DROP TABLE answers")
        conn.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, value TEXT NOT NULL, scope TEXT)")
        conn.execute("CREATE TABLE IF NOT EXISTS scopes (digest TEXT PRIMARY KEY, description TEXT NOT NULL)")
        # autocommit, before BEGIN: no write lock is held between open and the first answer
        conn.execute("INSERT OR REPLACE INTO scopes (digest, description) VALUES (?, ?)",
                     (scope.digest, json.dumps(scope.describe(), sort_keys=True)))
        conn.execute("BEGIN")
        return cls(conn, path, scope)

    def key(self, kind: str, request: Any) -> str:
        body = json.dumps([self.scope.digest, kind, request], ensure_ascii=False, default=str)
        return hashlib.sha256(body.encode("utf-8")).hexdigest()

    def get(self, kind: str, request: Any) -> Any | None:
        row = self.conn.execute("SELECT value FROM answers WHERE key = ?", (self.key(kind, request),)).fetchone()
        if row is None:
            return None
        self.hits += 1
        return json.loads(row[0])

    def put(self, kind: str, request: Any, value: Any) -> None:
        self.conn.execute("INSERT OR REPLACE INTO answers (key, value, scope) VALUES (?, ?, ?)",
                          (self.key(kind, request), json.dumps(value), self.scope.digest))
        self.writes += 1
        self._pending += 1
        if self._pending >= self.commit_every or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit()

    def commit(self) -> None:
        self.conn.execute("COMMIT")
        self.conn.execute("BEGIN")
        self._pending = 0
        self._last_commit = time.monotonic()

    def close(self) -> None:
        try:
            self.conn.execute("COMMIT")
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
