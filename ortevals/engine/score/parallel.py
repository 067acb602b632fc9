"""Independent forward passes run a few at a time (model arg ``passes``).

Owns :class:`PassPool`. On a CPU, one pass at a time on all the cores leaves cores idle at every
synchronisation inside the pass (an attention node splits its work by heads: nine heads on two threads
leave one idle for a ninth of it; small ops run on one thread) and while Python prepares the next pass.
``passes`` one-thread passes at once keep every core on its own pass instead: onnxruntime runs concurrent
calls on one session safely and releases the GIL while it computes. A pass is a ``(run, report)`` pair:
``run()`` (the runner's call) goes to a worker thread, ``report(result)`` (scores to their requests, the
store, the progress bar) runs on the calling thread in submission order, so everything but onnxruntime
stays single-threaded. At most ``2 × passes`` are started ahead, so only that many passes' outputs and
inputs are held at once. With ``passes=1`` every pass runs on the calling thread when submitted, exactly
as before. Which thread computes a pass changes none of its numbers (tests/test_parallel.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Report = Callable[[Any], None]


class PassPool:
    """``workers`` threads running passes; reports in order on the calling thread."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: deque[tuple[Future, Report]] = deque()

    def submit(self, run: Callable[[], Any], report: Report) -> None:
        """Start ``run`` (on this thread when there is one worker); earlier passes are reported first."""
        if self.workers == 1:
            report(run())
            return
        while len(self._ahead) >= 2 * self.workers:
            self._report_first()
        self._ahead.append((self._pool().submit(run), report))

    def call(self, run: Callable[[], Any]) -> Any:
        """``run()``'s result, computed on a worker while the passes already started go on (a prefix's KV that
        the next passes need)."""
        if self.workers == 1:
            return run()
        return self._pool().submit(run).result()

    def drain(self) -> None:
        """Wait for every pass started and report each, in order."""
        while self._ahead:
            self._report_first()

    def abandon(self) -> None:
        """After an error: the passes not yet running cancelled, the running ones waited for, none reported."""
        for future, _ in self._ahead:
            future.cancel()
        for future, _ in self._ahead:
            if not future.cancelled():
                future.exception()  # waits; an error of its own is not the one being raised
        self._ahead.clear()

    def _report_first(self) -> None:
        future, report = self._ahead.popleft()
        report(future.result())

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="ortevals-pass")
        return self._executor
