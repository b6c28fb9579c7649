"""No import cycles in pycomm/, of any length (issue #39 item 4).

The graph is built from the source with ``ast``, without importing anything. Every
``import`` and ``from ... import`` statement counts wherever it stands: at module level,
inside functions and methods, under ``if`` / ``try``. A function-level import is how a
cycle is usually hidden (it runs later, when the other module is complete), but the two
modules still need each other: neither can be read, tested or moved without the other.

Edges: ``import pycomm.a.b`` and ``from pycomm.a import b`` (``b`` a module) give an edge
to ``pycomm.a.b``; ``from pycomm.a import name`` (``name`` not a module) gives an edge to
``pycomm.a``. Relative imports resolve against the importing module's package. Only
modules of pycomm/ (``.py`` files) are nodes: the C extension, torch and the standard
library are not. The implicit import of a parent package (importing ``pycomm.bench.sweep``
first runs ``pycomm/bench/__init__.py``) is not an edge: a package's ``__init__`` that
re-exports its modules would otherwise close a cycle with every module of the package
that imports a sibling, which Python resolves by design (the package is already in
``sys.modules`` while its ``__init__`` runs).
"""
import ast
import os
import sys
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pycomm")


def _modules(root: str) -> Dict[str, Optional[str]]:
    """Module name -> path of every .py file under ``root`` (the package pycomm); a
    compiled extension (pycomm._C) maps to None: a module, but no node."""
    out: Dict[str, Optional[str]] = {}
    base = os.path.dirname(os.path.abspath(root))
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith((".so", ".pyd")):
                parts = os.path.relpath(path, base).split(".")[0].split(os.sep)
                out.setdefault(".".join(parts), None)
                continue
            if not name.endswith(".py"):
                continue
            parts = os.path.relpath(path, base)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph(root: str = ROOT) -> Dict[str, Set[str]]:
    modules = _modules(root)
    graph: Dict[str, Set[str]] = {name: set() for name, path in modules.items() if path}
    for name, path in modules.items():
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    source = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                # ``import pycomm.a.b`` names the deepest module of pycomm/ it reaches
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and modules[target] is not None:
                    graph[name].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> Tuple[List[List[str]], List[List[str]]]:
    """One cycle through each strongly connected component of more than one module
    (Tarjan's algorithm; then a shortest path back to the component's first module)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    found = []
    for component in components:
        members = set(component)
        start = component[0]
        parents: Dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:  # breadth-first: a shortest way back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in parents:
                        parents[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = parents[start]
        while v != start:
            path.append(v)
            v = parents[v]
        found.append([start] + path[:0:-1] + [start])
    return found, components


def test_graph_sees_known_imports():
    """The graph is not empty by mistake: edges that exist today are found, module level
    and function level."""
    graph = import_graph()
    assert "pycomm.hooks.topk" in graph["pycomm.hooks"]
    assert "pycomm.config" in graph["pycomm.bench.harness"]  # imported inside a function


def test_cycle_detection_reports_a_planted_cycle(tmp_path):
    pkg = tmp_path / "pycomm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import x\n")
    (pkg / "sub" / "a.py").write_text("from .b import y\nx = 1\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pycomm.sub import c\ny = 2\n")
    (pkg / "sub" / "c.py").write_text("from . import a\n")
    found, components = cycles(import_graph(str(pkg)))
    assert components == [["pycomm.sub.a", "pycomm.sub.b", "pycomm.sub.c"]]
    assert found == [["pycomm.sub.a", "pycomm.sub.b", "pycomm.sub.c", "pycomm.sub.a"]]


def test_no_import_cycles():
    found, components = cycles(import_graph())
    lines = []
    for cycle, component in zip(found, components):
        lines.append(f"{len(component)} modules: {', '.join(component)}\n    e.g. {' -> '.join(cycle)}")
    assert not found, "import cycles in pycomm/:\n  " + "\n  ".join(lines)
