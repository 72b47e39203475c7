"""Receiving datagrams: a UDP socket for them, and the drain that hands what waits on it
to an Ingress (psring.comm.ingress) in batches.

    sock = receiving_socket("198.18.0.3", 5555, 64 << 20)
    drain(sock, ingress)               # every datagram waiting, kept or counted as bad

The socket asks for UDP GRO (the kernel hands many datagrams of one flow in one
receive); whether or not the kernel coalesced them, the whole datagrams of consecutive
receives go one after another into the ingress's arena and are checked together
(numpy), a transfer at a time, so a datagram costs a receive but no Python of its own.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Callable

from psring.comm.datagrams import DATAGRAM_HEADER, DATAGRAM_MAGIC, DATAGRAM_PAYLOAD
from psring.comm.ingress import Ingress

#: Linux's UDP_GRO option: the kernel hands a socket many datagrams of one flow in one
#: receive, with their size (an int) in a control message
UDP_GRO = getattr(socket, "UDP_GRO", 104)

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def receiving_socket(host: str, port: int, buffer_bytes: int) -> socket.socket:
    """A non-blocking UDP socket bound to (``host``, ``port``; 0: any free one) whose
    kernel buffer holds ``buffer_bytes`` of datagrams (root may go beyond
    net.core.rmem_max, 208 KiB by default; others get what it allows). OSError when
    the port cannot be bound."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    try:  # (many datagrams a receive where the kernel coalesces them; else one)
        s.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    except OSError:
        pass
    s.setblocking(False)
    return s


#: bytes of a whole unsigned datagram, of any dtype (the one size a run of single
#: datagrams has)
WHOLE = DATAGRAM_HEADER + DATAGRAM_PAYLOAD
#: bytes one receive may return: a coalesced receive's (UDP GRO) 64 KiB at most
RECEIVE_MOST = 65536


@dataclass
class _Run:
    """Consecutive receives of whole datagrams of one size, end to end in the ingress's
    arena, kept together: one numpy check for many receives. Coalesced receives (UDP
    GRO) and single datagrams alike, of any transfers (kept a transfer at a time when
    it is flushed): where the kernel coalesces nothing (a link whose frames it does not
    gather, several sources interleaved), a datagram costs its receive and no more."""

    start: int = 0
    end: int = 0
    size: int = 0
    #: where each of its receives ends, from ``start``
    receives: list[int] = field(default_factory=list)

    def add(self, got: int, size: int) -> None:
        """A receive of ``got`` bytes of datagrams of ``size`` bytes, just made at
        ``end``."""
        self.size = size
        self.end += got
        self.receives.append(self.end - self.start)


def drain(sock: socket.socket, ingress: Ingress, most: int | None = None,
          heard: Callable[[tuple, bytes, int], None] | None = None) -> int:
    """Hand the datagrams waiting on ``sock`` to ``ingress`` (all, or about ``most``:
    a coalesced receive is handed whole); returns how many. ``heard(addr, first
    header, count)`` hears of each receive (psring.comm.credits.Granter.heard).
    Receives go into the ingress's arena; consecutive receives of whole, unsigned
    datagrams of one size (coalesced or single, of any transfers) are kept together,
    once the arena is full, the size changes or nothing more is waiting."""
    n = 0
    control = socket.CMSG_SPACE(4)
    arena = memoryview(ingress.arena)
    last = len(arena) - RECEIVE_MOST  # (where a receive still fits the arena)
    unsigned = ingress.key is None
    run = _Run()
    try:
        while most is None or n < most:
            if run.end > last:
                run = _flush(ingress, run)
            room = arena[run.end:run.end + RECEIVE_MOST]
            try:
                got, ancillary, _, addr = sock.recvmsg_into([room], control)
            except (BlockingIOError, InterruptedError):
                break
            data = room[:got]
            # (no control message: a datagram alone, as where nothing is coalesced)
            size = _coalesced(ancillary) if ancillary else 0
            k = -(-got // size) if size and got > size else 1
            piece = _piece(data, got, size, k) if unsigned else 0
            # (a transfer's last receive: its whole datagrams join the run, the short
            # last one is kept at once, before the next receive goes where it lies)
            short = got % size if unsigned and not piece and k > 2 \
                and size > DATAGRAM_HEADER else 0
            if short:
                piece = size
            if piece and run.end > run.start and piece != run.size:
                _flush(ingress, run)  # (datagrams of another size: they start a run)
                run = _Run(run.end, run.end)
            if piece:
                run.add(got - short, piece)
                if short:
                    ingress.datagram(data[got - short:])
            elif k > 1:  # (coalesced, signed or with a short last datagram)
                ingress.datagrams(data, size)
            else:  # (a marker, a request, a signed or a short last datagram)
                ingress.datagram(data)
            n += k
            if heard is not None:
                heard(addr, data[:DATAGRAM_HEADER], k)
    finally:  # (what was received is kept, even when a receive or a callback fails)
        _flush(ingress, run)
    return n


def _coalesced(ancillary: list) -> int:
    """The datagrams' size of a coalesced receive (UDP GRO's control message), else 0."""
    for level, kind, value in ancillary:
        if level == socket.SOL_UDP and kind == UDP_GRO:
            return int.from_bytes(value[:4], "little")
    return 0


def _piece(data: memoryview, got: int, size: int, k: int) -> int:
    """The size of the whole datagrams ``data`` holds (a coalesced receive of ``k``, or
    one), when they may join a run; else 0."""
    if k > 1:
        return size if got % size == 0 and size > DATAGRAM_HEADER else 0
    return got if got == WHOLE and data[:4] == DATAGRAM_MAGIC else 0


def _flush(ingress: Ingress, run: _Run) -> _Run:
    """Keep ``run``'s datagrams; an empty run at the arena's start."""
    if run.end > run.start:
        ingress.datagrams(memoryview(ingress.arena)[run.start:run.end], run.size,
                          run.receives)
    return _Run()
