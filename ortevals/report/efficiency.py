"""Efficiency of a run, reported like accuracy: tokens, rates, latencies and peak memory.

Owns the arithmetic on the engine's pass counts (:class:`~ortevals.runtime.meter.PassCounts`, measured
around each onnxruntime pass by the runner) and the ``results["efficiency"]`` layout, after
lmms-eval 0.7's ``results["efficiency"]`` (``by_task`` + ``overall``) and its throughput figures
(TTFT, TPOT, tokens/s):

* ``prefill_tokens_per_s`` = prefill tokens / prefill seconds (rows × new tokens of every pass with more
  than one new token or no past; right padding of a batch included: it is computed);
* ``decode_tokens_per_s`` = decode tokens / decode seconds (one-token passes on a past: generation);
* ``ttft_s``: a prompt's time to first token, the row-weighted mean latency of the prefill passes (every
  row of a pass waits for the whole pass; the first token is chosen from its logits);
* ``tpot_s``: a sequence's time per output token, the row-weighted mean latency of the decode passes;
* the run's wall clock in parts that add up (:func:`timeline`, one clock): ``startup_s``, process start to
  the first pass (imports, package, data, tokenizing not overlapped); ``scoring_s``, the first pass to the
  end of lm-eval's evaluation (every request, the canary, lm-eval's metrics); ``after_s``, from there to
  this record (calibration, scaling, verifier); ``total_s`` = their sum, process start to this record;
* peak host RSS, and peak device memory where the provider reports it (None on CPU).

lm-eval hands a model every task's requests in one call, and the prefix plan shares passes between
tasks, so timings cannot be split by task: ``by_task`` holds the run's figures when the run has one
task, and each task's request count otherwise (timings only under ``overall``). The og path
(onnxruntime-genai Generators) runs no metered pass: its tokens count, its rates are None.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np

from ortevals.runtime.meter import PassCounts


def since(after: PassCounts, before: PassCounts | None) -> PassCounts:
    """The passes run between two readings of one meter; ``first_pass_at`` stays the meter's first pass (or
    first work on an unmetered path: PassMeter.begin) where anything ran in the span, else None."""
    if before is None:
        return after
    diff = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(PassCounts)
            if f.name != "first_pass_at"}
    ran = diff["prefill_passes"] or diff["decode_passes"] or after.first_pass_at != before.first_pass_at
    return PassCounts(**diff, first_pass_at=after.first_pass_at if ran else None)


def timeline(started: float | None, first_pass: float | None, evaluated: float, now: float) -> dict[str, Any]:
    """The run's wall clock split into parts that add up, from readings of one clock (boot_clock()):
    when ortevals' code started (None where unknown), the first pass or first work (None when nothing ran:
    start-up then lasts to the end of the evaluation), the end of lm-eval's evaluation, and now.

    ``startup_s + scoring_s + after_s == total_s``; without a process start, start-up and total are None."""
    first = min(first_pass if first_pass is not None else evaluated, evaluated)
    return {"startup_s": first - started if started is not None else None, "scoring_s": evaluated - first,
            "after_s": now - evaluated, "total_s": now - started if started is not None else None}


def timeline_text(eff: dict[str, Any]) -> str | None:
    """``start-up 1.2 s + scoring 3.6 s + after 0.4 s = 5.2 s since launch``: each part shown as the difference
    of the rounded times since launch, so the printed numbers add up too; None without a process start."""
    if eff.get("total_s") is None:
        return None
    ends = np.round(np.cumsum([eff["startup_s"], eff["scoring_s"], eff["after_s"]]), 1)
    a, b, c = ends - np.concatenate([[0.0], ends[:-1]])
    return f"start-up {a:.1f} s + scoring {b:.1f} s + after {c:.1f} s = {ends[-1]:.1f} s since launch"


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def efficiency(counts: PassCounts, requests: int, reused: int, output_tokens: int, clock: dict[str, Any],
               peak_rss_mib: float, peak_device_mib: float | None = None) -> dict[str, Any]:
    """One efficiency record (the layout of ``results["efficiency"]["overall"]``); ``clock``: :func:`timeline`."""
    c = counts
    return {
        "requests": requests, "reused": reused, **clock,
        "prefill_passes": c.prefill_passes, "prefill_tokens": c.prefill_tokens, "prefill_s": c.prefill_seconds,
        "prefill_tokens_per_s": _rate(c.prefill_tokens, c.prefill_seconds),
        "decode_passes": c.decode_passes, "decode_tokens": c.decode_tokens, "decode_s": c.decode_seconds,
        "decode_tokens_per_s": _rate(c.decode_tokens, c.decode_seconds),
        "ttft_s": _rate(c.prefill_row_seconds, c.prefill_rows),
        "tpot_s": _rate(c.decode_row_seconds, c.decode_tokens),
        "output_tokens": output_tokens,
        "peak_rss_mib": peak_rss_mib, "peak_device_mib": peak_device_mib,
    }


def by_task(overall: dict[str, Any], task_requests: dict[str, int]) -> dict[str, dict[str, Any]]:
    """``results["efficiency"]["by_task"]``: the run's record for its one task; request counts for several."""
    if len(task_requests) == 1:
        return {task: dict(overall) for task in task_requests}
    return {task: {"requests": n, "timings": "overall (requests of all tasks share passes)"}
            for task, n in task_requests.items()}


def summary_line(eff: dict[str, Any]) -> str:
    """The CLI's efficiency line: rates and latencies that were measured, peak memory."""
    parts = []
    if eff["prefill_tokens_per_s"] is not None:
        parts.append(f"prefill {eff['prefill_tokens']} tok at {eff['prefill_tokens_per_s']:.0f} tok/s")
    if eff["ttft_s"] is not None:
        parts.append(f"TTFT {eff['ttft_s'] * 1000:.0f} ms")
    if eff["decode_tokens_per_s"] is not None:
        parts.append(f"decode {eff['decode_tokens']} tok at {eff['decode_tokens_per_s']:.1f} tok/s")
    if eff["tpot_s"] is not None:
        parts.append(f"TPOT {eff['tpot_s'] * 1000:.1f} ms")
    if eff["peak_device_mib"] is not None:
        parts.append(f"peak device {eff['peak_device_mib']:.0f} MiB")
    if not parts:
        return ("efficiency: no pass run here (requests ran on Ray workers or onnxruntime-genai's Generators, "
                "which this process does not meter)" if eff["requests"] else
                "efficiency: no pass run (all requests reused)")
    return "efficiency: " + "  ".join(parts)
