"""``hogwild``: Hogwild! — lock-free SGD on parameters in shared memory (one host).

Worker 0 puts the initial parameters in a file under /dev/shm and publishes it with an
atomic rename; every worker maps it (``torch.from_file(shared=True)``), points its
model's parameters at it, and applies its own SGD steps (its own momentum) to it without
locks, as Niu et al. (NIPS 2011) describe. Data is sharded as for the other strategies.

What can be recorded without locks: shared per-worker counters of updates begun and
finished (each worker writes only its own slots). A step's ``staleness`` is how many
updates *other* workers began between this worker's forward and the end of its own
update: each of them wrote parameters this step read, or raced with its write.

    psring run --strategy hogwild --workers 2
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from psring.errors import ConfigError, PsringError
from psring.records.runlog import run_id
from psring.strategies.base import STRATEGIES, Capabilities, Strategy

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig


def shm_paths(cfg: RunConfig) -> tuple[Path, Path]:
    """(parameters, counters) files of a run: derived from the run's id, so every
    worker (and the launcher, to clean up) finds the same ones."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    key = run_id(cfg)  # new per launch: a rerun never maps a stale file
    return root / f"psring-hogwild-{key}.params", root / f"psring-hogwild-{key}.counters"


#: a worker's slot in the third set of counters once it finished its last update
ENDED = 2


def _map(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


@STRATEGIES.register("hogwild")
class Hogwild(Strategy):
    name = "hogwild"
    # its workers share one memory, and have no device of their own to stand in for
    caps = Capabilities(synchronous=False, max_hosts=1, emulates_device=False,
                        devices=("cpu",))

    def setup(self, model: nn.Module) -> nn.Module:
        ctx = self.ctx
        if ctx.device.type != "cpu":
            raise ConfigError("hogwild shares CPU memory between worker processes; run it "
                              "with --device cpu.")
        if ctx.local_world != ctx.world:
            raise ConfigError(f"hogwild needs every worker on one host (shared memory), "
                              f"but only {ctx.local_world} of {ctx.world} are on this one.")
        params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        self.params_path, self.counters_path = shm_paths(ctx.cfg)
        if ctx.rank == 0:
            tmp = self.params_path.with_name(self.params_path.name + f".{os.getpid()}.tmp")
            _map(self.counters_path, 3 * ctx.world, torch.int64).zero_()
            flat = _map(tmp, total, torch.float32)
            flat.copy_(torch.cat([p.detach().reshape(-1) for p in params]))
            os.replace(tmp, self.params_path)  # publish: other workers wait for this name
        else:
            deadline = time.monotonic() + ctx.cfg.timeout
            while not self.params_path.exists():
                if time.monotonic() > deadline:
                    raise PsringError(f"worker {ctx.rank}: worker 0 did not publish the shared "
                                      f"parameters ({self.params_path}) within "
                                      f"{ctx.cfg.timeout:.0f} s.")
                time.sleep(0.01)
        self.flat = _map(self.params_path, total, torch.float32)
        # [updates begun per worker..., updates finished per worker..., ready (1) or
        # ended (2) per worker...]
        self.counters = _map(self.counters_path, 3 * ctx.world, torch.int64)
        off = 0
        for p in params:
            p.data = self.flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self._start_together()
        return model

    def _start_together(self) -> None:
        """Wait until every worker has mapped the shared model. Worker processes start
        hundreds of milliseconds apart; without this a short run's workers would not
        overlap at all, and Hogwild! would measure sequential SGD (no staleness, no
        contention)."""
        w, n = self.ctx.rank, self.ctx.world
        self.counters[2 * n + w] = 1
        deadline = time.monotonic() + self.ctx.cfg.timeout
        while int((self.counters[2 * n:] > 0).sum()) < n:
            if time.monotonic() > deadline:
                raise PsringError(f"hogwild: only {int((self.counters[2 * n:] > 0).sum())} of {n} "
                                  f"workers mapped the shared model within "
                                  f"{self.ctx.cfg.timeout:.0f} s.")
            time.sleep(0.001)

    def begin_step(self, step: int):
        self._seen = self.counters[:self.ctx.world].clone()
        return super().begin_step(step)

    def update(self, optimizer) -> None:
        w, n = self.ctx.rank, self.ctx.world
        self.counters[w] += 1  # update begun; only this worker writes its slots
        optimizer.step()  # straight into shared memory, no lock
        self.counters[n + w] += 1  # update done
        begun = self.counters[:n] - self._seen
        # other workers' updates begun since this step's forward: each one wrote the
        # parameters this step read, or overlapped this update
        self.stats.extra["staleness"] = int(begun.sum()) - int(begun[w])

    def finish_run(self, model: nn.Module) -> None:
        """This worker's last update is done: its slot of the third set says so (1 when
        it mapped the model, 2 when it ended)."""
        self.counters[2 * self.ctx.world + self.ctx.rank] = ENDED

    def _ended(self) -> int:
        """Workers that finished their last update."""
        n = self.ctx.world
        return int((self.counters[2 * n:3 * n] == ENDED).sum())

    def final_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # The model is final when every worker has finished its last update.
        n = self.ctx.world
        deadline = time.monotonic() + self.ctx.cfg.timeout
        while self._ended() < n:
            if time.monotonic() > deadline:
                raise PsringError(f"hogwild: {self._ended()} of {n} workers finished their "
                                  f"last update within {self.ctx.cfg.timeout:.0f} s.")
            time.sleep(0.005)
        return super().final_state(model)

    def close(self) -> None:
        # Worker 0 removes the files once the model is final (every worker has finished;
        # their mappings stay valid after an unlink). Under psring run the launcher also
        # removes them whatever happened; under torchrun this is the only cleanup.
        if self.ctx.rank == 0 and hasattr(self, "counters") and self._ended() == self.ctx.world:
            self.cleanup_run(self.ctx.cfg)

    @classmethod
    def cleanup_run(cls, cfg: RunConfig) -> None:
        for p in shm_paths(cfg):
            p.unlink(missing_ok=True)
