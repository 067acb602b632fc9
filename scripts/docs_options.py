#!/usr/bin/env python
"""The model-argument table of docs/options.md, written from the options table (ortevals/options.py).

    python scripts/docs_options.py            # rewrite the table between the markers in docs/options.md
    python scripts/docs_options.py --check    # exit 1 when the page's table differs from OPTIONS

tests/test_docs_options.py runs the check, so a new option fails the suite until this script has run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PAGE = REPO / "docs" / "options.md"
BEGIN, END = "<!-- options table: written by scripts/docs_options.py -->", "<!-- end of the options table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value) -> str:
    if value is None or value == ():
        return "—"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value!r}`" if isinstance(value, str) and not value.strip() else f"`{value}`"


def table() -> str:
    """One row per option, in the table's order."""
    from ortevals.options import OPTIONS

    rows = ["| model argument | `ortevals` flag | default | can change a number | what it does |",
            "|---|---|---|---|---|"]
    for o in OPTIONS:
        flag = f"`{o.flag}`" if o.flag else "`--pkg`" if o.name == "pkg" else "`--model-args`"
        scoped = "yes" if o.scoped else "no"
        rows.append(f"| `{o.name}` | {flag} | {_default(o.default)} | {scoped} | {_cell(o.help)} |")
    return "\n".join(rows)


def render(page: str) -> str:
    """``page`` with the text between the markers replaced by :func:`table`."""
    head, found, rest = page.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is stale")
    args = ap.parse_args()
    text = PAGE.read_text()
    new = render(text)
    if args.check:
        return int(new != text)
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
