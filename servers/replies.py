"""What a parameter server's request handler answers with (psring.servers.handler): a
:class:`Reply` to send, a request held back until it can be answered
(:class:`Deferred`), and the error of a valid request the server's state can't accept
(:class:`RequestError`, answered as an error message)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psring.comm.protocol import Message


class RequestError(Exception):
    """A valid message that the server's state can't accept (answered with an error)."""


@dataclass
class Piece:
    """A ready range of a pull answered as datagrams (psring.comm.egress): elements
    [start, start + len(values)) of the ``numel`` its request (``header``) asks for."""

    header: dict[str, Any]
    numel: int
    start: int
    values: Any  # torch.Tensor (this module stays free of torch)


@dataclass
class Reply:
    peer: bytes
    #: None: nothing to send over ZeroMQ (a dropped replay, or a ``piece``), the record
    frames: list | None
    record: dict[str, Any]
    piece: Piece | None = None


@dataclass
class Deferred:
    """A request held back: a pull waiting for its version, a snapshot for a later one,
    a commit for the step's choice of workers."""

    peer: bytes
    msg: Message
    since: float
    sent: set = field(default_factory=set)  # ranges already streamed to it (sync)
    #: how many of the step's updated ranges (_Run.done) it has been offered: each
    #: request then streams only the new ones (held pulls x ranges would be quadratic)
    done_seen: int = 0
    #: the part of the shard it asks for, [a, b) relative to it, once validated (_fits)
    part: tuple[int, int] | None = None
