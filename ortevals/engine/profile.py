"""`ortevals profile`: the package's own speed, measured the way onnxruntime-genai's benchmark measures it.

Owns the timing loop for one (batch, prompt length, generated length) :class:`Setting` on two
backends over the same token ids:

* ``raw``: ortevals' raw path: :class:`~ortevals.runtime.sessions.DecoderRunner` with the raw
  sampler's KV handling (engine/generate/rows/kv.py: the in-place buffers where the graph allows
  them, sized prompt + generated tokens), greedy;
* ``og``: onnxruntime-genai's ``Generator`` (a fresh one per repeat, greedy, ``min_length`` set so
  that it never stops early), as ``benchmark/python/benchmark_e2e.py`` in microsoft/onnxruntime-genai
  runs it.

The timers sit where that script puts them: prompt processing is the prompt pass alone (og's
``append_tokens``), the first token's choice is timed apart (og's first ``generate_next_token``), and
TTFT is their sum; each later token is one decode pass plus its choice (og's ``generate_next_token``),
and TPOT is their mean. Rates: prefill tokens/s = batch × prompt / prompt time, decode tokens/s =
batch / TPOT. Means over repeats after untimed warm-up runs (the script's default aggregation).
Greedy on both sides; the raw path masks EOS as og's ``min_length`` does, so both make exactly
``gen_len`` tokens per row and, on a deterministic graph, the same ones.

Each (setting, backend) runs in a fresh process, so that its peak memory is its own. Peak memory
differs from the script on purpose (docs/benchmarks.md): on the host, the kernel's high-water mark
of that process's resident set above its size before the model opened (the script: the machine's
used memory, other processes included); on an accelerator, the device's used memory (from its free
memory, every 10 ms) during the timed repeats above its level when they began.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import resource
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError

log = logging.getLogger(__name__)
BACKENDS = ("raw", "og")
# benchmark_e2e.py's --use_random_tokens: np.random.randint(100, size=(batch, prompt_length)), each row its
# own ids; here seeded, so that both backends (and a rerun) get the same ids
RANDOM_IDS_BELOW = 100
SEED = 0
POLL_S = 0.01


@dataclass(frozen=True)
class Setting:
    batch: int
    prompt_len: int
    gen_len: int


@dataclass
class Trial:
    """One backend on one setting: times in seconds per repeat, generated tokens per row per repeat."""

    backend: str
    setting: Setting
    prefill_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)  # the first token's choice after the prompt pass
    decode_s: list[float] = field(default_factory=list)  # every later token: pass + choice
    wall_s: list[float] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)  # [repeat][row]: tokens the row got
    peak_mib: float | None = None
    tokens: list[list[int]] = field(default_factory=list)  # the last repeat's tokens, per row

    @property
    def label(self) -> str:
        s = self.setting
        return f"{self.backend} batch {s.batch} prompt {s.prompt_len} gen {s.gen_len}"

    def summary(self) -> dict:
        s = self.setting
        prefill = float(np.mean(self.prefill_s))
        ttft = float(np.mean(np.add(self.prefill_s, self.first_token_s)))
        tpot = float(np.mean(self.decode_s)) if self.decode_s else None
        return {"backend": self.backend, "batch": s.batch, "prompt_len": s.prompt_len, "gen_len": s.gen_len,
                "repeats": len(self.prefill_s), "generated_per_row": self.generated,
                "prefill_ms": 1e3 * prefill, "prefill_tok_s": s.batch * s.prompt_len / prefill,
                "ttft_ms": 1e3 * ttft, "tpot_ms": None if tpot is None else 1e3 * tpot,
                "decode_tok_s": None if tpot is None else s.batch / tpot,
                "sampling_ms": 1e3 * float(np.mean(self.first_token_s)),
                "wall_s": float(np.mean(self.wall_s)), "peak_mib": self.peak_mib}


def parse_list(flag: str, text: str, most: int | None = None) -> tuple[int, ...]:
    """``"1,4,16"`` → ``(1, 4, 16)``; anything else is a one-line error naming ``flag``."""
    items = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(int(p) for p in items)
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise OrtEvalsError(f"{flag} {text!r}: expected comma-separated positive integers, such as 1,4,16")
    if most is not None and max(values) > most:
        raise OrtEvalsError(f"{flag} {text!r}: at most {most}")
    return tuple(dict.fromkeys(values))


def settings_for(batches: Sequence[int], prompts: Sequence[int], gens: Sequence[int], context: int) -> list[Setting]:
    """Every combination, checked against the package's context (prompt + generated tokens must fit)."""
    for p in prompts:
        for g in gens:
            if p + g > context:
                raise OrtEvalsError(f"--prompt-len {p} with --gen-len {g} needs {p + g} tokens; the package's "
                                    f"context_length is {context}")
    return [Setting(b, p, g) for b in batches for p in prompts for g in gens]


def prompt_ids(batch: int, length: int, vocab_size: int, seed: int = SEED) -> np.ndarray:
    """Random prompt ids ``[batch, length]`` int64 below ``min(100, vocab_size)``, each row its own, as
    benchmark_e2e.py's ``--use_random_tokens`` makes them; seeded by ``(seed, batch, length)``."""
    rng = np.random.default_rng([seed, batch, length])
    return rng.integers(0, min(RANDOM_IDS_BELOW, vocab_size), size=(batch, length), dtype=np.int64)


class MemoryWatch:
    """Peak used device memory (from its free memory, runtime/memory.py, every 10 ms) above the starting
    point while a block runs on an accelerator. (The host's peak is the kernel's: see :func:`_alone`.)"""

    def __init__(self, device: str, device_id: int = 0) -> None:
        self.read = _device_used(device, device_id)
        self.start = self.peak = None
        self._stop = threading.Event()

    def __enter__(self) -> MemoryWatch:
        self.start = self.peak = self.read()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._sample()

    def _sample(self) -> None:
        value = self.read()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def peak_mib(self) -> float | None:
        return None if self.start is None or self.peak is None else (self.peak - self.start) / 2**20


def _rss(statm: Path = Path("/proc/self/statm")) -> int | None:
    import os

    try:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _device_used(device: str, device_id: int) -> Callable[[], int | None]:
    from ortevals.runtime.memory import free_bytes

    def used() -> int | None:
        free = free_bytes(device, device_id)
        return None if free is None else -free  # less free = more used; the difference is what counts

    return used


def _greedy(logits: np.ndarray, eos: Sequence[int]) -> np.ndarray:
    """Greedy choice over ``logits [B,V]`` with EOS masked (og's ``min_length``): ids ``[B]``."""
    x = np.array(logits, dtype=np.float32)
    x[:, list(eos)] = -np.inf
    return x.argmax(axis=1)


class RawBackend:
    """The raw path on one runner: the sampler's KV kind, a batch of rows prefilled in one pass."""

    name = "raw"

    def __init__(self, runner, eos: Sequence[int]) -> None:
        from ortevals.engine.generate.rows.kv import choose_kv

        self.kv = choose_kv(runner)  # the check the sampler runs once, outside the timers
        self.eos = tuple(eos)
        log.info("profile raw: KV kept %s", self.kv.name)

    def once(self, ids: np.ndarray, gen_len: int, trial: Trial | None) -> list[list[int]]:
        start = time.perf_counter()
        past = self.kv.empty(ids.shape[0], ids.shape[1] + gen_len)
        t0 = time.perf_counter()
        logits, past = self.kv.run(ids, past, last=True)
        t1 = time.perf_counter()
        tok = _greedy(logits, self.eos)
        t2 = time.perf_counter()
        out, steps = [tok], []
        while len(out) < gen_len:
            s0 = time.perf_counter()
            logits, past = self.kv.run(tok[:, None].astype(np.int64), past)
            tok = _greedy(logits, self.eos)
            steps.append(time.perf_counter() - s0)
            out.append(tok)
        _record(trial, t1 - t0, t2 - t1, steps, time.perf_counter() - start)
        return np.stack(out, axis=1).tolist()


class OgBackend:
    """onnxruntime-genai's Generator: a fresh one per repeat (untimed), greedy, never stopping early."""

    name = "og"

    def __init__(self, runner) -> None:
        self.runner = runner

    def once(self, ids: np.ndarray, gen_len: int, trial: Trial | None) -> list[list[int]]:
        og, (batch, plen) = self.runner.og, ids.shape
        start = time.perf_counter()
        params = og.GeneratorParams(self.runner.model)
        params.set_search_options(max_length=plen + gen_len, min_length=plen + gen_len, batch_size=batch,
                                  do_sample=False, num_beams=1)
        gen = og.Generator(self.runner.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids.astype(np.int32))
        t1 = time.perf_counter()
        gen.generate_next_token()
        t2 = time.perf_counter()
        steps, made = [], 1
        while not gen.is_done() and made < gen_len:
            s0 = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - s0)
            made += 1
        _record(trial, t1 - t0, t2 - t1, steps, time.perf_counter() - start)
        return [list(gen.get_sequence(b))[plen:] for b in range(batch)]


def _record(trial: Trial | None, prefill: float, first: float, steps: list[float], wall: float) -> None:
    if trial is None:  # a warm-up run
        return
    trial.prefill_s.append(prefill)
    trial.first_token_s.append(first)
    trial.decode_s.extend(steps)
    trial.wall_s.append(wall)


def measure(backend, setting: Setting, ids: np.ndarray, repeats: int, warmup: int, device: str = "cpu",
            device_id: int = 0) -> Trial:
    """``warmup`` untimed runs, then ``repeats`` timed ones of ``backend`` on ``ids [batch, prompt_len]``."""
    for _ in range(warmup):
        backend.once(ids, setting.gen_len, None)
    trial = Trial(backend.name, setting)
    watch = MemoryWatch(device, device_id) if device != "cpu" else None
    with watch or contextlib.nullcontext():
        for _ in range(repeats):
            trial.tokens = backend.once(ids, setting.gen_len, trial)
            trial.generated.append([len(row) for row in trial.tokens])  # counted from what came back
    trial.peak_mib = None if watch is None else watch.peak_mib
    return trial


@dataclass(frozen=True)
class Profile:
    """Every trial of one invocation, in setting order (raw then og per setting), and what was skipped;
    ``interrupted``: Ctrl-C stopped it after ``trials`` of ``planned`` (setting, backend) runs."""

    package: str
    provider: str
    threads: int
    trials: tuple[Trial, ...]
    skipped: dict[str, str]  # backend → why it did not run
    interrupted: bool = False
    planned: int = 0


def memory_needed(package, setting: Setting) -> tuple[int, int]:
    """(logits, KV) bytes a setting holds at least: its prompt pass returns logits for every prompt position
    (``[batch, prompt, vocab]`` in the graph's logits type) and its KV grows to prompt + generated tokens."""
    from ortevals.runtime.buffers import ITEMSIZE, kv_bytes_per_token

    out = package.decoder.output(package.logits_name)
    logits = setting.batch * setting.prompt_len * package.vocab_size * ITEMSIZE.get(out.dtype if out else "", 4)
    return logits, setting.batch * (setting.prompt_len + setting.gen_len) * kv_bytes_per_token(package)


def check_fits(package, provider, settings: Sequence[Setting]) -> None:
    """Before any session opens: each setting's :func:`memory_needed` against the memory free where the
    tensors live (runtime/memory.py; nothing checked where that is unknown), else one line with the estimate."""
    from ortevals.runtime.memory import free_bytes

    where = "cpu" if not provider.on_device else provider.name
    free = free_bytes(where, int(provider.raw_options.get("device_id", 0) or 0))
    for s in settings if free is not None else ():
        logits, kv = memory_needed(package, s)
        if logits + kv > free:
            raise OrtEvalsError(
                f"--batch {s.batch} with --prompt-len {s.prompt_len} and --gen-len {s.gen_len} needs at least "
                f"{_gib(logits + kv)} ({_gib(logits)} of prompt logits [{s.batch}, {s.prompt_len}, "
                f"{package.vocab_size}] + {_gib(kv)} of KV) but {_gib(free)} is free "
                f"{'on the host' if where == 'cpu' else 'on ' + where}; expected a smaller --batch or --prompt-len")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def open_backends(package, provider, wanted: Sequence[str] = BACKENDS) -> tuple[list, dict[str, str]]:
    """The backends that can run this package on ``provider``; the others with the reason."""
    from ortevals.engine.backends import capability
    from ortevals.engine.generate.rows.sampler import can_serve
    from ortevals.runtime.genai import GenaiRunner
    from ortevals.runtime.sessions import DecoderRunner

    out, skipped = [], {}
    if "raw" in wanted:
        ok, why = can_serve(package, capability(package, provider))
        if ok:
            out.append(RawBackend(DecoderRunner.open(package, provider, cache=None), package.eos_token_ids))
        else:
            skipped["raw"] = why
    if "og" in wanted and package.unwindowed:  # og sizes its KV cache to a window the graph lacks (runtime/genai.py)
        skipped["og"] = (f"{package.unwindowed}; onnxruntime-genai sizes its KV cache to that window and fails "
                         "past it (the raw backend runs the graph as it is)")
    elif "og" in wanted:
        out.append(OgBackend(GenaiRunner.open(package, provider)))
    return out, skipped


def profile_package(package, provider, settings: Sequence[Setting], repeats: int = 3, warmup: int = 1,
                    progress: Callable[[Trial], None] | None = None) -> Profile:
    """Each setting on each backend, the backends taking turns per setting (a busy machine slows both
    alike), each (setting, backend) in a fresh process (:func:`_alone`) so that its peak memory is its
    own; the same random prompt ids (:func:`prompt_ids`) for both."""
    trials, skipped, interrupted = [], {}, False
    try:
        for s in settings:
            for name in BACKENDS:
                if name in skipped:
                    continue
                trial, why = _in_fresh_process(str(package.root), provider, name, s, repeats, warmup)
                if trial is None:
                    skipped[name] = why
                    continue
                trials.append(trial)
                if progress is not None:
                    progress(trial)
    except KeyboardInterrupt:  # Ctrl-C: what was measured is kept (the caller writes it)
        interrupted = True
    return Profile(str(package.root), provider.name, provider.intra_op_threads, tuple(trials), skipped,
                   interrupted, len(settings) * len(BACKENDS))


def _in_fresh_process(root: str, provider, name: str, setting: Setting, repeats: int, warmup: int):
    """:func:`_alone` in a fresh process that ignores Ctrl-C (the parent stops it); its running out of memory is
    one line naming the setting."""
    label = f"{name} batch {setting.batch} prompt {setting.prompt_len} gen {setting.gen_len}"
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=signal.signal,
                               initargs=(signal.SIGINT, signal.SIG_IGN))
    try:
        return pool.submit(_alone, root, provider, name, setting, repeats, warmup).result()
    except MemoryError:
        raise OrtEvalsError(f"{label}: out of memory (MemoryError); expected a smaller --batch or --prompt-len") \
            from None
    except BrokenProcessPool:
        raise OrtEvalsError(f"{label}: the measuring process died (killed for memory?); expected a smaller --batch "
                            "or --prompt-len") from None
    except KeyboardInterrupt:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # it ignores Ctrl-C: stop it
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _alone(root: str, provider, name: str, setting: Setting, repeats: int, warmup: int) -> tuple[Trial | None, str]:
    """One backend on one setting in this (fresh) process: the trial, or None and why it cannot run.

    Peak memory on the host: the kernel's high-water mark of this process's resident set (``ru_maxrss``)
    above its resident set once both runtimes are imported and before the model opens: the model, its
    sessions and the run, warm-up included (the script's machine-wide figure includes the model too)."""
    from ortevals.install import import_og, import_ort
    from ortevals.package.loader import ModelPackage

    import_ort(), import_og()
    package = ModelPackage.load(root)
    base = _rss()
    backends, skipped = open_backends(package, provider, (name,))
    if skipped:
        return None, skipped[name]
    device = "cpu" if not provider.on_device else provider.name
    ids = prompt_ids(setting.batch, setting.prompt_len, package.vocab_size)
    trial = measure(backends[0], setting, ids, repeats, warmup, device,
                    int(provider.raw_options.get("device_id", 0) or 0))
    if device == "cpu" and base is not None:
        trial.peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20
    return trial, ""
