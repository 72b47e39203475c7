"""``single``: one process, no communication. The baseline every speedup is measured against."""

from __future__ import annotations

from psring.strategies.base import STRATEGIES, Strategy


@STRATEGIES.register("single")
class Single(Strategy):
    name = "single"
    max_workers = 1
