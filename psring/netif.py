"""Which network interface a worker's collectives use on several hosts.

gloo (and NCCL) must advertise to the other hosts an address they can reach. Without
``GLOO_SOCKET_IFNAME``, gloo resolves the machine's host name, and where that name maps
to 127.0.0.1 (a common /etc/hosts) it advertises loopback: the other hosts then dial
their own loopback and fail with "Gloo connectFullMesh failed ... Connection refused".

psring's rule (:func:`choose`): a user's ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
always wins (checked to exist); else, when ``MASTER_ADDR`` is not a loopback address,
the interface that carries this host's address toward ``MASTER_ADDR`` in the kernel's
routing table, found with a connected UDP socket (which sends nothing); where there is
no route, a :class:`ConfigError` naming the variable to set.

    >>> choose({"MASTER_ADDR": "127.0.0.1"}, cuda=False).interface is None
    True
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path
from typing import Mapping

from .errors import ConfigError

GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


@dataclasses.dataclass(frozen=True)
class Choice:
    """The interface for the collectives and how it was chosen."""

    #: None: nothing to choose (one host: MASTER_ADDR is a loopback address)
    interface: str | None
    #: this host's address on it (toward MASTER_ADDR), when psring chose it
    address: str | None
    #: "user" (GLOO_SOCKET_IFNAME was set), "route" (psring chose), "loopback"
    how: str
    #: environment variables to set before the process group is created
    env: dict[str, str]

    def describe(self) -> dict:
        return {"interface": self.interface, "address": self.address, "chosen_by": self.how}

    def message(self) -> str:
        if self.how == "user":
            return f"network interface {self.interface} ({GLOO} as set)"
        if self.how == "route":
            return (f"network interface {self.interface} ({self.address}), the route to "
                    f"MASTER_ADDR; set {GLOO} to choose another")
        return "one host (MASTER_ADDR is loopback): gloo uses loopback"


def resolve(host: str) -> str:
    """MASTER_ADDR as an IP address (torchrun accepts names too)."""
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except socket.gaierror as e:
        raise ConfigError(f"MASTER_ADDR {host!r} does not resolve ({e.strerror}); give "
                          f"torchrun's --master-addr as an IP address or a name every host "
                          f"resolves.") from None


def source_address(dest: str) -> str | None:
    """This host's address on the kernel's route to ``dest`` (None: no route). A UDP
    socket's connect() only looks the route up: no packet is sent."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest, 9))  # any port: nothing is sent
        except OSError:
            return None
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The interface that holds ``address``."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        try:
            rows = Path("/proc/net/if_inet6").read_text().splitlines()
        except OSError:
            return None
        for row in rows:  # address (32 hex digits), ifindex, prefix, scope, flags, name
            cols = row.split()
            if len(cols) >= 6 and ipaddress.ip_address(int(cols[0], 16)) == ip:
                return cols[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def _exists(name: str) -> bool:
    try:
        socket.if_nametoindex(name)
        return True
    except OSError:
        return False


def choose(env: Mapping[str, str], cuda: bool) -> Choice:
    """The interface for this worker's process group (see the module's docstring)."""
    names = (GLOO, NCCL) if cuda else (GLOO,)
    master = env.get("MASTER_ADDR", "")
    ip = resolve(master) if master else None
    loopback = ip is None or ipaddress.ip_address(ip.split("%")[0]).is_loopback
    src = None if loopback else source_address(ip)
    given = {n: env[n] for n in names if env.get(n)}
    if given:
        for var, value in given.items():
            # gloo and NCCL take a comma-separated list (NCCL also ^excluded and =exact)
            for name in value.lstrip("^=").split(","):
                if name and not value.startswith("^") and not _exists(name):
                    raise ConfigError(
                        f"{var}={value} names an interface this host does not have "
                        f"({name}); its interfaces: "
                        f"{', '.join(n for _, n in socket.if_nameindex())}. Set {var} to "
                        f"the one on the network the other hosts are on, or unset it and "
                        f"psring picks the one routed to MASTER_ADDR.")
        return Choice(next(iter(given.values())), src, "user", {})
    if loopback:
        return Choice(None, None, "loopback", {})
    iface = interface_of(src) if src else None
    if iface is None:
        raise ConfigError(
            f"this host has no route to MASTER_ADDR {master} ({ip}), so psring cannot "
            f"tell which network interface the other hosts reach it on. Check that "
            f"--master-addr is the address of node 0 as this host sees it, or set "
            f"{GLOO}{' and ' + NCCL if cuda else ''} to the interface to use (see "
            f"`ip -brief address`).")
    return Choice(iface, src, "route", {n: iface for n in names})
