"""The default text of ``ortevals fidelity``: real questions with worked answers.

Owns building a deterministic text from MMLU-Pro in the hub's layout (the copy
bundled with ortevals by default): first the validation split's 70 questions
with their chain-of-thought answers (``cot_content``), then the test split's
questions in file order, each with its options and the correct answer::

    Question: <question>
    Options:
    A. <option>
    …
    Answer: Let's think step by step. … The answer is (A).

Documents are separated by a blank line. The same data and ``max_chars`` give
the same text, so a saved reference can be checked against it token by token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ortevals.errors import DataError

LETTERS = "ABCDEFGHIJKLMNOP"


def data_folder(data: str | None) -> Path:
    """``None``/``bundled`` → the copy inside ortevals; else a folder in the hub's layout."""
    from ortevals.presets import BUNDLED

    if data in (None, "bundled"):
        return BUNDLED / "mmlu_pro"
    path = Path(data).expanduser()
    if not path.is_dir():
        raise DataError(f"{path}: --data must be 'bundled' or a folder holding MMLU-Pro in the hub's layout")
    return path


def format_question(row: dict, worked: bool) -> str:
    """One document. ``worked``: answer with the row's ``cot_content``, else with the correct option."""
    options = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(row["options"]))
    if worked:
        answer = row["cot_content"].strip()
        answer = answer[2:].lstrip() if answer.startswith("A:") else answer
    else:
        i = int(row["answer_index"])
        answer = f"The answer is ({LETTERS[i]}) {row['options'][i]}."
    return f"Question: {row['question'].strip()}\nOptions:\n{options}\nAnswer: {answer}"


def documents(folder: Path) -> Iterator[str]:
    """Validation questions with worked answers, then test questions, in file order."""
    import pyarrow.parquet as pq

    from ortevals.presets import split_file

    for split in ("validation", "test"):
        path = split_file(folder, split)
        try:
            rows = pq.read_table(path, columns=["question", "options", "answer_index", "cot_content"]).to_pylist()
        except Exception as e:  # pyarrow's own error types
            raise DataError(f"{path}: cannot read question/options/answer_index/cot_content ({e})") from None
        for row in rows:
            worked = split == "validation" and bool((row.get("cot_content") or "").strip())
            yield format_question(row, worked)


def default_text(data: str | None = None, max_chars: int | None = None) -> str:
    """The text: whole documents until at least ``max_chars`` characters (None: every document)."""
    parts, size = [], 0
    for doc in documents(data_folder(data)):
        parts.append(doc)
        size += len(doc) + 2
        if max_chars is not None and size >= max_chars:
            break
    return "\n\n".join(parts) + "\n"
