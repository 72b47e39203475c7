"""The measuring processes of ``psring calibrate`` (psring.predict.measure): two
processes ping-pong messages over ZeroMQ or gloo along a ladder of sizes, on this host or
on two emulated hosts joined by a link (:class:`Link`), and send back their one-way
times.

Every measuring process runs under a deadline (:func:`run_pair`): it is joined, and
killed once the pair makes no progress for the deadline (or runs past four of them); it
also dies with its parent (PR_SET_PDEATHSIG), so nothing outlives it. The processes
import zmq and torch themselves: the parent needs neither to run them.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import statistics as st
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from psring.cluster.emulate import HOST_IFACE, enter
from psring.comm.endpoints import ABSTRACT_IPC, abstract_ipc_endpoint
from psring.errors import PsringError
from psring.runtime.process import die_with_parent, free_port

KB, MB = 1024, 1024 * 1024
#: message sizes of the ping-pongs: from latency-bound to bandwidth-bound. They stop at
#: 16 MB: psring's messages are gradient buckets (25 MB by default) or pieces of them, and
#: a 64 MB message measured half the bandwidth of a 16 MB one here (above glibc's 32 MB
#: mmap threshold every receive buffer is fresh memory, page-faulted in)
SIZES = [1 * KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB]
QUICK_SIZES = [1 * KB, 16 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB]
#: pyzmq's own threshold (zmq.COPY_THRESHOLD): below it a copy is cheaper than zero-copy
ZERO_COPY_FROM = 64 * KB
#: deadline for one pair of measuring processes: without progress (start-up included),
#: and each blocking call's own timeout inside them
PAIR_TIMEOUT_S, QUICK_PAIR_TIMEOUT_S = 60.0, 25.0
#: a pair that keeps making progress may run this many deadlines in all: a loaded machine
#: (a test suite beside it) slows every round trip, and the ladder's hundreds of them
#: then outlast one deadline without anything being stuck
PAIR_DEADLINES = 4
#: seconds between a measuring process's progress reports at most
TICK_S = 0.5


def _no_progress_report() -> None:
    """The parent's own calls (no pair to report to) report nothing."""


#: a measuring process reports progress to run_pair through this (_child sets it)
progress: Callable[[], None] = _no_progress_report


def _reps(size: int, quick: bool, budget: int | None = None) -> int:
    """Round trips per size: many for small messages (cheap, noisy), fewer for large
    ones (about 1 GB of traffic per size; 32 MB in quick mode; across an emulated link,
    what it carries in about a second: ``budget``). The full run still takes only
    ~10 s on 2 cores; the repeats are there for stable medians on a noisy shared
    machine."""
    if budget is None:
        budget = 32 * MB if quick else 1024 * MB
    lo, hi = (6, 200) if quick else (15, 5000)
    if budget < 32 * MB:  # a slow link: fewer repeats of the large messages
        lo = 2 if quick else PASSES
    return max(lo, min(hi, budget // size))


#: passes over the ladder of sizes (alternately up and down), each doing its share of a
#: size's round trips: a slow spell of the machine then lands on every size alike
#: instead of skewing one size (and the fit) — small gloo messages on 2 shared cores
#: were seen to take 2-10 ms instead of 30 µs for a second at a time
PASSES, QUICK_PASSES = 5, 2
#: round trips per size discarded first (connection set-up, page faults, the peer still
#: starting up)
WARMUP = 3


def ladder(sizes: list[int], quick: bool, roundtrip: Callable[[int], float],
           budget: int | None = None) -> list[list[float]]:
    """[[size, median, 25th percentile, 75th percentile], ...] of each size's one-way
    times (round trips halved); the quartiles show how noisy the median was.
    ``roundtrip(size)`` does one round trip and returns its seconds. Both sides of a
    ping-pong that must mirror each other run this same schedule."""
    passes = QUICK_PASSES if quick else PASSES
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for size in sizes:
        for _ in range(WARMUP):
            roundtrip(size)
        progress()
    for k in range(passes):
        for size in (sizes if k % 2 == 0 else sizes[::-1]):
            for _ in range(-(-_reps(size, quick, budget) // passes)):
                times[size].append(roundtrip(size))
            progress()
    rows = []
    for size in sizes:
        q1, _, q3 = st.quantiles(times[size], n=4)
        rows.append([size, st.median(times[size]) / 2, q1 / 2, q3 / 2])
    return rows


# -- running measuring processes -------------------------------------------------------

def _ticker(conn) -> Callable[[], None]:
    """A measuring process's progress report: ("tick", None) to run_pair, at most one
    every TICK_S."""
    last = [time.monotonic()]

    def tick() -> None:
        now = time.monotonic()
        if now - last[0] >= TICK_S:
            last[0] = now
            conn.send(("tick", None))

    return tick


def _child(fn: Callable[..., Any], rank: int, args: tuple, conn, parent_pid: int,
           where: tuple[list[dict], str] | None = None) -> None:
    """Entry of every measuring process: die with the parent, move onto its emulated
    host if ``where`` = (hosts' states, mode) says so, run ``fn``, send back ("ok",
    result) or ("error", traceback), then leave without interpreter finalization
    (gloo's C++ static destructors can abort a cleanly finished process at exit)."""
    global progress
    os.environ["PSRING_PARENT_PID"] = str(parent_pid)
    die_with_parent()
    progress = _ticker(conn)
    try:
        if where is not None:

            enter(where[0][rank], where[1])  # still single-threaded, as setns needs
            os.environ["GLOO_SOCKET_IFNAME"] = HOST_IFACE
        conn.send(("ok", fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the parent is gone; nothing to tell
            pass
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_pair(fn: Callable[..., Any], args: tuple, timeout: float, what: str,
             where: tuple[list[dict], str] | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` for ranks 0 and 1 in two spawned processes; return their
    results. ``where``: (two emulated hosts' states, the cluster's mode), rank r runs on
    host r. The pair has ``timeout`` seconds from its start or from either process's
    last progress report (:data:`progress`), and PAIR_DEADLINES of them in all; a process
    still alive then is killed, and every process is joined before this returns or
    raises."""
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    deadline, last_call = start + timeout, start + PAIR_DEADLINES * timeout
    procs, conns = [], []
    finished = False
    try:
        for rank in range(2):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, args, send, os.getpid(), where),
                            name=f"psring-calibrate-{what}-{rank}", daemon=True)
            p.start()
            send.close()  # the child holds the only write end: EOF if it dies
            procs.append(p)
            conns.append(recv)
        got: dict[int, Any] = {}
        while len(got) < len(conns):
            left = deadline - time.monotonic()
            pending = [c for r, c in enumerate(conns) if r not in got]
            ready = mp_connection.wait(pending, timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                raise PsringError(_overdue(what, timeout, deadline >= last_call,
                                           time.monotonic() - start,
                                           [r for r in range(len(conns)) if r not in got]))
            for conn in ready:
                rank = conns.index(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    raise PsringError(f"calibrate: the {what} measuring process {rank} died "
                                      f"(exit code {procs[rank].exitcode}) without a "
                                      f"result.") from None
                if status == "tick":
                    deadline = min(last_call, time.monotonic() + timeout)
                    continue
                # the first failure is the cause; the other process then only times out
                if status != "ok":
                    raise PsringError(f"calibrate: the {what} measurement failed in "
                                      f"process {rank}:\n{value.rstrip()}")
                got[rank] = value
        finished = True
        return [got[r] for r in range(len(conns))]
    finally:
        # After a success the processes are leaving on their own; after a failure the
        # survivor would only wait for its peer until its own timeout: kill it now.
        for p in procs:
            p.join(timeout=max(0.5, deadline - time.monotonic()) if finished else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()


def _overdue(what: str, timeout: float, capped: bool, ran: float, late: list[int]) -> str:
    """run_pair's error for a pair past its deadline: stalled, or (``capped``: the
    deadline was the last of PAIR_DEADLINES) slow throughout."""
    if capped:
        why = (f"did not finish within {PAIR_DEADLINES * timeout:.0f} s, though it kept "
               f"making progress")
    else:
        why = f"made no progress for {timeout:.0f} s (after {ran:.0f} s)"
    return (f"calibrate: the {what} measurement {why}; process {late} still running. "
            f"The machine may be overloaded (other work on its cores): retry when it is "
            f"quieter.")


# -- ZeroMQ ------------------------------------------------------------------------------

def _zmq_pingpong(rank: int, addr: str, sizes: list[int], quick: bool,
                  timeout_s: float, budget: int | None = None) -> list[list[float]] | None:
    """Rank 0 echoes every message back (the received frame itself, no copy); rank 1
    times round trips and returns [[size, one-way seconds], ...]. An empty message ends
    the echo. Every blocking call has a timeout, so a lost peer cannot hang either."""
    import zmq

    zctx = zmq.Context()
    s = zctx.socket(zmq.PAIR)
    s.setsockopt(zmq.LINGER, 0)
    ms = int(timeout_s * 1000)
    s.setsockopt(zmq.RCVTIMEO, ms)
    s.setsockopt(zmq.SNDTIMEO, ms)
    try:
        if rank == 0:
            s.bind(addr)
            while True:
                frame = s.recv(copy=False)
                if len(frame) == 0:
                    return None
                s.send(frame, copy=len(frame) < ZERO_COPY_FROM)
        s.connect(addr)
        # not all zeros, built fast; sent as the protocol sends tensors
        bufs = {size: bytearray(os.urandom(64)) * (size // 64) for size in sizes}

        def roundtrip(size: int) -> float:
            t0 = time.perf_counter()
            s.send(bufs[size], copy=size < ZERO_COPY_FROM)
            reply = s.recv(copy=False)
            dt = time.perf_counter() - t0
            if len(reply) != size:
                raise RuntimeError(f"echo of {size} bytes came back with {len(reply)}")
            return dt

        out = ladder(sizes, quick, roundtrip, budget)
        s.send(b"")
        return out
    finally:
        s.close(linger=0)
        zctx.term()


def measure_zmq(sizes: list[int], quick: bool, link: "Link | None" = None
                ) -> tuple[list[list[float]], dict]:
    """(ladder rows, {}) of the ZeroMQ ping-pong across ``link``, or on this host over
    the transport its runs use between workers and servers (psring.runs.launch.local_ipc:
    Unix sockets on Linux). Either way nothing outside can connect."""
    timeout = QUICK_PAIR_TIMEOUT_S if quick else PAIR_TIMEOUT_S
    if link:
        host, budget, where = link.args()
        addr = f"tcp://{host}:{free_port()}"
    elif ABSTRACT_IPC:  # as psring.runs.launch.local_ipc chooses for a run's own servers
        addr, budget, where = abstract_ipc_endpoint("psring-calibrate"), None, None
    else:
        addr, budget, where = f"tcp://127.0.0.1:{free_port()}", None, None
    _, points = run_pair(_zmq_pingpong, (addr, sizes, quick, timeout, budget),
                         timeout, "ZeroMQ", where)
    return points, {}


# -- torch.distributed (gloo) ---------------------------------------------------------------

def _gloo_pingpong(rank: int, port: int, sizes: list[int], quick: bool,
                   timeout_s: float, host: str = "127.0.0.1", budget: int | None = None,
                   collectives: bool = True) -> tuple[list[list[float]], dict]:
    """send/recv ping-pong between two gloo ranks; rank 0 times it. Then gloo's own
    collectives over the same sizes, {"dist_allreduce", and with ``collectives``
    "dist_reduce_scatter", "dist_all_gather": [[bytes of the full tensor, median s]]}.
    Both ranks return the same shape; the parent keeps rank 0's."""
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    try:
        peer = 1 - rank
        bufs = {size: torch.ones(size // 4, dtype=torch.float32) for size in sizes}

        def roundtrip(size: int) -> float:
            t = bufs[size]
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
            return time.perf_counter() - t0

        dist.barrier()
        out = ladder(sizes, quick, roundtrip, budget)
        ops = {"dist_allreduce": lambda size: dist.all_reduce(bufs[size])}
        if collectives:  # what one host's strategies call besides all_reduce
            # (imported here, as torch is: the parent and the ZeroMQ pair run without it)
            from psring.comm.interconnect import flat_collectives

            rs, ag = flat_collectives()  # (as psring.comm.interconnect calls them)
            half = {size: torch.empty(size // 8, dtype=torch.float32) for size in sizes}
            ops["dist_reduce_scatter"] = lambda size: rs(half[size], bufs[size])
            ops["dist_all_gather"] = lambda size: ag(bufs[size], half[size])
        timed = {name: [[size, _time_op(dist, op, size, WARMUP + max(
                    5, _reps(size, quick, budget) // 8))] for size in sizes]
                 for name, op in ops.items()}
        # rank 0 hosts the rendezvous store: nobody tears down while the other uses it
        dist.barrier()
        return out, timed
    finally:
        dist.destroy_process_group()


def measure_gloo(sizes: list[int], quick: bool, link: "Link | None" = None
                 ) -> tuple[list[list[float]], dict]:
    """(ladder rows of the send/recv ping-pong, the collectives' rows by name), on
    loopback (all three collectives) or across ``link`` (all_reduce, as a check)."""
    timeout = QUICK_PAIR_TIMEOUT_S if quick else PAIR_TIMEOUT_S
    host, budget, where = link.args() if link else ("127.0.0.1", None, None)
    (points, timed), _ = run_pair(
        _gloo_pingpong, (free_port(), sizes, quick, timeout, host, budget, link is None),
        timeout, "gloo", where)
    return points, timed


def _time_op(dist: Any, op: Callable[[int], Any], size: int, reps: int) -> float:
    """Median seconds of a collective over ``reps`` (the first WARMUP discarded), both
    ranks starting together: time the collective, not the skew between them."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        op(size)
        times.append(time.perf_counter() - t0)
    progress()
    return st.median(times[WARMUP:])


class Link:
    """Two emulated hosts joined by links of a rate (psring.cluster.emulate): where the
    measuring pair runs when calibrating a link."""

    def __init__(self, cluster: Any, bits: float, quick: bool):
        self.cluster, self.bits, self.quick = cluster, bits, quick

    def args(self) -> tuple[str, int, tuple[list[dict], str]]:
        """(rank 0's address, bytes per size to move, where the ranks run)."""
        hosts = [self.cluster.host("host-0"), self.cluster.host("host-1")]
        # about a second of the link per size (a quarter in quick mode)
        budget = int(self.bits / 8 * (0.25 if self.quick else 1.0))
        return hosts[0]["address"], budget, (hosts, self.cluster.mode)

    def sizes(self, sizes: list[int]) -> list[int]:
        """The ladder up to what crosses the link in ~0.1 s (at least 1 MB): β is read
        off the large messages, and larger ones only take longer."""
        top = max(MB, self.bits / 8 * 0.1)
        return [s for s in sizes if s <= top]
