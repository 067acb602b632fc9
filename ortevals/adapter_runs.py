"""Several LoRA adapters in one ``ortevals mmlu-pro`` or ``run``: one result per adapter over one loaded base.

Owns :func:`plan_adapters`: a run's adapters (``--adapter`` given more than once), each checked against the
package's decoder before the model loads (runtime/adapters.py), with its output folder (``--output DIR``:
``DIR/NAME``, a run folder of its own that ``ortevals compare`` reads); and :func:`evaluate_each`: the run opened
once with the first adapter, then for each one its tensors swapped on the same sessions (``OrtLM.use_adapter``)
and lm-eval run again on the same tasks. Each adapter's answers are stored under its own scope (the file's
content), and nothing computed under one adapter serves the next, so each result equals a run of that adapter
alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ortevals.errors import OrtEvalsError
from ortevals.evaluate import RunOutcome, RunSpec, evaluate
from ortevals.options import ModelArgs
from ortevals.package.adapters import adapter_specs
from ortevals.package.loader import ModelPackage
from ortevals.package.multimodal import has_media_models
from ortevals.runtime.adapters import run_adapter


@dataclass(frozen=True)
class AdapterRun:
    """One adapter's run: its ``FILE[=NAME]`` value, name and file, and where its files go (None: no --output)."""

    value: str
    name: str
    path: Path
    output: Path | None


def plan_adapters(args: ModelArgs, output: Path | None) -> tuple[AdapterRun, ...]:
    """One :class:`AdapterRun` per adapter where more than one is given (``()`` otherwise: the run as it is), every
    adapter checked against the decoder (one line, before any model loads)."""
    if len(args.adapter) < 2:
        return ()
    if args.workers or args.ray_address:
        raise OrtEvalsError(f"--adapter given {len(args.adapter)} times: the adapters are swapped on this process's "
                            "sessions, not on workers; drop workers/ray_address, or run once per adapter")
    package = ModelPackage.load(args.pkg, args.ep)
    media = has_media_models(package)
    runs = []
    for value, spec in zip(args.adapter, adapter_specs(args.adapter), strict=True):
        if spec.name in (".", ".."):
            raise OrtEvalsError(f"adapter {value}: {spec.name!r} names no folder for its results; give it a name "
                                "(FILE=NAME)")
        run_adapter(package, (value,), media)  # the file, its tensors against the decoder's adapter inputs
        runs.append(AdapterRun(value, spec.name, spec.path, output / spec.name if output is not None else None))
    return tuple(runs)


def evaluate_each(lm, runs: tuple[AdapterRun, ...], spec: RunSpec,
                  show: Callable[[AdapterRun, RunOutcome], None]) -> list[tuple[AdapterRun, RunOutcome]]:
    """``spec`` evaluated once per adapter on ``lm`` (an OrtLM opened with the first adapter active), each into
    its own output folder; ``show(run, outcome)`` as each ends."""
    out = []
    for i, run in enumerate(runs):
        if i:
            lm.use_adapter(run.value)
        outcome = evaluate(lm, dataclasses.replace(spec, output=run.output))
        show(run, outcome)
        out.append((run, outcome))
    return out
