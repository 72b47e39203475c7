"""psring's import graph, read from the source with ``ast`` (nothing is imported, so no
torch): every module of psring, psring.workers and psring.servers, and the psring
modules each one imports anywhere in it, function bodies included.

It draws docs/architecture.md's diagram of the packages, each module on the line of its
longest import chain, and tests/package/test_layout.py checks the same graph for cycles, so the
picture and the rule are one computation::

    python docs/architecture_graph.py           # print the diagram
    python docs/architecture_graph.py --write   # put it into docs/architecture.md
    python docs/architecture_graph.py --check   # exit 1 if docs/architecture.md differs

tests/package/test_architecture_doc.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
#: source directory -> the package it installs as (setup.py)
PACKAGES = {"psring": "psring", "workers": "psring.workers", "servers": "psring.servers"}
#: the lines around the generated block in DOC (the command is the one to rerun)
BEGIN = "<!-- generated: python docs/architecture_graph.py --write -->"
END = "<!-- end generated -->"
WIDTH = 88


def modules() -> dict[str, Path]:
    """Every module's dotted name (as installed) -> its source file."""
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
    tree = ast.parse(path.read_text())
    # (type-only imports, under `if TYPE_CHECKING:`, never run: no dependency)
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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


def import_graph() -> dict[str, set[str]]:
    """Each module -> the psring modules it imports."""
    known = modules()
    return {name: imports(name, path, known) & known.keys() for name, path in known.items()}


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's longest chain of imports down to a module that imports none (0).
    Defined only without cycles, which tests/package/test_layout.py rules out."""
    done: dict[str, int] = {}
    visiting: set[str] = set()

    def level(name: str) -> int:
        if name not in done:
            if name in visiting:
                raise ValueError(f"import cycle through {name}: no levels")
            visiting.add(name)
            done[name] = 1 + max(map(level, graph[name]), default=-1)
            visiting.discard(name)
        return done[name]

    return {name: level(name) for name in graph}


def short(name: str) -> str:
    """A module's name in the diagram: ``psring.`` dropped, except on psring itself."""
    return name.removeprefix("psring.") if name != "psring" else name


def diagram(graph: dict[str, set[str]]) -> str:
    """One line per level, highest first, its modules sorted and wrapped to WIDTH."""
    by_level: dict[int, list[str]] = {}
    for name, lv in levels(graph).items():
        by_level.setdefault(lv, []).append(short(name))
    pad = len(str(max(by_level)))
    lines = []
    for lv in sorted(by_level, reverse=True):
        head = f"{lv:>{pad}}  "
        lines += textwrap.wrap("  ".join(sorted(by_level[lv])), WIDTH,
                               initial_indent=head, subsequent_indent=" " * len(head),
                               break_on_hyphens=False)
    return "\n".join(lines)


def block(graph: dict[str, set[str]]) -> str:
    """The generated part of DOC, markers included."""
    return f"{BEGIN}\n```\n{diagram(graph)}\n```\n{END}"


def replace_block(text: str, new: str) -> str:
    """``text`` with the part between BEGIN and END (inclusive) replaced by ``new``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC} lacks the lines {BEGIN!r} ... {END!r}")
    return text[:start] + new + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"update {DOC.name}")
    mode.add_argument("--check", action="store_true",
                      help=f"exit 1 if {DOC.name} differs from the code")
    args = p.parse_args(argv)
    graph = import_graph()
    if not (args.write or args.check):
        print(diagram(graph))
        return 0
    text = DOC.read_text()
    new = replace_block(text, block(graph))
    if args.write:
        DOC.write_text(new)
        return 0
    if new != text:
        print(f"{DOC} differs from the code: run python docs/architecture_graph.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
