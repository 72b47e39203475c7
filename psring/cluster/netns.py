"""Network namespaces, in system calls: which one this process is in, and moving into
one. The emulated cluster (psring.cluster.emulate) is built from these; a parameter server
asks :func:`inside_cluster` whether it may listen without a secret.

Linux only; pure ctypes and /proc, no other psring module. Also what the emulated
cluster reads of its links: rtnetlink link events and byte counters.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import struct
from pathlib import Path

from psring.cluster.spec import NETWORK

#: the interface of every emulated host
HOST_IFACE = "eth0"
#: set by the launcher on every process it places on an emulated host: the inode of
#: that host's network namespace (see inside_cluster)
NETNS_ENV = "PSRING_CLUSTER_NETNS"


def namespace_is_isolated() -> bool:
    """True when this process's network namespace is shaped like an emulated host's and
    routes nowhere beyond 198.18.0.0/15: its interfaces are only ``lo`` and ``eth0``, its
    IPv4 routes (main table) all lie inside the range, and it has no IPv6 address of
    global scope."""
    try:
        devices = {line.split(":", 1)[0].strip()
                   for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]}
        rows = Path("/proc/self/net/route").read_text().splitlines()[1:]
    except OSError:
        return False
    if not devices <= {"lo", HOST_IFACE}:
        return False
    for row in rows:
        cols = row.split()
        if len(cols) < 8:
            return False
        dest = ipaddress.IPv4Address(struct.pack("<I", int(cols[1], 16)))
        mask = ipaddress.IPv4Address(struct.pack("<I", int(cols[7], 16)))
        try:
            net = ipaddress.ip_network(f"{dest}/{mask}")
        except ValueError:
            return False
        if not net.subnet_of(NETWORK):
            return False
    try:
        v6 = Path("/proc/self/net/if_inet6").read_text().splitlines()
    except OSError:
        v6 = []  # no IPv6 in this kernel
    # columns: address, ifindex, prefix length, scope (0x10 host, 0x20 link), flags, name
    return all(len(c := line.split()) >= 4 and int(c[3], 16) in (0x10, 0x20) for line in v6)


def inside_cluster() -> bool:
    """Is this process on a host of an emulated cluster psring built? The launcher marks
    the processes it places there with their namespace's inode (NETNS_ENV), and the
    namespace must still be that one and isolated (namespace_is_isolated). A parameter
    server there may listen on its emulated address without a shared secret: only
    psring's own namespaces can reach it."""
    mark = os.environ.get(NETNS_ENV, "")
    try:
        return mark.isdigit() and os.stat("/proc/self/ns/net").st_ino == int(mark) \
            and namespace_is_isolated()
    except OSError:
        return False


CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def setns_fd(fd: int, nstype: int) -> None:
    """Move this process into the namespace open at ``fd``."""
    if _libc.setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def _setns(path: str, nstype: int, inode: int | None = None) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if inode is not None and os.fstat(fd).st_ino != inode:
            raise OSError(errno.ESRCH, f"{path} is no longer the cluster's namespace")
        if _libc.setns(fd, nstype) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def ns_inode(pid: int | str, kind: str = "net") -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def link_events(data: bytes):
    """(interface name, carrier up) of each RTM_NEWLINK message in a netlink datagram."""
    IFF_UP, IFF_LOWER_UP, RTM_NEWLINK, IFLA_IFNAME = 0x1, 0x10000, 16, 3
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if kind == RTM_NEWLINK and length >= 32:
            flags = struct.unpack_from("=I", data, off + 24)[0]
            a = off + 32
            while a + 4 <= off + length:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype == IFLA_IFNAME:
                    name = data[a + 4:a + alen].split(b"\0")[0].decode(errors="replace")
                    yield name, bool(flags & IFF_UP and flags & IFF_LOWER_UP)
                a += (alen + 3) & ~3
        off += (length + 3) & ~3


def port_bytes(names: set[str]) -> dict[str, tuple[int, int]]:
    """(received, sent) byte counters of the named interfaces of this process's network
    namespace (/proc/self/net/dev is the namespace's own); {} if unreadable."""
    try:
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        f = rest.split()
        if name.strip() in names and len(f) >= 9:
            out[name.strip()] = (int(f[0]), int(f[8]))
    return out


#: TCP's counters of a namespace that say how it met loss (/proc/PID/net/snmp, netstat)
TCP_COUNTERS = ("OutSegs", "RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans",
                "TCPSackRecovery", "TCPSpuriousRTOs")


def tcp_counters(pid: int | str) -> dict[str, int]:
    """TCP_COUNTERS of the network namespace process ``pid`` is in (procfs shows the
    reading process the namespace of the pid it names); {} if unreadable."""
    out: dict[str, int] = {}
    for table in ("snmp", "netstat"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()
        except OSError:
            return {}
        # pairs of lines: "Tcp: Name1 Name2 ..." then "Tcp: 1 2 ..."
        for names, values in zip(lines[::2], lines[1::2]):
            for k, v in zip(names.split()[1:], values.split()[1:]):
                if k in TCP_COUNTERS and names.split()[0] in ("Tcp:", "TcpExt:"):
                    out[k] = int(v)
    return out
