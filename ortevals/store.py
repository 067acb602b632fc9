"""The result store: finished requests survive a crash, a kill or Ctrl-C.

Owns a SQLite file (WAL journal, so a SIGKILL loses no committed row) that maps
a key to a request's answer. The key hashes the package fingerprint (config
and model files), the settings that can change a number (execution provider
and its options, max_length, BOS rule, decoding seed) and the request itself,
so a changed package or setting never reuses an old score. Batch size and
prefix caching are left out on purpose: they never change an answer.

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

log = logging.getLogger(__name__)


class ResultStore:
    """Persistent answers keyed by (scope, kind, request). Build with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, scope: str, commit_every: int = 64,
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
    def open(cls, path: Path, scope: dict[str, Any]) -> ResultStore:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("BEGIN")
        digest = hashlib.sha256(json.dumps(scope, sort_keys=True).encode()).hexdigest()
        return cls(conn, path, digest)

    def key(self, kind: str, request: Any) -> str:
        body = json.dumps([self.scope, kind, request], ensure_ascii=False, default=str)
        return hashlib.sha256(body.encode("utf-8")).hexdigest()

    def get(self, kind: str, request: Any) -> Any | None:
        row = self.conn.execute("SELECT value FROM answers WHERE key = ?", (self.key(kind, request),)).fetchone()
        if row is None:
            return None
        self.hits += 1
        return json.loads(row[0])

    def put(self, kind: str, request: Any, value: Any) -> None:
        self.conn.execute("INSERT OR REPLACE INTO answers (key, value) VALUES (?, ?)",
                          (self.key(kind, request), json.dumps(value)))
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
