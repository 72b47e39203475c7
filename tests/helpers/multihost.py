"""Hosts for the tests of the multi-host path (torchrun on several machines).

Each host is one of psring's emulated hosts (psring.cluster.emulate.standalone: a network
namespace on a bridge, addressed in 198.18.0.0/15) with a host name of its own that
resolves nowhere, so nothing may rely on the host name (the failure that gloo's default
choice of address meets). On them a test runs docs/multihost.md's commands as a user runs
them on real machines: no psring launcher, nothing set in the environment but what a
user's shell has.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from psring.cluster import emulate
from tests.helpers.emulation import assert_cluster_gone

_ports = itertools.count(29500)


def user_env() -> dict[str, str]:
    """The environment of a user's shell: nothing psring, gloo, NCCL or torchrun set."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PSRING_", "GLOO_", "NCCL_", "TORCHELASTIC_", "MASTER_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


class Node:
    """A command running on one emulated host, its output in a file."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log
        self.started = time.monotonic()
        self.ended: float | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def poll(self) -> int | None:
        """Its exit status, or None while it runs; ``ended`` is when this first saw it
        exit (poll often, or through :func:`wait_all`, to time it)."""
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def wait(self, within: float) -> int:
        """Its exit status; killed (and an AssertionError) when it runs past ``within``
        seconds from its start."""
        wait_all([self], self.started + within)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Hosts:
    def __init__(self, cluster: emulate.EmulatedCluster, logs: Path,
                 python: str = sys.executable):
        self.cluster, self.logs = cluster, logs
        self.nodes: list[Node] = []
        #: the environment's commands (another checkout's venv: benchmarks/multihost_faults.py)
        self.bin = Path(python).parent

    def command(self, name: str) -> str:
        """An installed command of the environment under test (torchrun, psring)."""
        return str(self.bin / name)

    def address(self, i: int) -> str:
        return self.cluster.host(f"host-{i}")["address"]

    def run(self, i: int, argv: list[str], name: str,
            env: dict[str, str] | None = None) -> Node:
        """``argv`` on host ``i``, under its own host name (a UTS namespace), with
        ``env`` added to a user's environment."""
        host = f"host-{i}"
        # (Python sets the name: a `hostname` command is not on every machine)
        named = ["unshare", "--uts", "--", "sh", "-c",
                 f'{sys.executable} -c "import socket, sys; socket.sethostname(sys.argv[1])" '
                 f'"$0" && exec "$@"', host, *argv]
        log = self.logs / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(self.cluster.command(host, named),
                                    env={**user_env(), **(env or {})},
                                    stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = Node(proc, log)
        self.nodes.append(node)
        return node

    def torchrun(self, i: int, nnodes: int, port: int, worker_args: list[str],
                 rdzv_timeout: float, name: str = "", module: str = "psring.workers",
                 env: dict[str, str] | None = None) -> Node:
        """docs/multihost.md's command on host ``i`` as node ``i``, node 0 on host 0."""
        argv = [self.command("torchrun"), "--nnodes", str(nnodes), "--node-rank", str(i),
                "--nproc-per-node", "1", "--master-addr", self.address(0),
                "--master-port", str(port), "--rdzv-conf", f"timeout={rdzv_timeout:g}",
                "-m", module, *worker_args]
        return self.run(i, argv, name or f"node-{i}", env)

    def cut(self, i: int) -> None:
        """A network partition: host ``i``'s interface goes down."""
        pid = self.cluster.host(f"host-{i}")["pid"]
        subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "link", "set", "dev",
                        "eth0", "down"], check=True, timeout=10)

    def kill_all(self) -> None:
        for n in self.nodes:
            n.kill()


def wait_all(nodes: list[Node], until: float) -> None:
    """Wait for every node to exit, timing each; kill them all (and an AssertionError)
    at ``until`` (a time.monotonic())."""
    while any(n.poll() is None for n in nodes):
        if time.monotonic() > until:
            for n in nodes:
                n.kill()
            late = [n for n in nodes if n.ended is None]
            raise AssertionError(f"{len(late)} still running at the deadline; output:\n"
                                 + "\n".join(n.output[-3000:] for n in late))
        time.sleep(0.05)


def next_port() -> int:
    """A master port for one launch (each host is a fresh namespace: any port is free;
    a new one per launch keeps a closing store's port out of the next launch's way)."""
    return next(_ports)


@contextlib.contextmanager
def emulated_hosts(count: int, tmp: Path, python: str = sys.executable) -> Iterator[Hosts]:
    """``count`` emulated hosts; afterwards every command killed and every namespace and
    link of them gone (asserted)."""
    d = tmp / "cluster"
    d.mkdir()
    hosts = None
    try:
        with emulate.standalone(count, log_dir=d) as cluster:
            hosts = Hosts(cluster, tmp, python)
            yield hosts
    finally:
        if hosts is not None:
            hosts.kill_all()
    assert_cluster_gone(d)
