"""The parameter server's round as a run pays it: ``psring calibrate``'s PS probe.

The ping-pong (psring.predict.pingpong) times ZeroMQ alone; a ``ps`` step also pays
psring's server (one Python thread receiving, validating, summing, updating and
answering), its client and the copies between them, and how much of that a machine's
extra cores take off depends on the machine: on one 16-core GPU box the ring got 4x
faster than on a 2-core VM while the same PS round did not move. So the calibration
also times the real thing: one ``python -m psring.servers`` process, started with the
torch threads a run would give it on this machine's cores
(psring.runtime.process.server_threads), and :data:`WORKERS` processes with psring's
own client, each pushing M bytes (in 4 MiB pieces, as buckets) and pulling M back per
round, as bench_ps.py's round does. ``Calibration.ps_round`` keeps the fitted line
round(M) = α + M·β; the cost models read it through ``Calibration.link`` (the PS's
transport is then never priced faster than this round allows).

Every process runs under the pair's deadline (pingpong.run_pair: each round reports
progress) and dies with this one; the server is killed and reaped before this returns or
raises.
"""

from __future__ import annotations

import os
import statistics as st
import subprocess
import sys
import time

from psring.comm.endpoints import ABSTRACT_IPC, abstract_ipc_endpoint
from psring.errors import PsringError
from psring.predict import pingpong
from psring.predict.calibration import PS_ROUND_WORKERS
from psring.predict.pingpong import MB, QUICK_PAIR_TIMEOUT_S, run_pair
from psring.runtime.process import free_port, server_threads

#: the probe's workers: run_pair's two processes, as compare's runs have
WORKERS = PS_ROUND_WORKERS
#: per worker and round: from where the round's fixed costs show to where its bytes do
SIZES = [1 * MB, 4 * MB, 16 * MB]
QUICK_SIZES = [1 * MB, 8 * MB]
#: bytes a push carries at most (a bucket's size in bench_ps.py)
PIECE = 4 * MB
#: bytes a worker pushes per size (its rounds: this over the size, within MIN_ROUNDS and
#: MAX_ROUNDS), after WARMUP untimed rounds: on 2 shared cores a 1 MB round's median over
#: 5 rounds ranged 1.5-3.1 ms from one calibration to the next
BUDGET, QUICK_BUDGET = 96 * MB, 32 * MB
MIN_ROUNDS, MAX_ROUNDS, WARMUP = 8, 64, 2
#: the probe's deadline (server start, both workers' imports, every round)
TIMEOUT_S, QUICK_TIMEOUT_S = 90.0, 2 * QUICK_PAIR_TIMEOUT_S


def _pieces(numel: int) -> list[tuple[int, int]]:
    step = PIECE // 4
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def rounds_for(size: int, quick: bool) -> int:
    """Timed rounds of ``size`` bytes a worker."""
    return max(MIN_ROUNDS, min(MAX_ROUNDS, (QUICK_BUDGET if quick else BUDGET) // size))


def _worker(rank: int, addr: str, sizes: list[int], quick: bool,
            timeout_s: float) -> list[list[float]]:
    """One probe worker: for each size, init (rank 0), pull, then timed rounds of
    push-all-pieces + pull; returns [[bytes, median round s], ...]. Both workers keep
    the same schedule, so a round is synchronous as a ps step's is."""
    import torch  # (in the measuring process only: the parent needs no torch to run it)

    from psring.comm.psclient import PSClient

    torch.set_num_threads(1)
    rows = []
    for size in sizes:
        # a run of its own per size (a server holds one run; a pull of a run not yet
        # initialized waits for rank 0's init)
        client = PSClient([addr], run=f"calibrate-{os.getppid()}-{size}", worker=rank,
                          timeout=timeout_s)
        try:
            numel = size // 4
            if rank == 0:
                client.wait([client.send(0, "init", {
                    "lo": 0, "hi": numel, "workers": WORKERS, "mode": "sync", "lr": 0.01,
                    "momentum": 0.9, "weight_decay": 0.0, "max_staleness": -1},
                    [torch.zeros(numel)])], "init")
            rows.append([size, _rounds(client, torch.full((numel,), 1e-6),
                                       rounds_for(size, quick))])
        finally:
            client.close()
    return rows


def _rounds(client, grad, rounds: int) -> float:
    """Median seconds of ``rounds`` push + pull rounds of ``grad``."""
    numel = grad.numel()
    pieces = {}

    def keep(msg) -> None:  # (as the ps strategy keeps a piece: a view of the frame)
        pieces[msg.header["offset"]] = msg.tensors[0]

    client.wait([client.pull(0, 0, numel, keep)], "pull")
    times = []
    for step in range(WARMUP + rounds):
        t0 = time.perf_counter()
        keys = [client.send(0, "push", {"step": step, "offset": a}, [grad[a:b]])
                for a, b in _pieces(numel)]
        keys.append(client.pull(0, step + 1, numel, keep))
        client.wait(keys, "round")
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
        pingpong.progress()  # (the module's: run_pair's child sets it)
    return st.median(times)


def _endpoint() -> str:
    """Where the probe's server listens: as a run's own servers do on one host."""
    if ABSTRACT_IPC:
        return abstract_ipc_endpoint("psring-calibrate-ps")
    return f"tcp://127.0.0.1:{free_port()}"


def probe_threads() -> int:
    """The server's torch threads: what a run with :data:`WORKERS` workers and one
    server gives it on this machine's cores."""
    return server_threads(1, WORKERS)


def fit_round(points: list[list[float]]) -> tuple[float, float]:
    """(α, β) of round(M) = α + M·β by least squares through [[M, seconds], ...]. Unlike
    the ping-pong's fit (psring.predict.measure.fit), the smallest size here is a MB,
    whose bytes are most of its time, so the intercept is fitted; it is kept at least
    a microsecond (a round has a latency) and β must come out positive."""
    n = len(points)
    if len({m for m, _ in points}) < 2:
        raise ValueError("fit_round needs at least two different sizes")
    mx = sum(m for m, _ in points) / n
    my = sum(t for _, t in points) / n
    beta = sum((m - mx) * (t - my) for m, t in points) / sum((m - mx) ** 2 for m, _ in points)
    if not beta > 0:
        shown = ", ".join(f"{m / MB:.0f} MB: {t * 1e3:.2f} ms" for m, t in points)
        raise PsringError(f"calibrate: the parameter-server round did not grow with its "
                          f"size ({shown}); the machine was probably too busy — retry.")
    return max(1e-6, my - beta * mx), beta


def measure_ps_round(quick: bool) -> list[list[float]]:
    """[[bytes per worker, median seconds of a round], ...]: :data:`WORKERS` workers
    through one psring server with the threads a run gives it on this machine."""
    sizes = QUICK_SIZES if quick else SIZES
    timeout = QUICK_TIMEOUT_S if quick else TIMEOUT_S
    addr = _endpoint()
    env = {**os.environ, "PSRING_PARENT_PID": str(os.getpid()),
           "OMP_NUM_THREADS": str(probe_threads())}
    server = subprocess.Popen([sys.executable, "-m", "psring.servers", "--bind", addr,
                               "--name", "calibrate"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        rows, _ = run_pair(_worker, (addr, sizes, quick, timeout), timeout,
                           "parameter-server round")
        return rows
    finally:
        server.kill()
        server.wait()
        server.stderr.close()

