"""The parameter-server wire protocol: the only place that knows the message format.

A message is a ZeroMQ multipart message::

    frame 0      msgpack map: the header (fields below)
    frame 1      signature: HMAC-SHA256 of frames 0, 2..n under the shared secret
                 (32 bytes), or empty when the two sides have no secret
    frame 2..n   raw tensor bytes, one frame per tensor, little-endian, C order

Frames of 64 KB and more are sent zero-copy (pyzmq ``copy=False`` with the socket's
``copy_threshold``) and received as ``zmq.Frame`` whose buffer becomes a tensor
without another copy (``torch.frombuffer``). Nothing is pickled: msgpack carries only
maps, strings, numbers, booleans and lists, and is unpacked with hard size limits.

Every message is validated by :func:`decode` before anything uses it: protocol version,
op, the exact set of header fields and their types for that op, dtype, and that each
tensor frame carries exactly the bytes its header entry claims. A failure raises
:class:`ProtocolError` (and only that); the server answers it with an ``error`` message
and goes on serving. With a shared secret (:func:`load_secret`) the signature is checked
first, before the header is even unpacked; a message without a valid one raises
:class:`AuthenticationError` (a ProtocolError), which a server drops unanswered.
docs/protocol.md describes every op, the signature and the limits.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgpack
import torch

from psring.comm.endpoints import HOW_TO_SET_A_SECRET

#: 2: a signature frame after the header (empty without a shared secret)
VERSION = 2

#: header frame limit: a header is a few hundred bytes
MAX_HEADER_BYTES = 16 * 1024
#: the most tensor frames one message may carry
MAX_TENSORS = 16

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # (only a resend's packet numbers: every other op checks for its float dtype)
    "int32": torch.int32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(Exception):
    """A message that breaks the protocol; the text says which rule."""


class AuthenticationError(ProtocolError):
    """A message without a valid signature under this side's shared secret. A server
    drops it unanswered (the sender learns nothing); a worker fails naming the server."""


_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_BOOL = (bool,)
_LIST = (list,)

#: fields every message has
COMMON = {"v": _INT, "op": _STR, "run": _STR, "worker": _INT, "seq": _INT, "shard": _INT}

#: a snapshot request's `version`: a copy of the shard as it is now (async)
SNAPSHOT_NOW = -1
#: a snapshot request's `version`: the newest copy the server keeps (backups: worker 0
#: may trail the servers' version)
SNAPSHOT_NEWEST = -2

#: op -> {field: accepted types}; a message must have exactly COMMON + these fields
SCHEMAS: dict[str, dict[str, tuple]] = {
    # worker 0 -> server: take this shard [lo, hi) of the flat parameters and the run's
    # settings; tensor frames: the shard's initial values, and (resuming from a
    # checkpoint) its momentum buffer. The run starts at `version`; with
    # `snapshot_every` N > 0 the server keeps a copy of the shard (parameters and
    # momentum) whenever its version becomes a multiple of N or `snapshot_last`.
    # `group` G: workers that aggregate among themselves first (byteps: a host's), so
    # each range is pushed by workers / G of them, worker w in place w // G of the sum;
    # `update` "sgd" (the server runs the optimizer) or "sum" (it only adds: a pull
    # returns the step's summed gradient, the workers update); `backups` b (sync): a
    # step takes the first workers - b workers to commit, the same for every range and
    # shard (commit, choose)
    "init": {"lo": _INT, "hi": _INT, "workers": _INT, "mode": _STR, "lr": _NUM,
             "momentum": _NUM, "weight_decay": _NUM, "max_staleness": _INT,
             "version": _INT, "snapshot_every": _INT, "snapshot_last": _INT,
             "wire_dtype": _STR, "group": _INT, "update": _STR, "backups": _INT,
             "tensors": (list,)},
    # worker -> server: gradient for flat elements [offset, offset+len) of step `step`,
    # in the run's wire dtype (init's `wire_dtype`: float32, or float16 / bfloat16 with
    # --compress); pulls are answered in it too, the server keeps float32
    "push": {"step": _INT, "offset": _INT, "tensors": (list,)},
    # worker -> server (--loss-tolerance F > 0): the gradient for flat elements
    # [offset, offset+numel) of step `step` went as `packets` datagrams of transfer
    # `transfer` (DATAGRAM, in `dtype`) ahead of this message; sum what arrived if at
    # most the fraction `tolerance` of the elements is missing (scaled by numel /
    # delivered: unbiased), else answer `resend`. Each attempt has a seq of its own.
    "lossy_push": {"step": _INT, "offset": _INT, "numel": _INT, "packets": _INT,
                   "dtype": _STR, "tolerance": _NUM, "transfer": _INT, "tensors": (list,)},
    # worker -> server: send me the shard once its version is >= `min_version`; with
    # `hi` > 0 only flat elements [lo, hi) of it (byteps: the part a worker pushed);
    # with `datagrams` P > 0 (a sync run's bounded-loss pulls) as datagrams to UDP port
    # P at the address this request came from (DATAGRAM, transfer = this seq, paced at
    # `pace` bit/s, 0: unpaced, at most `burst` bytes ahead, 0: a millisecond's) rather
    # than params messages, when the server can
    "pull": {"min_version": _INT, "lo": _INT, "hi": _INT, "datagrams": _INT, "pace": _INT,
             "burst": _INT, "tensors": (list,)},
    # worker -> server: this worker is done with the run (it stops counting as in flight)
    "leave": {"tensors": (list,)},
    # worker -> shard 0 (with backups), once every push of its step `step` is
    # acknowledged: count me in; answered by `chosen` once the step's workers are chosen
    "commit": {"step": _INT, "tensors": (list,)},
    # a chosen worker -> every other shard: step `step` takes the pushes of `workers`
    # (ascending) and drops the others'
    "choose": {"step": _INT, "workers": _LIST, "tensors": (list,)},
    # worker 0 -> server: the shard's copy taken at `version` (sync: answered once it
    # exists; the server keeps its last one, with backups a few), at once of the shard
    # as it is now (SNAPSHOT_NOW; async), or the newest copy it keeps (SNAPSHOT_NEWEST,
    # answered once there is one; with backups)
    "snapshot": {"version": _INT, "tensors": (list,)},
    # server -> worker replies; `dropped`: the push came too late for its step (backups)
    # and was thrown away
    # `delivered`: of a lossy_push, the elements that arrived and were summed (-1: a
    # reliable push)
    "ack": {"version": _INT, "staleness": _INT, "dropped": _BOOL, "delivered": _INT,
            "tensors": (list,)},
    # answer to a lossy_push whose missing part is beyond its tolerance: send at least
    # `need` of the missing packets (tensor frame: their numbers, int32) again, then
    # the lossy_push again (a new seq: pushes are acknowledged in seq order)
    "resend": {"need": _INT, "tensors": (list,)},
    # answer to commit: the workers step `step` takes (ascending; those of the server's
    # current step, [] for a step already over), and whether this one is among them
    "chosen": {"step": _INT, "workers": _LIST, "taken": _BOOL, "tensors": (list,)},
    # a pull is answered by one or more params messages, each a range starting at flat
    # element `offset`; together they cover the shard
    "params": {"version": _INT, "offset": _INT, "tensors": (list,)},
    "ok": {"tensors": (list,)},
    # answer to snapshot: tensor frames parameters, then momentum (when SGD has one)
    "state": {"version": _INT, "tensors": (list,)},
    "error": {"message": _STR, "tensors": (list,)},
}
#: op -> {field: value when absent}: fields a sender may leave out (they arrived in
#: a later revision of version 2; a decoded header always has them)
OPTIONAL: dict[str, dict[str, Any]] = {
    "init": {"version": 0, "snapshot_every": 0, "snapshot_last": 0, "wire_dtype": "float32",
             "group": 1, "update": "sgd", "backups": 0},
    "pull": {"lo": 0, "hi": 0, "datagrams": 0, "pace": 0, "burst": 0},
    "ack": {"dropped": False, "delivered": -1},
}

REQUESTS = ("init", "push", "lossy_push", "pull", "leave", "snapshot", "commit", "choose")
#: the ops a worker accepts in reply (psring.comm.psclient)
REPLIES = ("ack", "params", "ok", "error", "state", "chosen", "resend")
MODES = ("sync", "async")
#: what a server does with the summed gradients (init's `update`)
UPDATES = ("sgd", "sum")

#: a tensor entry in the header: [dtype name, shape list]
_MAX_DIMS = 8
#: largest single dimension (2**31 elements)
MAX_DIM = 2**31
#: largest product of a shape's dimensions, zeros counted as 1 (what torch's strides
#: need, even for a tensor with no elements)
MAX_VOLUME = 2**40


# ---------------------------------------------------------------------- signatures
SIGNATURE_BYTES = 32  # HMAC-SHA256
#: signed ahead of the frames: names the scheme, so a signature means nothing elsewhere
_SIGNING_TAG = b"psring-hmac-sha256-v2"


def _view(frame: Any) -> memoryview:
    """Read-only view of a frame's bytes, without a copy (for hashing)."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        raise ProtocolError(f"frame of unexpected type {type(frame).__name__}")
    return buf


def signature(key: bytes, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 over the header and tensor frames (not the signature frame), each
    preceded by its length, so no bytes can move between frames, and no frame can be
    added, dropped or swapped, without changing it."""
    mac = hmac.new(key, _SIGNING_TAG + struct.pack("<I", len(frames)), hashlib.sha256)
    for f in frames:
        buf = _view(f)
        mac.update(struct.pack("<Q", buf.nbytes))
        mac.update(buf)
    return mac.digest()


def _verify(key: bytes, frames: Sequence[Any]) -> None:
    if len(frames) < 2:
        raise AuthenticationError("unsigned message (no signature frame): the sender has "
                                  "no shared secret, or runs an older psring")
    sig = _view(frames[1])
    if sig.nbytes == 0:
        raise AuthenticationError("unsigned message: the sender has no shared secret")
    expected = signature(key, [frames[0], *frames[2:]])
    if not hmac.compare_digest(expected, bytes(sig) if sig.nbytes == SIGNATURE_BYTES else b""):
        raise AuthenticationError("bad signature: the sender uses a different shared "
                                  "secret, or the message was altered")


@dataclass
class Message:
    header: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def op(self) -> str:
        return self.header["op"]


def tensor_entry(t: torch.Tensor) -> list:
    return [DTYPE_NAMES[t.dtype], list(t.shape)]


def encode(op: str, fields: dict[str, Any], tensors: Sequence[torch.Tensor] = (),
           key: bytes | None = None) -> list:
    """Frames for one message, signed when ``key`` (the shared secret) is given.
    Tensors must be contiguous CPU tensors; their memory is handed to ZeroMQ without a
    copy, so the caller must not modify it until the peer has answered (every request
    is answered)."""
    header = {"v": VERSION, "op": op, **fields,
              "tensors": [tensor_entry(t) for t in tensors]}
    frames: list = [msgpack.packb(header, use_bin_type=True)]
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("protocol tensors must be contiguous CPU tensors")
        frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    frames.insert(1, signature(key, frames) if key else b"")
    return frames


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, bytes):
        # torch wants writable memory; bytes only arrive from tests and fuzzers (the
        # sockets give zmq.Frame), so this copy is off the hot path
        return memoryview(bytearray(frame))
    if isinstance(frame, (bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        raise ProtocolError(f"frame of unexpected type {type(frame).__name__}")
    return buf


def decode(frames: Sequence[Any], expect: Iterable[str] | None = None,
           key: bytes | None = None) -> Message:
    """Validate and decode one message; raise ProtocolError on any violation. With
    ``key`` (the shared secret) the signature is verified before anything else
    (AuthenticationError); without one, a signed message is refused."""
    if not frames:
        raise ProtocolError("empty message")
    if key is not None:
        _verify(key, frames)
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        # The size check above bounds the input; these bound what it can expand into.
        header = msgpack.unpackb(
            head, raw=False, strict_map_key=True, use_list=True, max_str_len=4096,
            max_bin_len=0, max_array_len=256, max_map_len=64, max_ext_len=0)
    except (ValueError, TypeError) as e:  # msgpack's errors (FormatError, ExtraData, limits,
        # bad UTF-8, unhashable keys) all derive from these: all mean "bad header"
        raise ProtocolError(f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not {VERSION}; "
                            f"the worker and server run different psring versions")
    if len(frames) < 2:
        raise ProtocolError("no signature frame (frame 1, empty when unsigned)")
    if key is None and _view(frames[1]).nbytes:
        raise ProtocolError(f"the message is signed but this side has no shared secret: "
                            f"{HOW_TO_SET_A_SECRET}")
    op = header.get("op")
    if not isinstance(op, str) or op not in SCHEMAS:  # (a list is not even hashable)
        raise ProtocolError(f"unknown op {op!r}; known ops: {', '.join(SCHEMAS)}")
    if expect is not None and op not in expect:
        raise ProtocolError(f"op {op!r} is not expected here")
    schema = {**COMMON, **SCHEMAS[op]}
    for name, default in OPTIONAL.get(op, {}).items():
        header.setdefault(name, default)
    missing = schema.keys() - header.keys()
    extra = header.keys() - schema.keys()
    if missing or extra:
        raise ProtocolError(f"op {op!r}: missing fields {sorted(missing)}, "
                            f"unexpected fields {sorted(map(str, extra))}")
    for name, types in schema.items():
        value = header[name]
        # bool is an int in Python; a boolean where a number belongs is still wrong
        if not isinstance(value, types) or isinstance(value, bool) and types is not _BOOL:
            raise ProtocolError(f"op {op!r}: field {name!r} has type "
                                f"{type(value).__name__}")
    entries = header["tensors"]
    if len(entries) > MAX_TENSORS or len(entries) != len(frames) - 2:
        raise ProtocolError(f"header lists {len(entries)} tensors but "
                            f"{len(frames) - 2} tensor frames arrived")
    tensors = [_tensor(entry, _buffer(f)) for entry, f in zip(entries, frames[2:])]
    return Message(header, tensors)


def _tensor(entry: Any, buf: memoryview) -> torch.Tensor:
    if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
            or not isinstance(entry[1], list)):
        raise ProtocolError(f"tensor entry {entry!r} is not [dtype, shape]")
    dtype_name, shape = entry
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ProtocolError(f"dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    if len(shape) > _MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool)
                                         and 0 <= d < 2**40 for d in shape):
        raise ProtocolError(f"shape {shape!r} is not a list of at most {_MAX_DIMS} "
                            f"non-negative ints")
    numel, volume = 1, 1
    for d in shape:
        numel *= d
        volume *= max(d, 1)
    if any(d > MAX_DIM for d in shape) or volume > MAX_VOLUME:
        # even with a zero elsewhere in the shape (no bytes at all), torch can't lay out
        # dimensions this large (its strides overflow): refuse them here, not with a
        # RuntimeError later
        raise ProtocolError(f"shape {shape!r} has a dimension above {MAX_DIM} or more "
                            f"than {MAX_VOLUME} elements")
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Compare the claim with what arrived before touching the data: a header that
    # claims more bytes than its frame carries costs nothing.
    if numel * itemsize != len(buf):
        raise ProtocolError(f"tensor {dtype_name}{shape} needs {numel * itemsize} bytes, "
                            f"its frame carries {len(buf)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def error_frames(message: str, request: dict[str, Any] | None = None,
                 key: bytes | None = None) -> list:
    """An error reply; echoes what it can of the request so the sender can match it."""
    req = request if isinstance(request, dict) else {}

    def pick(name: str, types: tuple, default: Any) -> Any:
        v = req.get(name, default)
        return v if isinstance(v, types) and not isinstance(v, bool) else default

    return encode("error", {"run": pick("run", _STR, ""), "worker": pick("worker", _INT, -1),
                            "seq": pick("seq", _INT, -1), "shard": pick("shard", _INT, -1),
                            "message": message[:1000]}, key=key)
