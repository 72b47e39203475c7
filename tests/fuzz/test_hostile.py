"""Hostile input: the decoder raises nothing but ProtocolError on any frames (fuzzed with
hypothesis, and with atheris when it is installed); a frame above the server's limit
costs the sender its connection, not the server its service; a flood of connections
sending garbage neither stops a server serving a valid client nor grows its memory."""

import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psring.comm import endpoints, protocol
from psring.comm.protocol import AuthenticationError, ProtocolError, decode, encode
from tests.helpers import LiveServer, RawClient, assert_no_processes, rss_kib, start_server_process

KEY = b"k" * 32
HERE = Path(__file__).resolve().parent


def decodes_or_refuses(frames, key=None, expect=None) -> bool:
    """True when decode accepted the frames; False when it refused them. Any other
    exception fails the test."""
    try:
        decode(frames, expect=expect, key=key)
    except ProtocolError:
        return False
    return True


frame = st.one_of(st.binary(max_size=64), st.binary(min_size=256, max_size=2048))
keys = st.sampled_from([None, KEY])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(frame, max_size=6), key=keys)
def test_fuzz_random_frames(frames, key):
    decodes_or_refuses(frames, key)


# headers built from plausible pieces, so the fuzzer gets past msgpack into the schema
_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
              st.text(max_size=8), st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
_field_names = st.sampled_from(["v", "op", "run", "worker", "seq", "shard", "tensors", "step",
                                "offset", "min_version", "lo", "hi", "workers", "mode", "lr",
                                "momentum", "weight_decay", "max_staleness", "version",
                                "staleness", "message", "evil"])
_tensor_entries = st.lists(st.tuples(st.sampled_from([*protocol.DTYPES, "int8", 3]),
                                     st.lists(st.integers(-2, 2**33), max_size=9)).map(list),
                           max_size=3)


@st.composite
def headers(draw):
    h = {"v": draw(st.sampled_from([protocol.VERSION, 1, "2"])),
         "op": draw(st.sampled_from([*protocol.SCHEMAS, "nope"])),
         "run": "r", "worker": 0, "seq": 1, "shard": 0, "tensors": draw(_tensor_entries)}
    for name in draw(st.lists(_field_names, max_size=10)):
        h[name] = draw(st.one_of(_values, st.integers(0, 10)))
    for name in draw(st.lists(_field_names, max_size=2)):
        h.pop(name, None)
    return h


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=headers(), tensors=st.lists(st.binary(max_size=64), max_size=4),
       sig=st.sampled_from([b"", b"x" * 32]))
def test_fuzz_structured_headers(header, tensors, sig):
    frames = [msgpack.packb(header, use_bin_type=True), sig, *tensors]
    decodes_or_refuses(frames, None, expect=protocol.REQUESTS)
    decodes_or_refuses(frames, KEY)
    if len(frames[0]) <= protocol.MAX_HEADER_BYTES and not sig:
        # signed with the right key, the same frames reach the schema checks
        signed = [frames[0], protocol.signature(KEY, [frames[0], *tensors]), *tensors]
        assert decodes_or_refuses(signed, KEY) == decodes_or_refuses(frames)


def _valid_messages():
    t = torch.arange(12, dtype=torch.float32)
    c = {"run": "r", "worker": 1, "seq": 9, "shard": 0}
    return [
        ("push", {**c, "step": 3, "offset": 0}, [t]),
        ("pull", {**c, "min_version": 2}, []),
        ("init", {**c, "lo": 0, "hi": 12, "workers": 2, "mode": "sync", "lr": 0.1,
                  "momentum": 0.9, "weight_decay": 0.0, "max_staleness": -1}, [t]),
        ("params", {**c, "version": 1, "offset": 0}, [t.view(3, 4), t[:2].double()]),
    ]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 3), key=keys, data=st.data())
def test_fuzz_mutated_valid_messages(which, key, data):
    op, fields, tensors = _valid_messages()[which]
    frames = [bytearray(bytes(f)) for f in encode(op, fields, tensors, key)]
    assert decodes_or_refuses([bytes(f) for f in frames], key)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "dup", "swap"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if kind == "flip" and frames[i]:
        j = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][j] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del frames[i][data.draw(st.integers(0, len(frames[i]))):]
    elif kind == "extend":
        frames[i] += data.draw(st.binary(min_size=1, max_size=16))
    elif kind == "drop":
        del frames[i]
    elif kind == "dup":
        frames.insert(i, bytearray(frames[i]))
    elif len(frames) > 1:
        frames[0], frames[-1] = frames[-1], frames[0]
    mutated = [bytes(f) for f in frames]
    original = [bytes(f) for f in encode(op, fields, tensors, key)]
    if key is not None and mutated != original:
        # any change to a signed message is caught by its signature, before anything else
        with pytest.raises(AuthenticationError):
            decode(mutated, key=key)
    else:
        decodes_or_refuses(mutated, key)


def test_msgpack_limits_bound_what_a_header_expands_into():
    for _name, blob in {"array32 of 2**32": b"\xdd\xff\xff\xff\xff",
                       "map32 of 2**32": b"\xdf\xff\xff\xff\xff",
                       "str32 of 4 GiB": b"\xdb\xff\xff\xff\xff",
                       "bin32 of 4 GiB": b"\xc6\xff\xff\xff\xff",
                       "ext32": b"\xc9\xff\xff\xff\xff\x01",
                       "257 entries": b"\xdc\x01\x01" + b"\x00" * 257,
                       "65 keys": msgpack.packb({str(i): 0 for i in range(65)}),
                       "4097-char string": msgpack.packb({"run": "r" * 4097})}.items():
        with pytest.raises(ProtocolError, match="not valid msgpack"):
            decode([blob, b""])


# ---------------------------------------------------------------------- live servers
@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_an_oversized_frame_drops_only_its_sender(key):
    limit = 1 << 20
    with LiveServer(secret=key, max_frame_bytes=limit) as server, \
            RawClient(server.endpoint, key, run="good") as good, \
            RawClient(server.endpoint, key, run="big") as big:
        good.init(n=4)
        # a well-formed init whose tensor frame is above the limit: libzmq disconnects
        n = limit // 4 + 1
        big.send(big.frames("init", [torch.zeros(n)], lo=0, hi=n, workers=1, mode="sync",
                            lr=1.0, momentum=0.0, weight_decay=0.0, max_staleness=-1))
        assert big.recv(timeout_ms=500) is None
        assert torch.equal(good.pull(0), torch.zeros(4))  # still served; run not replaced
        # one at the limit (header, signature and tensor frames each within it) is fine
        n = (limit - 64) // 4
        big.init(n=n)
        assert server.handler.state.run == "big"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_connection_flood_keeps_serving_with_bounded_memory(tmp_path, signed):
    env = dict(os.environ)
    env.pop(endpoints.SECRET_ENV, None)
    if signed:
        env[endpoints.SECRET_ENV] = KEY.decode()
    name = f"flood-{os.getpid()}-{tmp_path.name}"
    proc, endpoint = start_server_process("--name", name, "--max-frame-mb", "1",
                                          "--log", str(tmp_path / "servers.jsonl"), env=env)
    key = KEY if signed else None
    rng = random.Random(0)
    try:
        with RawClient(endpoint, key, run="valid") as good:
            good.init(n=1000)
            good.pull(0)

            def flood(rounds: int) -> None:
                ctx = zmq.Context()
                try:
                    for _ in range(rounds):
                        socks = []
                        for i in range(200):
                            s = ctx.socket(zmq.DEALER)
                            s.setsockopt(zmq.LINGER, 0)
                            s.connect(endpoint)
                            garbage = [
                                [rng.randbytes(rng.randrange(1, 300))],
                                [rng.randbytes(8)] * rng.randrange(2, 40),
                                [msgpack.packb({"v": protocol.VERSION, "op": "push"}), b""],
                                [b"\x80", b"", b"\0" * (1 << 16)],
                            ][i % 4]
                            s.send_multipart(garbage)
                            if i % 50 == 0:  # an oversized frame: libzmq drops the peer
                                s.send(b"\0" * (2 << 20))
                            socks.append(s)
                        time.sleep(0.2)
                        for s in socks:
                            s.close(linger=0)
                        assert good.request("pull", min_version=0).op == "params"
                finally:
                    ctx.term()

            flood(1)  # warm-up: libzmq's and Python's pools reach their working size
            before = rss_kib(proc.pid)
            flood(3)
            time.sleep(0.5)
            after = rss_kib(proc.pid)
            # 600 more connections and ~2400 garbage messages; growth stays small
            assert after - before < 32 * 1024, (before, after)
            assert torch.equal(good.pull(0), torch.zeros(1000))
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    summary = out.strip().splitlines()[-1]
    assert ("unauthenticated 0" not in summary) if signed else ("invalid 0" not in summary)
    assert_no_processes(name)


# ---------------------------------------------------------------------- atheris (optional)
@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris is not installed (pip install atheris: Linux x86_64 "
                           "wheels for Python 3.11-3.13)")
def test_atheris_fuzzes_the_decoder(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "fuzz_protocol.py"), "-runs=4000",
                           "-seed=1", f"-artifact_prefix={tmp_path}/"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Done 4000 runs" in proc.stderr
