"""docs/support.md is scripts/support_table.py's rendering of the parity matrix's results (docs/support.json),
covers every architecture of the matrix, and lists every refusal with its reason."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from tests.fixtures.matrix.archs import ARCHS

REPO = Path(__file__).resolve().parent.parent
SCRIPT = runpy.run_path(str(REPO / "scripts" / "support_table.py"))
DATA = json.loads((REPO / "docs" / "support.json").read_text())


def test_the_page_is_the_scripts_rendering_of_the_results():
    assert (REPO / "docs" / "support.md").read_text() == SCRIPT["render"](DATA)


def test_every_architecture_of_the_matrix_is_in_the_table():
    assert {a.name for a in ARCHS} <= set(DATA["archs"])
    assert len(DATA["archs"]) >= 20


def test_every_refusal_is_listed_with_its_reason_and_nothing_differs():
    """Errors (an exception where a one-line refusal belongs) are listed too; they are open work (archs.py's
    ``pending``)."""
    page = (REPO / "docs" / "support.md").read_text()
    refusals = page.split("## Refusals and errors", 1)[1].split("\n## ", 1)[0]
    for name, entry in DATA["archs"].items():
        for precision, cells in entry["cells"].items():
            for path, cell in cells.items():
                assert cell["status"] in ("equal", "tolerance", "refused", "error"), (name, precision, path, cell)
                if cell["status"] in ("refused", "error"):
                    assert cell["reason"] and "\n" not in cell["reason"]
                    assert cell["reason"] in refusals, (name, precision, path)


def test_the_script_refuses_missing_results_in_one_line(tmp_path, capsys):
    assert SCRIPT["main"](["--results", str(tmp_path / "none.json"), "--docs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--results" in err and not (tmp_path / "support.md").exists()
