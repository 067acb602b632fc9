"""Issue 38, "trust, round 3": bad stores, paths, settings and gates a new user trips over.

Each bad input is one line naming the file, field or flag, exit 2, before any model work (where a package path
that does not exist is given, loading it would have failed first: the error proves nothing was loaded).
"""

import sqlite3

import pytest
from click.testing import CliRunner

from ortevals.cli import cli
from tests.test_cli import assert_one_line_error


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False)


MISSING_PKG = "/nonexistent/package"


# --- item 12: result store errors ------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda p: (p.write_text("not a database, and long enough to be read as one " * 4), p)[1],
    lambda p: (p.mkdir(), p)[1],
], ids=["corrupt-file", "folder"])
def test_an_unusable_store_is_one_line_naming_it(tiny_pkg, tmp_path, make):
    store = make(tmp_path / "answers.sqlite")
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1",
                              "--model-args", f"store={store}"), str(store), "ortevals cache clear")


def test_a_corrupt_default_store_is_one_line_naming_it(tiny_pkg, tmp_path):
    from ortevals.files import store_path

    env = {"ORTEVALS_CACHE": str(tmp_path / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTEVALS_CACHE", env["ORTEVALS_CACHE"])
        default = store_path(tiny_pkg)
    default.parent.mkdir(parents=True)
    default.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # a header, then garbage pages
    assert_one_line_error(run("mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "1", env=env),
                          str(default), "ortevals cache clear")


def test_a_store_that_breaks_while_reading_is_a_store_error(tmp_path):
    """Malformed pages found at a read, not at open: the same one line (was sqlite3.DatabaseError)."""
    from ortevals.errors import StoreError
    from ortevals.report.scope import Scope
    from ortevals.report.store import ResultStore

    SCOPE = Scope("results", "/p", (("model.onnx", "abc"),), "{}", ())  # noqa: N806
    path = tmp_path / "s.sqlite"
    store = ResultStore.open(path, SCOPE)
    for i in range(2000):
        store.put("kind", [i, "x" * 200], i)
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    data[8192:len(data) - 4096] = b"\x07" * (len(data) - 4096 - 8192)  # the answers' pages, header kept
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{path}: result store unusable .*ortevals cache clear"):
        reopened = ResultStore.open(path, SCOPE)
        for i in range(2000):
            reopened.get("kind", [i, "x" * 200])


# --- item 14: CI gates that cannot fire or always fire ------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--max-kl", "nan"), ("--margin", "inf"), ("--max-flip-rate", "-1"),
                                         ("--max-flip-rate", "1.5"), ("--max-kl", "-0.1"), ("--margin", "-0.02")])
def test_gate_thresholds_out_of_range_are_one_line(tmp_path, flag, value):
    """Refused before the runs are read (the paths do not exist: reading them would fail first)."""
    assert_one_line_error(run("compare", "--ref", str(tmp_path / "ref"), str(tmp_path / "run"), flag, value),
                          f"{flag} {value}", "expected")
