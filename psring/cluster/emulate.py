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
The *agent* (psring.cluster.agent, started as ``python -m psring.cluster.emulate agent``,
a service of the run's supervisor)
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
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from psring.cluster.agent import (
    CLUSTER_FILE,
    READY_TIMEOUT_S,
    EmulationError,
    agent_main,
    tool,
)
from psring.cluster.netns import (
    CLONE_NEWNET,
    CLONE_NEWUSER,
    HOST_IFACE,
    NETNS_ENV,
    _setns,
)
from psring.cluster.spec import Cluster
from psring.runtime.process import (
    POLL_S,
    ProcessSpec,
    Supervisor,
    kill_with_parent,
    tail,
)

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
                "buffer_bytes": p.buffer_bytes, "switch": p.switch, "loss_in": p.loss_in,
                # TCP's floor, slowed by --time-scale as the link's times are
                "tcp_rto_min_us": round(p.tcp_rto_min_s * p.time_scale * 1e6)}
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
        subprocess.run(self.command(host, [tool("ip"), "link", "set", "dev",
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
               loss: float = 0.0, loss_burst: float = 1.0, seed: int = 0,
               link_buffer: str = "", switch: str = "fifo",
               loss_in: str = "forwarder", tcp_rto_min: str = "") -> Iterator[EmulatedCluster]:
    """An emulated cluster outside a run (calibration, benchmarks): its agent is
    supervised here and stopped on exit; ``cluster.command(host, argv)`` runs a program
    on a host, ``enter(cluster.host(name), cluster.mode)`` moves a fresh process there."""
    with tempfile.TemporaryDirectory(prefix="psring-cluster-") as tmp:
        d = Path(log_dir) if log_dir else Path(tmp)
        cluster = EmulatedCluster(Cluster.bare(hosts, link, delay, loss, loss_burst, seed,
                                               link_buffer, switch, loss_in, tcp_rto_min), d)
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
