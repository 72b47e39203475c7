"""The worker's clocks: rank 0's training time (psring.workers.loop).

    clock = TrainingClock()
    clock.begin()                 # the first step begins
    with clock.paused(): ...      # an evaluation: not training
    clock.elapsed()               # the train_s of evals.jsonl and checkpoints
"""

from __future__ import annotations

import contextlib
import time

now = time.perf_counter


class TrainingClock:
    """Rank 0's training time: wall-clock since its first step began, less what is not
    training (evaluations, checkpoints); a resumed run continues its checkpoint's."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.excluded = 0.0
        self.resumed = 0.0

    def begin(self, already: float = 0.0) -> None:
        """The first step begins (``already`` seconds ago: a wait charged to it)."""
        if self.start is None:
            self.start = now() - already
            self.excluded = 0.0  # (the evaluation of the initial model came before)

    def elapsed(self) -> float:
        return self.resumed + (now() - self.start - self.excluded if self.start else 0.0)

    @contextlib.contextmanager
    def paused(self):
        t = now()
        try:
            yield
        finally:
            self.excluded += now() - t
