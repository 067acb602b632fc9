"""What ``ortevals bench`` is asked to run: the options, the candidates' syntax and the rows they become.

Owns :class:`BenchOptions` (everything the command and ``ortevals.bench.run`` take), the candidate
syntax ``[LABEL=]PATH[:K=V,…]`` (:func:`parse_candidate`: the same package may be given several times
with other model args, each its own row) and :class:`RowSpec`, one row of the table as it will be run.
Pure Python: nothing here imports numpy, lm-eval or a runtime, so a benchmark's child processes never
pay for it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("ortevals", "hf", "onnxruntime-genai", "onnxruntime", "vllm")
ONNX_PEERS = ("onnxruntime-genai", "onnxruntime")  # lm-eval's ONNX backends: one full pass per request
CHECKPOINT_BACKENDS = ("hf", "vllm")  # run a transformers folder (--hf)
CACHE_STATES = ("cold", "warm", "stored")
DEFAULT_PEER_LIMIT = 3  # questions for lm-eval's ONNX backends (seconds a request on a CPU: minutes a question)
RATES = ("requests", "tokens")
_ARGS = re.compile(r":(?=[A-Za-z_][A-Za-z0-9_]*=)")  # where a candidate's model args start
_LABEL = re.compile(r"^([A-Za-z0-9_.+#-]+)=(.+)$")


@dataclass(frozen=True)
class Candidate:
    """One ``--pkg`` or ``--hf`` value: ``[LABEL=]PATH[:K=V,…]``."""

    path: str
    args: str = ""  # K=V,… as lm-eval's model_args (ortevals' options for --pkg, lm-eval hf's for --hf)
    label: str | None = None


@dataclass(frozen=True)
class BenchOptions:
    """Everything one benchmark takes; ``ortevals bench``'s flags of the same names."""

    pkgs: tuple[str, ...] = ()  # --pkg values, each [LABEL=]PATH[:K=V,…]
    hf: str | None = None  # --hf: a transformers folder of the same model, [LABEL=]PATH[:K=V,…]
    backends: tuple[str, ...] = ()  # empty: ortevals, and hf when --hf is given
    tasks: tuple[str, ...] = ()  # lm-eval task names; empty: MMLU-Pro (5-shot log-likelihood, or --cot)
    cot: bool = False
    data: str | None = None  # None: the bundled copy for MMLU-Pro, the hub for --tasks
    limit: int | None = None
    peer_limit: int | None = None  # questions for lm-eval's ONNX backends; None: min(limit, DEFAULT_PEER_LIMIT)
    samples: int | None = None  # --samples K: K samples a question (generation tasks)
    max_gen_toks: int | None = None
    ref: str | None = None  # a row's label or a backend naming one row; None: the hf row, else the first
    repeat: int = 1  # timed runs of every row, in rounds
    cache: tuple[str, ...] = ("warm",)  # the ortevals cache states, each its own row
    rate: str | None = None  # "requests" or "tokens"; None: tokens for generation presets, else requests
    ep: str | None = None  # execution provider for every backend (hf: cuda:0 on "cuda")
    output: Path | None = None
    timeout: float | None = None  # seconds a run may take before it is killed
    peak_tflops: float | None = None  # the device's dense peak, TFLOP/s: each ortevals row's MFU against it
    against: str | None = None  # --against RUN --decide M: every ortevals row decided against a finished run
    decide: float | None = None  # the margin, points
    decide_order: str | None = None  # uniform (default) or guided


@dataclass(frozen=True)
class RowSpec:
    """One row of the table: a backend on a target, run ``repeat`` times in the same way."""

    label: str
    backend: str
    target: str  # the package folder, or the transformers folder for hf and vllm
    args: str = ""  # model args K=V,…
    cache: str | None = None  # the ortevals cache state; None for the other backends
    limit: int | None = None  # questions this row runs
    missing: str | None = None  # why it is not run (a backend not installed): the row says so


def parse_candidate(value: str) -> Candidate:
    """``[LABEL=]PATH[:K=V,…]``: the model args start at the first ``:`` followed by ``NAME=``; a label is a
    ``NAME=`` prefix when what is left names the path (a path that exists as given is never split)."""
    if Path(value).expanduser().exists():
        return Candidate(value)
    head, args = value, ""
    found = _ARGS.search(value)
    if found:
        head, args = value[:found.start()], value[found.end():]
    label = None
    named = _LABEL.match(head)
    if named and not Path(head).expanduser().exists():
        label, head = named.group(1), named.group(2)
    return Candidate(head, args, label)


def default_rate(options: BenchOptions) -> str:
    """Generated tokens/s for generation presets (``--cot``, ``--samples``), else requests/s."""
    return options.rate or ("tokens" if options.cot or options.samples else "requests")


def command_line(o: BenchOptions) -> str:
    """The ``ortevals bench`` command that runs ``o``: printed above its table (defaults left out)."""
    words = ["ortevals", "bench"] + [w for p in o.pkgs for w in ("--pkg", p)] + (["--hf", o.hf] if o.hf else [])
    lists = (("--backends", o.backends), ("--tasks", o.tasks))
    words += [w for flag, v in lists if v for w in (flag, ",".join(v))] + (["--cot"] if o.cot else [])
    values = (("--data", o.data), ("--limit", o.limit), ("--peer-limit", o.peer_limit), ("--samples", o.samples),
              ("--max-gen-toks", o.max_gen_toks), ("--ref", o.ref), ("--repeat", o.repeat if o.repeat != 1 else None),
              ("--cache", ",".join(o.cache) if tuple(o.cache) != ("warm",) else None), ("--rate", o.rate),
              ("--ep", o.ep), ("--timeout", o.timeout), ("--peak-tflops", o.peak_tflops), ("--against", o.against),
              ("--decide", o.decide), ("--decide-order", o.decide_order), ("--output", o.output))
    return shlex.join(words + [str(w) for flag, v in values if v is not None for w in (flag, v)])
