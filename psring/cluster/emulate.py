"""Emulated clusters: hosts, links and server placement on one Linux machine.

    psring run --strategy allreduce --workers 4 --hosts 2 --link 1gbit
    psring run --strategy ps --workers 4 --hosts 4 --link 100mbit \\
        --servers 2 --server-placement own-hosts
    psring calibrate --hosts 2 --link 1gbit

Each emulated host is a Linux network namespace with one interface, ``eth0``, addressed
in 198.18.0.0/15 (RFC 2544's range for benchmarking network devices). Its other end is a
port of one bridge, the switch, which lives in a namespace of its own. Both ends of
every veth pair are shaped with ``tbf`` to the link's rate (``--link``), so a host sends
and receives at most RATE at once, as a full-duplex NIC does. With ``--delay`` or
``--loss`` a host's link is two TAP devices and a forwarder process between them that
delays and drops (psring.cluster.link; no netem needed), tbf still shaping both ends.
Traffic between processes of one host stays on that host's loopback. docs/emulation.md
has the picture and what is not emulated.

Lifetime, which is the point of the design: nothing is named and nothing is mounted.
The *agent* (``python -m psring.cluster.emulate agent``, a service of the run's supervisor)
moves itself into the switch's namespace (inside a new user namespace when it is not
root) and forks one *holder* per host, a process whose only job is to keep that host's
namespace alive. Every process of the run dies with its parent (PR_SET_PDEATHSIG), and
the kernel frees a namespace with its last process, its veths and bridge with it. So a
cluster disappears after a normal end, a failure, Ctrl-C, SIGTERM and a SIGKILL of the
launcher alike, with no cleanup code to run; the machine's own interfaces, routes and
qdiscs are never touched.

The launcher sees one seam, :func:`network_for`: a :class:`Network` that starts what it
needs beside the run's processes, puts each process on its host (:meth:`Network.place`)
and explains failures in terms of the cluster (a link that went down).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from psring.cluster.link import FRAME_BITS, LossModel, forward, open_tap
from psring.cluster.netns import (
    CLONE_NEWNET,
    CLONE_NEWUSER,
    HOST_IFACE,
    NETNS_ENV,
    _setns,
    _unshare,
    link_events,
    ns_inode,
    port_bytes,
    setns_fd,
    tcp_counters,
)
from psring.cluster.spec import NETWORK, Cluster
from psring.errors import PsringError
from psring.records.runlog import atomic_write_json
from psring.runtime.process import (
    POLL_S,
    ProcessSpec,
    Supervisor,
    die_with_parent,
    kill_with_parent,
    tail,
)

#: the switch's bridge (its ports are named after the hosts)
BRIDGE = "psr-br"
CLUSTER_FILE = "cluster.json"
#: seconds the agent may take to build a cluster
READY_TIMEOUT_S = 30.0

# -- links, in tc's syntax ----------------------------------------------------------------

#: bytes: one of veth's largest GSO packets (64 KiB) and room to spare (tbf_params)
GSO_BURST = 72 * 1024


def tbf_params(bits: float, limit: int | None = None) -> tuple[int, int]:
    """(burst, limit) bytes of the token bucket that shapes a link of ``bits``/s.

    burst: 1 ms of the rate, and never less than 72 KiB, one of veth's largest GSO
    packets (64 KiB) with room to spare. A packet larger than the burst is split by tbf
    into frames; where only some of a flow's packets are (a burst just under 64 KiB,
    about 300-600 Mbit/s), gloo's ring over the link carried 74% of 500 Mbit/s and 86%
    of 400 against 95% with the larger burst (docs/benchmarks.md, "Link fidelity").
    A full bucket lets a burst through at once, so a transfer can beat the rate by
    burst/rate: 1 ms, or 6 ms at 100 Mbit/s, small against the gradients of a step.
    limit, the queue: 100 ms of the rate, at least 4 MiB. Deep on purpose: a switch port
    that drops packets sends TCP into 200 ms retransmission timeouts, which would measure
    TCP's loss recovery instead of the link; with a deep queue, a link shared by several
    flows (a parameter server's) is a work-conserving pipe of RATE, as the cost model
    assumes. The price is queueing delay under load, which a real shallow-buffered
    switch would not add (docs/emulation.md). ``limit`` (--link-buffer) replaces it: a
    shallow port that drops when full, for incast."""
    bytes_per_s = bits / 8
    burst = max(GSO_BURST, int(bytes_per_s * 1e-3))
    return burst, limit or max(4 * 2**20, int(bytes_per_s * 0.1))


class EmulationError(PsringError):
    """The machine cannot build the cluster (permissions, tools, kernel): exit 2."""


def _tool(name: str) -> str:
    # /usr/sbin and /sbin are not on an ordinary user's PATH on Debian
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise EmulationError(
            f"emulated hosts need the `{name}` command of iproute2, which is not installed "
            f"here; install it (Debian/Ubuntu: apt-get install iproute2) or run without "
            f"--hosts/--link.")
    return path


def permission_help(detail: str) -> str:
    return (
        f"psring cannot create the emulated cluster's network namespaces here: {detail}. "
        f"Creating namespaces and shaping links needs CAP_NET_ADMIN and CAP_SYS_ADMIN: run "
        f"as root, or let ordinary users create user namespaces (psring then builds the "
        f"cluster inside one, as `unshare --user --net --map-root-user` does): "
        f"`sysctl -w user.max_user_namespaces=15000`, on Debian kernels also "
        f"`sysctl -w kernel.unprivileged_userns_clone=1`, and on Ubuntu 23.10+ "
        f"`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`. Nothing was "
        f"changed on this machine.")


# -- the agent: builds the cluster, then keeps it alive ------------------------------------

def _enter_switch() -> str:
    """Move the agent into a new network namespace (the switch's); as an ordinary user,
    inside a new user namespace where it is root. Returns the mode."""
    if os.geteuid() == 0:
        try:
            _unshare(CLONE_NEWNET)
            return "root"
        except OSError as e:
            if e.errno != errno.EPERM:
                raise EmulationError(permission_help(f"unshare(CLONE_NEWNET) failed: "
                                                     f"{e.strerror}")) from None
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as e:
        why = {errno.EPERM: "the kernel refused a user namespace (Operation not permitted)",
               errno.ENOSPC: "the kernel refused a user namespace: its limit "
                             "(/proc/sys/user/max_user_namespaces or max_net_namespaces) "
                             "is reached or 0",
               errno.EINVAL: "this kernel has no user namespaces"}.get(
            e.errno, f"unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: {e.strerror}")
        who = "root without CAP_SYS_ADMIN" if uid == 0 else f"uid {uid} is not root"
        raise EmulationError(permission_help(f"{who}, and {why}")) from None
    try:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    except OSError as e:
        raise EmulationError(permission_help(f"the kernel refused to map this user into a "
                                             f"user namespace ({e.strerror}); an LSM such "
                                             f"as AppArmor may restrict them")) from None
    return "userns"


def _spawn_holder(others: list[int]) -> tuple[int, int]:
    """Fork a process in a new network namespace of its own (an emulated host). It lives
    until the agent dies (pipe EOF, and PR_SET_PDEATHSIG). ``others``: the earlier
    holders' control fds, closed in the child so each pipe's only writer is the agent.
    Returns (pid, control fd)."""
    ready_r, ready_w = os.pipe()
    ctrl_r, ctrl_w = os.pipe()
    agent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the holder: as little as possible, then wait
        code = 0
        try:
            os.close(ready_r)
            os.close(ctrl_w)
            for fd in others:
                os.close(fd)
            kill_with_parent()
            if os.getppid() != agent:
                os._exit(0)
            # The launcher stops the agent by SIGTERM to its process group, holders
            # included: they stay until the agent has read the links' counters and
            # closes (pipe EOF), or dies (PR_SET_PDEATHSIG)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                _unshare(CLONE_NEWNET)
                os.write(ready_w, b"ok")
            except OSError as e:
                os.write(ready_w, f"unshare(CLONE_NEWNET): {e.strerror}".encode())
                code = 1
            os.close(ready_w)
            if code == 0:
                os.read(ctrl_r, 1)  # EOF when the agent is gone
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(ctrl_r)
    answer = os.read(ready_r, 512).decode(errors="replace")
    os.close(ready_r)
    if answer != "ok":
        raise EmulationError(permission_help(answer or "a host's namespace process died"))
    return pid, ctrl_w


def _run(argv: list[str], stdin: str, what: str) -> None:
    proc = subprocess.run(argv, input=stdin, text=True, capture_output=True)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        msg = err[-1] if err else f"exit code {proc.returncode}"
        raise EmulationError(f"building the emulated cluster failed at {what}: "
                             f"`{' '.join(argv)}` said: {msg}")


def _shaping(dev: str, plan: dict) -> list[str]:
    """tc batch lines shaping ``dev``'s egress with tbf to the link's rate."""
    if not plan["link_bits"]:
        return []
    burst, limit = tbf_params(plan["link_bits"], plan.get("buffer_bytes"))
    return [f"qdisc add dev {dev} root handle 1: tbf rate {int(plan['link_bits'])}bit "
            f"burst {burst} limit {limit}"]


#: frames a TAP device queues for its forwarder (the kernel's default is 1000): room
#: for the forwarder's pauses, so that only tbf's queue and the loss model drop
TAP_QUEUE = 20000


def _frames(dev: str, plan: dict) -> list[str]:
    """ip batch lines that make a veth hand its queue Ethernet frames, not 64 KiB GSO
    packets, where the queue is shallow (--link-buffer): a switch port's buffer holds
    frames, and a drop loses one, not 44. (A TAP link never offers GSO; its own queue
    is made long instead.)"""
    if user_space(plan):
        return [f"link set dev {dev} txqueuelen {TAP_QUEUE}"]
    return [f"link set dev {dev} gso_max_segs 1"] if plan.get("buffer_bytes") else []


def user_space(plan: dict) -> bool:
    """Do the links need the forwarder (psring.cluster.link): loss or delay?"""
    return bool(plan.get("loss") or plan.get("delay_us"))


def _no_ipv6() -> None:
    """IPv6 off in the current namespace: no autoconfiguration chatter on the links,
    and no address outside 198.18.0.0/15 (namespace_is_isolated)."""
    for name in ("all", "default"):
        try:
            Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6").write_text("1")
        except OSError:
            pass  # a kernel without IPv6


def _link_socket() -> socket.socket:
    """An rtnetlink socket of this namespace that hears its links go up and down."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    sock.bind((0, 1))  # RTMGRP_LINK
    return sock


class Agent:
    def __init__(self, plan: dict, state_path: Path):
        self.plan = plan
        self.state_path = state_path
        self.holders: list[tuple[int, int]] = []
        self.state: dict[str, Any] = {}
        #: user-space links: each host's (switch port, eth0) TAP fds until forked
        self.taps: dict[str, list[int]] | None = {} if user_space(plan) else None
        self.forwarders: list[int] = []
        #: rtnetlink sockets opened inside each host's namespace (watch)
        self.host_socks: list[socket.socket] = []

    def build(self) -> None:
        """Build the cluster; ``self.state`` records each namespace as soon as it exists
        (a failed build's state still names them: tests check they are gone too)."""
        plan = self.plan
        ip, tc = _tool("ip"), _tool("tc")
        mode = _enter_switch()
        self.state = {
            "ready": False, "mode": mode, "agent_pid": os.getpid(),
            "switch": {"net_inode": ns_inode("self"), "user_inode": ns_inode("self", "user")},
            "link": plan["link"], "link_bits": plan["link_bits"], "delay": plan["delay"],
            "hosts": [], "events": []}
        _no_ipv6()
        for h in plan["hosts"]:
            pid, ctrl = _spawn_holder([c for _, c in self.holders])
            self.holders.append((pid, ctrl))
            self.state["hosts"].append({**h, "pid": pid, "net_inode": ns_inode(pid),
                                        "interface": HOST_IFACE, "port": f"psr-h{h['index']}"})
        lines = ["link set dev lo up", f"link add name {BRIDGE} type bridge",
                 f"link set dev {BRIDGE} up"]
        for h in self.state["hosts"]:
            if self.taps is not None:  # the port's wire is a TAP; eth0's comes later
                self.taps[h["name"]] = [self._tap(h["port"])]
            else:
                lines.append(f"link add name {h['port']} type veth peer name {HOST_IFACE} "
                             f"netns {h['pid']}")
            lines += [f"link set dev {h['port']} master {BRIDGE}", *_frames(h["port"], plan),
                      f"link set dev {h['port']} up"]
        _run([ip, "-batch", "-"], "\n".join(lines) + "\n", "the switch")
        shaping = [ln for h in self.state["hosts"] for ln in _shaping(h["port"], plan)]
        if shaping:
            _run([tc, "-batch", "-"], "\n".join(shaping) + "\n", "the switch's links")
        switch = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for h in self.state["hosts"]:
                _setns(f"/proc/{h['pid']}/ns/net", CLONE_NEWNET)
                try:
                    self._configure_host(h, ip, tc)
                finally:
                    try:
                        setns_fd(switch, CLONE_NEWNET)
                    except OSError:
                        raise EmulationError("could not return to the switch's "
                                             "namespace") from None
        finally:
            os.close(switch)
        if self.taps is not None:
            self._start_forwarders()
        self.state["ready"] = True
        self._save()

    def _tap(self, name: str) -> int:
        try:
            return open_tap(name)
        except OSError as e:
            raise EmulationError(
                f"--loss and --delay need TAP devices (/dev/net/tun), which this machine "
                f"refused ({e.strerror}); load the tun module (modprobe tun) or run "
                f"without --loss/--delay.") from None

    def _start_forwarders(self) -> None:
        """One forwarder per host between its two TAPs (psring.cluster.link); the agent
        then closes its own copies, so a forwarder that dies takes its link down."""
        plan, out = self.plan, self.state_path.parent / "links"
        # a burst's spell in frame times of the link (unshaped: about what a
        # forwarder moves, 1 Gbit/s)
        model = LossModel(plan["loss"], plan["loss_burst"],
                          slot_s=FRAME_BITS / (plan["link_bits"] or 1e9))
        ctrl = [c for _, c in self.holders]
        for h in self.state["hosts"]:
            port_fd, host_fd = self.taps[h["name"]]
            others = [fd for fds in self.taps.values() for fd in fds
                      if fd not in (port_fd, host_fd)]
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    # (the agent's SIGTERM handler raises SystemExit: not in here before
                    # forward() installs its own, which writes the record first)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    for fd in [*others, *ctrl, *(sock.fileno() for sock in self.host_socks)]:
                        os.close(fd)
                    kill_with_parent()
                    forward(h["name"], host_fd, port_fd, model, plan["delay_us"] / 1e6,
                            plan["seed"], out)
                except BaseException as e:  # noqa: BLE001 - a forked child must not return
                    print(f"[cluster] {h['name']}'s forwarder failed: {e!r}", flush=True)
                    code = 1
                finally:
                    os._exit(code)
            self.forwarders.append(pid)
            h["forwarder_pid"] = pid
        for fds in self.taps.values():
            for fd in fds:
                os.close(fd)
        self.taps.clear()

    def _configure_host(self, h: dict, ip: str, tc: str) -> None:
        """Inside host ``h``'s namespace: loopback, its address, its side of the link."""
        _no_ipv6()
        if self.taps is not None:
            self.taps[h["name"]].append(self._tap(HOST_IFACE))
        self.host_socks.append(_link_socket())  # bound here: it hears this host's links
        lines = ["link set dev lo up",
                 f"addr add {h['address']}/{NETWORK.prefixlen} dev {HOST_IFACE}",
                 *_frames(HOST_IFACE, self.plan), f"link set dev {HOST_IFACE} up"]
        _run([ip, "-batch", "-"], "\n".join(lines) + "\n", h["name"])
        shaping = _shaping(HOST_IFACE, self.plan)
        if shaping:
            _run([tc, "-batch", "-"], "\n".join(shaping) + "\n", f"{h['name']}'s link")

    def _save(self) -> None:
        atomic_write_json(self.state_path, self.state)

    def watch(self) -> None:
        """Until stopped: record links going down and up, so a failed run can say which
        host was cut off: rtnetlink events of the switch's ports and of each host's eth0
        (a TAP link's two ends go down apart; psring.cluster.link)."""
        switch = _link_socket()
        host_of = {h["port"]: h for h in self.state["hosts"]}
        socks = {switch.fileno(): (switch, None), **{
            s.fileno(): (s, h) for h, s in zip(self.state["hosts"], self.host_socks)}}
        # each end of each link apart (a TAP link's two ends go down apart); a host's
        # link is up while both ends are
        ends = {(h["name"], end): True for h in self.state["hosts"] for end in ("port", "eth0")}
        while True:
            ready, _, _ = select.select(list(socks), [], [], 5.0)
            for fd in ready:
                sock, on_host = socks[fd]
                for name, is_up in link_events(sock.recv(65536)):
                    if on_host is None:
                        h, end = host_of.get(name), "port"
                    else:
                        h, end = (on_host, "eth0") if name == HOST_IFACE else (None, "")
                    if h is None or ends[(h["name"], end)] == is_up:
                        continue
                    was = ends[(h["name"], "port")] and ends[(h["name"], "eth0")]
                    ends[(h["name"], end)] = is_up
                    now = ends[(h["name"], "port")] and ends[(h["name"], "eth0")]
                    if now != was:
                        self._link_event(h, now)

    def _link_event(self, h: dict, is_up: bool) -> None:
        event = {"time": time.time(), "host": h["name"], "address": h["address"],
                 "link": "up" if is_up else "down"}
        self.state["events"].append(event)
        self._save()
        print(f"[cluster] {h['name']} ({h['address']}): link {event['link']}", flush=True)

    def record_link_bytes(self) -> None:
        """Each host link's byte counters, as the switch's port saw them (to the host =
        what the port sent, from it = what it received), into the cluster file: what the
        run moved over the emulated links, measured by the kernel (docs/emulation.md)."""
        ports = {h["port"]: h["name"] for h in self.state.get("hosts", [])}
        if not ports or not self.state.get("ready"):
            return
        counts = {}
        for port, (rx, tx) in port_bytes(set(ports)).items():
            counts[ports[port]] = {"from_host": rx, "to_host": tx}
        self.state["link_bytes"] = counts
        # how each host's TCP met the links: retransmissions, timeouts (incast, loss)
        self.state["tcp"] = {h["name"]: tcp_counters(h["pid"]) for h in self.state["hosts"]}
        self._save()

    def close(self) -> None:
        self.record_link_bytes()  # before the hosts (and their links) go
        self._stop_forwarders()
        for pid, ctrl in self.holders:
            try:
                os.close(ctrl)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass


    def _stop_forwarders(self) -> None:
        """SIGTERM: each forwarder writes its drop trace and record, then exits."""
        for pid in self.forwarders:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for pid in self.forwarders:
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.01)
            else:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        self.forwarders.clear()


def agent_main(plan_json: str, state_path: str) -> int:

    die_with_parent()  # with the launcher; the holders die with this agent

    def stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    plan = json.loads(plan_json)
    agent = Agent(plan, Path(state_path))
    try:
        try:
            agent.build()
        except OSError as e:  # fork, setns, /proc: the machine refused something
            raise EmulationError(f"building the emulated cluster failed: {e}") from None
        print(f"[cluster] {len(plan['hosts'])} hosts ready ({agent.state['mode']} mode): "
              + ", ".join(f"{h['name']}={h['address']}" for h in plan["hosts"]), flush=True)
        agent.watch()
    except EmulationError as e:
        atomic_write_json(Path(state_path), {**agent.state, "ready": False, "error": str(e),
                                             "exit_code": e.exit_code})
        print(f"[cluster] error: {e}", flush=True)
        return e.exit_code
    finally:
        agent.close()
    return 0


# -- entering a host: the trampoline every process of an emulated host starts through -------

def enter(host: dict, mode: str) -> None:
    """Move the calling process (single-threaded) into an emulated host's namespace."""
    pid = host["pid"]
    if mode == "userns":
        _setns(f"/proc/{pid}/ns/user", CLONE_NEWUSER)
    _setns(f"/proc/{pid}/ns/net", CLONE_NEWNET, host["net_inode"])


def enter_host(state_path: str | Path, host_name: str) -> None:
    """Move this (single-threaded) process onto emulated host ``host_name`` of the
    cluster whose state is at ``state_path``; PsringError naming the cause if it
    cannot."""
    try:
        state = json.loads(Path(state_path).read_text())
        host = next(h for h in state["hosts"] if h["name"] == host_name)
        enter(host, state["mode"])
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise EmulationError(
            f"cannot enter emulated host {host_name!r} of {state_path}: "
            f"{getattr(e, 'strerror', None) or e or 'no such host'}; the cluster's agent "
            f"may have died (see logs/cluster.log).") from None


def _enter_main(argv: list[str]) -> int:
    # python -m psring.cluster.emulate enter STATE HOST -- COMMAND...
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m psring.cluster.emulate enter STATE HOST -- COMMAND...",
              file=sys.stderr)
        return 2
    state_path, host_name, _, *command = argv
    try:
        enter_host(state_path, host_name)
    except EmulationError as e:
        print(f"psring: {e}", file=sys.stderr)
        return 1
    # a program started on a host dies with whoever started it (the launcher restates
    # this for its own processes), so nothing keeps a namespace alive by accident
    kill_with_parent()
    os.execvp(command[0], command)
    return 127  # not reached


# -- the launcher's side ------------------------------------------------------------------

class Network:
    """What the launcher calls. This base is the machine's own network (no emulation)."""

    def __init__(self, plan: Cluster):
        #: the run's cluster (psring.cluster.spec): which process is on which host
        self.plan = plan

    def start(self, sup: Supervisor) -> None:
        """Start what the network needs (before any process is placed)."""

    def place(self, spec: ProcessSpec) -> ProcessSpec:
        """The spec to start ``spec`` on its host."""
        return spec

    def explain(self) -> str:
        """What the network saw, to add to a failure's message ('' when nothing)."""
        return ""


class EmulatedCluster(Network):
    """The cluster an agent builds; processes are started inside its hosts."""

    def __init__(self, plan: Cluster, run_dir: Path):
        super().__init__(plan)
        self.state_path = Path(run_dir) / CLUSTER_FILE
        self.state: dict[str, Any] = {}
        self.started = 0.0

    def agent_spec(self) -> ProcessSpec:
        p = self.plan
        plan = {"hosts": [{"name": h.name, "index": h.index, "address": h.address,
                           "processes": h.processes} for h in p.host_list],
                "link": p.link, "delay": p.delay,
                # shaped as the cluster it stands for, slowed by --time-scale
                "link_bits": p.emulated_link_bits, "delay_us": round(p.emulated_delay_s * 1e6),
                "loss": p.loss, "loss_burst": p.loss_burst, "seed": p.seed,
                "buffer_bytes": p.buffer_bytes}
        return ProcessSpec("cluster", [sys.executable, "-m", "psring.cluster.emulate", "agent",
                                       json.dumps(plan), str(self.state_path)], service=True)

    def start(self, sup: Supervisor) -> None:
        self.state_path.unlink(missing_ok=True)
        child = sup.start(self.agent_spec())
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                self.state = json.loads(self.state_path.read_text())
            except (OSError, ValueError):
                self.state = {}
            if self.state.get("ready"):
                self.started = time.time()
                return
            if "error" in self.state:
                raise EmulationError(self.state["error"])
            died = child.proc.poll() is not None
            if died or time.monotonic() > deadline:
                what = "died" if died else f"was not ready within {READY_TIMEOUT_S:.0f} s"
                raise EmulationError(f"the emulated cluster's agent {what}; its log "
                                     f"({child.log_path}) ends:\n{tail(child.log_path)}")
            time.sleep(POLL_S)

    @property
    def mode(self) -> str:
        return self.state["mode"]

    def host(self, name: str) -> dict[str, Any]:
        """A host's entry in the cluster's state (address, holder pid, namespace inode)."""
        return next(h for h in self.state["hosts"] if h["name"] == name)

    def trampoline(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside emulated ``host``."""
        return [sys.executable, "-m", "psring.cluster.emulate", "enter", str(self.state_path), host,
                "--"]

    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv that runs ``argv`` inside emulated ``host``."""
        return [*self.trampoline(host), *argv]

    def environment(self, host: str) -> dict[str, str]:
        return {"PSRING_HOST": host, NETNS_ENV: str(self.host(host)["net_inode"]),
                # gloo and NCCL find their interface by name, not by resolving the
                # machine's hostname (which names an address outside the namespace)
                "GLOO_SOCKET_IFNAME": HOST_IFACE, "NCCL_SOCKET_IFNAME": HOST_IFACE,
                # NCCL would otherwise move data between GPUs of one machine through
                # shared memory or NVLink, around the emulated links (not run here: no GPU)
                "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}

    def place(self, spec: ProcessSpec) -> ProcessSpec:
        # a new interpreter goes through the setns trampoline; a forked one enters the
        # host itself (psring.runtime.forking): both the same namespaces, the same environment
        host = self.plan.host_of(spec.name).name
        return dataclasses.replace(spec, prefix=self.trampoline(host),
                                   enter=functools.partial(enter_host, self.state_path, host),
                                   env={**spec.env, **self.environment(host)})

    def cut(self, host: str) -> None:
        """Cut ``host`` off (a partition, or the first half of a host crash): its side of
        the link set down inside its namespace, so nothing it sends afterwards, a dying
        process's resets included, reaches anyone. The holder's pid is checked against
        the namespace's inode first: a stale pid could be a process in this machine's own
        namespace, whose interfaces are not the cluster's."""
        h = self.host(host)
        if os.stat(f"/proc/{h['pid']}/ns/net").st_ino != h["net_inode"]:
            raise EmulationError(f"{host}'s namespace is gone: nothing to cut")
        # (through psring's own trampoline into the host, as its processes entered it)
        subprocess.run(self.command(host, [_tool("ip"), "link", "set", "dev",
                                           h["interface"], "down"]),
                       check=True, timeout=10, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)

    def explain(self) -> str:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return ""
        downs = [e for e in state.get("events", []) if e["link"] == "down"]
        if not downs:
            return ""
        parts = []
        on_host = {h.name: h.processes for h in self.plan.host_list}
        for e in downs:
            on = ", ".join(on_host.get(e["host"], [])) or "nothing"
            parts.append(f"{e['host']}'s link ({e['address']}) went down "
                         f"{e['time'] - self.started:.1f} s after the cluster was built, "
                         f"cutting off {on}")
        return "The emulated network saw: " + "; ".join(parts) + "."


@contextlib.contextmanager
def standalone(hosts: int, link: str = "", delay: str = "", log_dir: Path | None = None,
               loss: float = 0.0, loss_burst: float = 1.0,
               seed: int = 0) -> Iterator[EmulatedCluster]:
    """An emulated cluster outside a run (calibration, benchmarks): its agent is
    supervised here and stopped on exit; ``cluster.command(host, argv)`` runs a program
    on a host, ``enter(cluster.host(name), cluster.mode)`` moves a fresh process there."""
    with tempfile.TemporaryDirectory(prefix="psring-cluster-") as tmp:
        d = Path(log_dir) if log_dir else Path(tmp)
        cluster = EmulatedCluster(Cluster.bare(hosts, link, delay, loss, loss_burst, seed), d)
        sup = Supervisor(d / "logs")
        try:
            cluster.start(sup)
            yield cluster
        finally:
            sup.stop()


def network_for(cluster: Cluster, run_dir: Path) -> Network:
    """The launcher's one seam: the machine's network, or an emulated cluster."""
    return EmulatedCluster(cluster, run_dir) if cluster.emulated else Network(cluster)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["enter"]:
        return _enter_main(argv[1:])
    if argv[:1] == ["agent"] and len(argv) == 3:
        return agent_main(argv[1], argv[2])
    print("usage: python -m psring.cluster.emulate enter STATE HOST -- COMMAND... "
          "| agent PLAN STATE (started by psring run; see docs/emulation.md)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
