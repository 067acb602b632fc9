"""The parity matrix (issue 37): every text architecture the builder exports, scored as transformers scores it;
and the exporter dimension (issue 48): the architectures users run from Mobius, exported fp32 by Mobius.

For each architecture of tests/fixtures/matrix/archs.py, a tiny random checkpoint exported fp32 and int4 by
the onnxruntime-genai builder, or fp32 by Mobius (tests/fixtures/matrix/cache.py: cached, keyed by the exporter's
code and the config) is scored on real MMLU-Pro 5-shot prompts (tests/fixtures/matrix/prompts.py) on four paths: the
default (shared prefixes, padded batches, canary), ``exact``, ``prefix_cache=false`` and
``path=incremental``; fp32 also decodes greedily on the raw rows and on onnxruntime-genai's Generator.

* fp32 equals transformers (lm-eval's hf backend on the same weights) within ``TOL``; where the package itself
  differs from transformers (a plain one-pass onnxruntime session shows it) the architecture must state the
  builder's deviation, and the paths equal that one-pass session instead;
* int4 equals the one-pass session on the same package;
* a path ortevals cannot serve is refused in one line (OrtEvalsError), one the architecture expects today
  (``refused``); an export the builder cannot make is recorded with the builder's one-line error.

Every outcome goes to ``results.json`` (tests/fixtures/matrix/record.py), from which
``scripts/support_table.py`` writes docs/support.md. The int4 paths and the generation cells are the slow
half (marker ``matrix_slow``; ``-m "not matrix_slow"`` leaves them out). The whole matrix takes about 100 s of
CPU on an empty fixture cache (60 s of it building every architecture in one subprocess) and 40 s warm.
"""

from __future__ import annotations

import os
from functools import cache

import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ortevals.errors import OrtEvalsError
from ortevals.integrations.lm import ModelArgs, OrtLM
from tests.conftest import CACHE
from tests.fixtures.matrix import oracle, record
from tests.fixtures.matrix.archs import ARCHS, GEN_PATHS, PATHS, WINDOW
from tests.fixtures.matrix.cache import built
from tests.fixtures.matrix.prompts import MAX_GEN_TOKS, STOP, SWITCH, gen_prompts, header, requests

TOL = record.TOL
ARGS = {"default": {}, "exact": {"exact": True}, "no_prefix_cache": {"prefix_cache": False},
        "incremental": {"path": "incremental"}, "shared_batch": {"shared_prefix_batch": "on", "check": False},
        "gen_raw": {"gen_path": "raw"}, "gen_og": {"gen_path": "og"}}
slow = pytest.mark.matrix_slow
AVAILABLE = [a for a in ARCHS if not a.unavailable]


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    record.write(CACHE / "matrix" / "results.json")
    if os.environ.get("ORTEVALS_MATRIX_JSON"):
        from pathlib import Path

        record.write(Path(os.environ["ORTEVALS_MATRIX_JSON"]))


@cache
def _built(name: str) -> tuple:
    return built(name, CACHE)


def _package(arch, precision: str):
    """The package folder, or None with every path of the precision recorded as refused (the build's reason)."""
    folder, info = _built(arch.name)
    record.note(arch, checkpoint=info["checkpoint"], build=info["build"])
    assert info["checkpoint"] == "ok", f"{arch.name}: transformers cannot make the checkpoint: {info['checkpoint']}"
    error = info["build"].get(precision)
    if error == "ok":
        return folder / precision
    reason = f"{'the builder' if arch.exporter == 'builder' else 'Mobius'}'s export fails: {error}"
    for path in PATHS + (GEN_PATHS if precision == "fp32" else ()):
        record.cell(arch, precision, path, "refused", reason=reason)
    expected = arch.export_fails.get(precision, arch.export_fails.get("*"))
    assert expected and expected in error, f"{arch.name} {precision}: the builder fails unexpectedly: {error}"
    return None


@cache
def _oracle(name: str, precision: str) -> tuple[float, ...]:
    """The package's one-pass numbers (raises where onnxruntime cannot run the package at all)."""
    folder, info = _built(name)
    return tuple(oracle.loglikelihoods(folder / precision, info["reference"]["requests"]))


def _hf(name: str) -> np.ndarray:
    return np.array([r["loglikelihood"] for r in _built(name)[1]["reference"]["requests"]])


def _gap(arch, precision: str) -> float:
    """max |Δ| between the package's one-pass numbers and transformers'; recorded."""
    gap = float(np.max(np.abs(np.array(_oracle(arch.name, precision)) - _hf(arch.name))))
    record.note(arch, package_gap={precision: gap})
    return gap


def _instances(kind: str, args: list) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _open(arch, precision, path, pkg):
    """The OrtLM of one cell, or None with the refusal recorded (one line, and one the architecture expects)."""
    try:
        return OrtLM.from_package(ModelArgs(pkg=str(pkg), max_length=1024, **ARGS[path]))
    except Exception as e:
        _failed(arch, precision, path, pkg, e)
        return None


def _failed(arch, precision, path, pkg, error: Exception) -> None:
    """Record a cell that did not serve: a one-line refusal the architecture expects, or (pending) an error."""
    reason = str(error).replace(f"{pkg}/", "").replace(str(pkg), "the package")
    if not isinstance(error, OrtEvalsError):
        reason = f"{type(error).__name__}: {reason.splitlines()[0] if reason else ''}"
        record.cell(arch, precision, path, "error", reason=reason)
        if path in arch.pending:
            pytest.xfail(f"{arch.pending[path]}: {reason}")
        raise error
    record.cell(arch, precision, path, "refused", reason=reason)
    assert "\n" not in reason, f"a refusal in more than one line: {reason!r}"
    expected = arch.refused.get(path, arch.refused.get("*"))
    assert expected and expected in reason, f"{arch.name} {precision} {path} refused unexpectedly: {reason}"


def test_the_matrix_covers_twenty_architectures():
    import transformers

    assert len({a.model_class for a in AVAILABLE}) >= 20
    for a in ARCHS:
        if a.unavailable:  # the reason is checked: transformers really has no such class
            assert a.unavailable.startswith("transformers has no") and not hasattr(transformers, a.model_class)
            record.note(a, checkpoint=a.unavailable, build={})
            for path in PATHS + GEN_PATHS:
                record.cell(a, "fp32", path, "refused", reason=a.unavailable)


def test_the_prompts_exercise_windows_and_the_longrope_switch():
    """The shared five-shot header (so every prompt) is longer than the sliding windows; LongRoPE's switch lies
    above the header and between the prompts' input lengths (context + continuation - 1, the pass's width)."""
    from tokenizers import Tokenizer

    folder, info = _built("llama")
    head = len(Tokenizer.from_file(str(folder / "hf" / "tokenizer.json")).encode(header()).ids)
    lengths = [len(r["context_ids"]) + len(r["continuation_ids"]) - 1 for r in info["reference"]["requests"]]
    assert WINDOW < head < SWITCH
    assert min(lengths) <= SWITCH < max(lengths)


@pytest.mark.parametrize("arch", AVAILABLE, ids=lambda a: a.name)
def test_the_package_is_what_transformers_computes_or_the_deviation_is_stated(arch):
    """fp32: the package's one-pass numbers equal transformers', or the architecture names the builder's
    deviation that explains the gap (its size goes to the table); a package onnxruntime cannot run at all is
    one ortevals refuses on every path."""
    if _package(arch, "fp32") is None:
        return
    try:
        gap = _gap(arch, "fp32")
    except Exception as e:  # onnxruntime's own error: the package cannot be run
        record.note(arch, package_error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        assert "*" in arch.refused, f"{arch.name}: onnxruntime cannot run the package ({e}) but ortevals serves it"
        return
    if gap > TOL:
        assert arch.deviation, f"{arch.name}: the package differs from transformers by {gap:.3g} unexplained"


def _compare(arch, precision: str, path: str, ours: list[float], served: dict | None = None) -> None:
    ours = np.array(ours)
    gap = _gap(arch, precision)
    vs_hf = float(np.max(np.abs(ours - _hf(arch.name))))
    vs_pkg = float(np.max(np.abs(ours - np.array(_oracle(arch.name, precision)))))
    if precision == "fp32" and gap <= TOL:
        status, against, err = ("equal" if vs_hf <= TOL else "differs"), "hf", vs_hf
    else:
        status, against, err = ("tolerance" if vs_pkg <= TOL else "differs"), "package", vs_pkg
    if precision != "fp32" and status == "tolerance":
        status = "equal"
    record.cell(arch, precision, path, status, max_abs=err, against=against, vs_hf=vs_hf, **(served or {}))
    assert err <= TOL, f"{arch.name} {precision} {path}: max |Δ| {err:.3g} against {against}"


def _score_cell(arch, precision: str, path: str) -> None:
    pkg = _package(arch, precision)
    if pkg is None:
        return
    lm = _open(arch, precision, path, pkg)
    if lm is None:
        return
    try:
        ours = [lp for lp, _ in lm.loglikelihood(_instances("loglikelihood", list(requests())), disable_tqdm=True)]
    except Exception as e:
        _failed(arch, precision, path, pkg, e)
        return
    _compare(arch, precision, path, ours, _shared_served(arch, precision, lm, ours) if path == "shared_batch" else None)


def _shared_served(arch, precision: str, lm, ours: list[float]) -> dict:
    """shared_prefix_batch=on (check=false: the canary would hide a wrong graph by switching to exact mode): the
    inputs under the five-shot header ran many a pass and within float32 rounding of the package's one-pass
    numbers (1e-5 + 1e-6 |log-likelihood|), or fell back for the reason the architecture states (fp32; int4 on
    CPU: int8 activations)."""
    engine = lm.run.backends.prefill
    why = getattr(lm.run.backends, "shared_refused", "") or getattr(engine, "shared_refused", "") or (
        f"exact mode ({engine.mode})" if engine.settings.exact else "")
    # int4 on CPU: the int8 activations' refusal comes first (but a graph in exact mode opens no second session)
    expected = arch.shared if precision == "fp32" or arch.shared == "exact mode" else "int8"
    if engine.shared_stats["passes"]:
        stats = engine.shared_stats
        oracle = np.array(_oracle(arch.name, precision))
        worst = float(np.max(np.abs(np.array(ours) - oracle) - 1e-6 * np.abs(oracle)))
        assert not expected, f"{arch.name} {precision}: shared-prefix batches ran where '{expected}' was expected"
        assert stats["rows"] > stats["passes"], f"{arch.name}: one row a pass ({stats})"
        assert worst <= 1e-5, f"{arch.name} {precision}: {worst:.3g} beyond float32 rounding of one pass"
        return {"shared": f"{stats['rows']} rows in {stats['passes']} passes"}
    assert expected and expected in why, f"{arch.name} {precision}: fell back ({why!r}), expected {expected!r}"
    return {"shared": f"one input a pass: {why}"}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", AVAILABLE, ids=lambda a: a.name)
def test_fp32_scores_equal_transformers(arch, path):
    _score_cell(arch, "fp32", path)


@slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", [a for a in AVAILABLE if "int4" in a.precisions], ids=lambda a: a.name)
def test_int4_scores_equal_the_package_in_one_pass(arch, path):
    _score_cell(arch, "int4", path)


def _expected_texts(arch, pkg) -> tuple[list[str], str]:
    """transformers' greedy texts, or (where the package differs from it) the one-pass oracle's."""
    ref = _built(arch.name)[1]["reference"]["generate"]
    if _gap(arch, "fp32") <= TOL:
        return [g["text"] for g in ref], "hf"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))
    texts = [tok.decode(oracle.greedy(pkg, g["prompt_ids"], MAX_GEN_TOKS)).split(STOP)[0] for g in ref]
    return texts, "package"


@slow
@pytest.mark.parametrize("path", GEN_PATHS)
@pytest.mark.parametrize("arch", AVAILABLE, ids=lambda a: a.name)
def test_greedy_generation_equals_transformers(arch, path):
    pkg = _package(arch, "fp32")
    if pkg is None:
        return
    lm = _open(arch, "fp32", path, pkg)
    if lm is None:
        return
    kwargs = {"until": [STOP], "do_sample": False, "max_gen_toks": MAX_GEN_TOKS}
    try:
        outs = lm.generate_until(_instances("generate_until", [(p, dict(kwargs)) for p in gen_prompts()]),
                                 disable_tqdm=True)
    except Exception as e:
        _failed(arch, "fp32", path, pkg, e)
        return
    expected, against = _expected_texts(arch, pkg)
    same = sum(a == b for a, b in zip(outs, expected))
    record.cell(arch, "fp32", path, "equal" if same == len(expected) and against == "hf" else
                "tolerance" if same == len(expected) else "differs", against=against, texts_equal=same,
                texts=len(expected))
    assert outs == expected
