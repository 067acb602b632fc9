"""docs/options.md says what the code does: its model-argument table is the options table (ortevals/options.py)
row for row, and every other flag of ``ortevals mmlu-pro`` and ``ortevals run`` is on the page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def writer():
    spec = importlib.util.spec_from_file_location("docs_options", ROOT / "scripts" / "docs_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_holds_the_options_table():
    docs = writer()
    page = docs.PAGE.read_text()
    assert docs.render(page) == page, "docs/options.md is stale: run python scripts/docs_options.py"
    from ortevals.options import OPTIONS

    block = page.partition(docs.BEGIN)[2].partition(docs.END)[0]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [o.name for o in OPTIONS]


def test_the_table_follows_a_new_option(monkeypatch):
    """The check fails when OPTIONS gains a row the page lacks (the writer's output is what it compares)."""
    import ortevals.options as options

    docs = writer()
    page = docs.PAGE.read_text()
    extra = options.Option("new_knob", options.boolean("new_knob"), False, "A new setting.")
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, extra))
    assert docs.render(page) != page
    assert "| `new_knob` | `--model-args` | `false` | yes | A new setting. |" in docs.render(page)


def test_every_other_flag_is_on_the_page():
    from ortevals.cli import cli
    from ortevals.options import OPTIONS

    page = (ROOT / "docs" / "options.md").read_text()
    own = {o.flag for o in OPTIONS if o.flag} | {"--pkg"}
    missing = []
    for name in ("mmlu-pro", "run"):
        for param in cli.commands[name].params:
            flags = [f for f in [*param.opts, *param.secondary_opts] if f.startswith("--")]
            if flags and not set(flags) & own and not any(f"`{f}" in page for f in flags):
                missing.append(f"{name} {flags[0]}")
    assert not missing, "flags not described in docs/options.md: " + ", ".join(missing)
