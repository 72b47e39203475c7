"""docs/architecture_graph.py loaded as a module: the import graph of psring's code,
which both checks the import rules (tests/package/test_layout.py) and draws
docs/architecture.md's diagram (tests/package/test_architecture_doc.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def architecture_graph() -> ModuleType:
    path = ROOT / "docs" / "architecture_graph.py"
    spec = importlib.util.spec_from_file_location("architecture_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
