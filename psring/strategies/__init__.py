"""Strategy registry. Importing this package registers every built-in strategy.

A new strategy is a :class:`~psring.strategies.base.Strategy` subclass in a module
imported here, decorated with ``@STRATEGIES.register("flag-name")``; see
docs/architecture.md.
"""

from .base import STRATEGIES, Strategy, StepStats, WorkerContext  # noqa: F401
from . import single, allreduce, ddp  # noqa: F401,E402  (registration side effects)

__all__ = ["STRATEGIES", "Strategy", "StepStats", "WorkerContext"]
