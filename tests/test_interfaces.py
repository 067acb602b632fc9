"""Lower layers get data, not a higher layer's objects: an ``OrtLM`` (integrations/lm.py) is read only through
its documented interface.

- ``report/`` sits below ``integrations/``: none of its modules takes an OrtLM or reads one. What the report
  needs of a run comes as data (report/samples.py's ``SampleFacts``, built by ``OrtLM.sample_facts``).
- The other modules of ``integrations/`` read an OrtLM only through ``OrtLM.INTERFACE`` (lm-eval's model API,
  the model arguments, package and tokenizer, and the views ``sample_facts`` and ``ptrue_model``), and never
  assign to one.

An expression is taken for an OrtLM when it is a name ``lm``, an attribute ``.lm`` (``self.lm``), a name
annotated ``OrtLM``, or a call of ``from_package``, ``create_from_arg_string``, ``create_from_arg_obj`` or
``open_judge`` (the functions that return one): the project names an OrtLM ``lm``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ortevals"
OWN = ("integrations/lm.py",)  # the class's own module
MAKERS = ("from_package", "create_from_arg_string", "create_from_arg_obj", "open_judge")


def _annotated(tree: ast.AST) -> set[str]:
    """Names annotated with OrtLM anywhere in the module (parameters, annotated assignments)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and "OrtLM" in ast.unparse(node.annotation):
            out.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and "OrtLM" in ast.unparse(
                node.annotation):
            out.add(node.target.id)
    return out


def _is_lm(node: ast.AST, annotated: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "lm" or node.id in annotated
    if isinstance(node, ast.Attribute):
        return node.attr == "lm"
    if isinstance(node, ast.Call):
        f = node.func
        return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in MAKERS
    return False


def findings(path: Path, rel: str, interface: frozenset[str]) -> list[str]:
    """One line per use of an OrtLM that the rule forbids in module ``rel`` (``report/…`` or ``integrations/…``)."""
    tree = ast.parse(path.read_text(), str(path))
    annotated = _annotated(tree)
    report = rel.startswith("report/")
    out = []
    for node in ast.walk(tree):
        where = f"ortevals/{rel}:{getattr(node, 'lineno', 0)}"
        if report and isinstance(node, ast.arg) and (node.arg == "lm" or node.arg in annotated):
            out.append(f"{where}: report/ takes an OrtLM ({node.arg}); hand it the data instead")
        elif isinstance(node, ast.Attribute) and _is_lm(node.value, annotated):
            if report:
                out.append(f"{where}: report/ reads an OrtLM ({ast.unparse(node)})")
            elif not isinstance(node.ctx, ast.Load):
                out.append(f"{where}: assigns to an OrtLM ({ast.unparse(node)})")
            elif node.attr not in interface:
                out.append(f"{where}: reads {ast.unparse(node)}, not in OrtLM.INTERFACE")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and node.args
              and _is_lm(node.args[0], annotated)):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            if report or node.func.id != "getattr" or name not in interface:
                out.append(f"{where}: {node.func.id}(…, {name!r}) on an OrtLM, not in OrtLM.INTERFACE")
    return out


def scan(root: Path, interface: frozenset[str]) -> list[str]:
    out = []
    for folder in ("report", "integrations"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel not in OWN:
                out += findings(path, rel, interface)
    return out


def test_report_and_integrations_use_an_ortlm_only_through_its_interface():
    from ortevals.integrations.lm import OrtLM

    found = scan(ROOT, OrtLM.INTERFACE)
    assert not found, "\n".join(found)


def test_the_interface_names_what_an_ortlm_has():
    from ortevals.integrations.lm import OrtLM

    assert sorted(n for n in OrtLM.INTERFACE if not hasattr(OrtLM, n)) == []
    assert not {"run", "engine", "store", "backends", "sample_logprobs", "sample_certainty"} & OrtLM.INTERFACE


def test_the_checker_sees_reads_a_layer_must_not_make(tmp_path):
    """A planted report module reading an OrtLM and an integration reaching into its run and engine."""
    (tmp_path / "report").mkdir()
    (tmp_path / "integrations").mkdir()
    (tmp_path / "report" / "a.py").write_text(
        "def f(results, lm):\n    return getattr(lm, 'sample_logprobs', {}), lm.store\n")
    (tmp_path / "integrations" / "b.py").write_text(
        "def g(lm):\n    lm.engine.settings = 1\n    return lm.loglikelihood([]), lm.args\n\n"
        "class V:\n    def __init__(self, lm: 'OrtLM'):\n        self.lm = lm\n"
        "    def h(self):\n        return self.lm.run, open_judge(1, self.lm).ptrue_model(), self.lm.package\n")
    got = scan(tmp_path, frozenset({"loglikelihood", "args", "package", "ptrue_model"}))
    assert got == [
        "ortevals/report/a.py:1: report/ takes an OrtLM (lm); hand it the data instead",
        "ortevals/report/a.py:2: getattr(…, 'sample_logprobs') on an OrtLM, not in OrtLM.INTERFACE",
        "ortevals/report/a.py:2: report/ reads an OrtLM (lm.store)",
        "ortevals/integrations/b.py:2: reads lm.engine, not in OrtLM.INTERFACE",
        "ortevals/integrations/b.py:9: reads self.lm.run, not in OrtLM.INTERFACE",
    ], got
