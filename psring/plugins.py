"""Strategies (or models) kept outside psring, loaded by module name.

    PSRING_PLUGINS=mylab.strategies psring run --strategy my-strategy --workers 2

Each module in ``PSRING_PLUGINS`` (comma-separated) is imported once, in the launcher
and in every worker (the variable is inherited), and registers itself with
``@STRATEGIES.register(...)`` or ``@MODELS.register(...)``.
"""

from __future__ import annotations

import importlib
import os

from psring.errors import ConfigError

_loaded: set[str] = set()


def load_plugins() -> None:
    for name in filter(None, (n.strip() for n in os.environ.get("PSRING_PLUGINS", "").split(","))):
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"PSRING_PLUGINS names {name!r}, which cannot be imported ({e}); "
                              f"check the module is on PYTHONPATH.") from None
        _loaded.add(name)
