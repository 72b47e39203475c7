"""psring.comm.interconnect: a host's collectives as a device link's time (--device-link).
The time of a ring reduce-scatter or all-gather, the timed collectives' serial stream,
what moves, failures handed to the waiter; bad settings refused; and through the CLI,
byteps's, hallreduce's, allreduce's and ddp's steps take at least the device link's
time for their traffic inside a host."""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest
import torch

from psring.comm import interconnect
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from psring.records.profile import Profile
from psring.train.workload import meta_model
from tests.helpers import assert_no_processes, psring, read_steps

FLAGS = dict(model="mlp", width=1024, depth=3, features=64, batch_size=32)


class _Entered:
    """A one-element collective that every worker has joined (or that failed)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error
        self.waited = threading.Event()  # (the stream has taken a collective up)

    def wait(self) -> bool:
        self.waited.set()
        if self.error:
            raise self.error
        return True


def test_a_ring_collective_takes_g_minus_1_steps_of_a_gth():
    # 4 devices, 8 MB in, 10 µs a step, 1 GB/s: 3 steps of 2 MB
    assert interconnect.collective_s(4, 8e6, 10e-6, 1e9) == pytest.approx(3 * (10e-6 + 2e-3))
    assert interconnect.collective_s(1, 8e6, 10e-6, 1e9) == 0.0
    assert interconnect.parse("nvlink") == interconnect.NVLINK
    # named hosts' interconnects, by generation, bytes per second each way
    rates = [interconnect.parse(n)[1] for n in ("pcie", "pcie4", "nvlink", "nvlink3", "nvlink4")]
    assert rates == sorted(rates) and interconnect.parse("NVLink4")[1] == 450e9
    assert interconnect.parse("8gbit") == (interconnect.DEVICE_ALPHA_S, 1e9)
    assert interconnect.parse("") is None


def test_timed_collectives_move_only_this_workers_part_one_after_another():
    # local rank 1 of 2; 1 MB/s, time scale 2: a collective of 40 kB takes 20 ms x 2
    comm = interconnect.TimedComm(None, 2, 1, 0.0, 1e6, time_scale=2.0,
                                  enter=lambda: _Entered())
    try:
        full = torch.arange(10_000, dtype=torch.float32)
        shard = torch.zeros(5_000)
        t0 = time.perf_counter()
        rs = comm.reduce_scatter(shard, full)
        assert not rs.is_completed()
        gathered = torch.full((10_000,), -1.0)
        ag = comm.all_gather(gathered, shard)
        rs.wait()
        t_rs = time.perf_counter() - t0
        ag.wait()
        t_ag = time.perf_counter() - t0
    finally:
        comm.close()
    assert torch.equal(shard, full[5_000:])  # its own part of its own gradient
    assert torch.equal(gathered[5_000:], full[5_000:])  # put in place
    assert torch.equal(gathered[:5_000], torch.full((5_000,), -1.0))  # the rest untouched
    assert 0.040 <= t_rs < 0.040 + 0.5
    assert t_ag >= 0.080  # after the reduce-scatter, on the same stream


def test_a_failed_entry_reaches_the_waiter_and_the_stream_goes_on():
    errors = [RuntimeError("peer gone"), None]
    comm = interconnect.TimedComm(None, 2, 0, 0.0, 1e9,
                                  enter=lambda: _Entered(errors.pop(0)))
    try:
        bad = comm.all_gather(torch.zeros(4), torch.ones(2))
        with pytest.raises(RuntimeError, match="peer gone"):
            bad.wait()
        assert comm.all_gather(torch.zeros(4), torch.ones(2)).wait()
    finally:
        comm.close()


def test_a_closed_interconnect_fails_what_is_queued_and_refuses_more():
    gate = _Entered()
    slow = interconnect.TimedComm(None, 2, 0, 0.0, 1e4, enter=lambda: gate)  # 0.1 s each
    first = slow.all_gather(torch.zeros(2000), torch.ones(1000))
    queued = slow.all_gather(torch.zeros(2000), torch.ones(1000))
    assert gate.waited.wait(5)  # the first under way
    slow.close()
    assert first.wait()  # (the one under way finishes)
    with pytest.raises(RuntimeError, match="closed"):
        queued.wait()
    with pytest.raises(RuntimeError, match="closed"):
        slow.all_gather(torch.zeros(2), torch.ones(1))


def test_bad_device_link_settings_are_refused_with_the_fix(tmp_path):
    model, _ = meta_model(RunConfig(**FLAGS))
    Profile.on_paper([p.numel() * 4 for p in model.parameters()], 0.01, 0.02, 0.0,
                     batch_size=16, source={"model": "mlp"}).save(tmp_path)
    device = dict(compute="device", device_profile=str(tmp_path))

    def refused(match: str, **kw) -> None:
        with pytest.raises(ConfigError, match=match):
            validate(RunConfig(**{**FLAGS, "workers": 2} | kw))

    refused("only a timing-only run may do .* add --compute device", strategy="byteps",
            device_link="nvlink")
    refused("'single' has none it can time.* Use allreduce, ddp, hallreduce, byteps, ps",
            strategy="single", workers=1, device_link="nvlink", **device)
    refused("--reduce adasum swaps halves.* --strategy hallreduce --reduce adasum",
            strategy="allreduce", reduce="adasum", device_link="nvlink", **device)
    refused("'fast' is not a rate.* --device-link nvlink", strategy="byteps",
            device_link="fast", **device)
    refused("leave one a host: nothing to time", strategy="byteps", hosts=2,
            device_link="nvlink", **device)
    assert validate(RunConfig(**{**FLAGS, "workers": 2, "strategy": "hallreduce",
                                 "device_link": "1200gbit", **device})).device_link == "1200gbit"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["byteps", "hallreduce", "allreduce", "ddp", "ps"])
def test_the_traffic_inside_a_host_takes_the_device_links_time(tmp_path, strategy):
    """2 workers on one host, 8.7 MB of gradients, a 10 MB/s device link: a step's
    reduce-scatter and all-gather (byteps, hallreduce), or a flat ring's two steps of
    half the gradients (allreduce, ddp: psring.comm.hostring), take 2 x 4.35 MB / 10
    MB/s = 0.87 s on the device's stream, more than its 0.13 s of compute: no step can
    be shorter. A ps worker copies its 8.7 MB of gradients to the host and the
    parameters back on the host's bus, here 20 MB/s: 0.87 s."""
    model, _ = meta_model(RunConfig(**FLAGS))
    sizes = [p.numel() * 4 for p in model.parameters()]
    Profile.on_paper(sizes, 0.040, 0.080, 0.010, batch_size=16,
                     source={"model": "mlp"}).save(tmp_path / "prof")
    out = tmp_path / "run"
    extra = ["--servers", "1", "--update-on", "worker"] if strategy == "byteps" else []
    link = "160mbit" if strategy == "ps" else "80mbit"
    psring("run", "--strategy", strategy, "--workers", 2, "--model", "mlp", "--width",
           "1024", "--depth", "3", "--features", "64", "--batch-size", "32", "--steps",
           "4", "--compute", "device", "--device-profile", tmp_path / "prof",
           "--device-link", link, *extra, "--out", out, timeout=100)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compute"]["device_link"] == link
    assert manifest["compute"]["host_copy"] == interconnect.host_copy(link)
    inside = (2 * sum(sizes) / 20e6 if strategy == "ps" else
              2 * interconnect.collective_s(2, sum(sizes), 10e-6, 10e6))
    steps = [r["step_s"] for r in read_steps(out) if r["step"] >= 1]
    assert min(steps) >= inside, (steps, inside)
    assert statistics.median(steps) < 3 * (inside + 0.13), steps  # and not stuck
    assert_no_processes(out)
