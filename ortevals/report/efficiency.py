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
* ``startup_s``: process start to the first pass (imports, package, data, tokenizing not overlapped);
* peak host RSS, and peak device memory where the provider reports it (None on CPU).

lm-eval hands a model every task's requests in one call, and the prefix plan shares passes between
tasks, so timings cannot be split by task: ``by_task`` holds the run's figures when the run has one
task, and each task's request count otherwise (timings only under ``overall``). The og path
(onnxruntime-genai Generators) runs no metered pass: its tokens count, its rates are None.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ortevals.runtime.meter import PassCounts, process_started


def since(after: PassCounts, before: PassCounts | None) -> PassCounts:
    """The passes run between two readings of one meter; ``first_pass_at`` stays the meter's first pass."""
    if before is None:
        return after
    diff = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(PassCounts)
            if f.name != "first_pass_at"}
    ran = diff["prefill_passes"] or diff["decode_passes"]
    return PassCounts(**diff, first_pass_at=after.first_pass_at if ran else None)


def startup_seconds(counts: PassCounts, ended: float) -> float | None:
    """Process start to the first pass (to ``ended``, a boot_clock() reading, when no pass ran)."""
    started = process_started()
    if started is None:
        return None
    return (counts.first_pass_at if counts.first_pass_at is not None else ended) - started


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def efficiency(counts: PassCounts, requests: int, reused: int, output_tokens: int, startup_s: float | None,
               peak_rss_mib: float, peak_device_mib: float | None = None) -> dict[str, Any]:
    """One efficiency record (the layout of ``results["efficiency"]["overall"]``)."""
    c = counts
    return {
        "requests": requests, "reused": reused, "startup_s": startup_s,
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
