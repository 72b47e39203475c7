"""--compress fp16|bf16 (psring.comm.compress): half the bytes on the wire, float32 everywhere
else; the loss still falls and the model stays close to the uncompressed one."""

from __future__ import annotations

import json

import pytest
import torch

from psring.comm.protocol import decode, encode
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from psring.servers.handler import Handler
from tests.helpers import (
    SMALL,
    assert_no_processes,
    load_model,
    psring,
    psring_together,
    read_steps,
)

#: unit roundoff of each wire dtype: the largest relative error of one cast
EPS = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def norm_rel(a: dict, b: dict) -> float:
    """Largest per-tensor ||a - b|| / ||b||."""
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


@pytest.mark.parametrize("strategy", ["single", "hogwild"])
def test_compression_is_refused_where_nothing_is_sent(strategy):
    with pytest.raises(ConfigError, match="sends nothing to compress"):
        validate(RunConfig(strategy=strategy, workers=1, compress="fp16"))


def test_an_unknown_compression_is_refused():
    with pytest.raises(ConfigError, match="none, fp16 or bf16"):
        RunConfig(strategy="allreduce", workers=2, compress="int8")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["allreduce", "ddp", "ps"])
def test_compression_halves_the_bytes_and_stays_close(tmp_path, small_runs, strategy):
    """The bytes logged halve exactly (they count tensor bytes; headers are not counted),
    the loss falls, and the final parameters stay within 2·steps·eps of the uncompressed
    run's (norm per tensor): each step's update is computed from values rounded at most
    twice — the gradient sent, and for a parameter server the parameters pulled — each
    rounding off by at most eps relative, and such errors add up at most linearly over
    the 12 steps."""
    runs = [["run", "--strategy", strategy, "--workers", 2, *SMALL, "--compress", compress,
             "--out", tmp_path / compress] for compress in ("fp16", "bf16")]
    if strategy in small_runs:
        ref = small_runs[strategy]
    else:
        ref = tmp_path / "none"
        runs.append(["run", "--strategy", strategy, "--workers", 2, *SMALL, "--out", ref])
    psring_together(*runs)
    base = {(r["worker"], r["step"]): r for r in read_steps(ref)}
    steps = 12
    for compress in ("fp16", "bf16"):
        out = tmp_path / compress
        records = read_steps(out)
        for r in records:
            b = base[(r["worker"], r["step"])]
            assert 2 * r["bytes_sent"] == b["bytes_sent"] > 0
            assert 2 * r["bytes_recv"] == b["bytes_recv"] > 0
        losses = [r["loss"] for r in records if r["worker"] == 0]
        assert losses[-1] < losses[0] - 0.05
        manifest = json.loads((out / "manifest.json").read_text())
        assert 2 * manifest["wire_bytes"] == manifest["parameter_bytes"]
        assert 2 * manifest["bytes_per_step"]["sent"] == \
            json.loads((ref / "manifest.json").read_text())["bytes_per_step"]["sent"]
        diff = norm_rel(load_model(out), load_model(ref))
        assert 0 < diff <= 2 * steps * EPS[compress], (compress, diff)
        assert_no_processes(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compressed_ps_run_resumes_exactly_from_its_servers_float32_state(tmp_path):
    """The servers keep float32 parameters and momentum: a checkpoint holds them, and a
    run resumed from it ends with exactly the parameters of one never interrupted."""
    args = ["--strategy", "ps", "--workers", 2, "--servers", 2, *SMALL, "--compress",
            "fp16", "--checkpoint-every", 6]
    ref, half = tmp_path / "ref", tmp_path / "half"
    psring_together(["run", *args, "--steps", 12, "--out", ref],
                    ["run", *args, "--steps", 6, "--out", half])
    state = torch.load(half / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)
    assert state["ps/params"].dtype == state["ps/momentum"].dtype == torch.float32
    psring("run", "--resume", half, "--steps", 12, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(load_model(half).values(),
                                                 load_model(ref).values()))
    assert_no_processes(tmp_path)


def test_a_compressed_server_sums_in_float32_and_answers_in_the_wire_dtype():
    def req(op, worker=0, seq=1, **fields):
        tensors = fields.pop("tensors", [])
        return decode(encode(op, {"run": "r", "worker": worker, "seq": seq, "shard": 0,
                                  **fields}, tensors))

    h = Handler()
    h.handle(b"w0", req("init", lo=0, hi=4, workers=2, mode="sync", lr=1.0, momentum=0.0,
                        weight_decay=0.0, max_staleness=-1, wire_dtype="float16",
                        tensors=[torch.zeros(4)]))
    (r,) = h.handle(b"w0", req("push", seq=2, step=0, offset=0, tensors=[torch.ones(4)]))
    assert "float16" in decode(r.frames).header["message"]  # float32 is not this run's
    small = torch.full((4,), 1e-4, dtype=torch.float16)
    h.handle(b"w0", req("push", seq=3, step=0, offset=0, tensors=[small]))
    h.handle(b"w1", req("push", worker=1, step=0, offset=0, tensors=[small]))
    assert h.state.store.params.dtype == torch.float32
    # summed and applied in float32: -2 * fp16(1e-4), not rounded to float16 again
    assert torch.equal(h.state.store.params, -2 * small.float())
    out = h.handle(b"w0", req("pull", seq=4, min_version=1))
    params = decode(out[0].frames).tensors[0]
    assert params.dtype == torch.float16
    assert torch.equal(params, (-2 * small.float()).half())
    # the other worker's pull of the same version shares that cast; the next version
    # is cast afresh (the old tensor may still be on its way out)
    other = h.handle(b"w1", req("pull", worker=1, seq=2, min_version=1))
    assert decode(other[0].frames).tensors[0].data_ptr() == params.data_ptr()
    h.handle(b"w0", req("push", seq=5, step=1, offset=0, tensors=[small]))
    h.handle(b"w1", req("push", worker=1, seq=3, step=1, offset=0, tensors=[small]))
    (nxt,) = h.handle(b"w0", req("pull", seq=6, min_version=2))
    fresh = decode(nxt.frames).tensors[0]
    assert fresh.data_ptr() != params.data_ptr()
    assert torch.equal(fresh, (-4 * small.float()).half())
    assert torch.equal(params, (-2 * small.float()).half())  # unchanged
