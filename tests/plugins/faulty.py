"""A test plugin: strategies that fail on purpose (loaded via PSRING_PLUGINS)."""

from psring.strategies import STRATEGIES
from psring.strategies.allreduce import AllReduce


@STRATEGIES.register("faulty")
class Faulty(AllReduce):
    """allreduce whose worker 1 raises at step 3, while worker 0 waits in a collective."""

    name = "faulty"

    def begin_step(self, step):
        if self.ctx.rank == 1 and step == 3:
            raise RuntimeError("injected failure in worker 1 at step 3")
        return super().begin_step(step)
