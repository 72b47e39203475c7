"""psring.comm.tcp_timers: the least TCP retransmission timeout set on this process's own
connections found among its descriptors (a listener's accepted connections inherit it;
a client's connection is found by its peer), others untouched."""

from __future__ import annotations

import socket

import pytest

from psring.comm.tcp_timers import TCP_RTO_MIN_US, lower_rto_min, tcp_peers


def _rto_min(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US)


def _kernel_has_it() -> bool:
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 200_000)
            return True
        except OSError:
            return False


pytestmark = pytest.mark.skipif(not _kernel_has_it(),
                                reason="the kernel has no TCP_RTO_MIN_US (Linux 6.15+)")


def test_a_listener_passes_it_on_and_a_client_is_found_by_its_peer():
    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        other.bind(("127.0.0.1", 0))
        other.listen()
        default = _rto_min(listener)
        assert lower_rto_min(5_000, port=port) == 1
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            with accepted:
                # (the kernel keeps it in jiffies: 5 ms reads back as a whole tick)
                assert 5_000 <= _rto_min(accepted) < default
                assert _rto_min(client) == default  # (the client's side is its own)
                assert lower_rto_min(5_000, peers=tcp_peers(f"tcp://127.0.0.1:{port}")) == 1
                assert 5_000 <= _rto_min(client) < default
        assert _rto_min(other) == default  # another port's listener untouched


def test_endpoints_that_name_no_tcp_peer():
    assert tcp_peers("ipc:///tmp/x") == set()
    assert tcp_peers("tcp://127.0.0.1:5555") == {("127.0.0.1", 5555)}
    assert lower_rto_min(5_000, peers=set()) == 0
