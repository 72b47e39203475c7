"""``single``: one process, no communication. The baseline every speedup is measured against."""

from __future__ import annotations

from psring.strategies.base import STRATEGIES, Capabilities, Strategy


@STRATEGIES.register("single")
class Single(Strategy):
    name = "single"
    caps = Capabilities(max_workers=1)
