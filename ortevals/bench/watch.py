"""One benchmarked process, watched from outside, the same way for every backend.

Owns :func:`watch`: start a command, time it from launch to exit (``time.perf_counter`` around ``Popen``
and ``os.wait4``, polled every 10 ms), read its peak resident memory from the kernel (``wait4``'s
``ru_maxrss``: the high-water mark of the largest process in its tree, exact where sampling would miss a
peak), sample its peak device memory from here through NVML where the parent can (devmem.py: ``n/a``
without it), read its stderr line by line (tqdm's ``\\r`` updates included) with the time each arrived,
note the first moment a scoring progress bar shows a finished item (:data:`SCORING_BARS`: ortevals' bars
and lm-eval's backends'), and kill it after ``timeout`` seconds. Nothing is imported that the child would
not see.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from ortevals.bench.devmem import PeakSampler

# the progress bars that count answers (each backend's own unit): ortevals' questions and generations, lm-eval
# hf's and vllm's requests, lm-eval onnxruntime(-genai)'s requests
SCORING_BARS = ("ortevals", "ortevals generate", "Running loglikelihood requests", "Running generate_until requests",
                "Computing log-likelihoods", "Generating text")
_BAR = re.compile(r"^\s*(?P<desc>[^:|]+?):\s*\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)")
TAIL = 40  # stderr lines kept
_ERROR = re.compile(r"\w*(?:Error|error|Exception|Traceback|Killed)\b.*")


@dataclass(frozen=True)
class Watched:
    """What one run of a command did: exit status, seconds, memory, its output's tail."""

    exit_code: int  # negative: killed by that signal
    wall_s: float  # launch to exit
    peak_rss_mib: float  # kernel's high-water mark of the largest process of the tree
    first_result_s: float | None  # launch to the first finished item on a scoring bar; None: no bar seen
    timed_out: bool
    stdout: str
    tail: tuple[str, ...]  # the last stderr lines
    device_mib: float | None = None  # peak device memory NVML saw (None: no NVML here, or no GPU)
    device_source: str | None = None  # "nvml-process" (its own count) or "nvml-device-delta" (the device's rise)
    last_bar: tuple[int, int] | None = None  # (done, total) of the last scoring bar seen: how far a cut run got

    def failure(self, timeout: float | None = None) -> str:
        """The one line that says why the run failed: a time-out, else the last line reading like an error."""
        if self.timed_out:
            said = f"timed out after {timeout:g} s" if timeout else "timed out"
            return said + (f", its progress bar at {self.last_bar[0]}/{self.last_bar[1]}" if self.last_bar else "")
        lines = [ln.strip() for ln in (*self.stdout.splitlines(), *self.tail) if ln.strip()]
        errors = [found[0] for ln in lines if (found := _ERROR.search(ln))]  # a bar's text before it left out
        return (errors or lines or [f"exit code {self.exit_code}, no output"])[-1]


def scoring_bar(line: str) -> tuple[int, int] | None:
    """(done, total) of the scoring progress bar on ``line``, else None."""
    found = _BAR.match(line)
    if found is None or found.group("desc").strip() not in SCORING_BARS:
        return None
    return int(found.group("n")), int(found.group("total"))


def watch(cmd: list[str], env: dict[str, str], timeout: float | None = None) -> Watched:
    """Run ``cmd`` to its end (or kill its process group at ``timeout`` seconds) and report it."""
    state = {"first": None, "bar": None, "tail": [], "out": b""}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    readers = [threading.Thread(target=_read_stderr, args=(proc, start, state), daemon=True),
               threading.Thread(target=_read_stdout, args=(proc, state), daemon=True)]
    for t in readers:
        t.start()
    sampler = PeakSampler(proc.pid).__enter__()  # a thread polling NVML, only where NVML answers
    expired = threading.Event()
    timer = threading.Timer(timeout, _kill, (proc, expired)) if timeout else None
    if timer:
        timer.start()
    try:
        status, usage = _reap(proc.pid)
    except BaseException:  # Ctrl-C reaches only this process's group: the child's own session goes too
        _kill(proc, expired)
        proc.wait()
        raise
    finally:
        sampler.__exit__(None, None, None)
    wall = time.perf_counter() - start
    if timer:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    for t in readers:
        t.join()
    device = sampler.result()
    return Watched(proc.returncode, wall, usage.ru_maxrss / 1024, state["first"], expired.is_set(),
                   state["out"].decode(errors="replace"), tuple(state["tail"]), device["peak_device_mib"],
                   device["peak_device_source"], state["bar"])


def _reap(pid: int, every: float = 0.01) -> tuple[int, object]:
    """``os.wait4`` on ``pid`` without blocking in it: Ctrl-C is delivered to whichever thread of this process the
    kernel picks (the readers', the timer's, NVML's sampler), and a main thread blocked in ``wait4`` then sleeps on
    to the child's end (seen: a minute) while Python's handler waits for it. Polled every ``every`` seconds, the
    main thread runs the handler within that time; the exit is timed to within it too."""
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage
        time.sleep(every)


def _kill(proc: subprocess.Popen, expired: threading.Event) -> None:
    expired.set()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_stdout(proc: subprocess.Popen, state: dict) -> None:
    state["out"] = proc.stdout.read()


def _read_stderr(proc: subprocess.Popen, start: float, state: dict) -> None:
    buf = b""
    while chunk := proc.stderr.read1(65536):
        buf += chunk
        *lines, buf = re.split(rb"[\r\n]", buf)
        for line in lines:
            _line(line.decode(errors="replace"), time.perf_counter() - start, state)
    _line(buf.decode(errors="replace"), time.perf_counter() - start, state)


def _line(text: str, at: float, state: dict) -> None:
    if not text.strip():
        return
    state["tail"] = (state["tail"] + [text])[-TAIL:]
    bar = scoring_bar(text)
    if bar is None:
        return
    state["bar"] = bar
    if state["first"] is None and bar[0] > 0:
        state["first"] = at
