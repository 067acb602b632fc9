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

from ortevals.errors import DataError

log = logging.getLogger(__name__)

BUNDLED = Path(__file__).parent / "data"
MMLU_PRO_COLUMNS = {"question": "string", "options": "list", "answer": "string", "category": "string"}


@dataclass(frozen=True)
class Preset:
    """A named benchmark: lm-eval task names plus the data set they read."""

    name: str
    tasks: tuple[str, ...]
    hub_dataset: str
    bundled_dir: str
    columns: dict[str, str]
    splits: tuple[str, ...]
    task_yamls: tuple[str, ...]  # relative to lm_eval/tasks, to re-point dataset_path


PRESETS: dict[str, Preset] = {
    "mmlu-pro": Preset(
        name="mmlu-pro",
        tasks=("leaderboard_mmlu_pro",),
        hub_dataset="TIGER-Lab/MMLU-Pro",
        bundled_dir="mmlu_pro",
        columns=MMLU_PRO_COLUMNS,
        splits=("test", "validation"),
        task_yamls=("leaderboard/mmlu_pro/mmlu_pro.yaml",),
    ),
}


def resolve_data(preset: Preset, data: str | None) -> Path | None:
    """``None`` -> hub; ``bundled`` -> the copy inside ortevals; else a validated folder."""
    if data is None:
        return None
    path = BUNDLED / preset.bundled_dir if data == "bundled" else Path(data).expanduser()
    validate_local(preset, path)
    return path.resolve()


def task_specs(preset: Preset, data: Path | None) -> list[str | dict[str, Any]]:
    """lm-eval task specs: names for the hub, configs with ``dataset_path`` for a local copy."""
    if data is None:
        return list(preset.tasks)
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own loader (0.4.13 layout)

    root = Path(lm_eval.tasks.__file__).parent
    # the task's own YAML, loaded as lm-eval loads it, with only dataset_path changed
    return [{**load_yaml(str(root / y), resolve_func=True), "dataset_path": str(data)} for y in preset.task_yamls]


def split_file(folder: Path, split: str) -> Path:
    """The parquet file of ``split`` in the hub layout (``data/test-00000-of-00001.parquet``)."""
    for pattern in (f"data/{split}-*.parquet", f"{split}-*.parquet", f"data/{split}.parquet", f"{split}.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    raise DataError(f"{folder}: no {split} split; expected data/{split}-00000-of-00001.parquet (the hub's layout)")


def validate_local(preset: Preset, folder: Path) -> None:
    """Check every split's columns and types, and that options are non-empty."""
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
        lengths = table.column("options").to_pylist()
        for row, opts in enumerate(lengths):
            if not opts or any(not isinstance(o, str) for o in opts):
                raise DataError(f"{path}: row {row} has empty or non-text options; expected a list of strings")


def _has_kind(arrow_type, kind: str) -> bool:
    import pyarrow as pa

    if kind == "string":
        return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
    if kind == "list":
        return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
    return True
