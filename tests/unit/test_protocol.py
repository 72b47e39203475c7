"""The wire protocol: round trips (property-based) and rejection of every malformed
message the rules name, without large allocations; and a live server that keeps
serving a valid client after each bad message."""

import threading

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from psring.comm import protocol
from psring.comm.protocol import ProtocolError, decode, encode

COMMON = {"run": "r", "worker": 0, "seq": 1, "shard": 0}


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(list(protocol.DTYPES.values())),
       shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
       big=st.booleans())
def test_round_trip(dtype, shape, big):
    if big:  # above the zero-copy threshold
        shape = [70_000]
    t = (torch.randn(shape) * 100).to(dtype)
    frames = encode("push", {**COMMON, "step": 3, "offset": 7}, [t])
    msg = decode([bytes(f) for f in frames])
    assert msg.op == "push" and msg.header["step"] == 3 and msg.header["offset"] == 7
    assert msg.tensors[0].dtype == dtype and list(msg.tensors[0].shape) == shape
    assert torch.equal(msg.tensors[0], t)


def test_round_trip_through_zmq_frames_without_copies():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = b.bind_to_random_port("tcp://127.0.0.1")
        a.connect(f"tcp://127.0.0.1:{port}")
        t = torch.arange(100_000, dtype=torch.float32)
        a.send_multipart(encode("params", {**COMMON, "version": 4, "offset": 0}, [t]),
                        copy=False)
        msg = decode(b.recv_multipart(copy=False))
        assert msg.header["version"] == 4 and torch.equal(msg.tensors[0], t)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _header(**overrides):
    h = {"v": protocol.VERSION, "op": "pull", **COMMON, "min_version": 0, "tensors": []}
    h.update(overrides)
    return h


def _push_frames(entry, payload):
    h = {"v": protocol.VERSION, "op": "push", **COMMON, "step": 0, "offset": 0,
         "tensors": [entry]}
    return [msgpack.packb(h), b"", payload]


def _unsigned(header):
    return [msgpack.packb(header), b""]


#: name -> (frames, what the error says): each breaks exactly the rule it names
BAD = {
    "empty": ([], "empty"),
    "truncated header": ([msgpack.packb(_header())[:-3]], "not valid msgpack"),
    "not msgpack": ([b"\xc1\xc1garbage", b""], "not valid msgpack"),
    "header not a map": (_unsigned([1, 2, 3]), "not a map"),
    "wrong version": (_unsigned(_header(v=99)), "different psring versions"),
    "version 1 layout": ([msgpack.packb(_header(v=1))], "different psring versions"),
    "no signature frame": ([msgpack.packb(_header())], "no signature frame"),
    "signed, but no secret here": ([msgpack.packb(_header()), b"s" * 32], "no shared secret"),
    "unknown op": (_unsigned(_header(op="delete_everything")), "unknown op"),
    # found by fuzzing: a list can't even be looked up
    "op not a string": (_unsigned(_header(op=["push"])), "unknown op"),
    "missing field": (_unsigned({k: v for k, v in _header().items() if k != "seq"}),
                      "missing fields"),
    "extra field": (_unsigned(_header(evil=1)), "unexpected fields"),
    "wrong field type": (_unsigned(_header(seq="1")), "has type"),
    "bool for an int": (_unsigned(_header(min_version=True)), "has type"),
    "unknown dtype": (_push_frames(["complex128", [2]], b"\0" * 32), "dtype"),
    "wrong length": (_push_frames(["float32", [4]], b"\0" * 12), "needs 16 bytes"),
    "shape disagrees": (_push_frames(["float32", [2, 3]], b"\0" * 16), "needs 24 bytes"),
    "claims more than it carries": (_push_frames(["float32", [2**30]], b"\0" * 8),
                                    "needs 4294967296 bytes"),
    "negative dim": (_push_frames(["float32", [-1]], b""), "non-negative"),
    "zero-size but huge dims": (_push_frames(["float32", [0, 2**39, 2**39]], b""),
                                "dimension above"),
    # found by fuzzing: every dimension allowed, but torch's strides overflow
    "zero-size, strides overflow": (_push_frames(["float32", [0, 2**31, 2**31, 2**31]], b""),
                                    "elements"),
    "more frames than tensors": ([msgpack.packb(_header()), b"", b"x"], "tensor frames"),
    "huge header": ([b"\x80" + b"\0" * (protocol.MAX_HEADER_BYTES + 1)], "exceeds"),
    "map bomb": ([b"\xdf\xff\xff\xff\xff", b""], "not valid msgpack"),  # map32: 4G entries
    "str bomb": ([b"\xdb\xff\xff\xff\xff" + b"a", b""], "not valid msgpack"),
    "deep nesting": ([b"\x91" * 10_000, b""], "not valid msgpack"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_messages_raise_only_protocol_error(name):
    frames, match = BAD[name]
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_decode_checks_expected_ops():
    with pytest.raises(ProtocolError, match="not expected"):
        decode(encode("ack", {**COMMON, "version": 0, "staleness": 0}), expect=("pull",))


@pytest.fixture()
def live_server(tmp_path):
    from psring.servers.server import Server

    server = Server("tcp://127.0.0.1:0", "test-server", tmp_path / "servers.jsonl")
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    server.close()


def _client(endpoint):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    return ctx, s


def _init_and_pull(sock, run):
    params = torch.arange(10, dtype=torch.float32)
    sock.send_multipart(encode("init", {"run": run, "worker": 0, "seq": 1, "shard": 0, "lo": 0,
                                        "hi": 10, "workers": 1, "mode": "sync", "lr": 0.1,
                                        "momentum": 0.0, "weight_decay": 0.0,
                                        "max_staleness": -1}, [params]))
    assert decode(sock.recv_multipart()).op == "ok"
    sock.send_multipart(encode("pull", {"run": run, "worker": 0, "seq": 2, "shard": 0,
                                        "min_version": 0}))
    reply = decode(sock.recv_multipart())
    assert reply.op == "params" and torch.equal(reply.tensors[0], params)


@pytest.mark.timeout(60)
def test_server_survives_every_malformed_message(live_server):
    ctx, good = _client(live_server.endpoint)
    ctx2, bad = _client(live_server.endpoint)
    try:
        for i, (name, (frames, _)) in enumerate(BAD.items()):
            if frames:
                bad.send_multipart(frames)
                reply = decode(bad.recv_multipart())
                assert reply.op == "error" and "protocol error" in reply.header["message"], name
            _init_and_pull(good, run=f"run-{i}")  # a valid client is still served
        assert live_server.invalid == sum(1 for f, _ in BAD.values() if f)
    finally:
        good.close(linger=0)
        bad.close(linger=0)
        ctx.term()
        ctx2.term()
