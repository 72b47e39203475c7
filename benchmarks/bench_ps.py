"""Parameter-server benchmarks: ratios measured side by side in one run.

    .venv/bin/python benchmarks/bench_ps.py [--quick]      (make bench runs it too)

1. A synchronous PS round, N=2 workers each pushing M bytes (in 4 MiB pieces, as
   buckets) and pulling M bytes through one psring server (msgpack header,
   validation, summation, SGD update, pieces landing as the worker's parameters), vs the
   transport bound: raw pyzmq moving the same 2·N·M bytes through one relay process
   (each client sends M, the relay answers with M; no header, no arithmetic). The
   relay answers once all N messages are in (as a synchronous round must) or each at
   once (full duplex); each repetition's PS round is divided by the faster of the two
   measured right beside it, and the median of these paired ratios is the figure. Both
   go over abstract Unix sockets, as ``psring run``'s servers do on one Linux host, and
   the relay has as many ZeroMQ I/O threads as a psring server.
   Target: <= 1.25x at M >= 16 MB.
2. The same round with M = 10 KB: median round time. Target: <= 1 ms.
3. ``--servers 2`` vs ``--servers 1``: the same round with the M bytes sharded across
   two server processes (on 2 cores they share the CPU with the workers).

Also printed, to explain figure 1: the server's arithmetic for one round measured
alone (summing N pushes into the update and applying it, range by range, on data not
in cache), as a share of the raw transport time. On 2 cores, already saturated by
the transport, that work cannot overlap, so raw·(1 + share) is the floor of figure 1.

Workers are processes using psring's own client (``PSClient``); servers are
``python -m psring.servers`` processes; rounds alternate between contenders.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics as st
import subprocess
import sys
import time

import torch
import zmq

from psring.comm.endpoints import abstract_ipc_endpoint
from psring.comm.partition import even_split

N = 2


def endpoint() -> str:
    """Where a server or relay listens: an abstract Unix socket, as ``psring run``'s own
    servers do on one Linux host (--transport auto)."""
    return abstract_ipc_endpoint("psring-bench")


def start_server(addr: str, servers: int) -> subprocess.Popen:
    from psring.runtime.process import server_threads

    return subprocess.Popen([sys.executable, "-m", "psring.servers", "--bind",
                             addr], stdout=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": str(server_threads(servers, N))})


CHUNK = 2**20  # elements: 4 MiB of float32


def chunks(lo: int, hi: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, hi)) for a in range(lo, hi, CHUNK)]


def ps_worker(rank: int, addrs: list[str], numel: int, rounds: int, run: str, q) -> None:
    from psring.comm.psclient import PSClient

    torch.set_num_threads(1)
    client = PSClient(addrs, run=run, worker=rank, timeout=60)
    ranges = even_split(numel, len(addrs))
    flat = torch.randn(numel)
    grad = torch.full((numel,), 1e-6)
    if rank == 0:
        keys = [client.send(k, "init", {"lo": lo, "hi": hi, "workers": N, "mode": "sync",
                                        "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0,
                                        "max_staleness": -1}, [flat[lo:hi]])
                for k, (lo, hi) in enumerate(ranges)]
        client.wait(keys, "init")
    pieces: dict[int, torch.Tensor] = {}

    def into_flat(msg) -> None:
        # What the ps strategy does with a piece on the CPU: parameters inside it become
        # views of the received frame (no copy). Parameters cut by a shard boundary
        # are copied instead; with one "parameter" per 4 MiB piece there are none here.
        pieces[msg.header["offset"]] = msg.tensors[0]

    client.wait([client.pull(k, 0, hi - lo, into_flat) for k, (lo, hi) in enumerate(ranges)],
                "pull")
    times = []
    for step in range(rounds):
        t0 = time.perf_counter()
        # pushed in 4 MiB pieces, as gradient buckets would be
        keys = [client.send(k, "push", {"step": step, "offset": a}, [grad[a:b]])
                for k, (lo, hi) in enumerate(ranges) for a, b in chunks(lo, hi)]
        keys += [client.pull(k, step + 1, hi - lo, into_flat)
                 for k, (lo, hi) in enumerate(ranges)]
        client.wait(keys, "round")
        times.append(time.perf_counter() - t0)
    client.close()
    q.put((rank, times))


def relay(addr: str, nbytes: int, ready, barrier: bool) -> None:
    """Raw transport: answer every message with nbytes (a preallocated buffer); with
    ``barrier``, answer only once all N clients' messages are in (a synchronous round's
    order of events), else answer each at once (full duplex, the looser bound)."""
    from psring.servers.server import default_io_threads

    # as many I/O threads as a psring server has: the same transport, without the rest
    ctx = zmq.Context(io_threads=default_io_threads())
    s = ctx.socket(zmq.ROUTER)
    s.bind(addr)
    out = bytearray(nbytes)
    ready.set()
    waiting = []
    while True:
        frames = s.recv_multipart(copy=False)
        if len(frames[1]) == 0:
            break
        waiting.append(frames[0])
        if not barrier or len(waiting) == N:
            for peer in waiting:
                s.send_multipart([peer, out], copy=False)
            waiting = []
    s.close(linger=0)
    ctx.term()


def raw_worker(rank: int, addr: str, nbytes: int, rounds: int, q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(addr)
    buf = bytearray(nbytes)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        s.send(buf, copy=False)
        reply = s.recv(copy=False)
        assert len(reply) == nbytes
        times.append(time.perf_counter() - t0)
    q.put((rank, times))
    s.close(linger=0)
    ctx.term()


def server_arithmetic(numel: int, reps: int = 15) -> float:
    """Median seconds of one sync round's server arithmetic (N pushes per 4 MiB range
    summed into the momentum buffer, then SGD), with the cache flushed between rounds."""
    from psring.servers.store import ShardStore

    torch.set_num_threads(1)
    store = ShardStore(0, numel, torch.randn(numel), lr=0.01, momentum=0.9, weight_decay=0.0)
    flush = torch.zeros(64 * 2**20 // 4)
    times = []
    for _ in range(reps):
        grads = [torch.randn(numel) for _ in range(N)]
        flush.add_(1)
        t0 = time.perf_counter()
        for a, b in chunks(0, numel):
            store.begin(grads[0][a:b], a)
            for g in grads[1:-1]:
                store.add(g[a:b], a)
            store.finish(grads[-1][a:b], a)
        times.append(time.perf_counter() - t0)
    return st.median(times)


def run_ps(numel: int, servers: int, rounds: int) -> float:
    addrs = [endpoint() for _ in range(servers)]
    procs = [start_server(a, servers) for a in addrs]
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        run = f"bench-{time.time_ns()}"
        ws = [ctx.Process(target=ps_worker, args=(r, addrs, numel, rounds, run, q))
              for r in range(N)]
        for w in ws:
            w.start()
        res = dict(q.get(timeout=600) for _ in ws)
        for w in ws:
            w.join(timeout=30)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
    # a round lasts as long as its slower worker; skip the first (connection set-up)
    per_round = [max(res[r][i] for r in range(N)) for i in range(1, rounds)]
    return st.median(per_round)


def run_raw(nbytes: int, rounds: int, barrier: bool) -> float:
    ctx = mp.get_context("spawn")
    addr = endpoint()
    ready = ctx.Event()
    rel = ctx.Process(target=relay, args=(addr, nbytes, ready, barrier))
    rel.start()
    ready.wait(30)
    q = ctx.Queue()
    ws = [ctx.Process(target=raw_worker, args=(r, addr, nbytes, rounds, q)) for r in range(N)]
    for w in ws:
        w.start()
    res = dict(q.get(timeout=600) for _ in ws)
    for w in ws:
        w.join(timeout=30)
    zc = zmq.Context()
    s = zc.socket(zmq.DEALER)
    s.connect(addr)
    s.send(b"")
    rel.join(timeout=30)
    s.close(linger=0)
    zc.term()
    per_round = [max(res[r][i] for r in range(N)) for i in range(1, rounds)]
    return st.median(per_round)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 2 if args.quick else 8
    big_rounds, small_rounds = (8, 100) if args.quick else (15, 400)
    mb = 16
    numel = mb * 2**20 // 4
    res: dict[str, list[float]] = {"ps1": [], "sync-raw": [], "raw": [], "ps2": []}
    print(f"psring PS benchmark (N={N} workers, {os.cpu_count()} cores, ipc (Unix sockets), "
          f"{reps} repetitions alternated)", flush=True)
    t0 = time.perf_counter()
    for i in range(reps):
        for name in (list(res) if i % 2 == 0 else list(res)[::-1]):
            if name.endswith("raw"):
                res[name].append(run_raw(numel * 4, big_rounds, barrier=name == "sync-raw"))
            else:
                res[name].append(run_ps(numel, int(name[-1]), big_rounds))
            # (on stderr: where the time goes, should a machine be slow to start processes)
            print(f"  [{time.perf_counter() - t0:6.1f} s] repetition {i + 1}: {name} "
                  f"{res[name][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    # Pair each repetition's PS round with the raw transport measured right beside it
    # (the faster of the two relays: the strictest bound), then take the median ratio.
    ratios = [p / min(a, b) for p, a, b in zip(res["ps1"], res["sync-raw"], res["raw"])]
    ps1, sraw, raw, ps2 = (st.median(res[k]) for k in ("ps1", "sync-raw", "raw", "ps2"))
    print(f"1. sync round, M = {mb} MiB, 1 server: {ps1 * 1e3:.1f} ms. Raw pyzmq moving the "
          f"same 2*N*M bytes through one process: {sraw * 1e3:.1f} ms answering once all N "
          f"are in, {raw * 1e3:.1f} ms answering each at once. Paired ratio to the faster "
          f"raw relay of the same repetition: median {st.median(ratios):.2f} (target <= "
          f"1.25; per repetition {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    arith = server_arithmetic(numel)
    floor = 1 + arith / min(sraw, raw)
    print(f"   the server's arithmetic for that round, alone: {arith * 1e3:.1f} ms = "
          f"{arith / min(sraw, raw):.0%} of the faster raw round; with no core free to "
          f"overlap it, the ratio's floor is {floor:.2f}", flush=True)
    print(f"3. sync round, M = {mb} MiB: 2 servers {ps2 * 1e3:.1f} ms vs 1 server "
          f"{ps1 * 1e3:.1f} ms -> 2 servers are {ps1 / ps2:.2f}x as fast", flush=True)
    small = st.median(run_ps(10 * 1024 // 4, 1, small_rounds) for _ in range(reps))
    small_raw = st.median(run_raw(10 * 1024, small_rounds, barrier=True) for _ in range(reps))
    print(f"2. sync round, M = 10 KiB, 1 server: median {small * 1e3:.3f} ms (target <= 1 ms); "
          f"raw pyzmq (synchronous): {small_raw * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
