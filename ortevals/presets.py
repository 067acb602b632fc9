"""Named benchmark presets and their data sources.

Owns what ``ortevals mmlu-pro`` means (lm-eval's ``leaderboard_mmlu_pro``:
5-shot, log-likelihood over ten lettered choices), where its data comes from
(the hub by default, a local copy with ``--data PATH``, or the copy bundled
with ortevals with ``--data bundled``), and validation of a local copy so that
a malformed file is reported by name and column, not by a traceback inside
``datasets``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortevals.errors import DataError, first_line
from ortevals.tasks import leaf_configs
from ortevals.tasks import task_manager as task_index

log = logging.getLogger(__name__)

BUNDLED = Path(__file__).parent / "data"
OFFLINE_HINTS = ("offline", "connection", "couldn't reach", "could not reach", "resolve", "localentrynotfound",
                 "max retries", "name or service not known", "network")
MMLU_PRO_COLUMNS = {"question": "string", "options": "list", "answer": "string", "answer_index": "int",
                    "category": "string"}


@dataclass(frozen=True)
class Preset:
    """A named benchmark: lm-eval task names plus the data set they read."""

    name: str
    tasks: tuple[str, ...]
    hub_dataset: str
    bundled_dir: str
    columns: dict[str, str]
    splits: tuple[str, ...]
    lm_eval_dir: str  # the folder under lm_eval/tasks holding these tasks' YAMLs
    id_column: str = "question_id"  # a question's identity in the data set (``--limit``: first_questions)

    def task_manager(self):
        """A TaskManager indexing only this preset's lm-eval folder (the full index takes ~6 s)."""
        import lm_eval.tasks

        return task_index(str(Path(lm_eval.tasks.__file__).parent / self.lm_eval_dir), defaults=False)


PRESETS: dict[str, Preset] = {
    "mmlu-pro": Preset(
        name="mmlu-pro",
        tasks=("leaderboard_mmlu_pro",),
        hub_dataset="TIGER-Lab/MMLU-Pro",
        bundled_dir="mmlu_pro",
        columns=MMLU_PRO_COLUMNS,
        splits=("test", "validation"),
        lm_eval_dir="leaderboard/mmlu_pro",
    ),
    # chain-of-thought generation: 14 subjects, 5-shot from the same subject, until "Question:"
    "mmlu-pro-cot": Preset(
        name="mmlu-pro-cot",
        tasks=("mmlu_pro",),
        hub_dataset="TIGER-Lab/MMLU-Pro",
        bundled_dir="mmlu_pro",
        columns={**MMLU_PRO_COLUMNS, "cot_content": "string"},
        splits=("test", "validation"),
        lm_eval_dir="mmlu_pro",
    ),
}


def resolve_data(preset: Preset, data: str | None) -> Path | None:
    """``None`` -> hub; ``bundled`` -> the copy inside ortevals; else a validated folder."""
    if data is None:
        return None
    path = BUNDLED / preset.bundled_dir if data == "bundled" else Path(data).expanduser()
    validate_local(preset, path)
    return path.resolve()


def resolve_local(data: str | None) -> Path | None:
    """A local data folder for any task (no schema known), or None for the hub."""
    if data is None:
        return None
    path = BUNDLED / "mmlu_pro" if data == "bundled" else Path(data).expanduser()
    if not path.exists():
        raise DataError(f"{path}: data folder not found")
    if not path.is_dir():
        raise DataError(_a_file(path, "the data set"))
    return path.resolve()


def _a_file(path: Path, what: str) -> str:
    """``--data`` given one file of a data set: name the folder to give instead (the hub layout's root)."""
    root = path.parent.parent if path.parent.name == "data" else path.parent
    return f"--data {path}: is a file; expected the folder of {what} (give --data {root})"


def task_specs(names: Preset | tuple[str, ...] | list[str], data: Path | None,
               task_manager=None) -> list[str | dict[str, Any]]:
    """lm-eval task specs: names for the hub, or each task's own YAML with ``dataset_path`` re-pointed.

    A group (``mmlu_pro``) passes the override on to every member task.
    """
    preset = names if isinstance(names, Preset) else None
    names = preset.tasks if preset else names
    if data is None:
        return list(names)
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader lm-eval itself uses (0.4.13 layout)

    tm = task_manager or (preset.task_manager() if preset else task_index())
    bundled = Path(data).resolve() == (BUNDLED / "mmlu_pro").resolve()
    specs: list[str | dict[str, Any]] = []
    for name in names:
        for cfg in leaf_configs(tm, name, load_yaml):
            if bundled and cfg.get("dataset_path") not in {p.hub_dataset for p in PRESETS.values()}:
                raise DataError(f"--data bundled holds MMLU-Pro only, and task {cfg.get('task', name)} reads "
                                f"{cfg.get('dataset_path')}: pass --data PATH to a local copy of "
                                f"{cfg.get('dataset_path')} (the hub's layout), or run online without --data")
            specs.append({**cfg, "dataset_path": str(data)})
    return specs


def check_hub_data(tasks, task_manager) -> None:
    """Each task's data set is on the Hugging Face hub that ``datasets`` will reach, in its cache, or local; else one
    line naming the task, the data set and how to provide it, before lm-eval asks the hub (offline: a ConnectionError
    after lm-eval has built the tasks; unreachable: a minute of retries). The hub is asked only for a data set the
    cache does not hold (:func:`hub_unreachable`)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    configs = [c for t in tasks for c in ([t] if isinstance(t, dict) else leaf_configs(task_manager, t, load_yaml))]
    missing = [(str(c.get("task")), c["dataset_path"], c.get("dataset_name")) for c in configs
               if _from_hub(c) and not in_datasets_cache(c["dataset_path"], c.get("dataset_name"))]
    why = missing and hub_unreachable()
    if not why:
        return
    import datasets.config

    task, path, name = missing[0]
    same = [t for t, p, _ in missing if p == path]
    others = sorted({p for _, p, _ in missing} - {path})
    who = f"task {task}" if len(same) == 1 else f"tasks {', '.join(same[:3])}{' and more' if len(same) > 3 else ''}"
    more = f" (and {len(others)} more data sets: {', '.join(others[:3])})" if others else ""
    bundled = ", or --data bundled for the MMLU-Pro copy shipped with ortevals" \
        if all(p in {q.hub_dataset for q in PRESETS.values()} for _, p, _ in missing) else ""
    raise DataError(f"{who} reads {path}{f' (configuration {name})' if name else ''}{more} from the Hugging Face "
                    f"hub, which is {why}, and the datasets cache ({datasets.config.HF_DATASETS_CACHE}) does not hold "
                    f"it; run once online to cache it, or pass --data PATH to a local copy in the hub's "
                    f"layout{bundled}")


def _from_hub(cfg: dict) -> bool:
    """The task's ``dataset_path`` names a hub data set (``owner/name`` or ``name``): not a folder here, not one of
    ``datasets``' file builders (json, csv, parquet, …), no URL; a task with its own loader is left to lm-eval."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    path = cfg.get("dataset_path")
    if not isinstance(path, str) or not path or "class" in cfg or cfg.get("custom_dataset"):
        return False
    return (path not in _PACKAGED_DATASETS_MODULES and "://" not in path and path.count("/") <= 1
            and not path.startswith((".", "/", "~")) and not Path(path).exists())


def in_datasets_cache(path: str, name: str | None) -> bool:
    """``datasets`` holds the configuration ``name`` of hub data set ``path`` prepared in its cache, where it loads
    it from offline (its ``CachedDatasetModuleFactory``: ``{cache}/{owner}___{name}/{config}/{version}/{hash}``)."""
    import glob

    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    parts = path.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser() / "___".join(parts)
    return any(p.is_dir() for p in root.glob(f"{glob.escape(name) if name else '*'}/*/*"))


def hub_unreachable() -> str:
    """Why ``datasets`` cannot reach the hub (offline mode, or no answer from its endpoint within 5 s), or ""."""
    import os
    import urllib.error
    import urllib.request

    import datasets.config

    if datasets.config.HF_HUB_OFFLINE:
        flags = [f"{k}={os.environ[k]}" for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                 if os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")]
        return f"offline ({', '.join(flags) or 'datasets offline mode'})"
    endpoint = datasets.config.HF_ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5).close()  # noqa: S310
    except urllib.error.HTTPError:
        return ""  # an answer: reachable
    except (OSError, ValueError) as e:  # URLError (no DNS, refused), a timeout
        reason = getattr(e, "reason", None) or e
        return f"unreachable ({endpoint}: {first_line(reason) if isinstance(reason, BaseException) else reason})"
    return ""


def apply_limit(tasks, specs: list, limit: int | None) -> tuple[list, dict[str, list[int]] | None, tuple[str, ...]]:
    """What ``--limit N`` means, said under the table: a preset takes the first N questions of its data
    (:func:`first_questions`); named tasks take lm-eval's first N of each. Returns (specs, samples, notes)."""
    if not limit:
        return specs, None, ()
    if isinstance(tasks, Preset):
        specs, samples = first_questions(tasks, specs, limit)
        where = f", in {len(specs)} of the subject tasks" if samples else ""
        return specs, samples or None, (f"--limit {limit}: the first {limit} questions of the test split{where}; "
                                        f"not a random sample (--sample {limit} draws one that stands for the whole "
                                        "set)",)
    if len(specs) > 1:
        return specs, None, (f"--limit {limit}: the first {limit} questions of each task (lm-eval's --limit); "
                             f"not a random sample (--sample {limit} draws one)",)
    return specs, None, (f"--limit {limit}: the first {limit} questions (lm-eval's --limit); not a random sample "
                         f"(--sample {limit} draws one)",)


def first_questions(preset: Preset, specs: list, n: int) -> tuple[list, dict[str, list[int]]]:
    """``--limit N`` on a preset of several tasks (``mmlu-pro --cot``: one task per subject): the first N
    questions of the test split, each scored by the subject task it belongs to.

    lm-eval's own limit takes the first N documents of every task (42 questions for ``--limit 3`` over 14
    subjects). Returns the tasks that hold any of the N questions and, per task, the indices of its
    documents to score (for lm-eval's ``samples``): the data set is loaded as lm-eval loads it and each
    task's own ``process_docs`` picks its documents, so the indices are those lm-eval sees.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    configs = [c for t in specs for c in ([t] if isinstance(t, dict) else leaf_configs(
        preset.task_manager(), t, load_yaml))]
    if len(configs) < 2:
        return specs, {}
    test = _load_split(configs[0])
    first = set(test.select(range(min(n, len(test))))[preset.id_column])
    kept, samples = [], {}
    for cfg in configs:
        docs = cfg["process_docs"](test) if callable(cfg.get("process_docs")) else test
        indices = [i for i, q in enumerate(docs[preset.id_column]) if q in first]
        if indices:
            kept.append(cfg)
            samples[cfg["task"]] = indices
    return kept, samples


def _load_split(cfg: dict):
    """The task's test split, loaded by the call lm-eval makes (datasets caches it for lm-eval's own load)."""
    import datasets

    try:
        data = datasets.load_dataset(cfg["dataset_path"], cfg.get("dataset_name"), **(cfg.get("dataset_kwargs") or {}))
    except Exception as e:  # datasets/hub raise many types; offline is the common one
        raise DataError(f"could not load {cfg['dataset_path']} to find the first questions for --limit "
                        f"({type(e).__name__}); pass --data PATH to a local copy, or --data bundled") from None
    return data[cfg.get("test_split") or "test"]


def split_file(folder: Path, split: str) -> Path:
    """The parquet file of ``split`` in the hub layout (``data/test-00000-of-00001.parquet``)."""
    for pattern in (f"data/{split}-*.parquet", f"{split}-*.parquet", f"data/{split}.parquet", f"{split}.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    raise DataError(f"{folder}: no {split} split; expected data/{split}-00000-of-00001.parquet (the hub's layout)")


def validate_local(preset: Preset, folder: Path) -> None:
    """Check every split's columns and types, and that options are non-empty."""
    if folder.is_file():
        raise DataError(_a_file(folder, f"a local copy of {preset.hub_dataset}, holding data/test-….parquet"))
    if not folder.is_dir():
        raise DataError(f"{folder}: data folder not found; expected a local copy of {preset.hub_dataset}")
    for split in preset.splits:
        _validate_table(split_file(folder, split), preset.columns)


def _validate_table(path: Path, columns: dict[str, str]) -> None:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    if table.num_rows == 0:
        raise DataError(f"{path}: has no rows")
    names = set(table.column_names)
    for col, kind in columns.items():
        if col not in names:
            raise DataError(f"{path}: column {col!r} is missing; expected columns {sorted(columns)}")
        if not _has_kind(table.schema.field(col).type, kind):
            raise DataError(f"{path}: column {col!r} has type {table.schema.field(col).type}; expected {kind}")
    if "options" in columns:
        _check_rows(path, {c: table.column(c).to_pylist() for c in (*columns, "question_id") if c in names})


LETTERS = "ABCDEFGHIJKLMNOP"


def _check_rows(path: Path, cols: dict[str, list]) -> None:
    """Each row of a multiple-choice split as lm-eval reads it: text where text is used (a null question
    would become the prompt "None"), options, and an answer letter and index that point at the same option."""
    for row, opts in enumerate(cols["options"]):
        qid = cols["question_id"][row] if "question_id" in cols else None
        where = f"{path}: row {row}" + (f" (question_id {qid})" if qid is not None else "")
        if not opts or any(not isinstance(o, str) for o in opts):
            raise DataError(f"{where} has empty or non-text options; expected a list of strings")
        for field in ("question", "category"):
            value = cols[field][row] if field in cols else ""
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field {field} is {value!r}; expected non-empty text")
        letters = LETTERS[:len(opts)]
        answer = cols["answer"][row] if "answer" in cols else None
        index = cols["answer_index"][row] if "answer_index" in cols else None
        if answer not in tuple(letters):
            raise DataError(f"{where}: field answer={answer!r}; expected one letter of {letters[0]}-{letters[-1]} "
                            f"for {len(opts)} options")
        if "answer_index" in cols and (not isinstance(index, int) or not 0 <= index < len(opts)):
            raise DataError(f"{where}: field answer_index={index!r} is out of range for {len(opts)} options; "
                            f"expected 0-{len(opts) - 1}")
        if "answer_index" in cols and letters[index] != answer:
            raise DataError(f"{where}: field answer={answer!r} but answer_index={index} is option "
                            f"{letters[index]}; they must name the same option")


def _has_kind(arrow_type, kind: str) -> bool:
    import pyarrow as pa

    if kind == "string":
        return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
    if kind == "list":
        return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
    if kind == "int":
        return pa.types.is_integer(arrow_type)
    return True


def _quoted(line: str) -> str:
    """The first quoted name in ``line`` (datasets' ``BuilderConfig 'ARC-Easy' not found``), else "?"."""
    import re

    found = re.search(r"'([^']+)'", line)
    return repr(found.group(1)) if found else "?"


def reword_data_error(e: Exception, tasks, num_fewshot: int | None) -> None:
    """An lm-eval/datasets failure while loading ``tasks``' data as one :class:`DataError` line where it is a
    data problem (a local folder that is a copy of another data set, offline, empty after filters, too few
    few-shot examples, unknown task, no documents); returns otherwise."""
    text = f"{type(e).__name__}: {e}".lower()
    names = [t if isinstance(t, str) else t.get("task", "?") for t in tasks]
    local = sorted({str(t["dataset_path"]) for t in tasks if isinstance(t, dict) and t.get("dataset_path")
                    and Path(str(t["dataset_path"])).is_dir()})
    if "builderconfig" in text and "not found" in text and local:  # datasets: the folder lacks the task's config
        raise DataError(f"--data {local[0]}: {', '.join(names)[:200]} read the configuration "
                        f"{_quoted(first_line(e))} of a data set this folder is not a copy of; expected a local "
                        f"copy of the data set these tasks read (datasets: {first_line(e)})") from None
    if any(h in text for h in OFFLINE_HINTS):
        if local:  # the local copy is there: the hub was asked for something else (a script, a config)
            raise DataError(f"loading {', '.join(names)[:200]} from --data {local[0]} still asked the Hugging Face "
                            f"hub (offline?): {first_line(e)}") from None
        bundled = ", or --data bundled for the MMLU-Pro copy shipped with ortevals" \
            if all("mmlu_pro" in n for n in names) else ""
        raise DataError(f"could not reach the Hugging Face hub for the data of {', '.join(names)[:200]} (offline?); "
                        f"run online, or pass --data PATH to a local copy in the hub's layout{bundled}") from None
    if "out of bounds for size 0" in text or "must have valid or test docs" in text:
        raise DataError(f"the data set is empty after filters for {', '.join(map(str, names))[:200]} "
                        "(check --data, --limit and the task names)") from None
    if "number of fewshot samples requested exceeds" in text:  # lm-eval's assert while building prompts
        available = next((w for w in first_line(e).split() if w.isdigit()), "fewer")
        raise DataError(f"--num-fewshot {num_fewshot}: {', '.join(map(str, names))[:200]} has only "
                        f"{available} few-shot examples; expected --num-fewshot {available} or less") from None
    if "not a registered task" in text or "spec '" in text:
        raise DataError(f"unknown task in {', '.join(names)}: {first_line(e)}") from None
    if "must have valid or test docs" in text or "dataset" in text and "not found" in text:
        raise DataError(f"no documents for {', '.join(names)}: {first_line(e)}") from None
