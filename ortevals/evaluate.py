"""One evaluation run: an OrtLM plus task specs → lm-eval → a summary.

Owns the call into ``lm_eval.simple_evaluate`` (samples always logged, so the
per-category table can be built), turning lm-eval's data-loading failures
into one-line :class:`~ortevals.errors.DataError` messages (the hub
unreachable while offline is the common one), and writing outputs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from ortevals.errors import DataError, OrtEvalsError, OutputError, first_line
from ortevals.files import cache_root, check_writable_file, check_writable_folder, publish, staged
from ortevals.presets import check_hub_data, reword_data_error
from ortevals.report.results import RunSummary, stale_outputs, summarize, write_outputs, write_unreported
from ortevals.report.samples import add_sample_tokens
from ortevals.report.sampling import lines as sample_lines
from ortevals.runtime.meter import boot_clock
from ortevals.tasks import check_generation_settings, check_task_names, task_manager, with_fit_split, with_samples

log = logging.getLogger(__name__)
OUTPUT_FILES = ("results.json", "samples_*.jsonl", "calibration_fit_*.jsonl", "*.png")  # what a run writes


@dataclass(frozen=True)
class RunSpec:
    """What to evaluate and where results go."""

    tasks: tuple[Any, ...]  # lm-eval task names or config dicts
    limit: int | None = None
    num_fewshot: int | None = None
    output: Path | None = None
    use_cache: Path | None = None
    include_path: str | None = None
    apply_chat_template: bool = False
    gen_kwargs: dict[str, Any] | None = None
    samples: dict[str, list[int]] | None = None  # documents to score per task (lm-eval's samples), not limit
    notes: tuple[str, ...] = ()  # what an option meant in this run, printed under the table (--limit)
    sample: Any = None  # --sample's draw (subset.SamplePlan): results["sample"] and its lines after the run
    record: dict[str, Any] = field(default_factory=dict)  # more keys of results.json (--decide's "decide")
    extra: dict[str, Any] = field(default_factory=dict)  # more simple_evaluate kwargs


@dataclass(frozen=True)
class RunOutcome:
    summary: RunSummary
    results: dict[str, Any]
    files: tuple[Path, ...]
    removed: tuple[Path, ...] = ()  # an earlier run's files in --output that this run's set replaced


def check_spec(spec: RunSpec) -> None:
    """Everything about a run that can be wrong before any work: one line each (a file as --output, a
    folder as --use-cache, no tasks, a cache path that is a file)."""
    if not spec.tasks:
        raise OrtEvalsError("no tasks given; expected at least one lm-eval task or group name")
    if spec.limit is not None and spec.limit <= 0:
        raise OrtEvalsError(f"--limit must be > 0, got {spec.limit}")
    if spec.output is not None:
        check_writable_folder(spec.output, "--output", OUTPUT_FILES)
    if spec.use_cache is not None:
        check_writable_file(spec.use_cache, "--use-cache")
    if spec.gen_kwargs:  # each value checked as generation will read it (temperature=inf: random tokens)
        from ortevals.engine.generate.choice.settings import parse_gen_kwargs

        parse_gen_kwargs(spec.gen_kwargs, default_max=256)
    cache_root()  # $ORTEVALS_CACHE naming a file is refused here, not halfway through the run


def evaluate(lm, spec: RunSpec) -> RunOutcome:
    """Run lm-eval on ``lm`` (an :class:`~ortevals.integrations.lm.OrtLM`) and summarize."""
    import lm_eval

    check_spec(spec)
    model: Any = lm
    if spec.use_cache is not None:
        from lm_eval.api.model import CachingLM

        model = CachingLM(lm, str(spec.use_cache))
    tasks, gen_kwargs = list(spec.tasks), spec.gen_kwargs
    args = getattr(lm, "args", None)
    k = getattr(args, "samples", None)
    check_task_names([t for t in tasks if isinstance(t, str)], "--tasks", include_path=spec.include_path)
    check_hub_data(tasks, _run_task_manager(spec))  # offline: a data set nowhere here is one line now
    check_generation_settings(tasks, _run_task_manager(spec), getattr(args, "cascade", "auto"))
    if k:  # --samples K (issue 14 §3, tasks.py): repeats K, each task's settings rewritten to sample
        tasks = with_samples(tasks, k, _run_task_manager(spec), gen_kwargs, getattr(args, "self_eval", False))
    if getattr(getattr(lm, "args", None), "temperature_fit", "cv") == "split":  # issue 24: <task>@validation too
        tasks = with_fit_split(tasks, _run_task_manager(spec))
    verifier = _open_verifier(lm, k)
    start = time.perf_counter()
    before, passes = dict(lm.stats), _meter_counts(lm)
    try:
        with quiet_git_hash(), deferred_torch_seed(), env_info_without_torch():
            results = lm_eval.simple_evaluate(
                model=model, tasks=tasks, limit=None if spec.samples else spec.limit, samples=spec.samples,
                num_fewshot=spec.num_fewshot, batch_size=_batch_size(lm),
                log_samples=True, task_manager=_run_task_manager(spec),
                apply_chat_template=spec.apply_chat_template, gen_kwargs=gen_kwargs, **spec.extra,
            )
    except OrtEvalsError:
        raise
    except Exception as e:  # datasets/hub raise many types; only data problems are re-worded
        reword_data_error(e, spec.tasks, spec.num_fewshot)
        raise
    seconds, evaluated = time.perf_counter() - start, boot_clock()
    if not results or not results.get("samples"):
        raise DataError("the data set is empty after filters (check --limit and the task names)")
    return _report(lm, spec, tasks, results, verifier, before, passes, (seconds, evaluated))


def _report(lm, spec: RunSpec, tasks, results: dict, verifier, before: dict, passes, clock) -> RunOutcome:
    """After lm-eval: the verifier, scaling, calibration and efficiency into ``results``, the summary, and every
    file of the run written into a stage, then published as one set (``clock``: lm-eval's seconds and the
    boot_clock() reading when it ended). An error or Ctrl-C while reporting loses no model work: lm-eval's
    results and every sample are published instead, ``results.json`` saying why (``write_unreported``)."""
    k = getattr(getattr(lm, "args", None), "samples", None)
    _search(results, lm, before)
    with staged(spec.output) as stage:
        try:
            if k:
                from ortevals.report.samples import add_scaling

                add_scaling(results, tasks, lm.sample_facts(), stage,
                            _verify(results, tasks, lm, verifier, lm.stats["seconds"] - before["seconds"]))
            elif hasattr(lm, "sample_facts"):
                add_sample_tokens(results, tasks, lm.sample_facts())
            _calibration(results, lm, stage)
        except BaseException as e:
            if stage is not None:
                _publish_unreported(spec.output, stage, results, e)
            raise
        notes = spec.notes
        if spec.sample is not None:  # --sample: the draw and the whole-set estimate (subset.py, report/sampling.py)
            results["sample"] = spec.sample.record(results)
            notes += tuple(sample_lines(results["sample"]))
        results.update(spec.record)
        requests = lm.stats["requests"] - before["requests"]
        reused = lm.stats["reused"] - before["reused"]
        eff = _efficiency(results, lm, passes, requests, reused,
                          lm.stats["generated_tokens"] - before["generated_tokens"], clock[1])
        summary = summarize(results, requests, clock[0], lm.stats["seconds"] - before["seconds"], reused,
                            mode_text(lm.stats, requests, reused), workers_text(lm), notes, eff)
        if stage is None:
            return RunOutcome(summary, results, ())
        return _publish(spec.output, stage, results, summary)


def _publish(output: Path, stage: Path, results: dict, summary: RunSummary) -> RunOutcome:
    """results.json and the samples beside the plots in ``stage``, then the whole set into ``output``; the earlier
    run's files it leaves out go with it (files.py ``publish``: the earlier set or this one, never a mix)."""
    others = sorted(p.name for p in stage.iterdir() if p.is_file())  # plots, calibration fit samples
    names = [p.name for p in write_outputs(stage, results, summary, others)] + others
    removed = stale_outputs(output, set(names))
    publish(stage, output, "--output", removed)
    return RunOutcome(summary, results, tuple(output / n for n in names), tuple(output / n for n in removed))


def _publish_unreported(output: Path, stage: Path, results: dict, error: BaseException) -> None:
    """Reporting failed after the model work: lm-eval's results and every sample published as the run's set
    (plots already drawn kept), ``results.json``'s ``ortevals.unreported`` saying why; a failure here is logged,
    never raised over the first. A file the stage could not take (a full disk: :class:`OutputError`) would fail
    again: the caller's one line says nothing was written."""
    if isinstance(error, OutputError):
        return
    try:
        others = sorted(p.name for p in stage.iterdir() if p.is_file())
        names = [p.name for p in write_unreported(stage, results, error, others)] + others
        publish(stage, output, "--output", stale_outputs(output, set(names)))
        log.error("reporting stopped (%s); lm-eval's results and every sample are in %s", first_line(error), output)
    except Exception as e:  # noqa: BLE001  (the first error is the one the user must see)
        log.error("reporting stopped (%s), and its samples could not be written either: %s", first_line(error),
                  first_line(e))


@contextlib.contextmanager
def collector_paused(active: bool = True):
    """Python's cyclic garbage collector off while a run starts, on again (yielded ``thaw``) once its first
    requests arrive, and always on again after the block; nothing where not ``active``.

    Start-up imports lm-eval, datasets and pyarrow and builds the tasks: objects that live to the end and
    make no garbage, yet each full collection re-scanned them all (three during start-up and a fourth at
    the calibration's scipy import, 50k to 181k objects: 0.25 s of a 6 s first run). ``thaw`` freezes what
    exists by then (``gc.freeze``: never scanned again) and enables collection for the rest of the run, so
    a long run's cycles are still collected. Only for a process the run owns (the ``ortevals`` command):
    frozen objects in cycles are never freed before exit."""
    was = gc.isenabled()
    if active:
        gc.disable()

    def thaw() -> None:
        if active:
            gc.freeze()
        if was:
            gc.enable()

    try:
        yield thaw
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def quiet_git_hash():
    """While lm-eval runs: its ``git_hash`` lookup (``git describe --always`` in the working folder) with git's
    stderr dropped. lm-eval lets git print ``fatal: not a git repository`` on every run outside a repository;
    the recorded value is unchanged (the same command, then lm-eval's own fallback)."""
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash():
        try:
            out = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)  # noqa: S607
            return out.strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", git_hash):
        yield


@contextlib.contextmanager
def deferred_torch_seed():
    """While lm-eval runs: its torch seed (``set_torch_seed``, called by ``simple_evaluate`` whenever torch is
    installed) set when torch is imported, not by importing it. ortevals computes nothing with torch, so
    lm-eval's import of it cost about 3 s of start-up for nothing. Seeding at import gives torch the state
    lm-eval's early seed gives it (nothing draws from torch's generator before it is imported); a torch
    already imported is seeded at once, as lm-eval does. ``results["config"]["torch_seed"]`` is unchanged."""
    import lm_eval.evaluator

    original = lm_eval.evaluator.set_torch_seed
    pending: list[int] = []

    def seed_when_imported(seed: int) -> None:
        if "torch" in sys.modules:
            original(seed)
        else:
            pending.append(seed)

    lm_eval.evaluator.set_torch_seed = seed_when_imported
    hook = _SeedOnImport(pending, original)
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        lm_eval.evaluator.set_torch_seed = original
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)


TORCHLESS_ENV = ("not collected: ortevals computes nothing with torch (lm-eval's collection imports torch and "
                 "takes about 2 s); the runtime is in config.model_info")


@contextlib.contextmanager
def env_info_without_torch():
    """While lm-eval runs: its ``add_env_info`` (results' ``pretty_env_info``, ``transformers_version``,
    ``lm_eval_version``, ``upper_git_hash``) without importing torch or transformers. The versions come from
    package metadata (the same strings); ``pretty_env_info``, torch's environment report, says why it is not
    collected (``TORCHLESS_ENV``). No number changes."""
    from importlib.metadata import PackageNotFoundError, version

    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def add_env_info(storage: dict) -> None:
        def ver(dist: str, missing: str) -> str:
            try:
                return version(dist)
            except PackageNotFoundError:
                return missing
        storage.update({"pretty_env_info": TORCHLESS_ENV, "transformers_version": ver("transformers", "N/A"),
                        "lm_eval_version": ver("lm_eval", "N/A"),
                        "upper_git_hash": get_commit_from_path(Path(os.getcwd(), ".."))})

    with mock.patch.object(lm_eval.evaluator, "add_env_info", add_env_info):
        yield


class _SeedOnImport:
    """A meta-path finder for ``torch`` alone: the spec the other finders give, its loader wrapped so lm-eval's
    pending seed is applied right after torch's own module has run."""

    def __init__(self, pending: list[int], seed_fn) -> None:
        self.pending, self.seed_fn = pending, seed_fn

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or not self.pending:
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     and (s := f.find_spec(name, path, target)) is not None), None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        run_module, pending, seed_fn = spec.loader.exec_module, self.pending, self.seed_fn

        def exec_module(module) -> None:
            run_module(module)
            while pending:
                seed_fn(pending.pop(0))

        spec.loader.exec_module = exec_module
        return spec


def _search(results: dict, lm, before: dict) -> None:
    """--search: ``results["search"]`` (run/search.py ``search_record``): which search ran, its settings and
    verifier, and what it cost in this run."""
    args = getattr(lm, "args", None)
    if getattr(args, "search", "none") == "none":
        return
    from ortevals.run.search import search_record

    results["search"] = search_record(args, lm.run.search_reward, lm.run.search_verifier, lm.stats, before)


def _batch_size(lm):
    """What results["config"]["batch_size"] records: the run's rows per pass (lm-eval only records it for a
    model object), as model_args says it."""
    args = getattr(lm, "args", None)
    return None if args is None else args.batch_size or "auto"


def _meter_counts(lm):
    """The run's pass meter reading (runtime/meter.py), None without one (a fake lm, Ray workers' passes)."""
    meter = getattr(getattr(lm, "backends", None), "meter", None)
    return meter.counts() if meter is not None else None


def _efficiency(results: dict, lm, before, requests: int, reused: int, output_tokens: int,
                evaluated: float) -> dict | None:
    """``results["efficiency"]`` (report/efficiency.py) from the engine's pass meter, the run's clock (lm-eval's
    evaluation ended at ``evaluated``, a boot_clock() reading) and peak memory."""
    from ortevals.report.efficiency import by_task, efficiency, since, timeline
    from ortevals.report.results import peak_rss_mb
    from ortevals.runtime.meter import CODE_STARTED

    after = _meter_counts(lm)
    if after is None:
        return None
    counts = since(after, before)
    clock = timeline(CODE_STARTED, after.first_pass_at, evaluated, boot_clock())
    overall = efficiency(counts, requests, reused, output_tokens, clock, peak_rss_mb())
    tasks = {t: len(s) for t, s in results.get("samples", {}).items()}
    results["efficiency"] = {"by_task": by_task(overall, tasks), "overall": overall}
    return overall


GEN_PATHS = {"raw": "generation on raw onnxruntime", "og": "generation on onnxruntime-genai"}


def mode_text(stats: dict, requests: int, reused: int) -> str:
    """How this run's requests were answered: the log-likelihood mode, the generation engine, or the store."""
    if not requests and reused:
        return (f"all {reused} request{'s' if reused != 1 else ''} reused from the result store (scored earlier with "
                "the same package files, settings and versions)")
    parts = [stats["mode"]] if stats.get("mode") else []
    parts += [GEN_PATHS[stats["gen_path"]]] if stats.get("gen_path") in GEN_PATHS else []
    return "; ".join(parts)


def workers_text(lm) -> str:
    """``2 Ray workers (local cluster)`` when the run was data parallel (integrations/ray.py), else ``""``."""
    pool = getattr(lm, "pool", None)
    if pool is None or not getattr(pool, "workers", 0):
        return ""
    where = lm.args.ray_address or "a local cluster"
    return f"{pool.workers} Ray worker{'s' if pool.workers > 1 else ''} on {where}"


def _calibration(results: dict, lm, output: Path | None) -> list[Path]:
    """Issue 24: calibration metrics of every multiple-choice task (numpy/scipy on the logged
    log-likelihoods), P(True) where ``--self-eval`` asked for it, the PNGs under ``output``."""
    from ortevals.report.calibration_results import add_calibration

    scores = None
    if getattr(getattr(lm, "args", None), "self_eval", False):
        from ortevals.integrations.self_eval import generation_scores

        scores = {**lm.self_eval_scores, **generation_scores(lm, results)}
        if not scores:
            log.warning("--self-eval: no multiple-choice question and no single generated answer to ask about; "
                        "no P(True) is reported")
    return add_calibration(results, output, scores)


def _open_verifier(lm, k: int | None):
    """Issue 25: the run's verifier (integrations/verify.py), opened before the run so a bad one stops it at once."""
    args = getattr(lm, "args", None)
    spec = getattr(args, "verifier", None)
    if spec is None:
        return None
    if (not k or k < 2) and getattr(args, "search", "none") != "none":
        return None  # the verifier guides --search only (its PRM: integrations/lm.py)
    if not k or k < 2:
        raise OrtEvalsError("--verifier scores each question's K answers: give --samples K (K >= 2)")
    from ortevals.integrations.verify import check_room, open_verifier

    verifier = open_verifier(spec, lm)
    if hasattr(lm, "before_generation"):  # its inputs checked against its context before any answer is made
        lm.before_generation.append(lambda prompts: check_room(verifier, prompts))
    return verifier


def _verify(results: dict, tasks, lm, verifier, generation_seconds: float):
    """Each question's K answers scored after the run: ((task, doc_id) -> K scores, -> K step-score lists),
    the verifier's kind (self, genai, classifier), parameters, samples judged, tokens, seconds and its cost against
    generation's in ``results["verifier"]`` (report/compute.py's ``run_cost`` reads it)."""
    if verifier is None:
        return None
    from ortevals.integrations.verify import questions_of, verify_run

    names = [t.get("task") for t in tasks if isinstance(t, dict) and t.get("repeats")]
    out = verify_run(verifier, questions_of(results, names), lm.args.prm, lm.args.step_separator)
    results["verifier"] = {"name": out.name, "kind": out.kind, "score": out.meaning, "params": out.params,
                           "questions": len(out.scores),
                           "samples": sum(len(v) for v in out.scores.values()), "tokens_run": out.tokens,
                           "seconds": out.seconds, "prm": bool(lm.args.prm), "generation_seconds": generation_seconds,
                           "cost_ratio": out.seconds / generation_seconds if generation_seconds > 0 else None}
    return out.scores, out.steps


def _run_task_manager(spec: RunSpec):
    if spec.include_path is None and all(isinstance(t, dict) for t in spec.tasks):
        return task_manager(None, defaults=False)  # resolved configs: nothing to look up
    return task_manager(spec.include_path)
