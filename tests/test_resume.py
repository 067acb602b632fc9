"""Nothing lost on a crash: a SIGKILLed run resumes, recomputes nothing finished, ends identical."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.report.store import ResultStore, Scope

LIMIT = "150"


def cli(args, cache: Path, logs: Path | None = None) -> subprocess.Popen:
    """The CLI in a subprocess; its output goes to files in ``logs`` (default: the cache folder; a pipe
    nobody reads could fill and stall it)."""
    logs = logs or cache
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ORTEVALS_CACHE": str(cache)}
    out, err = (logs / "stdout.txt").open("w"), (logs / "stderr.txt").open("w")
    return subprocess.Popen([sys.executable, "-m", "ortevals.cli", *args], env=env, stdout=out, stderr=err)


def stderr(cache: Path) -> str:
    return (cache / "stderr.txt").read_text()


def rows(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("SELECT count(*) FROM answers").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def samples(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "samples_leaderboard_mmlu_pro.jsonl").read_text().splitlines()]


def test_kill_and_resume(tiny_pkg, tmp_path):
    # MMLU-Pro prompts (~1800 tiny-tokenizer tokens) exceed the tiny model's 1024 context: truncate as hf does
    args = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", LIMIT, "--batch-size", "1",
            "--truncate", "left"]
    ref = cli(args + ["--no-resume", "--output", str(tmp_path / "ref")], tmp_path / "cache-ref")
    assert ref.wait(timeout=600) == 0, stderr(tmp_path / "cache-ref")

    cache = tmp_path / "cache"
    first = cli(args + ["--output", str(tmp_path / "run")], cache)
    db = None
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None:
        found = list((cache / "runs").glob("*.sqlite")) if (cache / "runs").exists() else []
        if found and rows(found[0]) >= 200:
            db = found[0]
            break
        time.sleep(0.05)
    assert db is not None, "the run finished or stalled before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    finished = rows(db)
    assert not (tmp_path / "run" / "results.json").exists()  # nothing half-written

    second = cli(args + ["--output", str(tmp_path / "run")], cache)
    assert second.wait(timeout=600) == 0, stderr(cache)
    err = stderr(cache)
    reused = int(err.split("resuming: ")[1].split(" of ")[0])
    assert reused >= 0.9 * finished and finished > 0
    body = json.loads((tmp_path / "run" / "results.json").read_text())
    assert body["ortevals"]["requests"] == sum(len(s["resps"]) for s in samples(tmp_path / "run")) - reused
    assert body["ortevals"]["reused"] == reused
    for a, b in zip(samples(tmp_path / "ref"), samples(tmp_path / "run")):
        assert a["resps"] == b["resps"] and a["acc"] == b["acc"]
    print(f"kill-and-resume: {finished} finished at the kill, {reused} reused ({100 * reused / finished:.0f}%)")


def test_store_is_keyed_by_package_and_settings(tiny_pkg, copy_pkg, tmp_path, monkeypatch):
    """One change of each kind of input: a package file, a setting, a version. tests/test_scope.py has them all."""
    from ortevals.package import scope

    pkg = copy_pkg(tiny_pkg)
    monkeypatch.setenv("ORTEVALS_CACHE", str(tmp_path / "cache"))
    reqs = [Instance("loglikelihood", {}, ("The city", " of"), 0)]
    store = str(tmp_path / "s.sqlite")

    def run(**kw) -> tuple[float, ResultStore]:
        lm = OrtLM.from_package(ModelArgs(pkg=str(pkg), store=store, **kw))
        [(lp, _)] = lm.loglikelihood(reqs, disable_tqdm=True)
        lm.store.close()
        return lp, lm.store

    first, _ = run()
    again, s = run()
    assert again == first and s.hits == 1  # the same command: reused
    tok = json.loads((pkg / "tokenizer.json").read_text())
    (pkg / "tokenizer.json").write_text(json.dumps({**tok, "post_processor": None}))  # BOS no longer added
    edited, s = run()
    fresh = OrtLM.from_package(ModelArgs(pkg=str(pkg))).loglikelihood(reqs, disable_tqdm=True)[0][0]
    assert s.hits == 0 and edited == fresh and abs(edited - first) > 1e-3
    assert run(gen_batch_size=4)[1].hits == 0  # a setting outside the old key
    monkeypatch.setattr(scope, "runtime_versions", lambda: {"onnxruntime": "onnxruntime==99",
                                                             "onnxruntime-genai": None})
    assert run()[1].hits == 0  # another onnxruntime


def test_store_survives_reopen_and_holds_only_json(tmp_path):
    abc, xyz = (Scope("results", "/p", (("model.onnx", h),), "{}", ()) for h in ("abc", "xyz"))
    s = ResultStore.open(tmp_path / "x.sqlite", abc)
    s.put("loglikelihood", ["a", "b"], [-1.5, True])
    s.close()
    s = ResultStore.open(tmp_path / "x.sqlite", abc)
    assert s.get("loglikelihood", ["a", "b"]) == [-1.5, True]
    assert ResultStore.open(tmp_path / "x.sqlite", xyz).get("loglikelihood", ["a", "b"]) is None
    with pytest.raises(TypeError):
        s.put("loglikelihood", ["a"], object())  # not JSON: refused, never pickled


def test_two_connections_see_each_others_commits_and_never_lock(tmp_path):
    """Two runs on one store file: a commit of one is visible to the other's next lookup, and a run
    that read before the other committed can still write (the stale-snapshot 'database is locked')."""
    scope = Scope("results", "/p", (("model.onnx", "abc"),), "{}", ())
    a, b = (ResultStore.open(tmp_path / "x.sqlite", scope) for _ in range(2))
    assert b.get("loglikelihood", ["q"]) is None  # b looked first
    a.put("loglikelihood", ["q"], [-1.0, True])
    a.commit()
    assert b.get("loglikelihood", ["q"]) == [-1.0, True]  # a's committed answer, reused by b
    b.put("loglikelihood", ["r"], [-2.0, False])
    b.commit()
    a.put("loglikelihood", ["s"], [-3.0, False])  # a holds no lock between puts: b's commit went through
    a.close()
    b.close()
    fresh = ResultStore.open(tmp_path / "x.sqlite", scope)
    assert [fresh.get("loglikelihood", [k]) for k in "qrs"] == [[-1.0, True], [-2.0, False], [-3.0, False]]


def test_two_runs_at_once_on_one_store(tiny_pkg, tmp_path):
    """Two CLI processes on the tiny package write the same result store at the same time (batch sizes
    1 and 4, two scopes): both finish, each with the answers of a run made alone; a third run with the
    first one's settings reuses every answer the two committed."""
    args = ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--limit", "40", "--truncate", "left"]
    alone = cli(args + ["--batch-size", "1", "--no-resume", "--output", str(tmp_path / "alone")], tmp_path / "c0")
    assert alone.wait(timeout=600) == 0, stderr(tmp_path / "c0")
    cache = tmp_path / "shared"
    runs = [cli(args + ["--batch-size", b, "--output", str(tmp_path / f"run{b}")], cache, tmp_path / f"log{b}")
            for b in ("1", "4")]
    for b, run in zip(("1", "4"), runs):  # one shared cache (and store), a log folder each
        assert run.wait(timeout=600) == 0, stderr(tmp_path / f"log{b}")
    ref = samples(tmp_path / "alone")
    for b in ("1", "4"):
        got = samples(tmp_path / f"run{b}")
        assert [s["acc"] for s in got] == [s["acc"] for s in ref]
        for x, y in zip(got, ref):
            assert [r[0][0] for r in x["resps"]] == pytest.approx([r[0][0] for r in y["resps"]], abs=1e-4)
    again = cli(args + ["--batch-size", "1", "--output", str(tmp_path / "again")], cache, tmp_path / "log-again")
    assert again.wait(timeout=600) == 0, stderr(tmp_path / "log-again")
    body = json.loads((tmp_path / "again" / "results.json").read_text())
    assert body["ortevals"]["requests"] == 0 and body["ortevals"]["reused"] > 0
