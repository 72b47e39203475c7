"""How faithful the emulated links are: rate, delay and loss as set against as seen.

    python -m psring.cluster.linkcheck --link 100mbit --delay 2ms --loss 0.01
    python -m psring.cluster.linkcheck --delay 1us --seconds 3     # the forwarder's ceiling

Builds a two-host cluster (psring.cluster.emulate.standalone) and, from host-0 to
host-1, measures: the round trip of small UDP datagrams (each crosses four link
directions, so 4 x the delay is set), the share of a train of UDP datagrams that
arrives (each crosses two directions: 1 - (1 - loss)^2 is set), and a TCP stream's
goodput (the rate as set, less the headers: psring.units.PAYLOAD_FRACTION).
With the user-space links, the forwarders' own records say what they dropped and the
CPU they used. Prints one JSON object; docs/emulation.md shows what it measured here.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from psring.cluster.emulate import standalone
from psring.cluster.link import read_links
from psring.cluster.spec import LOSS_PATHS
from psring.units import PAYLOAD_FRACTION, parse_delay, parse_rate

PORT = 47000
_SELF = [sys.executable, "-m", "psring.cluster.linkcheck"]


def _echo(addr: str, count: int) -> None:
    """On host-1: echo ``count`` UDP datagrams, or until 5 s pass without one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, PORT))
    s.settimeout(5.0)
    try:
        for _ in range(count):
            data, peer = s.recvfrom(2048)
            s.sendto(data, peer)
    except TimeoutError:
        pass


def _sink(addr: str, count: int) -> None:
    """On host-1: count UDP datagrams until 0.5 s pass without one; print the count."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((addr, PORT))
    s.settimeout(10.0)
    n = 0
    try:
        while n < count:
            s.recv(2048)
            n += 1
            s.settimeout(0.5)
    except TimeoutError:
        pass
    print(n, flush=True)


def _marked_sink(addr: str, quiet_s: float) -> None:
    """On host-1: count UDP datagrams by their TOS byte until ``quiet_s`` pass without
    one (10 s for the first); print {tos: count}."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    s.bind((addr, PORT))
    s.settimeout(10.0)
    counts: dict[int, int] = {}
    try:
        while True:
            _, anc, _, _ = s.recvmsg(2048, 64)
            tos = anc[0][2][0] if anc else 0
            counts[tos] = counts.get(tos, 0) + 1
            s.settimeout(quiet_s)
    except TimeoutError:
        pass
    print(json.dumps(counts), flush=True)


def _marked_train(peer: str, count: int, gap_s: float, marks: list[int]) -> None:
    """``count`` datagrams of 1400 bytes, each TOS of ``marks`` in turn (one socket a
    mark), on a schedule ``gap_s`` apart (0: as fast as the socket takes them). The
    schedule, not a sleep per datagram, sets the rate: a sleep that wakes late is made
    up by sending the next ones at once, so a slow machine offers the same load."""
    socks = []
    for tos in marks:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        socks.append(s)
    payload = b"p" * 1400
    start = time.perf_counter()
    for i in range(count):
        if gap_s and (wait := start + i * gap_s - time.perf_counter()) > 0:
            time.sleep(wait)
        while True:
            try:
                socks[i % len(socks)].sendto(payload, (peer, PORT))
                break
            except OSError:  # ENOBUFS: the host's own queue is full; a moment
                time.sleep(1e-4)


def marks_delivered(link: str = "", loss: float = 0.0, link_buffer: str = "",
                    switch: str = "fifo", count: int = 6000, gap_s: float = 0.0,
                    marks: tuple[int, ...] = (0x20, 0x80, 0), seed: int = 0
                    ) -> dict[int, float]:
    """Two emulated hosts; host-0 sends ``count`` datagrams to host-1 cycling through
    the TOS ``marks`` (a bounded-loss datagram's priority marks, 0 unmarked): the
    fraction of each mark's datagrams that arrived, by mark."""
    with tempfile.TemporaryDirectory(prefix="psring-linkcheck-") as d, \
            standalone(2, link, "", Path(d), loss, 1.0, seed, link_buffer, switch) as cluster:
        peer = cluster.host("host-1")["address"]
        sink = _on(cluster, "host-1", "marked-sink", peer, "0.5")
        time.sleep(0.3)
        subprocess.run(cluster.command("host-0", [*_SELF, "marked-train", peer, str(count),
                                                  str(gap_s), ",".join(map(str, marks))]),
                       timeout=120, check=True)
        got = {int(k): v for k, v in json.loads(sink.communicate(timeout=60)[0]).items()}
    sent = {m: len(range(i, count, len(marks))) for i, m in enumerate(marks)}
    return {m: got.get(m, 0) / sent[m] for m in marks}


def _tcp_sink(addr: str) -> None:
    """On host-1: accept one TCP stream, print its bytes."""
    srv = socket.create_server((addr, PORT))
    conn, _ = srv.accept()
    n = 0
    while b := conn.recv(1 << 20):
        n += len(b)
    print(n, flush=True)


def _rtts(peer: str, count: int, gap_s: float, wait_s: float) -> list[float]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(wait_s)
    out = []
    for i in range(count):
        t0 = time.perf_counter()
        s.sendto(i.to_bytes(8, "little"), (peer, PORT))
        try:
            while int.from_bytes(s.recv(64), "little") != i:
                pass
            out.append(time.perf_counter() - t0)
        except TimeoutError:
            pass  # lost one way or the other
        time.sleep(gap_s)
    return out


def _train(peer: str, count: int, gap_s: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(count):
        s.sendto(i.to_bytes(8, "little") * 8, (peer, PORT))
        if gap_s:
            time.sleep(gap_s)


def _stream(peer: str, seconds: float) -> tuple[int, float]:
    s = socket.create_connection((peer, PORT), timeout=30)
    buf = b"x" * (1 << 18)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s.sendall(buf)
        n += len(buf)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the sink's close: everything arrived
    return n, time.perf_counter() - t0


def _on(cluster: Any, host: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(cluster.command(host, [*_SELF, *args]), stdout=subprocess.PIPE,
                            text=True)


def _client(cluster: Any, *args: str) -> Any:
    out = subprocess.run(cluster.command("host-0", [*_SELF, *args]), capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out)


def measure(link: str = "", delay: str = "", loss: float = 0.0, loss_burst: float = 1.0,
            seed: int = 0, pings: int = 200, datagrams: int = 4000, seconds: float = 3.0,
            log_dir: Path | None = None, loss_in: str = "forwarder") -> dict[str, Any]:
    """Build the two hosts, measure, take them down; the figures as set and as seen."""
    with tempfile.TemporaryDirectory(prefix="psring-linkcheck-") as tmp:
        d = Path(log_dir or tmp)
        out = _measure(d, link, delay, loss, loss_burst, seed, pings, datagrams, seconds,
                       loss_in)
        # the forwarders write their records when the cluster stops
        out["forwarders"] = read_links(d)
    return out


def _measure(d: Path, link: str, delay: str, loss: float, loss_burst: float, seed: int,
             pings: int, datagrams: int, seconds: float, loss_in: str) -> dict[str, Any]:

    out: dict[str, Any] = {"link": link, "delay": delay, "loss": loss, "loss_burst": loss_burst,
                           "loss_in": loss_in}
    with standalone(2, link, delay, d, loss, loss_burst, seed, loss_in=loss_in) as cluster:
        peer = cluster.host("host-1")["address"]
        if pings:
            echo = _on(cluster, "host-1", "echo", peer, str(pings))
            time.sleep(0.3)
            # a datagram lost either way is given up after twice the round trip set
            wait = 8 * (parse_delay(delay) if delay else 0.0) + 0.05
            rtts = _client(cluster, "rtts", peer, str(pings), "0.01", str(wait))
            echo.kill()  # it waits for the datagrams the links dropped
            echo.wait(30)
            out["rtt_set_ms"] = 4 * parse_delay(delay) * 1e3 if delay else 0.0
            out["rtt_p50_ms"] = round(statistics.median(rtts) * 1e3, 3) if rtts else None
            out["rtt_p99_ms"] = round(sorted(rtts)[int(0.99 * (len(rtts) - 1))] * 1e3, 3) \
                if rtts else None
        if datagrams:
            sink = _on(cluster, "host-1", "sink", peer, str(datagrams))
            time.sleep(0.3)
            # paced to a tenth of the link (or 20k/s): drops are the loss model's, not a queue's
            rate = parse_rate(link) / 8 / 110 if link else 20000.0
            _client(cluster, "train", peer, str(datagrams), str(1 / min(rate, 20000.0)))
            got = int(sink.communicate(timeout=30)[0])
            out["delivered_set"] = round((1 - loss) ** 2, 5)
            out["delivered_seen"] = round(got / datagrams, 5)
        if seconds:
            sink = _on(cluster, "host-1", "tcp-sink", peer)
            time.sleep(0.3)
            try:
                n, dt = _client(cluster, "stream", peer, str(seconds))
            except subprocess.CalledProcessError:  # the stream stalled past its timeout
                n, dt = 0, float("inf")
            sink.kill()
            sink.communicate(timeout=30)
            out["goodput_set_mbit"] = round(parse_rate(link) * PAYLOAD_FRACTION / 1e6, 1) \
                if link else None
            out["goodput_seen_mbit"] = round(n * 8 / dt / 1e6, 1)
    return out


def _quantile(counts: list[int], edges: list[float], q: float) -> str | None:
    """The histogram bucket holding quantile ``q``, as 'under E' (or 'over' the last)."""
    total = sum(counts)
    if not total:
        return None
    run = 0
    for i, c in enumerate(counts):
        run += c
        if run >= q * total:
            return f"< {edges[i]:g}" if i < len(edges) else f">= {edges[-1]:g}"
    return None


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """The forwarders' records in a few numbers: frames, drops, lateness, CPU."""
    fw = res.pop("forwarders", {})
    if fw:
        ways = [w for rec in fw.values() for w in (rec["up"], rec["down"])]
        packets = sum(w["packets"] for w in ways)
        res["forwarded_packets"] = packets
        res["dropped_fraction"] = round(sum(w["dropped"] for w in ways) / max(packets, 1), 5)
        if any(r.get("loss_in") == "kernel" for r in fw.values()):
            return res  # (the kernel's drops are counted; nothing is delayed)
        counts = [sum(c) for c in zip(*(w["late_us_counts"] for w in ways))]
        edges = ways[0]["late_us_edges"]
        res["late_us_p50"], res["late_us_p99"] = (_quantile(counts, edges, q)
                                                  for q in (0.5, 0.99))
        res["late_us_max"] = max(w["late_us_max"] for w in ways)
        res["forwarder_cpu_s"] = round(sum(r["cpu_s"] for r in fw.values()), 3)
        res["forwarder_seconds"] = max(r["seconds"] for r in fw.values())
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    helpers = {"echo": lambda a: _echo(a[0], int(a[1])),
               "sink": lambda a: _sink(a[0], int(a[1])),
               "tcp-sink": lambda a: _tcp_sink(a[0]),
               "marked-sink": lambda a: _marked_sink(a[0], float(a[1])),
               "marked-train": lambda a: _marked_train(a[0], int(a[1]), float(a[2]),
                                                       [int(m) for m in a[3].split(",")]),
               "rtts": lambda a: print(json.dumps(_rtts(a[0], int(a[1]), float(a[2]),
                                                         float(a[3])))),
               "train": lambda a: print(json.dumps(_train(a[0], int(a[1]), float(a[2])))),
               "stream": lambda a: print(json.dumps(_stream(a[0], float(a[1]))))}
    if argv[:1] and argv[0] in helpers:  # run on a host by measure()
        helpers[argv[0]](argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m psring.cluster.linkcheck",
                                description=__doc__.split("\n\n")[2])
    p.add_argument("--link", default="", help="rate of each link (tc syntax), '' unshaped")
    p.add_argument("--delay", default="", help="one-way delay of each link direction")
    p.add_argument("--loss", type=float, default=0.0, help="fraction each direction drops")
    p.add_argument("--loss-burst", type=float, default=1.0, help="mean loss burst, packets")
    p.add_argument("--loss-in", choices=LOSS_PATHS, default=LOSS_PATHS[0],
                   help="where --loss drops (psring run --loss-in)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=3.0, help="length of the TCP stream")
    args = p.parse_args(argv)
    res = measure(args.link, args.delay, args.loss, args.loss_burst, args.seed,
                  seconds=args.seconds, loss_in=args.loss_in)
    print(json.dumps(_summary(res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
