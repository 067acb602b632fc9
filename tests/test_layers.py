"""The shape of ortevals: imports run one way, from the front doors down (docs/architecture.md).

:data:`LAYERS` is the one place the layer order is written. Every ``import`` of an ortevals
module in ``ortevals/`` is an edge, at module level or inside a function (``TYPE_CHECKING``
blocks too): a function-level import may delay loading an optional heavy dependency, never hide
an edge. The tests fail on a module no layer holds, on an import from a lower layer to a higher
one, and on an import cycle (within a layer too), naming the file and line of each import.
They also hold files to about 400 lines and functions to about 50 (the project's rule).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ortevals"

# Lowest first. A module belongs to the layer of its longest matching prefix, so a layer can hold a
# folder and a later one one module of it (integrations/olive.py calls the front door evaluate.py).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("ortevals.errors", "ortevals.files", "ortevals.install", "ortevals.tokens", "ortevals.version")),
    ("package", ("ortevals.package",)),
    ("runtime", ("ortevals.runtime",)),
    ("engine.score", ("ortevals.engine.score",)),
    ("engine.generate.choice", ("ortevals.engine.generate.choice",)),
    ("engine.generate", ("ortevals.engine.generate",)),
    ("engine.media", ("ortevals.engine.media",)),
    ("engine", ("ortevals.engine",)),
    ("report", ("ortevals.report",)),
    ("run", ("ortevals.options", "ortevals.run")),
    ("integrations", ("ortevals.integrations",)),
    ("front", ("ortevals", "ortevals.tasks", "ortevals.presets", "ortevals.evaluate", "ortevals.fidelity",
               "ortevals.diagnose", "ortevals.integrations.olive", "ortevals.integrations.olive_workflow",
               "ortevals.cli", "ortevals.bench")),
)
MAX_FILE_LINES = 440  # "about 400"
MAX_FUNCTION_LINES = 50


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path:line
    nested: bool  # inside a function or class body


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name → file of every module under ``root`` (a package's ``__init__`` is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def edges(mods: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    """Every import of an ortevals module by an ortevals module (``root``: the ortevals folder)."""
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node, nested in _imports(tree):
            for target in _targets(node, package, mods):
                if target != name:
                    out.append(Edge(name, target, f"{path.relative_to(root.parent)}:{node.lineno}", nested))
    return out


def _imports(tree: ast.AST) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    def walk(node: ast.AST, nested: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, nested
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            yield from walk(child, inner)

    yield from walk(tree, False)


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    if base in mods and len(found) < len(node.names):  # a name defined in the module itself
        found.append(base)
    return found


def layer_of(module: str) -> int | None:
    """Index into :data:`LAYERS` of the longest prefix holding ``module``, None when none does."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward(all_edges: list[Edge]) -> list[str]:
    """One line per import from a lower layer to a higher one."""
    out = []
    for e in all_edges:
        a, b = layer_of(e.source), layer_of(e.target)
        if a is not None and b is not None and b > a:
            out.append(f"{e.where}: {e.source} ({LAYERS[a][0]}) imports {e.target} ({LAYERS[b][0]}), a higher layer"
                       + (" (function-level)" if e.nested else ""))
    return out


def cycles(all_edges: list[Edge]) -> list[str]:
    """One line per import cycle (a strongly connected component), with one closed path through it."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in all_edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    out = []
    for comp in _components(graph):
        path = _closed_path(graph, comp)
        steps = [graph[a][b] for a, b in zip(path, path[1:])]
        out.append("import cycle: " + " -> ".join(path) + "  (" + ", ".join(s.where for s in steps) + ")")
    return out


def _components(graph: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def _closed_path(graph: dict[str, dict[str, Edge]], comp: set[str]) -> list[str]:
    """A shortest closed path through the component's first module (breadth first)."""
    start = min(comp)
    parent: dict[str, str] = {start: ""}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in comp and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def test_every_module_has_a_layer():
    loose = [m for m in modules() if layer_of(m) is None]
    assert not loose, "modules in no layer (add their prefix to LAYERS): " + ", ".join(loose)


def test_imports_point_down():
    found = upward(edges(modules()))
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


def test_no_import_cycles():
    found = cycles(edges(modules()))
    assert not found, "\n".join(found)


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path):
    """The checker itself, on a small tree with two imports planted in a function (as a dodge would be)."""
    root = tmp_path / "ortevals"
    (root / "package").mkdir(parents=True)
    planted = {"__init__.py": "", "cli.py": "", "package/__init__.py": "",
               "package/a.py": "import ortevals.package.b\n",
               "package/b.py": "def f():\n    from ortevals.package import a\n    import ortevals.cli\n"}
    for name, text in planted.items():
        (root / name).write_text(text)
    found = edges(modules(root), root)
    assert cycles(found) == ["import cycle: ortevals.package.a -> ortevals.package.b -> ortevals.package.a  "
                             "(ortevals/package/a.py:1, ortevals/package/b.py:2)"]
    assert upward(found) == ["ortevals/package/b.py:3: ortevals.package.b (package) imports ortevals.cli (front), "
                             "a higher layer (function-level)"]


def test_files_and_functions_stay_small():
    long = []
    for path in modules().values():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.name} is {n} lines")
    assert not long, "over the size rule:\n" + "\n".join(long)


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def diagram(text: str) -> list[tuple[str, str]]:
    """(layer name, the text of its line and continuation lines) of the page's first code block, in order."""
    block = text.split("```", 2)[1]
    out: list[tuple[str, str]] = []
    for line in block.splitlines()[1:]:
        if line.strip() in ("", "▼", "│"):
            continue
        if line[0].isspace() and out:
            out[-1] = (out[-1][0], out[-1][1] + " " + line.strip())
        else:
            name, _, rest = line.strip().partition(" ")
            out.append((name, rest.strip()))
    return out


def path_form(prefix: str, root: Path = ROOT) -> str:
    """How the picture names a layer's prefix: ``ortevals.run`` → ``run/``, ``ortevals.cli`` → ``cli.py``."""
    parts = prefix.split(".")[1:]
    if not parts:
        return "__init__.py"
    return "/".join(parts) + ("/" if (root / Path(*parts)).is_dir() else ".py")


def picture_problems(text: str) -> list[str]:
    """How a page's picture differs from LAYERS: the names (highest first), and each layer's prefixes named
    on its line."""
    found = diagram(text)
    names = [name for name, _ in reversed(LAYERS)]
    if [name for name, _ in found] != names:
        return [f"the picture's layers {[name for name, _ in found]} are not LAYERS' {names}"]
    return [f"{name}: {path_form(p)} not named" for (name, line), (_, prefixes) in zip(found, reversed(LAYERS))
            for p in prefixes if path_form(p) not in line]


def test_the_architecture_picture_is_layers():
    """docs/architecture.md's picture lists LAYERS' names highest first, each line naming its layer's prefixes."""
    found = picture_problems(ARCHITECTURE.read_text())
    assert not found, "docs/architecture.md's picture disagrees with LAYERS:\n" + "\n".join(found)


def test_the_picture_check_sees_a_wrong_order_and_a_missing_prefix():
    lines = [f"{name}  {' · '.join(path_form(p) for p in prefixes)}" for name, prefixes in reversed(LAYERS)]
    page = "x\n```\n" + "\n  ▼\n".join(lines) + "\n```\n"
    assert picture_problems(page) == []
    swapped = lines[:2] + [lines[3], lines[2]] + lines[4:]
    assert picture_problems("```\n" + "\n".join(swapped) + "\n```")[0].startswith("the picture's layers")
    assert picture_problems(page.replace(" · run/", "")) == ["run: run/ not named"]
    assert diagram("```\nrun  a\n  more\n  ▼\nreport  b\n```") == [("run", "a more"), ("report", "b")]


def test_every_folder_and_module_is_on_the_architecture_page():
    text = ARCHITECTURE.read_text()
    folders = sorted({p.parent.relative_to(ROOT.parent).as_posix() for p in ROOT.rglob("__init__.py")})
    rows = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.M))
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    assert [f for f in folders if f"`{f}/`" not in text] == [], "folders without their line"
    assert sorted(files - rows) == [], "modules without a row in the module table"
    assert sorted(rows - files) == [], "rows for modules that do not exist"
