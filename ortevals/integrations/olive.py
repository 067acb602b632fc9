"""The Olive edge: ``OrtEvalsEvaluator``, an Olive evaluator type running ortevals.

Importing this module registers the type in Olive's evaluator registry; a
workflow's ``user_script`` does that with one line (``configs/ortevals_olive.py``),
because Olive imports the user script twice and anything else in it would run
twice too. Olive (olive-ai, which pulls torch) is optional: ``import ortevals``
never imports this module.

The evaluator finds the GenAI package folder of the input model (an
ONNXModel whose folder holds ``genai_config.json``, or the composite or
multimodal output of the ModelBuilder pass), runs the tasks through
:func:`ortevals.evaluate.evaluate`, and returns every metric per task with
lm-eval's higher-is-better flags and stderr. Any failure is raised as a
``ValueError`` (an :class:`~ortevals.errors.OrtEvalsError`): Olive re-raises
those instead of logging "Failed to run Olive" and carrying on.

Importing this module changes nothing in Olive or onnxruntime-genai beyond the evaluator registry, and
the process's ``sys.excepthook`` (``olive_workflow.one_line_errors``: an ortevals error that ends ``olive run``, or
Olive's own "Model path … does not exist" for the input model, is printed as one line instead of a
traceback; every other exception goes to the previous hook). The builder shim that Olive 0.13's
ModelBuilder needs lives in :mod:`ortevals.integrations.olive_builder` and applies only while that pass runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.integrations.olive_workflow import NAME, check_evaluator, degradation_goal, one_line_errors
from ortevals.integrations.olive_workflow import model_args as evaluator_model_args
from ortevals.report.decision import decision_lines

try:
    from olive.evaluator.metric_result import MetricResult, SubMetricResult, flatten_metric_result
    from olive.evaluator.olive_evaluator import OliveEvaluator
    from olive.evaluator.registry import Registry
except ImportError as e:  # pragma: no cover - exercised without olive-ai
    raise OrtEvalsError(f"the Olive evaluator needs olive-ai ({e}); install it with: pip install olive-ai") from None

log = logging.getLogger(__name__)


if not getattr(sys.excepthook, "ortevals", False):
    sys.excepthook = one_line_errors(sys.excepthook)


def package_dir(model) -> Path:
    """The folder holding genai_config.json for an Olive model handler (plain, composite or multimodal)."""
    candidates: list[Path] = []
    paths = [getattr(model, "model_path", None)]
    for component in getattr(model, "model_components", None) or []:
        paths.append(getattr(component, "model_path", None))
    for p in paths:
        if p:
            p = Path(p)
            candidates += [p, p.parent]
    for c in candidates:
        if (c / "genai_config.json").is_file():
            return c
    raise OrtEvalsError(f"{NAME}: no genai_config.json beside the input model ({', '.join(map(str, candidates))}); "
                        "ortevals evaluates ONNX Runtime GenAI packages (the ModelBuilder pass output)")


def _provider(execution_providers) -> str | None:
    if isinstance(execution_providers, (list, tuple)):
        execution_providers = execution_providers[0] if execution_providers else None
    if isinstance(execution_providers, (list, tuple)):  # [(name, options)]
        execution_providers = execution_providers[0]
    return str(execution_providers) if execution_providers else None


@Registry.register(NAME)
class OrtEvalsEvaluator(OliveEvaluator):
    """Olive evaluator args: tasks, limit, batch_size, execution_provider, provider_options,
    data, path, max_length, num_fewshot, max_gen_toks, reference (a run folder to compare against:
    adds ``<task>-flip_rate`` and ``<task>-kl_mean``, lower is better), and model_args (a ``K=V,…`` string or an
    object) for any other ortevals model argument (the options table, ortevals/options.py)."""

    def __init__(self, tasks: list[str] | str = ("mmlu-pro",), limit: int | None = None, batch_size: Any = None,
                 execution_provider: str | None = None, provider_options: dict | None = None,
                 data: str | None = None, path: str | None = None, max_length: int | None = None,
                 num_fewshot: int | None = None, max_gen_toks: int | None = None,
                 truncate: str | None = None, model_args: str | dict | None = None,
                 reference: str | None = None, against: str | None = None, decide_seed: int | None = None,
                 decide_alpha: float | None = None, decide_part: int | None = None, decide_cap: int | None = None,
                 decide_order: str | None = None, **kwargs) -> None:
        # Olive hands every key it does not know itself to the evaluator (a typo would be ignored); every key and
        # value is checked here, before ortevals opens the package or lm-eval its tasks
        given = {k: v for k, v in inspect.signature(OrtEvalsEvaluator.__init__).bind(
            self, tasks, limit, batch_size, execution_provider, provider_options, data, path, max_length, num_fewshot,
            max_gen_toks, truncate, model_args, reference, against, decide_seed, decide_alpha, decide_part,
            decide_cap, decide_order).arguments.items() if k != "self"}
        check_evaluator({**given, **kwargs})
        super().__init__()
        self.settings = {k: v for k, v in given.items() if v is not None}
        self.model_args = model_args
        self.reference = reference  # a run folder: adds flip_rate and kl_mean per task (issue 12)
        self.against = against  # a run folder of the original model: its max-degradation goal decided (issue 56)
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        self.limit = limit
        self.batch_size = batch_size
        self.execution_provider = execution_provider
        self.provider_options = provider_options or {}
        self.data = data
        self.path = path
        self.max_length = max_length
        self.num_fewshot = num_fewshot
        self.max_gen_toks = max_gen_toks
        self.truncate = truncate  # issue 10 §6: error | left, for prompts longer than the context

    def evaluate(self, model, metrics, device=None, execution_providers=None) -> MetricResult:
        try:
            if self.against:
                return self._decide(model, metrics, execution_providers)
            return self._evaluate(model, execution_providers)
        except OrtEvalsError:
            raise
        except Exception as e:  # surface as ValueError: Olive would log other types and carry on
            raise OrtEvalsError(f"{NAME} failed: {type(e).__name__}: {e}") from e

    def _evaluate(self, model, execution_providers) -> MetricResult:
        from ortevals.evaluate import RunSpec, evaluate
        from ortevals.integrations.lm import OrtLM
        from ortevals.options import parse_model_args

        pkg = package_dir(model)
        ep = self.execution_provider or _provider(execution_providers)
        args = parse_model_args(evaluator_model_args(self.settings, str(pkg), ep))
        log.info("%s: %s on %s with %s", NAME, pkg, ep or "the package's provider", self.tasks)
        lm = OrtLM.from_package(args)
        spec = RunSpec(tasks=tuple(self._task_specs()), limit=self.limit, num_fewshot=self.num_fewshot,
                       gen_kwargs={"max_gen_toks": self.max_gen_toks} if self.max_gen_toks else None)
        results = evaluate(lm, spec).results
        metrics = to_metric_result(results)
        if self.reference:
            metrics = MetricResult.model_validate({**metrics.root, **reference_metrics(results, self.reference)})
        return metrics

    def _decide(self, model, metrics, execution_providers) -> MetricResult:
        """The metric with Olive's max-degradation goal decided against ``against`` (module docstring of
        decision.py's loop, margin = the goal's value): the value returned is the reference's accuracy plus the
        interval's low end, so Olive's check (value >= baseline - goal, the baseline the reference's accuracy) holds
        exactly when the degradation is decided to be within the goal. The reference run's own package (the same
        model_fingerprint) is the baseline: its accuracy, nothing scored."""
        from ortevals.decision import DecideSpec, decide, plan_decision
        from ortevals.evaluate import RunSpec
        from ortevals.integrations.lm import OrtLM
        from ortevals.options import parse_model_args

        key, kind, value = degradation_goal(_metric_dicts(metrics), self.against)
        pkg = package_dir(model)
        args = parse_model_args(evaluator_model_args(self.settings, str(pkg), self.execution_provider
                                                     or _provider(execution_providers)))
        spec = DecideSpec(Path(self.against).expanduser(), 1.0, self.settings.get("decide_seed", 0),
                          self.settings.get("decide_part", 50), self.settings.get("decide_cap"),
                          self.settings.get("decide_alpha", 0.05), self.settings.get("decide_order", "uniform"))
        specs = self._task_specs()
        plan = plan_decision(spec, specs, self._task_manager())
        first = next(iter(plan.tasks))
        if len(plan.tasks) != 1 or not key.startswith(f"{first}-"):
            raise OrtEvalsError(f"{NAME}: {key}'s {kind} goal: against {self.against} decides task "
                                f"{', '.join(plan.tasks)}; name the metric after it (e.g. {first}-acc)")
        accuracy = float(np.mean(plan.outcome))
        margin = value if kind == "max-degradation" else accuracy * value / 100  # Olive's threshold, as a fraction
        plan = dataclasses.replace(plan, spec=dataclasses.replace(spec, margin=100 * margin))
        if _fingerprint(pkg) == _fingerprint_of_run(plan.spec.against):
            log.info("%s: %s is the package %s scored: %s = its accuracy %.4f over %d questions, nothing scored",
                     NAME, pkg, self.against, key, accuracy, len(plan.outcome))
            return MetricResult.model_validate({key: _sub(accuracy)})
        results = decide(OrtLM.from_package(args), plan, RunSpec(
            tasks=tuple(specs), num_fewshot=self.num_fewshot,
            gen_kwargs={"max_gen_toks": self.max_gen_toks} if self.max_gen_toks else None)).results
        record = results["decide"]
        for line in decision_lines(record):
            log.info("%s: %s", NAME, line)
        low = record["candidate_accuracy"]["low"]
        log.info("%s: %s returned as %.4f, the reference's %.4f plus the interval's low end %+.4f: Olive's %s goal "
                 "(>= %.4f) %s", NAME, key, low, accuracy, record["difference"]["low"], kind, accuracy - margin,
                 "holds" if low >= accuracy - margin else "fails")
        return MetricResult.model_validate({**to_metric_result(results).root, key: _sub(low)})

    def _task_manager(self):
        from ortevals.presets import PRESETS
        from ortevals.tasks import task_manager

        one = PRESETS.get(self.tasks[0]) if len(self.tasks) == 1 else None
        return one.task_manager() if one is not None else task_manager()

    def _task_specs(self) -> list:
        from ortevals.presets import PRESETS, resolve_data, resolve_local, task_specs

        specs: list = []
        for name in self.tasks:
            preset = PRESETS.get(name)
            if preset is not None:
                specs += task_specs(preset, resolve_data(preset, self.data))
            else:
                specs += task_specs([name], resolve_local(self.data))
        return specs


def _metric_dicts(metrics) -> list[dict]:
    """Olive's Metric objects as the workflow's dicts (what olive_workflow.degradation_goal reads)."""
    return [{"name": m.name, "sub_types": [{"name": str(s.name), "goal": s.goal and {"type": s.goal.type,
                                                                                    "value": s.goal.value}}
                                           for s in m.sub_types]} for m in metrics or ()]


def _sub(value: float) -> SubMetricResult:
    return SubMetricResult(value=float(value), priority=-1, higher_is_better=True)


def _fingerprint(pkg: Path) -> str:
    from ortevals.package.loader import ModelPackage

    return ModelPackage.load(pkg).fingerprint()


def _fingerprint_of_run(run: Path) -> str | None:
    """The model_fingerprint an ortevals run's results.json records, None where it records none."""
    try:
        return json.loads((run / "results.json").read_text(encoding="utf-8"))["config"]["model_fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def to_metric_result(results: dict[str, Any]) -> MetricResult:
    """Every metric of every task, with lm-eval's higher-is-better flags and stderr."""
    flags = results.get("higher_is_better", {})
    metrics = {}
    for task, values in sorted(results.get("results", {}).items()):
        subs = {}
        for key, value in sorted(values.items()):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key in ("sample_len",):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            base = metric.removesuffix("_stderr")
            better = False if metric.endswith("_stderr") else bool(flags.get(task, {}).get(base, True))
            subs[name] = SubMetricResult(value=float(value), priority=-1, higher_is_better=better)
        if subs:
            metrics[task] = MetricResult.model_validate(subs)
    return flatten_metric_result(metrics)


def reference_metrics(results: dict[str, Any], reference: str) -> dict[str, SubMetricResult]:
    """``<task>-flip_rate`` and, for log-likelihood tasks, ``<task>-kl_mean`` against a reference run."""
    from ortevals.report.compare import compare
    from ortevals.report.runs import load_run, run_from_results

    cmp = compare(load_run(reference), [run_from_results(results, "candidate")])
    subs = {}
    for c in cmp.tasks:
        subs[f"{c.task}-flip_rate"] = SubMetricResult(value=c.flip_rate, priority=-1, higher_is_better=False)
        if c.choice is not None:
            subs[f"{c.task}-kl_mean"] = SubMetricResult(value=c.choice.kl.mean, priority=-1, higher_is_better=False)
    return subs
