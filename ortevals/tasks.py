"""lm-eval task configs before a run: finding them, and rewriting them for what a run asks.

Owns lm-eval's :class:`TaskManager` (:func:`task_manager`, built once per process), a task or
group's YAML configs (:func:`leaf_configs`; lm-eval 0.4.13 leaks a group's own keys into its
members, so groups are expanded here), and the two rewrites made before ``simple_evaluate``:

* ``--samples K`` (:func:`with_samples`): every ``generate_until`` task gets ``repeats: K`` (lm-eval
  then hands the model K identical requests per question, which the raw path decodes as K rows
  of one prompt), and its generation_kwargs are rewritten to sample: ``do_sample=True`` whatever
  the YAML says, at ``--gen-kwargs temperature=…``, else the task's own temperature if it already
  samples, else 0.7 (:data:`DEFAULT_TEMPERATURE`); the change is logged. What the samples score
  after the run is :mod:`ortevals.report.samples`'.
* ``temperature_fit=split`` (:func:`with_fit_split`): a copy ``<task>@<split>`` of each
  multiple-choice task on its validation (else few-shot) split, whose questions fit the
  temperature (:mod:`ortevals.report.calibration_results` detaches them after the run).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ortevals.errors import DataError, OrtEvalsError, did_you_mean
from ortevals.report.calibration_results import FIT_MARK

log = logging.getLogger(__name__)
DEFAULT_TEMPERATURE = 0.7


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None = None, defaults: bool = True):
    """lm-eval's TaskManager, with the user's extra task folder; built once per process.

    Indexing every lm-eval task YAML takes ~6 s, so ``defaults=False`` indexes
    only ``include_path`` (a preset's own lm-eval folder), and a run whose tasks
    are all resolved configs (dicts) needs no index at all.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).exists():
        raise DataError(f"{include_path}: --include-path folder not found")
    return TaskManager(include_path=include_path, include_defaults=defaults)


def check_task_names(names: Sequence[str], flag: str, extra: Sequence[str] = (),
                     include_path: str | None = None) -> None:
    """Each name a task, group or tag lm-eval's index holds (or a glob matching some, or a YAML path, as lm-eval
    takes them), else one line naming ``flag`` and the closest of the index and ``extra`` (ortevals' presets)."""
    if not names:
        return
    tm = task_manager(include_path)
    known = set(tm.all_tasks)
    for name in names:
        if name in known or Path(name).exists() or (any(c in name for c in "*?[") and tm.match_tasks([name])):
            continue
        presets = f", or one of {', '.join(extra)}" if extra else ""
        raise OrtEvalsError(f"{flag}: unknown task {name!r}{did_you_mean(name, [*extra, *known])}; expected an "
                            f"lm-eval task, group or tag name{presets}")


def leaf_configs(tm, name: str, load_yaml) -> list[dict[str, Any]]:
    """The YAML configs of ``name``'s tasks; a group or a tag expands to its members.

    lm-eval 0.4.13 leaks a group dict's own keys into its members' configs,
    so groups are expanded here and their aggregate is computed by results.py.
    A tag has no YAML of its own: lm-eval's index lists the tasks that carry it.
    """
    entry = tm._entry(name)  # lm-eval 0.4.13's index entry: where the task's YAML lives
    if entry is None:
        raise DataError(f"unknown task {name!r}{did_you_mean(name, tm.all_tasks)}; expected an lm-eval task, group "
                        "or tag name")
    if not getattr(entry, "yaml_path", None):
        members = sorted(getattr(entry, "tags", None) or ())
        if not members:
            raise DataError(f"task {name!r} has no YAML config of its own to read; name its tasks in --tasks")
        return [c for m in members for c in leaf_configs(tm, m, load_yaml)]
    cfg = load_yaml(str(entry.yaml_path), resolve_func=True)
    if "group" in cfg and isinstance(cfg.get("task"), list):
        members = [t if isinstance(t, str) else t.get("task") for t in cfg["task"]]
        return [c for m in members if isinstance(m, str) for c in leaf_configs(tm, m, load_yaml)]
    return [cfg]


def _configs(tasks: Sequence[Any], task_manager) -> list[dict]:
    """Each task's leaf configs (names resolved to their YAML; dicts copied)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    configs: list[dict] = []
    for t in tasks:
        configs.extend([dict(t)] if isinstance(t, dict) else leaf_configs(task_manager, t, load_yaml))
    return configs


def generates(tasks: Sequence[Any], task_manager) -> bool:
    """Whether any of ``tasks`` (names, groups or resolved configs) generates text (``generate_until``)."""
    return any(c.get("output_type") == "generate_until" for c in _configs(tasks, task_manager))


def check_generation_settings(tasks: Sequence[Any], task_manager, cascade: str) -> None:
    """``cascade`` other than auto acts only on generation: on a run with no generate_until task it is one line
    before the run (the task names are resolved only then)."""
    if cascade == "auto":
        return
    configs = _configs(tasks, task_manager)
    if not any(c.get("output_type") == "generate_until" for c in configs):
        names = ", ".join(str(c.get("task")) for c in configs)[:200]
        raise OrtEvalsError(f"cascade={cascade} does nothing on this run: {names} score log-likelihoods and generate "
                            "nothing (cascade decodes sampled rows on one shared prompt KV); drop it")


def with_samples(tasks: Sequence[Any], k: int, task_manager, user: dict | None = None,
                 self_eval: bool = False) -> list[dict]:
    """Task configs (names resolved to their YAML) with ``repeats: k`` and sampling generation_kwargs
    (:func:`sampling_kwargs`) on every generate_until task; what changed is logged once. ``self_eval`` on tasks
    that all generate is refused (P(True) asks about one answer a question; K samples have none)."""
    configs = _configs(tasks, task_manager)
    generating = [c for c in configs if c.get("output_type") == "generate_until"]
    names = ", ".join(str(c.get("task")) for c in configs)
    if not generating:
        raise OrtEvalsError(f"--samples {k} needs generate_until tasks; {names} score log-likelihoods "
                            "(for MMLU-Pro use --cot)")
    if self_eval and len(generating) == len(configs):
        raise OrtEvalsError(f"--self-eval with --samples {k}: P(True) is asked about a question's one generated "
                            f"answer or chosen choice, and {names[:200]} give {k} samples a question; give "
                            "--verifier self to score each sample by P(True), or drop --samples")
    changed: dict[str, list[str]] = {}
    for c in generating:
        _check_first_k(c, k)
        c["repeats"] = k
        c["generation_kwargs"], changes = sampling_kwargs(c.get("generation_kwargs"), user, k)
        if changes:
            changed.setdefault(changes, []).append(str(c.get("task")))
    for changes, names in changed.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log.warning("--samples %d: generation settings of %s changed to sample: %s", k, shown, changes)
    return configs


def _check_first_k(cfg: dict, k: int) -> None:
    """A filter that takes the first n samples (lm-eval's ``take_first_k``) needs n <= K, or lm-eval's own filter
    fails after all generation: a one-line error naming the task and the filter before any work."""
    for entry in cfg.get("filter_list") or []:
        for step in entry.get("filter") or []:
            if step.get("function") == "take_first_k" and int(step.get("k", 0)) > k:
                raise OrtEvalsError(f"--samples {k}: task {cfg.get('task')}'s filter {entry.get('name')!r} takes the "
                                    f"first {step['k']} samples (take_first_k); give --samples {step['k']} or more")


def sampling_kwargs(task: dict | None, user: dict | None, k: int) -> tuple[dict, str]:
    """A task's generation_kwargs for K samples, and what changed (``""`` if nothing), as one string.

    ``--samples`` exists to sample: ``do_sample`` becomes true whatever the task's YAML says, at the
    user's ``--gen-kwargs`` temperature, else the task's own if the task already samples, else
    :data:`DEFAULT_TEMPERATURE`. A user asking for greedy decoding (``do_sample=false`` or
    ``temperature=0``) with ``--samples`` would get K identical samples: a one-line error."""
    task, user = dict(task or {}), dict(user or {})
    merged = {**task, **user}  # lm-eval applies --gen-kwargs over the task's own settings
    if _falsy(user.get("do_sample")) or ("temperature" in user and _number(user["temperature"]) == 0):
        raise OrtEvalsError(f"--samples {k} with --gen-kwargs do_sample=false/temperature=0 would decode the "
                            f"same greedy text {k} times; give a temperature > 0 or leave it out")
    temperature = _number(merged.get("temperature"))
    samples_already = not _falsy(merged.get("do_sample")) and "do_sample" in merged and bool(temperature)
    if "temperature" not in user and not samples_already:
        temperature = DEFAULT_TEMPERATURE
    out = {**task, "do_sample": True, "temperature": temperature}
    before = {key: merged.get(key) for key in ("do_sample", "temperature")}
    changes = ", ".join(f"{key} {before[key]!r} -> {out[key]!r}" for key in before if before[key] != out[key])
    return out, changes


def _falsy(value: Any) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() in ("false", "0", "no"))


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        raise OrtEvalsError(f"gen_kwargs temperature={value!r}: expected a number >= 0") from None


def with_fit_split(tasks: Sequence[Any], task_manager) -> list[Any]:
    """The tasks plus, for each multiple-choice one with a validation (else few-shot) split other than its
    test split, a copy ``<task>@<split>`` evaluated on that split: its questions fit the temperature."""
    from lm_eval.tasks._yaml_loader import load_yaml

    configs: list[dict] = []
    for t in tasks:
        configs.extend([dict(t)] if isinstance(t, dict) else leaf_configs(task_manager, t, load_yaml))
    extra = []
    for c in configs:
        test = c.get("test_split") or c.get("validation_split")
        split = next((s for s in (c.get("validation_split"), c.get("fewshot_split")) if s and s != test), None)
        if c.get("output_type") == "multiple_choice" and split:
            copy = {k: v for k, v in c.items() if k not in ("tag", "group")}
            extra.append({**copy, "task": f"{c['task']}{FIT_MARK}{split}", "test_split": split})
    if not extra:
        log.warning("temperature_fit=split: no multiple-choice task has a validation or few-shot split apart "
                    "from its test split; the temperature is cross-validated")
    return configs + extra
