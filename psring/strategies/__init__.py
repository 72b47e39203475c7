"""Strategy registry. Importing this package registers every built-in strategy.

A new strategy is a :class:`~psring.strategies.base.Strategy` subclass in a module
imported here, decorated with ``@STRATEGIES.register("flag-name")``. A strategy kept outside psring
is a module named in ``PSRING_PLUGINS`` (comma-separated, importable); it is imported
here, in the launcher and in every worker alike. See docs/architecture.md.
"""

from .base import STRATEGIES, Strategy, StepStats, WorkerContext  # noqa: F401
from . import single, allreduce, ddp, ps, hogwild, hallreduce, byteps  # noqa: F401,E402  (registration side effects)
from ..plugins import load_plugins  # noqa: E402

load_plugins()

__all__ = ["STRATEGIES", "Strategy", "StepStats", "WorkerContext"]
