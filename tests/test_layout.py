"""The house rules of psring's own code, checked: imports between its modules go one
way (no cycle), and no module grows past ~600 lines without a reason written here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: modules allowed past LIMIT lines, with the one concern that needs the length
LONG = {}
LIMIT = 600


def _graph_module():
    """docs/architecture_graph.py: the import graph, which also draws the diagram in
    docs/architecture.md (one computation for the rule and the picture)."""
    path = ROOT / "docs" / "architecture_graph.py"
    spec = importlib.util.spec_from_file_location("architecture_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRAPH = _graph_module()
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
    assert "psring.workers.loop" in graph and "psring.predict.simulate" in graph
    assert "psring.cluster.spec" in graph["psring.config.run"]  # the graph sees real imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_too_long_without_a_reason():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > LIMIT and name not in LONG}
    assert long == {}, f"split these, or say in LONG why one concern needs the length: {long}"
