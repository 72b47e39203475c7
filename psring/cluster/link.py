"""User-space links: loss and delay on an emulated host's link without the kernel's netem.

    psring run --strategy allreduce --workers 4 --hosts 2 --link 100mbit --loss 0.01
    psring run --strategy ps --workers 4 --hosts 2 --link 100mbit --delay 2ms \\
        --loss 0.01 --loss-burst 4

A host whose link has ``--loss`` or ``--delay`` is joined to the switch by two TAP
devices instead of a veth pair: ``eth0`` inside the host, ``psr-hN`` on the switch's
bridge. A *forwarder* (one process per host, forked by the cluster's agent) copies
Ethernet frames between the two devices' file descriptors, and on the way drops IPv4
frames by a seeded loss model and holds every frame back by the delay. tbf still shapes
both devices' egress in the kernel, as it shapes the veths, so the rate, the queue and
TCP's view of it all stay the kernel's: TCP sees a dropped segment as a real loss and
retransmits it.

The loss model is per link direction (``up``: what the host sends; ``down``: what it
receives) and seeded by the run's --seed, the host and the direction, so two runs with
the same seed drop the same packet numbers: with independent losses the n-th IPv4
frame of a direction is dropped or not whatever its timing (bursts also follow the
link's idle time: LossModel). Each forwarder writes what it dropped
(``links/<host>.<direction>.drops``: little-endian uint64 packet numbers) and what it
carried (``links/<host>.json``: frames, bytes, drops, how late delayed frames left, CPU
seconds) into the run directory. Non-IPv4 frames (ARP) are never dropped nor counted.

Pure Python on purpose (no extension to build): a frame costs a few microseconds of a
core, which caps a link (docs/emulation.md, "Loss and delay"). Where that cap matters,
``--loss-in kernel`` drops independent losses in the kernel instead, with no forwarder
(:func:`kernel_loss`: a classic-BPF classifier on each link end's ingress; its counts
in the same ``links/<host>.json``, :func:`save_kernel_loss`).
"""

from __future__ import annotations

import bisect
import collections
import fcntl
import json
import os
import random
import re
import resource
import select
import signal
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from psring.cluster.netns import CLONE_NEWNET, HOST_IFACE, _setns
from psring.records.runlog import atomic_write_json

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
#: bits of a full Ethernet frame on a 1500-byte MTU (the loss model's time slot)
FRAME_BITS = 1514 * 8
#: the directions of a host's link, from the host's side
DIRECTIONS = ("up", "down")
#: bytes read per frame: an Ethernet frame of any MTU psring sets, with room
_FRAME = 65536
#: frames taken from one side before looking at the other: neither direction starves
_BATCH = 64
#: lateness histogram's bucket edges, microseconds
_LATE_EDGES_US = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def open_tap(name: str) -> int:
    """A TAP device ``name`` in this process's network namespace; the returned fd is its
    wire (the device vanishes when the last fd closes). Non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


# -- the loss model -----------------------------------------------------------------------

@dataclass(frozen=True)
class LossModel:
    """Which packets a link direction drops: independent (``burst`` 1) or in bursts, by
    a Gilbert-Elliott chain (good state: no loss; bad: every packet lost) whose mean
    bad spell is ``burst`` packets and whose long-run loss is ``rate``.

    The chain steps once per packet and, between packets, once per ``slot_s`` of idle
    time (a full frame's time at the link's rate): a burst is a spell of the link, not
    of one sender's packets. Counted in packets only, a sender in retransmission
    backoff (one packet per timeout) would meet every burst as a run of timeouts: 30 s
    stalls at 1% loss in bursts of 4, where a link losing 4 frames' time does not."""

    rate: float
    burst: float = 1.0
    slot_s: float = FRAME_BITS / 1e9

    def __post_init__(self) -> None:
        if not 0 <= self.rate < 1:
            raise ValueError(f"a loss rate is in [0, 1) (got {self.rate!r})")
        if not self.burst >= 1:
            raise ValueError(f"a mean loss burst is >= 1 packet (got {self.burst!r})")

    def dropper(self, seed: str) -> "Dropper":
        return Dropper(self, seed)


class Dropper:
    """One direction's decisions, packet by packet, from its own seeded generator."""

    def __init__(self, model: LossModel, seed: str):
        self.rng = random.Random(seed)
        self.rate = model.rate
        self.bursty = model.burst > 1
        # Gilbert: leave the bad state with 1/burst; enter it so that P(bad) = rate
        self.leave = 1 / model.burst
        self.enter = model.rate * self.leave / (1 - model.rate)
        self.slot_s = model.slot_s
        self.bad = False
        self.last: float | None = None

    def drop(self, now: float | None = None) -> bool:
        """Whether the next packet is lost; ``now`` (seconds) lets a bursty chain
        evolve over the idle time since the last packet."""
        if not self.rate:
            return False
        if not self.bursty:
            return self.rng.random() < self.rate
        if now is not None:
            if self.last is not None:
                self._idle(int((now - self.last) / self.slot_s))
            self.last = now
        u = self.rng.random()
        self.bad = u >= self.leave if self.bad else u < self.enter
        return self.bad

    def _idle(self, steps: int) -> None:
        """``steps`` steps of the chain at once: P(bad) relaxes towards the long-run
        rate geometrically, by (1 - enter - leave) a step."""
        if steps <= 0:
            return
        decay = (1 - self.enter - self.leave) ** steps
        p_bad = self.rate + ((1.0 if self.bad else 0.0) - self.rate) * decay
        self.bad = self.rng.random() < p_bad


def link_seed(seed: int, host: str, direction: str) -> str:
    """The seed of one link direction's loss model: the run's seed, the host, the way."""
    return f"psring-link:{seed}:{host}:{direction}"


# -- the forwarder ------------------------------------------------------------------------

def _is_ipv4(frame: bytes) -> bool:
    return len(frame) >= 34 and frame[12:14] == b"\x08\x00"


#: an IPv4 frame's TOS byte -> its priority level at a priority-aware switch: the marks
#: of bounded-loss datagrams (psring.comm.lossy.PRIORITY_TOS: 0 lowest .. 3), and
#: everything unmarked (TCP: pushes, pulls, acks, the rings) above them all
LEVELS = {0x20: 0, 0x40: 1, 0x60: 2, 0x80: 3}
UNMARKED = 4
#: seconds a loss moved off a higher-priority frame waits for a lower one to take it;
#: then the next frame takes it whatever its level, so the link's loss rate holds
DEBT_S = 0.005


def level(frame: bytes) -> int:
    """An IPv4 frame's priority level (its TOS byte, after the 14-byte Ethernet header)."""
    return LEVELS.get(frame[15], UNMARKED)


def priority_queue(dev: str, limit: int) -> list[str]:
    """tc batch lines making tbf's queue on ``dev`` strict priority (DLCP's switch port;
    the agent shapes the links): an htb under tbf whose classes never run out of rate,
    so htb serves them by their ``prio`` alone — unmarked traffic (TCP) first, then the
    datagrams' levels 3 .. 0 by their TOS (u32 filters) — each class a byte FIFO of the
    port's buffer. The link's rate stays tbf's; when the port is congested the lowest
    level waits longest and its queue is the first to overflow."""
    top = UNMARKED + 1  # (level L's class is L + 1; unmarked traffic's, htb's default)
    lines = [f"qdisc add dev {dev} parent 1:1 handle 10: htb default {top}",
             f"class add dev {dev} parent 10: classid 10:100 htb rate 100gbit quantum 1514"]
    for c in range(1, top + 1):
        lines += [f"class add dev {dev} parent 10:100 classid 10:{c} htb rate 100gbit "
                  f"quantum 1514 prio {top - c}",
                  f"qdisc add dev {dev} parent 10:{c} bfifo limit {limit}"]
    for tos, lv in LEVELS.items():
        lines.append(f"filter add dev {dev} parent 10: protocol ip prio 1 u32 match ip tos "
                     f"{tos:#04x} 0xfc flowid 10:{lv + 1}")
    return lines


#: classic BPF's ancillary load of a random 32-bit number (SKF_AD_OFF + SKF_AD_RANDOM,
#: as an unsigned 32-bit offset)
_BPF_LOAD_RANDOM = (-0x1000 + 56) & 0xFFFFFFFF
#: tc's verdicts a direct-action classifier returns: pass the packet on, drop it
_TC_ACT_OK, _TC_ACT_SHOT = 0, 2


def kernel_loss(dev: str, rate: float) -> list[str]:
    """tc batch lines dropping the fraction ``rate`` of the IPv4 packets that arrive on
    ``dev`` (--loss-in kernel: no forwarder, no Python per frame): an ingress qdisc
    whose classic-BPF classifier, in direct-action mode, draws the kernel's random
    number per packet and drops when it falls in the top ``rate`` of its range. Put on
    the far end of each link direction, a packet is lost after it took the link's time,
    as the forwarder's are. Independent losses only, not seeded (the kernel's generator)."""
    if not 0 < rate < 1:
        raise ValueError(f"a kernel loss rate is in (0, 1) (got {rate!r})")
    above = min(round((1 - rate) * 2**32), 2**32 - 1)
    # A = random; if A >= above: drop, else pass (cBPF: "code jt jf k", jumps relative)
    program = [(0x20, 0, 0, _BPF_LOAD_RANDOM), (0x35, 1, 0, above),
               (0x06, 0, 0, _TC_ACT_OK), (0x06, 0, 0, _TC_ACT_SHOT)]
    code = ",".join(" ".join(map(str, op)) for op in program)
    return [f"qdisc add dev {dev} handle ffff: ingress",
            f"filter add dev {dev} parent ffff: protocol ip bpf da bytecode "
            f"'{len(program)},{code}'"]


def kernel_loss_counts(tc_stats: str) -> dict[str, int]:
    """``tc -s qdisc show dev D ingress``'s packets and drops (what :func:`kernel_loss`
    saw and dropped), in a link record's terms; zeros where there is no ingress qdisc."""
    for block in tc_stats.split("qdisc ")[1:]:
        if not block.startswith("ingress"):
            continue
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", block)
        if m:
            return {"packets": int(m[2]), "bytes": int(m[1]), "dropped": int(m[3])}
    return {"packets": 0, "bytes": 0, "dropped": 0}


def _tc_stats(tc: str, dev: str, pid: int | None = None) -> str:
    """``tc -s qdisc show dev DEV``, in the namespace of process ``pid`` (None: this
    one's); '' if it fails (a record then counts nothing rather than ending the run)."""
    enter = (lambda: _setns(f"/proc/{pid}/ns/net", CLONE_NEWNET)) if pid else None
    try:
        return subprocess.run([tc, "-s", "qdisc", "show", "dev", dev], capture_output=True,
                              text=True, timeout=10, preexec_fn=enter).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def save_kernel_loss(out: Path, hosts: list[dict], tc: str) -> None:
    """--loss-in kernel: each host link's record (``links/<host>.json``, in the
    forwarder's shape: packets and drops each way), from the counters of its ingress
    qdiscs, read by the cluster's agent from the switch's namespace: up arrives at the
    switch's port (``port``), down at the host's eth0 (in the namespace of ``pid``)."""
    out.mkdir(exist_ok=True)
    for h in hosts:
        atomic_write_json(out / f"{h['name']}.json", {
            "host": h["name"], "loss_in": "kernel",
            "up": kernel_loss_counts(_tc_stats(tc, h["port"])),
            "down": kernel_loss_counts(_tc_stats(tc, HOST_IFACE, h["pid"]))})


class Direction:
    """Frames one way: read from ``src``, maybe dropped, held ``delay_s``, written to
    ``dst``; with what it did, for the link's record.

    ``priority`` (--switch priority): DLCP's switch. A loss the model deals to a frame
    above the lowest level passing (the lowest seen in the last :data:`DEBT_S`) is
    moved onto the next frame of that level (a bounded-loss datagram of the back
    layers or small gradients) that comes within :data:`DEBT_S`, else onto the next
    frame of any level: the lowest priority goes first and the link's loss rate is
    unchanged. With TCP alone nothing moves."""

    def __init__(self, name: str, src: int, dst: int, dropper: Dropper, delay_s: float,
                 trace: Path, priority: bool = False):
        self.name, self.src, self.dst = name, src, dst
        self.dropper, self.delay_s = dropper, delay_s
        self.priority = priority
        #: losses moved off higher-priority frames, to be taken: (level, since)
        self.debts: collections.deque[tuple[int, float]] = collections.deque()
        self.moved = 0
        #: when a frame of each level last passed (the lowest recent one takes losses)
        self.seen = [-1.0] * (UNMARKED + 1)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.trace = open(trace, "wb")
        self.pending: list[int] = []
        self.packets = self.bytes = self.dropped = self.dropped_bytes = 0
        self.frames_lost = 0  # frames the far device refused (it was down)
        self.late = [0] * (len(_LATE_EDGES_US) + 1)
        self.late_max_us = 0.0

    def take(self, now: float) -> None:
        """Read what ``src`` has (up to a batch), decide, queue."""
        for _ in range(_BATCH):
            try:
                frame = os.read(self.src, _FRAME)
            except BlockingIOError:
                return
            if _is_ipv4(frame):
                n = self.packets
                self.packets += 1
                self.bytes += len(frame)
                lost = self.dropper.drop(now)
                if self.priority:
                    lost = self._prioritized(frame, lost, now)
                if lost:
                    self.dropped += 1
                    self.dropped_bytes += len(frame)
                    self.pending.append(n)
                    continue
            if self.delay_s:
                self.queue.append((now + self.delay_s, frame))
            else:
                self._send(frame)

    def _prioritized(self, frame: bytes, lost: bool, now: float) -> bool:
        """Whether this frame is lost at a priority-aware switch: a loss dealt to it
        above the lowest level becomes a debt; it takes an older debt of a higher level
        (or one that waited :data:`DEBT_S`) if it was spared its own."""
        lv = level(frame)
        self.seen[lv] = now
        floor = next(k for k, t in enumerate(self.seen) if t >= 0 and now - t <= DEBT_S)
        if lost and lv > floor:
            self.debts.append((lv, now))
            self.moved += 1
            return False
        if lost or not self.debts:
            return lost
        for k, (owed, since) in enumerate(self.debts):
            if lv == floor < owed or now - since > DEBT_S:
                del self.debts[k]
                return True
        return False

    def release(self, now: float) -> None:
        """Write the queued frames that are due."""
        q = self.queue
        while q and q[0][0] <= now:
            due, frame = q.popleft()
            late_us = (now - due) * 1e6
            self.late[bisect.bisect_left(_LATE_EDGES_US, late_us)] += 1
            self.late_max_us = max(self.late_max_us, late_us)
            self._send(frame)

    def due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def _send(self, frame: bytes) -> None:
        try:
            os.write(self.dst, frame)
        except OSError:  # the device is down (a cut host) or its queue is full
            self.frames_lost += 1

    def flush_trace(self) -> None:
        if self.pending:
            self.trace.write(struct.pack(f"<{len(self.pending)}Q", *self.pending))
            self.trace.flush()
            self.pending.clear()

    def record(self) -> dict:
        return {"packets": self.packets, "bytes": self.bytes, "dropped": self.dropped,
                "dropped_bytes": self.dropped_bytes, "refused": self.frames_lost,
                "moved": self.moved, "owed": len(self.debts),
                "delay_s": self.delay_s, "late_us_edges": list(_LATE_EDGES_US),
                "late_us_counts": self.late, "late_us_max": round(self.late_max_us, 1)}


class Forwarder:
    """Both directions of one host's link, in one thread: no lock, no GIL contention."""

    #: seconds between writes of the drop traces (and on exit)
    FLUSH_S = 0.5

    def __init__(self, host: str, host_fd: int, port_fd: int, model: LossModel,
                 delay_s: float, seed: int, out: Path, priority: bool = False):
        out.mkdir(parents=True, exist_ok=True)
        self.host, self.out = host, out
        self.ways = [Direction(d, src, dst, model.dropper(link_seed(seed, host, d)), delay_s,
                               out / f"{host}.{d}.drops", priority)
                     for d, src, dst in (("up", host_fd, port_fd), ("down", port_fd, host_fd))]
        self.started = time.monotonic()
        self.stopping = False

    def run(self) -> None:
        # select, not poll: its timeout has microseconds, poll's whole milliseconds
        # (each delayed frame would leave up to 1 ms late)
        by_fd = {w.src: w for w in self.ways}
        fds = list(by_fd)
        flushed = time.monotonic()
        while not self.stopping:
            now = time.monotonic()
            dues = [d for w in self.ways if (d := w.due()) is not None]
            wait = min(max(0.0, min(dues) - now), 0.2) if dues else 0.2
            try:
                ready, _, _ = select.select(fds, [], [], wait)
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd in ready:
                by_fd[fd].take(now)
            for w in self.ways:
                w.release(now)
            if now - flushed > self.FLUSH_S:
                self.save()
                flushed = now

    def save(self) -> None:
        for w in self.ways:
            w.flush_trace()
        use = resource.getrusage(resource.RUSAGE_SELF)
        atomic_write_json(self.out / f"{self.host}.json", {
            "host": self.host, "seconds": round(time.monotonic() - self.started, 3),
            "cpu_s": round(use.ru_utime + use.ru_stime, 3),
            **{w.name: w.record() for w in self.ways}})


def forward(host: str, host_fd: int, port_fd: int, model: LossModel, delay_s: float,
            seed: int, out: Path, priority: bool = False) -> None:
    """A forked forwarder's life: forward until SIGTERM, then write its record."""
    fw = Forwarder(host, host_fd, port_fd, model, delay_s, seed, out, priority)

    def stop(*_: object) -> None:
        fw.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fw.run()
    finally:
        fw.save()


def read_trace(path: Path) -> list[int]:
    """The packet numbers a direction dropped (its ``.drops`` file)."""
    data = Path(path).read_bytes()
    return list(struct.unpack(f"<{len(data) // 8}Q", data[: len(data) // 8 * 8]))


def read_links(run_dir: Path) -> dict[str, dict]:
    """Each host link's record (``links/<host>.json``) of a run, by host."""
    out = {}
    for p in sorted((Path(run_dir) / "links").glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[rec.get("host", p.stem)] = rec
    return out
