"""An Olive workflow that uses ``OrtEvalsEvaluator``, checked before Olive starts: one line per bad input.

Owns what an ``OrtEvalsEvaluator`` entry may hold (:data:`KEYS`) and its check (:func:`check_evaluator`: unknown
keys with the closest valid one; each task an ortevals preset or an lm-eval task, with a did-you-mean; ``limit``,
``num_fewshot`` and ``max_gen_toks`` in range, named by their JSON key; ``data`` ``bundled`` or a folder, named by
its key, a near miss of ``bundled`` getting it suggested; ``reference`` a run folder; ``against`` a run folder, the
decision's keys only with it, and in a workflow its one metric with a ``max-degradation`` goal
(:func:`degradation_goal`); the model arguments through the options table), which the evaluator's constructor
runs, and the workflow file's (:func:`check_workflow`: the input model's folder, which must hold a GenAI package,
and each ortevals evaluator). ``python -m
ortevals.integrations.olive_workflow run --config FILE …`` runs :func:`check_workflow` before Olive is imported
(Olive's own start-up, before it builds an evaluator, takes 15 to 30 s), then Olive's command line with the same
arguments; ortevals' errors, then or during the run, end the output as one line (``Error: …``, exit 2). Without the
wrapper, :func:`one_line_errors` (the excepthook the evaluator's module installs when Olive imports it) prints
them, and Olive's missing input model, as one line.
This module imports no Olive until Olive runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ortevals.errors import OrtEvalsError, did_you_mean, exit_in_one_line
from ortevals.report.decide import ORDERS

NAME = "OrtEvalsEvaluator"
KEYS = ("tasks", "limit", "batch_size", "execution_provider", "provider_options", "data", "path", "max_length",
        "num_fewshot", "max_gen_toks", "truncate", "model_args", "reference", "against", "decide_seed",
        "decide_alpha", "decide_part", "decide_cap", "decide_order")
DECIDE_KEYS = ("decide_seed", "decide_alpha", "decide_part", "decide_cap", "decide_order")  # only with against
DEGRADATION = ("max-degradation", "percent-max-degradation")  # Olive's goals a decision answers
OLIVE_KEYS = ("type", "name", "user_script", "script_dir", "metrics")  # Olive's own keys of an evaluator entry
EXAMPLE = "`ortevals example` prints the folder of the example package, SmolLM2-135M-Instruct fp32"


def model_args(settings: dict[str, Any], pkg: str, ep: str | None = None) -> dict[str, Any]:
    """The ortevals model arguments of an evaluator entry (``model_args`` and the keys that are model arguments)."""
    from ortevals.options import parse_arg_string

    given = settings.get("model_args")
    raw = parse_arg_string(given) if isinstance(given, str) else dict(given or {})
    raw.update({k: v for k, v in {"pkg": pkg, "ep": settings.get("execution_provider") or ep,
                                  "batch_size": settings.get("batch_size"), "path": settings.get("path"),
                                  "max_length": settings.get("max_length"),
                                  "truncate": settings.get("truncate")}.items() if v is not None})
    if settings.get("provider_options"):
        raw["provider_options"] = settings["provider_options"]
    return raw


def check_evaluator(settings: dict[str, Any]) -> None:
    """An ``OrtEvalsEvaluator`` entry's keys and values, before any model or data is opened."""
    from ortevals.options import parse_model_args

    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        raise OrtEvalsError(f"{NAME}: unknown key {unknown[0]!r} in the evaluator config"
                            f"{did_you_mean(unknown[0], KEYS)}; expected some of {list(KEYS)}")
    for key, low in (("limit", 1), ("num_fewshot", 0), ("max_gen_toks", 1), ("decide_seed", 0), ("decide_part", 1),
                     ("decide_cap", 1)):
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise OrtEvalsError(f"{NAME}: {key} must be an integer >= {low} in the evaluator config, got {value!r}")
    check_tasks(settings.get("tasks", ("mmlu-pro",)))
    check_data(settings.get("data"))
    reference = settings.get("reference")
    if reference is not None and not Path(reference).expanduser().exists():
        raise OrtEvalsError(f"{NAME}: reference {reference}: not found; expected an ortevals --output folder or an "
                            "lm-eval --log_samples folder")
    check_against(settings)
    parse_model_args(model_args(settings, "(the input model)"))


def check_against(settings: dict[str, Any]) -> None:
    """``against`` (a run folder) and the decision's keys, which need it; ``limit`` refused beside it."""
    against = settings.get("against")
    if against is None:
        extra = next((k for k in DECIDE_KEYS if settings.get(k) is not None), None)
        if extra:
            raise OrtEvalsError(f"{NAME}: {extra} sets the decision against a finished run: add against (the run "
                                "folder of the original model)")
        return
    if not isinstance(against, str) or not Path(against).expanduser().exists():
        raise OrtEvalsError(f"{NAME}: against {against!r}: not found; expected an ortevals --output folder or an "
                            "lm-eval --log_samples folder of the original model")
    if (Path(against).expanduser() / "genai_config.json").is_file():
        raise OrtEvalsError(f"{NAME}: against {against}: a GenAI package; the evaluator decides against a finished run "
                            "of the original model (score it once: ortevals mmlu-pro --pkg ORIGINAL --output RUN)")
    alpha = settings.get("decide_alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1):
        raise OrtEvalsError(f"{NAME}: decide_alpha must be a level above 0 and below 1 in the evaluator config "
                            f"(0.05: a 95% sequence), got {alpha!r}")
    order = settings.get("decide_order")
    if order is not None and order not in ORDERS:
        raise OrtEvalsError(f"{NAME}: decide_order must be one of {', '.join(ORDERS)} in the evaluator config, "
                            f"got {order!r}{did_you_mean(str(order), ORDERS)}")
    if settings.get("limit") is not None:
        raise OrtEvalsError(f"{NAME}: limit and against: the decision scores the run's own questions in a random "
                            "order (decide_cap N stops after N); drop limit")


def degradation_goal(metrics, against: str) -> tuple[str, str, float]:
    """(``metric-sub_type``, goal type, goal value) of the one sub-metric of ``metrics`` (Olive's metric entries as
    dicts) with a max-degradation goal, which ``against`` decides; its value a fraction of the accuracy."""
    found = [(f"{m.get('name')}-{s.get('name')}", s["goal"].get("type"), s["goal"].get("value"))
             for m in metrics or () if isinstance(m, dict) for s in m.get("sub_types") or ()
             if isinstance(s, dict) and isinstance(s.get("goal"), dict) and s["goal"].get("type") in DEGRADATION]
    if len(found) != 1:
        raise OrtEvalsError(f"{NAME}: against {against} decides one metric with a max-degradation (or percent-max-"
                            f"degradation) goal; the evaluator's metrics have {len(found)}, expected one, e.g. "
                            '{"name": "leaderboard_mmlu_pro", "type": "custom", "sub_types": [{"name": "acc", '
                            '"priority": 1, "higher_is_better": true, "goal": {"type": "max-degradation", '
                            '"value": 0.01}}]}')
    key, kind, value = found[0]
    top = 1 if kind == "max-degradation" else 100
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < top:
        unit = "a fraction of the accuracy (0.01: one point)" if top == 1 else "a percent of the reference's accuracy"
        raise OrtEvalsError(f"{NAME}: {key}'s {kind} goal value {value!r}: expected {unit}, above 0 and below {top}")
    if not (key.endswith("-acc") or "-exact_match" in key):
        raise OrtEvalsError(f"{NAME}: {key}'s {kind} goal: against decides a 0/1 score per question; expected a "
                            "task's acc or exact_match sub-metric, e.g. leaderboard_mmlu_pro-acc")
    return key, kind, float(value)


def check_data(data) -> None:
    """``data``: ``bundled`` or a folder, named by its JSON key (a near miss of ``bundled`` gets it suggested)."""
    if data is None or data == "bundled":
        return
    expected = ('expected "bundled" (the MMLU-Pro copy shipped with ortevals) or the folder of a local copy of the '
                "data set, in the Hugging Face hub's layout")
    if not isinstance(data, str) or not data.strip():
        raise OrtEvalsError(f"{NAME}: data must be a string in the evaluator config, got {data!r}; {expected}")
    path = Path(data).expanduser()
    if not path.exists():
        raise OrtEvalsError(f"{NAME}: data {data!r}: data folder not found{did_you_mean(data, ('bundled',))}; "
                            f"{expected}")
    if not path.is_dir():
        raise OrtEvalsError(f"{NAME}: data {data!r}: is a file; expected the folder of the data set (the hub's "
                            "layout: the folder above data/test-….parquet)")


def check_tasks(tasks) -> None:
    """Each task an ortevals preset or a task, group or tag lm-eval knows (a glob or a YAML path as lm-eval takes
    them), else one line with the closest name."""
    from ortevals.presets import PRESETS
    from ortevals.tasks import check_task_names

    names = [tasks] if isinstance(tasks, str) else list(tasks or ())
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise OrtEvalsError(f"{NAME}: tasks must be a list of task names, got {tasks!r}")
    check_task_names([n for n in names if n not in PRESETS], f"{NAME}: tasks", extra=tuple(PRESETS))


def check_workflow(config: Path) -> None:
    """The workflow JSON: its input model's folder (a GenAI package where an ortevals evaluator scores it) and
    every ``OrtEvalsEvaluator`` entry."""
    try:
        workflow = json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OrtEvalsError(f"{config}: not a readable JSON workflow ({type(e).__name__}: {e})") from None
    evaluators = [e for e in (workflow.get("evaluators") or {}).values() if isinstance(e, dict)
                  and e.get("type") == NAME]
    for entry in evaluators:
        check_evaluator({k: v for k, v in entry.items() if k not in OLIVE_KEYS})
        if entry.get("against") is not None:
            degradation_goal(entry.get("metrics"), entry["against"])
    model = workflow.get("input_model") or {}
    path = model.get("model_path")
    if not evaluators or model.get("type") != "ONNXModel" or not isinstance(path, str):
        return  # no ortevals evaluator, or a checkpoint (a hub id, a folder) for a pass to build: Olive's to check
    where = Path(path).expanduser()
    if not where.exists():
        raise OrtEvalsError(f"{config}: input_model.model_path {path!r} does not exist; set it to a GenAI package "
                            f"folder ({EXAMPLE})")
    if not any((p / "genai_config.json").is_file() for p in (where, where.parent)):
        raise OrtEvalsError(f"{config}: input_model.model_path {path!r} holds no genai_config.json; expected a GenAI "
                            f"package folder, as the ModelBuilder pass writes ({EXAMPLE})")


def one_line_errors(previous):
    """``sys.excepthook`` for ``olive run``: ortevals' errors (and Olive's missing input model path) as one line,
    every other exception handed to ``previous``."""
    def hook(kind, value, tb):
        text = str(value)
        if isinstance(value, OrtEvalsError):
            sys.stderr.write(f"Error: {text}\n")
        elif isinstance(value, AssertionError) and text.startswith("Model path ") and text.endswith(" does not exist"):
            path = text.removeprefix("Model path ").removesuffix(" does not exist")
            sys.stderr.write(f"Error: input_model.model_path {path!r} does not exist; set it to a GenAI package "
                             f"folder ({EXAMPLE})\n")
        else:
            previous(kind, value, tb)

    hook.ortevals = True
    return hook


def main(argv: list[str] | None = None) -> None:
    """``run --config FILE …``: the workflow checked, then Olive's command line; ortevals' errors as one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if config is None and "--config" in args[:-1]:
        config = args[args.index("--config") + 1]
    with exit_in_one_line():
        if config is not None:
            check_workflow(Path(config))
        from olive.cli.launcher import main as olive_main

        olive_main(args, called_as_console_script=False)


if __name__ == "__main__":
    main()
