"""docs/architecture.md's module diagram is the code's: it is regenerated from the
imports (docs/architecture_graph.py) and compared with the doc, so a module added,
moved or given a new import fails here until the doc is rewritten:

    python docs/architecture_graph.py --write
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from tests.helpers.layout import architecture_graph

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python docs/architecture_graph.py --write"


G = architecture_graph()


def test_the_diagram_in_the_doc_is_the_codes():
    text = G.DOC.read_text()
    assert G.BEGIN in text and G.END in text, f"restore the markers, then run {COMMAND}"
    new = G.replace_block(text, G.block(G.import_graph()))
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                        "docs/architecture.md", "from the code"))
    assert new == text, f"docs/architecture.md is out of date: run {COMMAND}\n{diff}"


def test_the_marker_names_the_command_to_run():
    assert COMMAND in G.BEGIN


def test_every_module_is_drawn_once():
    graph = G.import_graph()
    drawn = G.diagram(graph).split()
    names = [G.short(m) for m in graph]
    assert sorted(w for w in drawn if not w.isdigit()) == sorted(names)
    # the modules the hand-drawn diagram once left out
    for name in ("train.device", "comm.interconnect", "runtime.rendezvous",
                 "strategies.byteps", "strategies.hallreduce", "cluster.netif"):
        assert name in drawn


def test_a_level_is_the_longest_chain_below():
    graph = {"cli": {"config", "errors"}, "config": {"errors"}, "errors": set(),
             "pure": set()}
    assert G.levels(graph) == {"cli": 2, "config": 1, "errors": 0, "pure": 0}
    assert G.diagram(graph).splitlines() == ["2  cli", "1  config", "0  errors  pure"]


def test_a_cycle_has_no_levels():
    with pytest.raises(ValueError, match="import cycle"):
        G.levels({"a": {"b"}, "b": {"a"}})


def test_imports_inside_functions_and_relative_ones_count(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import os\nfrom . import sib\n\n"
                   "def f():\n    from psring.pkg.deep import name\n    return name\n")
    known = {"psring.pkg.mod": src, "psring.pkg.sib": src, "psring.pkg.deep": src,
             "psring.pkg": src}
    assert G.imports("psring.pkg.mod", src, known) == {"psring.pkg.sib", "psring.pkg.deep"}


def test_the_block_is_replaced_between_its_markers_only():
    text = f"before\n{G.BEGIN}\nold\n{G.END}\nafter\n"
    assert G.replace_block(text, "NEW") == "before\nNEW\nafter\n"
    with pytest.raises(ValueError, match="lacks"):
        G.replace_block("no markers here", "NEW")


def test_the_layout_table_names_every_module_in_its_packages_row():
    """Each row of the Layout table (| `dir/` | ...) names every module file of that
    directory: a module added without a word in the doc fails here."""
    rows = {}
    for line in G.DOC.read_text().splitlines():
        if line.startswith("| `") and "/` |" in line:
            rows[line.split("`")[1]] = line
    missing = []
    for folder in ("psring", "workers", "servers"):
        for package in sorted({p.parent for p in (ROOT / folder).rglob("*.py")}):
            key = f"{package.relative_to(ROOT)}/"
            assert key in rows, f"docs/architecture.md's Layout table has no row {key}"
            missing += [f"{key}{p.name}" for p in sorted(package.glob("*.py"))
                        if p.name != "__init__.py" and f"`{p.name}`" not in rows[key]]
    assert missing == [], f"say in docs/architecture.md's Layout table what these hold: {missing}"
