"""What the raw-onnxruntime passes of a run cost: tokens and seconds per kind of pass.

Owns :class:`PassMeter`, which :class:`~ortevals.runtime.sessions.DecoderRunner` feeds with every
pass it runs (its probe excluded): a **prefill** pass runs ``S > 1`` new tokens per row, or any
first pass (no past); a **decode** pass runs one new token per row on a past (generation's
steps). Each pass counts ``rows × new tokens`` (the tokens the hardware computed, padding of a
right-padded batch included) and its wall seconds around ``session.run``; a kind's seconds are the time at
least one of its passes was running (passes that run at once, engine/score/parallel.py, count their
overlap once: each pass's interval is merged into the kind's busy intervals, which are kept back to the start
of the earliest pass still running, known from :meth:`PassMeter.start`), its row-seconds each pass's own.
``first_pass_at`` is the ``CLOCK_BOOTTIME`` instant the run began computing: its first metered pass, or the first
request it handed to a path whose passes are not metered here (onnxruntime-genai, the media paths, Ray workers:
:meth:`begin`), whichever came first; start-up ends there (report/efficiency.py). Start-up begins at
:data:`CODE_STARTED`, when ortevals' own code started (this module is the package's first import), not at the
process's start: a shell's ``sleep 20 && ortevals …`` or ``pip install … && ortevals …`` in one process is not
ortevals' start-up.
The arithmetic on these counts lives in report/efficiency.py.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass


def boot_clock() -> float:
    """Seconds on the clock /proc's process start times use (CLOCK_BOOTTIME), else monotonic."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


CODE_STARTED = boot_clock()  # when ortevals' code started: ortevals/__init__.py imports this module first


def process_started() -> float | None:
    """When this process started, on :func:`boot_clock` (Linux: /proc/self/stat's start time), else None: the
    interpreter's and the shell's time before ortevals' code (:data:`CODE_STARTED`) started."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): start time in clock ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass(frozen=True)
class PassCounts:
    """Totals of the metered passes. ``*_row_seconds``: Σ rows × pass seconds (each row of a pass waits for
    the whole pass, so ``decode_row_seconds / decode_tokens`` is a sequence's time per output token)."""

    prefill_passes: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_rows: int = 0
    prefill_row_seconds: float = 0.0
    decode_passes: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_row_seconds: float = 0.0
    first_pass_at: float | None = None  # boot_clock() when the first metered pass started


class PassMeter:
    """Running totals of a runner's passes (thread-safe: Ray-less runs use one thread, the opener another).

    A pass is timed as ``started = meter.start()`` before it runs and ``meter.record(..., started, seconds)``
    after, on the thread that ran it: ``start`` marks the pass as running, so busy intervals that may still
    overlap it are kept until it is recorded (a long pass recorded after many short ones with gaps: each
    second counted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._first: float | None = None
        # per kind: the busy intervals since the earliest running pass began, disjoint and sorted (starts, ends)
        self._spans: dict[str, tuple[list[float], list[float]]] = {}
        self._running: dict[int, float] = {}  # thread -> when its pass now running began (start())

    def start(self, at: float | None = None) -> float:
        """A pass begins on this thread now (or ``at``, boot_clock()); returns that instant for :meth:`record`."""
        at = boot_clock() if at is None else at
        with self._lock:
            self._running[threading.get_ident()] = at
        return at

    def record(self, rows: int, new_tokens: int, has_past: bool, started: float, seconds: float) -> None:
        """One pass: ``rows`` rows of ``new_tokens`` tokens each, begun at ``started`` (boot_clock())."""
        kind = "decode" if has_past and new_tokens == 1 else "prefill"
        with self._lock:
            self._running.pop(threading.get_ident(), None)
            if self._first is None:
                self._first = started
            t = self._totals
            t[f"{kind}_passes"] = t.get(f"{kind}_passes", 0) + 1
            t[f"{kind}_tokens"] = t.get(f"{kind}_tokens", 0) + rows * new_tokens
            t[f"{kind}_seconds"] = t.get(f"{kind}_seconds", 0.0) + self._busy(kind, started, started + seconds)
            t[f"{kind}_row_seconds"] = t.get(f"{kind}_row_seconds", 0.0) + rows * seconds
            if kind == "prefill":
                t["prefill_rows"] = t.get("prefill_rows", 0) + rows

    def _busy(self, kind: str, start: float, end: float) -> float:
        """The seconds of [start, end] not already counted as ``kind``'s busy time; the interval joins it."""
        starts, ends = self._spans.setdefault(kind, ([], []))
        i, j = bisect_left(ends, start), bisect_right(starts, end)  # [i, j): the intervals that meet it
        added = (end - start) - sum(max(0.0, min(ends[k], end) - max(starts[k], start)) for k in range(i, j))
        if i < j:
            start, end = min(start, starts[i]), max(end, ends[j - 1])
        starts[i:j], ends[i:j] = [start], [end]
        # a pass still to be recorded began at or after the earliest running one's start (or now, after this
        # pass's end, when none runs): intervals that ended before then cannot meet it
        drop = bisect_left(ends, min(self._running.values(), default=ends[-1]))
        del starts[:drop], ends[:drop]
        return added

    def begin(self, at: float) -> None:
        """The run began computing at ``at`` (boot_clock()) on a path whose passes this meter does not see;
        ``first_pass_at`` keeps the earlier of this and the first pass."""
        with self._lock:
            if self._first is None or at < self._first:
                self._first = at

    def counts(self) -> PassCounts:
        with self._lock:
            return PassCounts(**self._totals, first_pass_at=self._first)

    def reset(self) -> None:
        with self._lock:
            self._totals, self._first, self._spans, self._running = {}, None, {}, {}
