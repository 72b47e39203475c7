"""The emulated cluster's agent: the process that builds the cluster and keeps it alive
(``python -m psring.cluster.emulate agent PLAN STATE``, a service of the run's
supervisor; psring.cluster.emulate is the launcher's side and has the picture).

It moves itself into the switch's namespace (inside a new user namespace when it is not
root), forks one *holder* per host (a process whose only job is to keep that host's
namespace alive), builds the bridge, the veth pairs or TAP devices and their shaping
(``tbf``, in tc's syntax below), starts the links' forwarders where a link delays or
loses (psring.cluster.link), writes the cluster's state (CLUSTER_FILE) for the launcher
and the trampoline, then watches the links until it is stopped. Everything it made dies
with it: the kernel frees a namespace with its last process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from psring.cluster.link import FRAME_BITS, LossModel, forward, open_tap, save_kernel_loss
from psring.cluster.netns import (
    CLONE_NEWNET,
    CLONE_NEWUSER,
    HOST_IFACE,
    _setns,
    _unshare,
    link_events,
    ns_inode,
    port_bytes,
    setns_fd,
    tcp_counters,
)
from psring.cluster.shaping import frames, in_kernel, shaping, user_space
from psring.cluster.spec import NETWORK
from psring.errors import PsringError
from psring.records.runlog import atomic_write_json
from psring.runtime.process import (
    die_with_parent,
    kill_with_parent,
)

#: the switch's bridge (its ports are named after the hosts)
BRIDGE = "psr-br"
CLUSTER_FILE = "cluster.json"
#: seconds the agent may take to build a cluster
READY_TIMEOUT_S = 30.0

class EmulationError(PsringError):
    """The machine cannot build the cluster (permissions, tools, kernel): exit 2."""


def tool(name: str) -> str:
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


def _no_ipv6() -> None:
    """IPv6 off in the current namespace: no autoconfiguration chatter on the links,
    and no address outside 198.18.0.0/15 (namespace_is_isolated)."""
    for name in ("all", "default"):
        try:
            Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6").write_text("1")
        except OSError:
            pass  # a kernel without IPv6


def _set_rto_min(us: int) -> None:
    """--tcp-rto-min in the current namespace (a host's)."""
    try:
        Path("/proc/sys/net/ipv4/tcp_rto_min_us").write_text(str(us))
    except OSError as e:
        raise EmulationError(f"--tcp-rto-min needs net.ipv4.tcp_rto_min_us (Linux 6.11 or "
                             f"later), which this kernel refused ({e.strerror}); drop "
                             f"--tcp-rto-min.") from None


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
        ip, tc = tool("ip"), tool("tc")
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
            lines += [f"link set dev {h['port']} master {BRIDGE}", *frames(h["port"], plan),
                      f"link set dev {h['port']} up"]
        _run([ip, "-batch", "-"], "\n".join(lines) + "\n", "the switch")
        tc_lines = [ln for h in self.state["hosts"] for ln in shaping(h["port"], plan)]
        if tc_lines:
            _run([tc, "-batch", "-"], "\n".join(tc_lines) + "\n", "the switch's links")
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
                            plan["seed"], out, plan.get("switch") == "priority")
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
                 *frames(HOST_IFACE, self.plan), f"link set dev {HOST_IFACE} up"]
        _run([ip, "-batch", "-"], "\n".join(lines) + "\n", h["name"])
        if self.plan.get("tcp_rto_min_us"):
            _set_rto_min(self.plan["tcp_rto_min_us"])
        tc_lines = shaping(HOST_IFACE, self.plan)
        if tc_lines:
            _run([tc, "-batch", "-"], "\n".join(tc_lines) + "\n", f"{h['name']}'s link")

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
        if in_kernel(self.plan):  # the forwarders' records, without forwarders
            save_kernel_loss(self.state_path.parent / "links", self.state["hosts"], tool("tc"))

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
