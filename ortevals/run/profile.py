"""`ortevals profile` as one call: model arguments in, a measured :class:`~ortevals.engine.profile.Profile` out.

Owns the opening for a profile (package, provider from the options table's ``ep``,
``threads`` and ``provider_options``, resolved as a run resolves them) and the checks made before any
session opens: the lists, the settings against the package's context, the output folder.
The measuring is engine/profile.py's; the table, JSON and plot are report/profile.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ortevals.engine.profile import Profile, Trial, check_fits, parse_list, profile_package, settings_for
from ortevals.errors import OrtEvalsError
from ortevals.files import check_writable_folder
from ortevals.options import parse_model_args
from ortevals.package.loader import ModelPackage
from ortevals.report.profile import format_table, write
from ortevals.runtime.adapters import warn_base_model
from ortevals.runtime.providers import from_package, parse_options

__all__ = ["MODEL_ARGS", "ProfileRequest", "format_table", "run_profile"]  # format_table: the CLI's table
MOST_BATCH = 4096
MODEL_ARGS = ("ep", "threads", "provider_options")  # the options-table entries profile takes


@dataclass(frozen=True)
class ProfileRequest:
    """The command's own options, as typed (``"1,4,16"``); checked by :func:`run_profile`."""

    batch: str = "1"
    prompt_len: str = "128"
    gen_len: str = "128"
    repeats: int = 3
    warmup: int = 1
    output: Path = Path("ortevals-profile")


def run_profile(model: dict, req: ProfileRequest,
                progress: Callable[[Trial], None] | None = None) -> tuple[Profile, list[Path]]:
    """Check everything (a setting that cannot fit in memory included), measure, write ``profile.json`` and
    ``profile.png`` under ``req.output`` (after Ctrl-C: the runs measured so far; ``Profile.interrupted``).

    ``model``: ``pkg`` and the :data:`MODEL_ARGS` as given (None: not given), parsed by the options table.
    """
    args = parse_model_args({k: v for k, v in model.items() if v not in (None, ())})

    batches = parse_list("--batch", req.batch, MOST_BATCH)
    prompts = parse_list("--prompt-len", req.prompt_len)
    gens = parse_list("--gen-len", req.gen_len)
    if req.repeats < 1 or req.warmup < 0:
        raise OrtEvalsError(f"--repeats {req.repeats} / --warmup {req.warmup}: expected repeats >= 1, warmup >= 0")
    check_writable_folder(req.output, "--output")
    package = ModelPackage.load(args.pkg, args.ep)
    warn_base_model(package, "profile")  # a LoRA package: the base model is profiled
    settings = settings_for(batches, prompts, gens, package.context_length)
    provider = from_package(package.decoder.session_options, args.ep, parse_options(args.provider_options),
                            args.threads)
    check_fits(package, provider, settings)  # a batch that cannot fit: its estimate, before any session opens
    profile = profile_package(package, provider, settings, req.repeats, req.warmup, progress)
    return profile, write(profile, Path(req.output)) if profile.trials else []  # after Ctrl-C: what was measured
