"""The datagrams' wire formats (--loss-tolerance's bounded-loss transport): gradient
datagrams, and the control datagrams that steer them (credit grants, end markers,
resend requests). The only place that knows these formats; the ZeroMQ messages' is
psring.comm.protocol, whose errors these raise. docs/protocol.md describes both.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import NamedTuple

import numpy as np

from psring.comm.protocol import DTYPES, AuthenticationError, ProtocolError

# ----------------------------------------------------------------- gradient datagrams
# --loss-tolerance: a push's gradient travels as UDP datagrams to the server's port (the
# same number as its TCP endpoint), each self-describing:
#
#     magic "PSRG", version, dtype code (WIRE_CODES), worker, shard, run tag (CRC-32 of
#     the run id), transfer (the lossy_push's `transfer`), packet number, packets,
#     elements
#     then the elements (packet i holds [i * per, i * per + n) of the pushed range,
#     per = DATAGRAM_PAYLOAD // itemsize), then with a shared secret 16 bytes of
#     HMAC-SHA256 over all of the above
#
# A datagram that breaks a rule is dropped and counted by the server, never answered.
DATAGRAM_MAGIC = b"PSRG"
DATAGRAM_VERSION = 1
#: the header, packed and unpacked at once (DATAGRAM_DTYPE: the same, for many)
DATAGRAM_STRUCT = struct.Struct("<4sBBHHIQIII")
DATAGRAM_HEADER = DATAGRAM_STRUCT.size
#: the header as a numpy record, to read many datagrams' headers at once
DATAGRAM_DTYPE = np.dtype([("magic", "S4"), ("version", "u1"), ("code", "u1"),
                         ("worker", "<u2"), ("shard", "<u2"), ("tag", "<u4"),
                         ("transfer", "<u8"), ("index", "<u4"), ("packets", "<u4"),
                         ("n", "<u4")])
#: element bytes per datagram: header + payload + signature fit one 1500-byte
#: Ethernet frame's UDP payload (1472), divisible by every wire dtype's size
DATAGRAM_PAYLOAD = 1408
DATAGRAM_SIGNATURE = 16
#: dtype codes of the datagrams' elements
WIRE_CODES = ("float32", "float16", "bfloat16")
#: the most packets one transfer may have (a 1 GiB float32 range is 762,601)
MAX_PACKETS = 2**24
_DATAGRAM_TAG = b"psring-datagram-hmac-sha256-v1"


def per_datagram(dtype: str) -> int:
    """Elements of ``dtype`` each datagram carries (the last of a transfer fewer)."""
    return DATAGRAM_PAYLOAD // DTYPES[dtype].itemsize


def run_tag(run: str) -> int:
    return zlib.crc32(run.encode())


class Datagram(NamedTuple):
    worker: int
    shard: int
    run_tag: int
    transfer: int
    index: int
    packets: int
    dtype: str
    payload: memoryview


def _datagram_mac(key: bytes, body: memoryview) -> bytes:
    return hmac.new(key, _DATAGRAM_TAG + bytes(body), hashlib.sha256).digest()[
        :DATAGRAM_SIGNATURE]


def encode_datagram(d: Datagram, key: bytes | None = None) -> bytes:
    n = len(d.payload) // DTYPES[d.dtype].itemsize
    body = DATAGRAM_STRUCT.pack(DATAGRAM_MAGIC, DATAGRAM_VERSION, WIRE_CODES.index(d.dtype),
                          d.worker, d.shard, d.run_tag, d.transfer, d.index, d.packets,
                          n) + bytes(d.payload)
    return body + _datagram_mac(key, memoryview(body)) if key else body


def block_bytes(nbytes: int) -> int:
    """The bytes of :func:`encode_block`'s buffer for ``nbytes`` of payload."""
    return max(1, -(-nbytes // DATAGRAM_PAYLOAD)) * (DATAGRAM_HEADER + DATAGRAM_PAYLOAD)


def encode_block(worker: int, shard: int, tag: int, transfer: int, dtype: str,
                 raw: np.ndarray, out: np.ndarray | None = None, first: int = 0,
                 packets: int | None = None) -> tuple[np.ndarray, int]:
    """All unsigned datagrams of one transfer in one buffer, built at once: row i is
    packet i (its header, then its piece of ``raw``, the range's bytes as uint8, cut
    every DATAGRAM_PAYLOAD), rows end to end, so consecutive packets are consecutive
    bytes; and the last packet's length (the rest of its row is not sent). ``out``:
    the memory to build it in (uint8, :func:`block_bytes` of them), else new. A part
    of a transfer (``raw`` its packets ``first`` on, of ``packets`` in all: a pull
    answered as its ranges are ready, psring.comm.egress) is numbered in the whole."""
    itemsize = DTYPES[dtype].itemsize
    count = max(1, -(-len(raw) // DATAGRAM_PAYLOAD))
    shape = (count, DATAGRAM_HEADER + DATAGRAM_PAYLOAD)
    buf = np.empty(shape, np.uint8) if out is None else out.reshape(shape)
    sizes = np.full(count, DATAGRAM_PAYLOAD, np.int64)
    sizes[-1] = len(raw) - DATAGRAM_PAYLOAD * (count - 1)
    head = np.zeros(count, DATAGRAM_DTYPE)
    head["magic"], head["version"], head["code"] = DATAGRAM_MAGIC, DATAGRAM_VERSION, \
        WIRE_CODES.index(dtype)
    head["worker"], head["shard"], head["tag"], head["transfer"] = worker, shard, tag, \
        transfer
    head["index"] = np.arange(first, first + count)
    head["packets"], head["n"] = count if packets is None else packets, sizes // itemsize
    buf[:, :DATAGRAM_HEADER] = head.view(np.uint8).reshape(count, DATAGRAM_HEADER)
    full = len(raw) // DATAGRAM_PAYLOAD  # (whole payloads: one copy into their rows)
    buf[:full, DATAGRAM_HEADER:] = raw[:full * DATAGRAM_PAYLOAD].reshape(full, DATAGRAM_PAYLOAD)
    rest = len(raw) - full * DATAGRAM_PAYLOAD
    if rest:
        buf[full, DATAGRAM_HEADER:DATAGRAM_HEADER + rest] = raw[full * DATAGRAM_PAYLOAD:]
    return buf, DATAGRAM_HEADER + int(sizes[-1])


def encode_datagrams(worker: int, shard: int, tag: int, transfer: int, dtype: str,
                     raw: np.ndarray, key: bytes | None = None, first: int = 0,
                     packets: int | None = None) -> list[memoryview]:
    """All datagrams of one transfer (or part: ``first``, ``packets`` as for
    :func:`encode_block`), one object each (its rows), each signed with ``key`` when
    there is one."""
    buf, last = encode_block(worker, shard, tag, transfer, dtype, raw, first=first,
                             packets=packets)
    count, width = buf.shape
    flat = memoryview(buf).cast("B")
    out = [flat[i * width:(i + 1) * width] for i in range(count - 1)]
    out.append(flat[(count - 1) * width:(count - 1) * width + last])
    if key:
        out = [memoryview(bytes(d) + _datagram_mac(key, d)) for d in out]
    return out


def decode_datagram(data: bytes | memoryview, key: bytes | None = None) -> Datagram:
    """Validate one datagram; ProtocolError (AuthenticationError for a signature) on
    any violation."""
    buf = memoryview(data)
    if key is not None:
        if len(buf) < DATAGRAM_HEADER + DATAGRAM_SIGNATURE:
            raise AuthenticationError("datagram too short to be signed")
        body, sig = buf[:-DATAGRAM_SIGNATURE], bytes(buf[-DATAGRAM_SIGNATURE:])
        if not hmac.compare_digest(_datagram_mac(key, body), sig):
            raise AuthenticationError("datagram with a bad signature")
        buf = body
    if len(buf) < DATAGRAM_HEADER:
        raise ProtocolError(f"datagram of {len(buf)} bytes is shorter than its header")
    magic, version, code, worker, shard, tag, transfer, index, packets, n = \
        DATAGRAM_STRUCT.unpack_from(buf)
    if magic != DATAGRAM_MAGIC or version != DATAGRAM_VERSION:
        raise ProtocolError("not a psring gradient datagram of this version")
    if code >= len(WIRE_CODES):
        raise ProtocolError(f"datagram dtype code {code} is unknown")
    dtype = WIRE_CODES[code]
    payload = buf[DATAGRAM_HEADER:]
    if not 0 < n <= per_datagram(dtype) or n * DTYPES[dtype].itemsize != len(payload):
        raise ProtocolError(f"datagram claims {n} {dtype} elements, carries "
                            f"{len(payload)} bytes")
    if not index < packets <= MAX_PACKETS:
        raise ProtocolError(f"datagram {index} of {packets} packets")
    return Datagram(worker, shard, tag, transfer, index, packets, dtype, payload)


# ------------------------------------------------ control datagrams: grants, end markers
# Two small UDP datagrams of one layout steer the gradient datagrams:
#
#     magic, version, worker, shard, run tag, transfer, a packet count
#     then with a shared secret 16 bytes of HMAC-SHA256 over all of the above
#
# A grant ("PSRC", --credit-window) goes from a receiver back to the socket a transfer's
# datagrams come from: packets [0, upto) may leave (NDP's and Homa's receiver-driven
# pacing). Grants are cumulative: a lost one is made good by the next. An end marker
# ("PSRE", the transpose all-reduce) follows a transfer's datagrams to their receiver,
# a few copies: all of its packets have left, so what is missing once it is in is lost.
# A resend request ("PSRN", the transpose all-reduce) goes from that receiver to the
# transfer's sender: worker is the receiver's rank, the count how many packets it needs
# again, and up to NACK_MOST of the missing packets' numbers (u32 each) follow, chosen
# at random among them, before the signature. A datagram that breaks a rule is dropped.
GRANT_MAGIC = b"PSRC"
END_MAGIC = b"PSRE"
NACK_MAGIC = b"PSRN"
#: the most packet numbers one resend request lists (they fit one Ethernet frame)
NACK_MOST = 340
CONTROL_VERSION = 1
_CONTROL = struct.Struct("<4sBxHHIQI")
_CONTROL_TAGS = {GRANT_MAGIC: b"psring-grant-hmac-sha256-v1",
                 END_MAGIC: b"psring-end-hmac-sha256-v1",
                 NACK_MAGIC: b"psring-nack-hmac-sha256-v1"}


class Grant(NamedTuple):
    worker: int
    shard: int
    run_tag: int
    transfer: int
    upto: int


class End(NamedTuple):
    worker: int
    shard: int
    run_tag: int
    transfer: int
    packets: int


class Nack(NamedTuple):
    worker: int
    shard: int
    run_tag: int
    transfer: int
    need: int
    missing: tuple[int, ...]


def _sign_control(magic: bytes, body: bytes, key: bytes) -> bytes:
    return hmac.new(key, _CONTROL_TAGS[magic] + body, hashlib.sha256).digest()[
        :DATAGRAM_SIGNATURE]


def _encode_control(magic: bytes, fields: tuple, key: bytes | None) -> bytes:
    body = _CONTROL.pack(magic, CONTROL_VERSION, *fields)
    return body + _sign_control(magic, body, key) if key else body


def _decode_control(data: bytes | memoryview, key: bytes | None, magic: bytes,
                    what: str, extra: int = 0) -> tuple:
    buf = bytes(data)
    size = _CONTROL.size + extra + (DATAGRAM_SIGNATURE if key else 0)
    if len(buf) != size:
        raise ProtocolError(f"{what} is {size} bytes, not {len(buf)}")
    body = _CONTROL.size + extra
    if key and not hmac.compare_digest(_sign_control(magic, buf[:body], key), buf[body:]):
        raise AuthenticationError(f"{what} with a bad signature")
    got, version, *fields = _CONTROL.unpack_from(buf)
    if got != magic or version != CONTROL_VERSION:
        raise ProtocolError(f"not {what} of this version")
    if not 0 < fields[-1] <= MAX_PACKETS:
        raise ProtocolError(f"{what} of {fields[-1]} packets")
    return tuple(fields)


def encode_grant(g: Grant, key: bytes | None = None) -> bytes:
    return _encode_control(GRANT_MAGIC, tuple(g), key)


def decode_grant(data: bytes | memoryview, key: bytes | None = None) -> Grant:
    """Validate one grant; ProtocolError (AuthenticationError for a signature) on any
    violation."""
    return Grant(*_decode_control(data, key, GRANT_MAGIC, "a psring credit grant"))


def encode_end(e: End, key: bytes | None = None) -> bytes:
    return _encode_control(END_MAGIC, tuple(e), key)


def decode_end(data: bytes | memoryview, key: bytes | None = None) -> End:
    """Validate one end marker; ProtocolError (AuthenticationError for a signature) on
    any violation."""
    return End(*_decode_control(data, key, END_MAGIC, "a psring end marker"))


def encode_nack(n: Nack, key: bytes | None = None) -> bytes:
    body = _CONTROL.pack(NACK_MAGIC, CONTROL_VERSION, n.worker, n.shard, n.run_tag,
                         n.transfer, n.need) + np.asarray(n.missing, "<u4").tobytes()
    return body + _sign_control(NACK_MAGIC, body, key) if key else body


def decode_nack(data: bytes | memoryview, key: bytes | None = None) -> Nack:
    """Validate one resend request; ProtocolError (AuthenticationError for a
    signature) on any violation."""
    listed = (len(data) - _CONTROL.size - (DATAGRAM_SIGNATURE if key else 0)) // 4
    if not 0 < listed <= NACK_MOST:
        raise ProtocolError(f"a resend request listing {listed} packets")
    worker, shard, tag, transfer, need = _decode_control(
        data, key, NACK_MAGIC, "a psring resend request", 4 * listed)
    missing = np.frombuffer(bytes(data), "<u4", listed, _CONTROL.size)
    if not (missing < MAX_PACKETS).all():
        raise ProtocolError("a resend request for packets beyond MAX_PACKETS")
    return Nack(worker, shard, tag, transfer, need, tuple(int(i) for i in missing))
