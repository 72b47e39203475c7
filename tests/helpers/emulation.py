"""Helpers for the tests of emulated clusters (psring.cluster.emulate): can this machine build
one, and is every namespace, veth and bridge of a run gone afterwards?"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=None)
def emulation_unavailable() -> str | None:
    """Why this machine cannot build emulated clusters (None when it can): iproute2's
    tools, and a network namespace: as root a plain one, else one inside a user
    namespace, as psring would."""
    import shutil

    for tool in ("ip", "tc"):
        if not (shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")):
            return f"iproute2's `{tool}` is not installed (apt-get install iproute2)"
    for argv in (["unshare", "--net", "true"],
                 ["unshare", "--user", "--net", "--map-root-user", "true"]):
        if os.geteuid() != 0 and argv[1] == "--net":
            continue
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`{' '.join(argv)}` could not run: {e}"
        if proc.returncode == 0:
            return None
        why = proc.stderr.strip()
    return f"this machine cannot create network namespaces ({why})"


needs_emulation = pytest.mark.skipif(emulation_unavailable() is not None,
                                     reason=str(emulation_unavailable()))


def cluster_state(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "cluster.json").read_text())


def _inodes(state: dict) -> dict[int, str]:
    """The namespaces a cluster's state names (a build that failed names those it made)."""
    if "switch" not in state:
        return {}
    found = {state["switch"]["net_inode"]: "the switch's network namespace"}
    for h in state.get("hosts", []):
        found[h["net_inode"]] = f"{h['name']}'s network namespace"
    if state["mode"] == "userns":
        found[state["switch"]["user_inode"]] = "the cluster's user namespace"
    return found


def leftovers(state: dict) -> list[str]:
    """What of a cluster still exists. A namespace lives while a process is in it, a
    file descriptor refers to it or it is bind-mounted (nsfs); with none of these the
    kernel frees it, and the veths and bridge inside it with it. Also: no interface
    psring names (psr-*) in this machine's own namespace."""
    inodes = _inodes(state)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        paths = [proc / "ns" / "net", proc / "ns" / "user"]
        try:
            paths += [t / "ns" / "net" for t in (proc / "task").iterdir()]
            paths += list((proc / "fd").iterdir())
        except OSError:
            pass
        for p in paths:
            try:
                link = os.readlink(p)
            except OSError:
                continue
            if link.startswith(("net:[", "user:[")):
                ino = int(link.split("[", 1)[1].rstrip("]"))
                if ino in inodes:
                    found.append(f"{inodes[ino]} (held by {p})")
        try:
            mounts = (proc / "mountinfo").read_text()
        except OSError:
            continue
        for ino, what in inodes.items():
            if f"[{ino}]" in mounts:
                found.append(f"{what} (bind-mounted, seen in {proc}/mountinfo)")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    found += [f"interface {line.split(':')[1].strip()} in this machine's namespace"
              for line in links.stdout.splitlines() if ": psr-" in line]
    return found


def assert_cluster_gone(run_dir: Path, within: float = 10.0) -> dict:
    """Every namespace, veth and bridge of the run's cluster is gone (polling up to
    ``within`` seconds while the last processes are reaped). Returns the state."""
    state = cluster_state(run_dir)
    deadline = time.monotonic() + within
    while True:
        left = leftovers(state)
        if not left:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the emulated cluster of {run_dir} is still there: {left}")
        time.sleep(0.1)


def cut_link(run_dir: Path, host: str) -> None:
    """A network partition: set the host's interface down inside its namespace. The
    holder's pid is checked against the namespace's inode first: a stale pid could
    belong to a process in this machine's own namespace, whose eth0 is not ours."""
    h = next(h for h in cluster_state(run_dir)["hosts"] if h["name"] == host)
    ns = f"/proc/{h['pid']}/ns/net"
    assert os.stat(ns).st_ino == h["net_inode"], f"{host}'s namespace is gone"
    subprocess.run(["nsenter", f"--net={ns}", "ip", "link", "set", "dev", "eth0", "down"],
                   check=True, timeout=10)
