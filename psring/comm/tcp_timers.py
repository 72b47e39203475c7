"""TCP's least retransmission timeout on this process's own connections.

A bounded-loss run's TCP carries only control messages (a push's ``lossy_push`` and its
answer, a pull's request: psring.comm.psclient, servers/server.py), each one segment.
Linux probes a lone lost segment only after two round trips plus the socket's least
retransmission timeout (``tcp_schedule_loss_probe``), 200 ms unless set, so every lost
control message held a step back at least that. Linux 6.15 lets a process set that least
timeout on its own sockets (``TCP_RTO_MIN_US``); the timeout itself stays TCP's own
estimate (the smoothed round trip plus four of its deviations) above it. libzmq opens
its connections itself, so they are found among this process's descriptors: a server's
listening socket (the connections it accepts inherit the setting), a worker's
connections to its servers. Elsewhere (older kernels, not Linux) nothing changes.
"""

from __future__ import annotations

import errno
import os
import socket
from urllib.parse import urlparse

#: linux/tcp.h (Linux 6.15)
TCP_RTO_MIN_US = 45
#: the least retransmission timeout of a bounded-loss run's control connections: a few
#: round trips of a data centre's network, where 200 ms is hundreds of them (Vasudevan
#: et al., SIGCOMM 2009, safe fine-grained retransmissions for data-centre TCP)
CONTROL_RTO_MIN_US = 5_000


def lower_rto_min(us: int, port: int | None = None,
                  peers: set[tuple[str, int]] | None = None) -> int:
    """Set ``TCP_RTO_MIN_US`` to ``us`` on this process's TCP sockets listening on local
    ``port``, or connected to one of ``peers`` ((address, port)). Returns how many were
    set; 0 where the kernel has no such option or /proc is not there."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    done = 0
    for name in names:
        sock = _wrap(int(name))
        if sock is None:
            continue
        try:
            if _matches(sock, port, peers):
                sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, us)
                done += 1
        except OSError as e:
            if e.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return done  # (the kernel has no such option: none will take it)
        finally:
            sock.detach()  # (the descriptor is libzmq's: never closed here)
    return done


def tcp_peers(endpoint: str) -> set[tuple[str, int]]:
    """The (address, port) pairs a ``tcp://HOST:PORT`` endpoint's connection may have as
    its peer (HOST resolved); none for another transport or a name that does not resolve."""
    url = urlparse(endpoint)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        return set()
    try:
        infos = socket.getaddrinfo(url.hostname, url.port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {(info[4][0], url.port) for info in infos}


def _wrap(fd: int) -> socket.socket | None:
    """A socket object over descriptor ``fd`` when it is a TCP socket (detach it after)."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        return sock
    sock.detach()
    return None


def _matches(sock: socket.socket, port: int | None,
             peers: set[tuple[str, int]] | None) -> bool:
    try:
        peer = sock.getpeername()[:2]
    except OSError:  # (not connected: a listening socket)
        return port is not None and sock.getsockname()[1] == port
    return bool(peers) and (peer[0], peer[1]) in peers
