"""The house rules of psring's own code, checked: imports between its modules go one
way (no cycle), and no function needs a scroll (LIMIT lines) without a reason written
here, for at most two of them."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.layout import architecture_graph

ROOT = Path(__file__).resolve().parents[2]
#: functions allowed past LIMIT lines ("module.qualname"), each with the one concern
#: that needs the length; at most two
LONG: dict[str, str] = {}
LIMIT = 80


GRAPH = architecture_graph()
modules = GRAPH.modules


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
    graph = GRAPH.import_graph()
    assert "psring.workers.loop" in graph and "psring.predict.sim.simulate" in graph
    assert "psring.cluster.spec" in graph["psring.config.run"]  # the graph sees real imports
    assert cycles(graph) == []


#: modules beside every package (errors users see, the registries, units, lazy
#: re-exports): the bottom; and the command on top, which imports everything
FOUNDATION = {"errors", "registry", "_lazy", "plugins", "units"}
COMMAND = {"cli", "__main__"}


def package_of(module: str) -> str:
    """The package a module belongs to for the layering: psring.records.runlog is in
    records, psring.workers.loop in workers; the foundation and the command apart."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in FOUNDATION:
        return "foundation"
    return "command" if parts[1] in COMMAND else parts[1]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each package -> the packages its modules import (a package's own ``__init__``,
    whose lazy re-exports name its modules, left out)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        a = package_of(module)
        out.setdefault(a, set())
        out[a] |= {package_of(d) for d in deps if package_of(d) != a} - {"psring"}
    return out


def test_packages_are_layers_no_two_import_each_other():
    """Packages by layer (docs/architecture.md): a package imports only packages below
    it, so the package graph has no cycle, of two packages or more; the foundation
    imports none, and nothing imports the command."""
    packages = package_graph(GRAPH.import_graph())
    assert {"records", "runtime", "runs", "commands", "predict"} <= set(packages)
    assert cycles(packages) == [], "these packages import each other: move the module " \
        "that points up to the package of its layer"
    assert packages["foundation"] <= {"foundation"}
    assert not any("command" in deps for deps in packages.values())


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def long_functions(source: str, limit: int) -> dict[str, int]:
    """Functions and methods of ``source`` longer than ``limit`` lines (decorators and
    docstring included), by qualified name."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    if child.end_lineno - first + 1 > limit:
                        found[name] = child.end_lineno - first + 1
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def test_no_function_is_too_long_without_a_reason():
    assert len(LONG) <= 2, "at most two functions may be longer than LIMIT"
    long = {f"{name}.{fn}": n for name, path in GRAPH.modules().items()
            for fn, n in long_functions(path.read_text(), LIMIT).items()}
    assert {k: v for k, v in long.items() if k not in LONG} == {}, \
        f"split these (a function that needs a scroll is two), or say in LONG why: {long}"
    assert set(LONG) <= set(long), "LONG names a function that is short now: drop it"


def test_the_length_rule_sees_nested_and_decorated_functions():
    src = "class A:\n    @staticmethod\n    def f():\n" + "        x = 1\n" * 5 + \
        "def g():\n    def h():\n" + "        y = 2\n" * 4 + "    return h\n"
    assert long_functions(src, 4) == {"A.f": 7, "g": 7, "g.h": 5}
    assert long_functions(src, 10) == {}
