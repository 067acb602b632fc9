"""The work every row of a benchmark does, written once for both kinds of process.

Owns :class:`Work` (the tasks, data, limit and generation settings shared by every row), the command line
of an ortevals row (:func:`ortevals_command`: the ``ortevals mmlu-pro`` or ``ortevals run`` command a user
types) and the lm-eval call of the other backends (:func:`lm_eval_tasks`: the same task configs, documents
and generation settings as that command builds, from the same functions: presets.py and tasks.py), so
every row answers the same questions with the same prompts. The lm-eval models are built by
:func:`lm_eval_model` with lm-eval's own registry.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ortevals.bench.spec import BenchOptions, RowSpec
from ortevals.package.session_options import normalize
from ortevals.presets import PRESETS, apply_limit, resolve_data, resolve_local, task_specs
from ortevals.tasks import task_manager, with_samples


@dataclass(frozen=True)
class Work:
    tasks: tuple[str, ...] = ()  # empty: MMLU-Pro
    cot: bool = False
    data: str | None = None
    samples: int | None = None
    max_gen_toks: int | None = None
    ep: str | None = None
    decide: tuple[str, ...] = ()  # an ortevals row's decision flags (--against RUN --decide M [--decide-order O])

    @classmethod
    def of(cls, options: BenchOptions) -> Work:
        ep = normalize(options.ep) if options.ep else None  # one spelling for every backend (gpu, CUDA: cuda)
        decide = ("--against", str(options.against), "--decide", f"{options.decide:g}") if options.decide else ()
        decide += ("--decide-order", options.decide_order) if decide and options.decide_order else ()
        return cls(tuple(options.tasks), options.cot, options.data, options.samples, options.max_gen_toks, ep, decide)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def gen_kwargs(self) -> dict[str, Any] | None:
        return {"max_gen_toks": self.max_gen_toks} if self.max_gen_toks else None


def ortevals_command(row: RowSpec, work: Work, output: Path, limit: int | None, resume: bool) -> list[str]:
    """The ``ortevals`` command of an ortevals row, run by this interpreter (``python -m ortevals.cli``)."""
    cmd = [sys.executable, "-m", "ortevals.cli"]
    if work.tasks:
        cmd += ["run", "--tasks", ",".join(work.tasks)] + (["--data", work.data] if work.data else [])
        if work.max_gen_toks:
            cmd += ["--gen-kwargs", f"max_gen_toks={work.max_gen_toks}"]
    else:
        cmd += ["mmlu-pro", "--data", work.data or "bundled"] + (["--cot"] if work.cot else [])
        if work.max_gen_toks:
            cmd += ["--max-gen-toks", str(work.max_gen_toks)]
    cmd += ["--pkg", row.target, "--output", str(output)]
    cmd += ["--limit", str(limit)] if limit else []
    cmd += ["--samples", str(work.samples)] if work.samples else []
    cmd += ["--ep", work.ep] if work.ep else []
    cmd += ["--model-args", row.args] if row.args else []
    cmd += list(work.decide)
    return cmd + ([] if resume else ["--no-resume"])


def child_command(spec_file: Path) -> list[str]:
    """The command of any other row: :mod:`ortevals.bench.child` on its spec file."""
    return [sys.executable, "-m", "ortevals.bench.child", str(spec_file)]


def lm_eval_tasks(work: Work, limit: int | None) -> dict[str, Any]:
    """``lm_eval.simple_evaluate``'s task arguments for ``work``: what the ortevals command passes it."""
    if work.tasks:
        source: Any = tuple(work.tasks)
        data = resolve_local(work.data)
    else:
        source = PRESETS["mmlu-pro-cot" if work.cot else "mmlu-pro"]
        data = resolve_data(source, work.data or "bundled")
    specs, samples, _ = apply_limit(source, task_specs(source, data), limit)
    tm = task_manager(None, defaults=False) if all(isinstance(t, dict) for t in specs) else task_manager(None)
    if work.samples:
        specs = with_samples(specs, work.samples, tm, work.gen_kwargs)
    return {"tasks": specs, "limit": None if samples else limit, "samples": samples, "task_manager": tm,
            "gen_kwargs": work.gen_kwargs}


def lm_eval_model(backend: str, target: str, args: str, ep: str | None):
    """lm-eval's own model for ``backend`` on ``target`` with the row's model args (``K=V,…``, typed as lm-eval's
    command line types them): hf and vllm on the transformers folder (hf in lm-eval's default dtype, ``auto``: the
    checkpoint's ``torch_dtype``, unless the args say otherwise; on ``cuda:0`` with ``ep`` cuda, else the CPU), the
    ONNX backends on the package (on ``ep``, else the providers its genai_config.json names, as lm-eval does)."""
    from lm_eval.api.registry import get_model
    from lm_eval.utils import simple_parse_args_string

    if backend == "hf":
        base = {"pretrained": target, "device": "cuda:0" if ep == "cuda" else "cpu"}
    elif backend == "vllm":
        base = {"pretrained": target}
    else:
        base = {"pretrained": target, **({"execution_provider": ep} if ep else {})}
    return get_model(backend).create_from_arg_obj({**base, **simple_parse_args_string(args)})
