"""Coverage-guided fuzzing of the wire-protocol decoder with atheris (optional).

    pip install atheris                     # Linux x86_64 wheels for Python 3.11-3.13
    python tests/fuzz/fuzz_protocol.py -runs=100000          # or -max_total_time=600

Each input becomes a list of frames — raw, a fuzzed msgpack header, or a valid message
with fuzzed bytes spliced in — decoded with and without a shared secret. Anything but
a ProtocolError is a crash (atheris prints the input). tests/fuzz/test_hostile.py runs a
short session when atheris is installed.
"""

import sys

try:
    import atheris
except ImportError:
    sys.exit("atheris is not installed: pip install atheris (Linux x86_64, Python 3.11-3.13)")

# imported before instrumentation: only psring.comm.protocol is instrumented, not torch
import msgpack
import torch

with atheris.instrument_imports(include=["psring.comm.protocol"]):
    from psring.comm import protocol

KEY = b"k" * 32
_T = torch.arange(8, dtype=torch.float32)
_VALID = [
    protocol.encode("push", {"run": "r", "worker": 0, "seq": 1, "shard": 0, "step": 0,
                             "offset": 0}, [_T]),
    protocol.encode("pull", {"run": "r", "worker": 0, "seq": 2, "shard": 0,
                             "min_version": 0}),
    protocol.encode("params", {"run": "r", "worker": 0, "seq": 2, "shard": 0, "version": 0,
                               "offset": 0}, [_T.view(2, 4)]),
]
_FIELDS = ["v", "op", "run", "worker", "seq", "shard", "tensors", "step", "offset",
           "min_version", "lo", "hi", "workers", "mode", "lr", "version", "message"]


def _value(fdp: "atheris.FuzzedDataProvider", depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 7)
    if kind == 0:
        return fdp.ConsumeInt(8)  # msgpack packs 64-bit ints
    if kind == 1:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
    if kind == 2:
        return fdp.ConsumeRegularFloat()
    if kind == 3:
        return fdp.ConsumeBool()
    if kind == 4 and depth < 3:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 5:
        return [fdp.PickValueInList([*protocol.DTYPES, "int8"]),
                [fdp.ConsumeIntInRange(0, 2**34) for _ in range(fdp.ConsumeIntInRange(0, 9))]]
    if kind == 6:
        return fdp.PickValueInList([*protocol.SCHEMAS, "sync", "async"])
    return None


def _frames(fdp: "atheris.FuzzedDataProvider") -> list:
    mode = fdp.ConsumeIntInRange(0, 2)
    if mode == 0:  # raw frames
        return [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))
                for _ in range(fdp.ConsumeIntInRange(0, 5))]
    if mode == 1:  # a header from plausible pieces
        header = {"v": protocol.VERSION, "op": fdp.PickValueInList(list(protocol.SCHEMAS))}
        for _ in range(fdp.ConsumeIntInRange(0, 12)):
            header[fdp.PickValueInList(_FIELDS)] = _value(fdp)
        frames = [msgpack.packb(header), b""]
        return frames + [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
                         for _ in range(fdp.ConsumeIntInRange(0, 3))]
    frames = [bytearray(bytes(f)) for f in fdp.PickValueInList(_VALID)]  # a valid one, spliced
    i = fdp.ConsumeIntInRange(0, len(frames) - 1)
    at = fdp.ConsumeIntInRange(0, len(frames[i]))
    frames[i][at:at + fdp.ConsumeIntInRange(0, 8)] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
    return [bytes(f) for f in frames]


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    key = KEY if fdp.ConsumeBool() else None
    frames = _frames(fdp)
    for k in (key, None):
        try:
            protocol.decode(frames, key=k)
        except protocol.ProtocolError:
            pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
