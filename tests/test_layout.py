"""The house rules of psring's own code, checked: imports between its modules go one
way (no cycle), and no module grows past ~600 lines without a reason written here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source directory -> the package it installs as (setup.py)
PACKAGES = {"psring": "psring", "workers": "psring.workers", "servers": "psring.servers"}
#: modules allowed past LIMIT lines, with the one concern that needs the length
LONG = {"psring.predict.simulate": "its absolute imports after the move into packages; "
        "the PS simulation is split next, and functions, not files, get the cap"}
LIMIT = 600


def modules() -> dict[str, Path]:
    found = {}
    for src, pkg in PACKAGES.items():
        for path in (ROOT / src).rglob("*.py"):
            rel = path.relative_to(ROOT / src).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([pkg, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """psring modules ``name`` imports, anywhere in it (function bodies included)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    assert "psring.workers.loop" in known and "psring.predict.simulate" in known
    graph = {name: imports(name, path, known) & known.keys() for name, path in known.items()}
    assert "psring.cluster.spec" in graph["psring.config.run"]  # the graph sees real imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_too_long_without_a_reason():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > LIMIT and name not in LONG}
    assert long == {}, f"split these, or say in LONG why one concern needs the length: {long}"
