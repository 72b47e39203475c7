"""Lazy re-exports for psring's package ``__init__`` modules.

A package re-exports its public API at its top (``from psring.cluster import Cluster``)
without importing its modules until a name is used: ``psring --help``, the servers and
the pure prediction modules stay without torch, and a package's ``__init__`` adds no
import edge (tests/package/test_layout.py checks the edges for cycles).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                 Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name
    to the module (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
