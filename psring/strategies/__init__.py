"""Strategy registry. Importing this package registers every built-in strategy.

A new strategy is a :class:`~psring.strategies.base.Strategy` subclass in a module
imported here, decorated with ``@STRATEGIES.register("flag-name")``. A strategy kept outside psring
is a module named in ``PSRING_PLUGINS`` (comma-separated, importable); it is imported
here, in the launcher and in every worker alike. See docs/architecture.md.
"""

from psring.plugins import load_plugins
from psring.strategies.base import STRATEGIES, Capabilities, StepStats, Strategy, WorkerContext

# the registry lists the strategies in the order they are imported here (kept, not sorted)
# isort: off
from psring.strategies import (  # noqa: F401 - imported to register the built-in strategies
    single, allreduce, ddp, ps, hogwild, hallreduce, byteps,
)
# isort: on

load_plugins()

__all__ = ["STRATEGIES", "Capabilities", "Strategy", "StepStats", "WorkerContext"]
