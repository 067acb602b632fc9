"""Resume: answer what the result store already holds, compute only the rest.

Owns the lookup-then-compute step between lm-eval's request lists and the
engines: store keys per request (for generation also which repeat of the same
prompt it is, so repeats sample differently, resumed or not), the count of
reused answers, and committing whatever finished when a run stops early
(Ctrl-C, a crash). What a key covers beyond the request is the store's scope
(:mod:`ortevals.report.store`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


def request_keys(kind: str, requests, key_args: Callable[[Any], list] = list) -> list[list]:
    """Store keys: the request's args; for generation also which repeat of the same prompt it is.

    ``key_args`` turns a request's args into JSON-able key parts (media: their content hashes)."""
    if kind != "generate_until":
        return [key_args(r.args) for r in requests]
    seen: dict[str, int] = {}
    keys = []
    for r in requests:
        args = key_args(r.args)
        ident = json.dumps(args, sort_keys=True, default=str)
        keys.append([*args, seen.get(ident, 0)])
        seen[ident] = seen.get(ident, 0) + 1
    return keys


def answer(store, kind: str, requests: Sequence, compute: Callable[[list, list[list]], list],
           decode: Callable[[Any], Any] = lambda v: v, stats: dict | None = None,
           key_args: Callable[[Any], list] = list) -> list:
    """Answers in request order: stored ones decoded, the rest from ``compute(todo, todo_keys)``.

    ``store`` None computes everything. ``compute`` stores its own answers as they finish.
    """
    keys = request_keys(kind, requests, key_args)
    if store is None:
        return compute(list(requests), keys)
    found = [store.get(kind, k) for k in keys]
    todo = [r for r, v in zip(requests, found) if v is None]
    todo_keys = [k for k, v in zip(keys, found) if v is None]
    reused = len(requests) - len(todo)
    if stats is not None:
        stats["reused"] = stats.get("reused", 0) + reused
    if reused:  # a warning, so every front door shows it (lm-eval configures only its own logger)
        log.warning("resuming: %d of %d %s requests reused from %s", reused, len(requests), kind, store.path)
    try:
        fresh = iter(compute(todo, todo_keys) if todo else [])
    finally:  # Ctrl-C or a crash: keep every answer finished so far
        store.commit()
    return [decode(v) if v is not None else next(fresh) for v in found]
