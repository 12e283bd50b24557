"""docs/design.md's module map is the package's import contract, checked against the code.

The map is a table `| module | responsibility | may import |`. A row names a file
(`core/comm.py`) or a package (`tools/estimator/`); a module follows the longest row that covers
it. "may import" lists the megatron-tsp layers (`core`, `megatron_lm`, `inference`, `tools`) and
the third-party packages (`torch`, `megatron.core`, ...) the module may import, at any depth
(function-level imports count). The standard library is always allowed.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_tsp"
DESIGN = ROOT / "docs" / "design.md"
LAYERS = ("core", "megatron_lm", "inference", "tools")


def read_map(text: str) -> dict[str, set[str]]:
    """{row path: allowed names} from the '## Module map' table of design.md."""
    section = text.split("## Module map", 1)
    if len(section) != 2:
        raise AssertionError("docs/design.md has no '## Module map' section")
    rows = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        path = cells[0].strip("`")
        allowed = {t.strip().strip("`") for t in re.split(r"[,;]", cells[2]) if t.strip()}
        rows[path] = {a for a in allowed if a not in ("—", "-", "")}
    if not rows:
        raise AssertionError("the module map table has no rows")
    return rows


def row_for(relpath: str, rows: dict[str, set[str]]) -> str | None:
    best = None
    for path in rows:
        covers = relpath == path or (path.endswith("/") and relpath.startswith(path))
        if covers and (best is None or len(path) > len(best)):
            best = path
    return best


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the source, relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                names.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                names.append((node.lineno, node.module))
    return names


def violations(relpath: str, source: str, allowed: set[str]) -> list[str]:
    module = "megatron_tsp." + relpath.removesuffix(".py").replace("/", ".")
    is_package = relpath.endswith("__init__.py")
    module = module.removesuffix(".__init__")
    found = []
    for line, name in imported_names(source, module, is_package):
        top = name.split(".")[0]
        if top == "megatron_tsp":
            parts = name.split(".")
            layer = parts[1] if len(parts) > 1 else "megatron_tsp"
            if layer not in allowed:
                found.append(f"{relpath}:{line} imports {name} (allowed: {sorted(allowed)})")
        elif top in sys.stdlib_module_names or top == "__future__":
            continue
        else:
            key = ".".join(name.split(".")[:2]) if top == "megatron" else top
            if key not in allowed:
                found.append(f"{relpath}:{line} imports {name} (allowed: {sorted(allowed)})")
    return found


def package_modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_row_and_every_row_a_module():
    rows = read_map(DESIGN.read_text())
    uncovered = [m for m in package_modules() if row_for(m, rows) is None]
    assert not uncovered, f"modules missing from docs/design.md's module map: {uncovered}"
    missing = [p for p in rows if not (PACKAGE / p).exists()]
    assert not missing, f"module map rows naming nothing in megatron_tsp/: {missing}"


def test_imports_follow_the_module_map():
    rows = read_map(DESIGN.read_text())
    found = []
    for relpath in package_modules():
        row = row_for(relpath, rows)
        found += violations(relpath, (PACKAGE / relpath).read_text(), rows[row])
    assert not found, "imports outside docs/design.md's module map:\n" + "\n".join(found)


def module_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports, at any depth}; ``from pkg import name`` is an
    edge to ``pkg.name`` where that is a module, else to ``pkg``."""
    modules = {}
    for relpath in package_modules():
        name = "megatron_tsp." + relpath.removesuffix(".py").replace("/", ".")
        modules[name.removesuffix(".__init__")] = relpath
    graph = {}
    for module, relpath in modules.items():
        tree = ast.parse((PACKAGE / relpath).read_text())
        is_package = relpath.endswith("__init__.py")
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".")
                    keep = len(parts) - node.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_module_graph_is_acyclic():
    """No import cycle anywhere in the package, function-level imports included (an import
    inside a function only hides a cycle)."""
    graph = module_graph()
    assert "megatron_tsp.core.layers.head_groups" in graph["megatron_tsp.core.layers.attention"]
    assert cycles(graph) == [], cycles(graph)


def test_cycle_finder_reports_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_core_rows_allow_no_tool_and_no_integration():
    rows = read_map(DESIGN.read_text())
    for path, allowed in rows.items():
        if path.startswith("core/"):
            assert not allowed & {"megatron_lm", "inference", "tools", "megatron.training"}, path


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from megatron_tsp.tools import comm_counter\n", "imports megatron_tsp.tools"),
        ("def f():\n    import megatron.training.arguments\n", "imports megatron.training"),
        ("from ...tools.estimator import formulas\n", "imports megatron_tsp.tools.estimator"),
        ("import numpy as np\n", "imports numpy"),
    ],
)
def test_checker_reports_a_planted_violation(source, expected):
    found = violations("core/layers/planted.py", source, {"core", "torch", "megatron.core"})
    assert len(found) == 1 and expected in found[0], found


def test_checker_accepts_allowed_imports():
    source = (
        "import os\nimport torch\nfrom megatron.core import parallel_state\nfrom . import comm\n"
    )
    assert violations("core/planted.py", source, {"core", "torch", "megatron.core"}) == []
