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
import subprocess
from pathlib import Path
from typing import Mapping

from psring.errors import ConfigError

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


def resolve(host: str) -> list[str]:
    """MASTER_ADDR's IP addresses, IPv4 first (torchrun accepts names too)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ConfigError(f"MASTER_ADDR {host!r} does not resolve ({e.strerror}); give "
                          f"torchrun's --master-addr as an IP address or a name every host "
                          f"resolves.") from None
    ips = list(dict.fromkeys(i[4][0] for i in infos))
    return sorted(ips, key=lambda a: ":" in a)


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def source_address(dest: str) -> str | None:
    """This host's address on the kernel's route to ``dest`` (None: no route, or no
    such address family here). A UDP socket's connect() only looks the route up: no
    packet is sent."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))  # any port: nothing is sent
            return s.getsockname()[0]
    except OSError:
        return None


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 address, secondary ones included (``ip``);
    where ``ip`` is missing, each interface's primary address (SIOCGIFADDR)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5).stdout
        pairs = []
        for line in out.splitlines():  # "2: eth0    inet 198.18.0.1/15 brd ... scope ..."
            cols = line.split()
            if len(cols) >= 4 and cols[2] == "inet":
                pairs.append((cols[1].split("@")[0], cols[3].split("/")[0]))
        if pairs:
            return pairs
    except (OSError, subprocess.TimeoutExpired):
        pass
    pairs = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            pairs.append((name, socket.inet_ntoa(raw[20:24])))
    return pairs


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
    return next((name for name, a in _ipv4_addresses() if a == str(ip)), None)


def _exists(name: str, prefix: bool = False) -> bool:
    """An interface of that name (``prefix``: one whose name starts with it, as NCCL
    reads NCCL_SOCKET_IFNAME without a leading '=')."""
    names = [n for _, n in socket.if_nameindex()]
    return any(n.startswith(name) for n in names) if prefix else name in names


def _check_given(var: str, value: str) -> None:
    if value.startswith("^"):
        return  # an exclusion list (NCCL): nothing to look up
    exact = var == GLOO or value.startswith("=")
    for name in value.lstrip("=").split(","):
        if name and not _exists(name, prefix=not exact):
            raise ConfigError(
                f"{var}={value} names an interface this host does not have ({name}); its "
                f"interfaces: {', '.join(n for _, n in socket.if_nameindex())}. Set {var} to "
                f"the one on the network the other hosts are on, or unset it and psring "
                f"picks the one routed to MASTER_ADDR.")


def choose(env: Mapping[str, str], cuda: bool) -> Choice:
    """The interface for this worker's process group (see the module's docstring).
    With MASTER_ADDR loopback on a launch of several nodes (node 0, whose host name
    maps to 127.0.1.1), the choice waits for the peers: :func:`after_join`."""
    names = (GLOO, NCCL) if cuda else (GLOO,)
    master = env.get("MASTER_ADDR", "")
    ips = resolve(master) if master else []
    loopback = not ips or all(is_loopback(ip) for ip in ips)
    src = next((a for a in map(source_address, ips) if a), None)  # IPv4 first
    given = {n: env[n] for n in names if env.get(n)}
    if given:
        for var, value in given.items():
            _check_given(var, value)
        fill = {NCCL: env[GLOO]} if cuda and GLOO in given and NCCL not in given else {}
        if GLOO in given:
            return Choice(given[GLOO], None if loopback else src, "user", fill)
        # NCCL's own setting given: gloo's interface is still psring's to choose
        names = (GLOO,)
    if loopback:
        return Choice(None, None, "loopback", {})
    return _routed(src, names,
                   f"this host has no route to MASTER_ADDR {master} ({', '.join(ips)}), so "
                   f"psring cannot tell which network interface the other hosts reach it on. "
                   f"Check that --master-addr is the address of node 0 as this host sees it, "
                   f"or set {GLOO}{' and ' + NCCL if cuda else ''} to the interface to use "
                   f"(see `ip -brief address`).")


def after_join(choice: Choice, peers: list[dict], host: str, cuda: bool) -> Choice:
    """The choice once every rank has registered. Node 0 whose MASTER_ADDR is loopback
    (its own host name mapped to 127.0.1.1 or 127.0.0.1) has peers on other hosts: it
    takes the interface routed to one of them. All on this machine: loopback it stays."""
    if choice.how != "loopback":
        return choice
    away = [p for p in peers if p.get("address") and p.get("host") != host]
    if not away:
        return choice
    peer = away[0]
    return _routed(source_address(peer["address"]), (GLOO, NCCL) if cuda else (GLOO,),
                   f"MASTER_ADDR is a loopback address on this host, but worker "
                   f"{peer['rank']} is on {peer['host']} ({peer['address']}), to which this "
                   f"host has no route; give torchrun's --master-addr as node 0's address on "
                   f"the network between the hosts, or set {GLOO} to the interface on it.")


def _routed(src: str | None, names: tuple[str, ...], no_route: str) -> Choice:
    """The interface holding ``src`` (this host's address on a route), for ``names``;
    ``no_route`` is the ConfigError's paragraph when there is none."""
    iface = interface_of(src) if src else None
    if iface is None:
        raise ConfigError(no_route)
    return Choice(iface, src, "route", {n: iface for n in names})
