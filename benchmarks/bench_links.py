"""Emulated-cluster benchmarks (psring.cluster.emulate): figures measured side by side in one run.

    .venv/bin/python benchmarks/bench_links.py [--quick] [--only fidelity|ring|sharded]

Needs what psring's emulated hosts need: root, or user namespaces (docs/emulation.md).

1. Link fidelity: one TCP stream moves ~2 s worth of bytes between two emulated hosts
   joined by links of RATE (100 Mbit/s ... 5 Gbit/s); the receiver times it. Printed:
   the payload it got per second as a share of RATE, and the same counted as the link
   counts it (tbf shapes whole frames: 1514 bytes on the wire per 1448 of payload).
   Target: 90-105% of RATE.
2. Ring fidelity: gloo's ring all-reduce (torch.distributed, 50 MB, one rank per host)
   over 4 emulated hosts at rates around the ones device mode emulates; rank 0 times
   three all-reduces after a warm-up. Printed: the bytes each host's link carries per
   all-reduce, 2 (W-1)/W x 50 MB, per second of the median, as a share of RATE.
   Target: 90-105%, as for one stream.
3. Sharded parameter servers on hosts of their own: 4 workers on 4 hosts joined by
   100 Mbit/s links (link-bound: 1.6 MB of gradients per step), `psring run --strategy
   ps` with K = 1, 2, 4 servers, placed on hosts of their own and colocated with the
   workers, each a separate run through the CLI as a user starts it, contenders
   alternated round by round (the first of each round alternates too). Figure: the
   median per-step communication time (as `psring report` defines it) of each, and
   its ratio to K = 1 of the same placement, per round; the median over rounds.
   Target: own hosts, K = 2 at most 0.6x of K = 1, and K = 4 lower again.
"""

from __future__ import annotations

import argparse
import shutil
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psring.cluster.emulate import standalone
from psring.cluster.shaping import tbf_params
from psring.units import PAYLOAD_FRACTION, parse_rate

RATES = ["100mbit", "200mbit", "500mbit", "1gbit", "2gbit", "5gbit"]

_RECEIVE = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; first = t0 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:  # time from the first bytes: connection set-up is not the link's
        t0, first = time.perf_counter(), k
    n += k
print(n - first, time.perf_counter() - t0, flush=True)
"""

_SEND = r"""
import socket, sys
total = int(sys.argv[2]); s = socket.create_connection((sys.argv[1], 5001))
chunk = b"\x5a" * (1 << 20); sent = 0
while sent < total:
    s.sendall(chunk); sent += len(chunk)
s.close()
"""


def transfer(cluster, bits: float, seconds: float) -> float:
    """Payload bits per second of one bulk TCP transfer from host-0 to host-1."""
    dst = cluster.host("host-1")["address"]
    recv = subprocess.Popen(cluster.command("host-1", [sys.executable, "-c", _RECEIVE, dst]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        subprocess.run(cluster.command("host-0", [sys.executable, "-c", _SEND, dst,
                                                  str(int(bits / 8 * seconds))]),
                       check=True, timeout=60)
        n, dt = recv.stdout.readline().split()
        return int(n) * 8 / float(dt)
    finally:
        recv.kill()
        recv.wait()


_RING = r"""
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, addr, mb = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29555", rank=rank,
                        world_size=world, timeout=__import__("datetime").timedelta(seconds=120))
t = torch.ones(int(mb * 2**20 / 4))
dist.all_reduce(t)
ts = []
for _ in range(3):
    t0 = time.perf_counter(); dist.all_reduce(t); ts.append(time.perf_counter() - t0)
if rank == 0:
    print(sorted(ts)[1], flush=True)
dist.destroy_process_group()
"""


def ring(cluster, hosts: int, mb: float) -> float:
    """Median seconds of one gloo all-reduce of ``mb`` MiB, one rank per host."""
    addr = cluster.host("host-0")["address"]
    procs = [subprocess.Popen(cluster.command(f"host-{r}", [sys.executable, "-c", _RING, str(r),
                                                            str(hosts), addr, str(mb)]),
                              stdout=subprocess.PIPE, text=True) for r in range(hosts)]
    try:
        out = procs[0].communicate(timeout=300)[0]
        for p in procs:
            if p.wait(timeout=60) != 0:
                raise SystemExit("a ring rank failed")
        return float(out)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def bench_ring(quick: bool) -> None:
    hosts, mb = 4, 50.0
    print(f"\n2. ring fidelity: gloo all-reduce of {mb:g} MB, {hosts} hosts, one rank each")
    print(f"   {'RATE':>8}  {'burst':>7}  {'link carries/RATE':>17}")
    for rate in (["500mbit", "1gbit"] if quick else ["250mbit", "400mbit", "500mbit", "1gbit"]):
        bits = parse_rate(rate)
        with standalone(hosts, rate) as cluster:
            t = ring(cluster, hosts, mb)
        carried = 2 * (hosts - 1) / hosts * mb * 2**20 * 8
        print(f"   {rate:>8}  {tbf_params(bits)[0]:7d}  {carried / t / bits:17.1%}", flush=True)


def bench_fidelity(quick: bool) -> None:
    print("1. link fidelity: one TCP stream between two emulated hosts")
    print(f"   {'RATE':>8}  {'payload/RATE':>12}  {'on the wire/RATE':>16}   (3 transfers each)")
    for rate in (RATES[::2] if quick else RATES):
        bits = parse_rate(rate)
        with standalone(2, rate) as cluster:
            got = [transfer(cluster, bits, 1.0 if quick else 2.0) for _ in range(3)]
        share = st.median(got) / bits
        print(f"   {rate:>8}  {share:12.1%}  {share / PAYLOAD_FRACTION:16.1%}   "
              f"(payload {', '.join(f'{g / 1e6:.0f}' for g in got)} Mbit/s)")


#: 1.6 MB of gradients: link-bound at 100 Mbit/s (~0.13 s per copy over one link)
WORKLOAD = ["--model", "mlp", "--width", "512", "--depth", "2", "--batch-size", "64",
            "--timeout", "120"]


def ps_run(out: Path, servers: int, placement: str, steps: int) -> float:
    """Median communication time per step (s) of one `psring run`, as reports show it."""
    from psring.report.points import load_point

    proc = subprocess.run([sys.executable, "-m", "psring", "run", "--strategy", "ps",
                           "--workers", "4", "--hosts", "4", "--link", "100mbit",
                           "--servers", str(servers), "--server-placement", placement,
                           *WORKLOAD, "--steps", str(steps), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"psring run failed:\n{proc.stderr}")
    return load_point(out)["comm_time_s"]


def bench_sharded(quick: bool) -> None:
    rounds, steps = (2, 6) if quick else (3, 10)
    contenders = [(k, p) for p in ("own-hosts", "colocated") for k in (1, 2, 4)]
    print(f"\n3. sharded PS, 4 workers on 4 hosts, 100 Mbit/s links, {steps} steps, "
          f"{rounds} rounds of {len(contenders)} runs (alternated)")
    times: dict[tuple[int, str], list[float]] = {c: [] for c in contenders}
    tmp = Path(tempfile.mkdtemp(prefix="bench-links-"))
    try:
        for r in range(rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            for k, p in order:
                t0 = time.monotonic()
                times[(k, p)].append(ps_run(tmp / f"r{r}-{p}-k{k}", k, p, steps))
                print(f"   round {r + 1}: K={k} {p:<9} comm {times[(k, p)][-1] * 1e3:7.1f} "
                      f"ms/step  ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"   {'placement':<10} {'K':>2} {'comm ms/step':>13} {'vs K=1 (per round)':>26}")
    for k, p in contenders:
        ratios = [a / b for a, b in zip(times[(k, p)], times[(1, p)])]
        print(f"   {p:<10} {k:>2} {st.median(times[(k, p)]) * 1e3:13.1f} "
              f"{st.median(ratios):8.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rates, rounds and steps")
    ap.add_argument("--only", choices=("fidelity", "ring", "sharded"), default=None)
    args = ap.parse_args()
    if args.only in (None, "fidelity"):
        bench_fidelity(args.quick)
    if args.only in (None, "ring"):
        bench_ring(args.quick)
    if args.only in (None, "sharded"):
        bench_sharded(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
