"""One benchmarked process, watched from outside: wall time from launch to exit, its tree's RSS sampled
(psutil, children included), its stdout, and its stderr cut into lines (tqdm's ``\\r`` updates included)
with the time each arrived, handed to a callback that may stop it (SIGKILL) on what it reads.

Each run holds ``/work/bench.lock`` (flock) when that folder exists, so no two benchmark runs on a shared
machine overlap; the clock starts once the lock is held.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

LOCK = Path("/work/bench.lock")


class Watched:
    """Runs ``cmd`` to its end (or until ``on_line`` returns True: then SIGKILL) and keeps what it saw."""

    def __init__(self, cmd: list[str], env: dict, every: float = 1.0,
                 on_line: Callable[[float, str], bool] | None = None) -> None:
        import psutil

        self.on_line, self.killed_at = on_line, None
        self.rss: list[tuple[float, float]] = []  # (seconds since launch, MiB)
        self.tail: list[str] = []
        self.out = ""
        with open(LOCK, "a") if LOCK.parent.is_dir() else open(os.devnull) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.start = time.perf_counter()
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            ps = psutil.Process(self.proc.pid)
            readers = [threading.Thread(target=self._stderr, daemon=True),
                       threading.Thread(target=self._stdout, daemon=True)]
            for t in readers:
                t.start()
            while self.proc.poll() is None:
                self._sample(ps)
                time.sleep(every)
            for t in readers:
                t.join()
            self.wall = time.perf_counter() - self.start
        self.code = self.proc.returncode

    @property
    def peak_mib(self) -> float:
        return max((m for _, m in self.rss), default=0.0)

    def now(self) -> float:
        return time.perf_counter() - self.start

    def _stdout(self) -> None:
        self.out = self.proc.stdout.read().decode(errors="replace")

    def _stderr(self) -> None:
        buf = b""
        while chunk := self.proc.stderr.read1(65536):
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for line in lines:
                self._line(line.decode(errors="replace"))
        self._line(buf.decode(errors="replace"))

    def _line(self, text: str) -> None:
        if not text.strip():
            return
        self.tail = (self.tail + [text])[-40:]
        if self.on_line is not None and self.killed_at is None and self.on_line(self.now(), text):
            self.proc.send_signal(signal.SIGKILL)
            self.killed_at = self.now()

    def _sample(self, ps) -> None:
        import psutil

        try:
            rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
        except psutil.NoSuchProcess:
            return
        self.rss.append((self.now(), rss / 2**20))

    def failure(self) -> str:
        """The last line that reads like an error (else the last line) of its output."""
        lines = [ln for ln in (self.out.splitlines() + self.tail) if ln.strip()]
        errors = [ln for ln in lines if re.search(r"Error|error|Exception|Traceback", ln)]
        return (errors or lines or ["no output"])[-1].strip()
