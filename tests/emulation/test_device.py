"""--compute device (psring.train.device): each worker's compute as the profile's times, its
communication real. Bad settings are refused before anything starts; gradients are
released at the profile's ready times, in its order, through the parameters' own
accumulators (so DDP's buckets launch during backward); a compute-bound step takes the
profile's time; synchronous ranks agree step by step; the run is marked timing only."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from psring.config import RunConfig, validate
from psring.errors import ConfigError
from psring.records.profile import Profile
from psring.train import device
from psring.train.workload import meta_model
from tests.helpers import (
    SMALL,
    assert_cluster_gone,
    assert_no_processes,
    cli_here,
    needs_emulation,
    psring,
    read_steps,
)

FLAGS = dict(model="mlp", width=256, depth=2, features=64, batch_size=32)


def _sizes(**flags) -> list[int]:
    model, _ = meta_model(RunConfig(**{**FLAGS, **flags}))
    return [p.numel() * p.element_size() for p in model.parameters()]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """On paper: forward 40 ms, backward 80 ms, update 10 ms at a worker batch of 16."""
    d = tmp_path_factory.mktemp("profile")
    Profile.on_paper(_sizes(), 0.040, 0.080, 0.010, batch_size=16,
                     source={"model": "mlp"}).save(d)
    return d


def test_bad_device_settings_are_refused_with_the_fix(profile, tmp_path):
    def refused(match: str, **kw) -> None:
        with pytest.raises(ConfigError, match=match):
            validate(RunConfig(**{**FLAGS, "strategy": "allreduce", "workers": 2, **kw}))

    refused("needs the device's times: --device-profile", compute="device")
    refused("no profile at", compute="device", device_profile=str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{not json")
    refused("unreadable or not JSON", compute="device", device_profile=str(tmp_path / "bad.json"))
    refused(r"is of mlp with 6 parameters .* --model mlp here has 6 .*same --width",
            compute="device", device_profile=str(profile), width=128)
    for speed in (0.0, -2.0, float("nan")):
        refused("--device-speed must be a positive number", compute="device",
                device_profile=str(profile), device_speed=speed)
    refused("apply to --compute device", device_profile=str(profile))
    refused("apply to --compute device", time_scale=4.0)
    for scale in (0.0, -1.0, float("inf")):
        refused("--time-scale must be a positive number", compute="device",
                device_profile=str(profile), time_scale=scale)
    refused("timing only.*drop --target-accuracy", compute="device",
            device_profile=str(profile), target_accuracy=0.5)
    with pytest.raises(ConfigError, match="nothing to emulate for 'hogwild'"):
        validate(RunConfig(**FLAGS, strategy="hogwild", workers=2, compute="device",
                           device_profile=str(profile)))
    cfg = validate(RunConfig(**FLAGS, strategy="allreduce", workers=2, compute="device",
                             device_profile=str(profile), device_speed=2))
    assert cfg.eval_samples == 0  # nothing learnt, nothing to evaluate


class _Late:
    """A clock whose sleeps wake ``late`` seconds after they should."""

    def __init__(self, late: float):
        self.now, self.late = 0.0, late

    def sleep(self, s: float) -> None:
        self.now += s + self.late


def test_a_device_phase_ends_on_time_though_every_sleep_wakes_late():
    """Sleeps that wake 0.3 ms late (a loaded machine's): within a few phases the
    stand-in's phases end on time, where plain sleeps would add the 0.3 ms to each;
    a phase shorter than the lateness returns at once, and the past costs nothing."""
    clock = _Late(0.0003)
    on_time = device.OnTime(clock=lambda: clock.now, sleep=clock.sleep)
    ends = []
    for _ in range(40):
        start = clock.now
        on_time.take(0.005)
        ends.append(clock.now - start - 0.005)
    assert ends[0] == pytest.approx(0.0003)
    assert all(abs(e) < 0.00002 for e in ends[-10:]), ends[-10:]
    start = clock.now
    on_time.take(0.0001)  # (shorter than the lateness learnt)
    on_time.until(start - 1)
    assert clock.now == start


@pytest.mark.timeout(60)
def test_a_bad_profile_starts_nothing(tmp_path):
    out = tmp_path / "run"
    proc = cli_here("run", "--strategy", "allreduce", "--workers", 2, *SMALL, "--compute",
                    "device", "--device-profile", tmp_path / "missing", "--out", out)
    assert proc.returncode == 2 and "--device-profile" in proc.stderr
    assert not out.exists()


def test_gradients_come_at_the_profiles_ready_times_in_its_order():
    """Three parameters made ready out of parameter order, 200 ms apart: hooks on the
    parameters (what psring's buckets and DDP's reducer listen to) fire then. (Upper
    bounds leave room for a loaded machine; a sleep ends early by at most its process's
    learnt lateness, OnTime, microseconds here.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2))
    ready = (0.2, 0.6, 0.4)  # weight 0, weight 1, bias 1
    times = device.DeviceTimes(0.1, ready, 0.7, 0.0, "test")
    dev = device.DeviceCompute(times, seed=1, rank=0, kind="vector", classes=2)
    dev.install(model)
    params = list(model.parameters())
    seen: list[tuple[int, float]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: seen.append((i, time.perf_counter())))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    forward = time.perf_counter() - t0
    start = time.perf_counter()
    loss.backward()
    total = time.perf_counter() - start
    assert 0.099 <= forward < 0.2
    assert [i for i, _ in seen] == [0, 2, 1]
    for i, t in seen:  # (0.3 s of room: one full suite's serial run saw 0.18 s late)
        assert ready[i] - 0.001 <= t - start < ready[i] + 0.3, (i, t - start)
    assert 0.699 <= total < 0.85  # the last gradient waits out the profile's backward
    # one value per parameter, deterministic and finite, different on another rank
    assert all(torch.isfinite(p.grad).all() and (p.grad == p.grad.reshape(-1)[0]).all()
               for p in params)
    again = device.DeviceCompute(times, seed=1, rank=0, kind="vector", classes=2)
    again.params, again.step = params, 1
    other = device.DeviceCompute(times, seed=1, rank=1, kind="vector", classes=2)
    other.params, other.step = params, 1
    again._backward_start = other._backward_start = time.perf_counter() - 1
    assert torch.equal(again.release(0), params[0].grad)
    assert not torch.equal(other.release(0), params[0].grad)


@pytest.mark.timeout(60)
def test_ddp_buckets_launch_during_a_device_backward():
    """torch DDP (world of 1, gloo) with one bucket per parameter: its communication hook
    runs for each bucket when the profile makes that bucket's gradients ready, so
    communication overlaps the device's backward as on the device."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
        sizes = [p.numel() * 4 for p in model.parameters()]
        prof = Profile.on_paper(sizes, 0.01, 0.6, batch_size=8)
        dev = device.DeviceCompute(device.DeviceTimes.of(prof, 1.0, 8), 0, 0, "vector", 2)
        dev.install(model)
        ddp = DDP(model, bucket_cap_mb=64 * 4 / 2**20)  # one parameter per bucket
        launched: list[float] = []

        def hook(_, bucket):
            launched.append(time.perf_counter())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        for _ in range(2):  # DDP rebuilds its buckets in ready order after iteration 1
            launched.clear()
            loss = torch.nn.functional.cross_entropy(ddp(torch.randn(8, 64)),
                                                     torch.randint(0, 2, (8,)))
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
    finally:
        dist.destroy_process_group()
    offsets = [t - start for t in launched]
    ready = sorted(dev.times.ready_s)
    assert len(offsets) == 3 and offsets == sorted(offsets)
    # the first buckets went out when the profile made their gradients ready, long
    # before backward ended (0.6 s, with the first layer's weight)
    assert offsets[0] < ready[1] + 0.15 and offsets[1] < ready[2] + 0.15 < 0.3
    assert 0.6 <= offsets[2] and 0.6 <= end - start < 0.75


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_device_run_takes_the_profiles_time_and_ranks_agree(tmp_path, profile, strategy):
    out = tmp_path / strategy
    psring("run", "--strategy", strategy, "--workers", 2, *SMALL, "--steps", "8",
           "--compute", "device", "--device-profile", profile, "--device-speed", "2",
           "--out", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["timing_only"] and manifest["compute"]["mode"] == "device"
    steps = read_steps(out)
    # SMALL's global batch 32 is 16 a worker, the profile's: (40 + 80) / 2 ms compute
    compute = statistics.median(r["forward_s"] + r["backward_s"] for r in steps[4:])
    assert 0.060 <= compute < 0.060 * 1.3, compute  # (docs/benchmarks.md: how close)
    by_step: dict[int, list] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r["device_digest"])
    for digests in by_step.values():
        assert len(digests) == 2
        if strategy == "allreduce":  # the reduced gradients, the same on both ranks
            assert digests[0][1] == pytest.approx(digests[1][1], rel=1e-6)
        else:  # the parameters the servers sent: the same version on both ranks
            assert digests[0][0] == pytest.approx(digests[1][0], rel=1e-6)
    if strategy == "ps":  # the servers really updated them
        assert by_step[0][0][0] != by_step[7][0][0]
    report = psring("report", out).stdout
    assert "timing only" in report
    assert_no_processes(out)


@pytest.mark.timeout(60)
def test_a_profile_on_paper_fits_its_model_and_states_its_rule(tmp_path):
    out = tmp_path / "paper"
    shown = psring("profile", "--on-paper", "--model", "mlp", "--width", "256", "--depth", "2",
                   "--features", "64", "--batch-size", "16", "--step-ms", "90",
                   "--source", "a paper, table 2", "--out", out).stdout
    assert "split 0.33:0.67 forward:backward" in shown
    prof = Profile.load(out)
    assert prof.param_bytes == _sizes()
    assert (prof.forward_s, prof.backward_s) == pytest.approx((0.030, 0.060))
    assert prof.source["cited"] == "a paper, table 2" and prof.batch_size == 16
    # usable as it is by a device-mode run of that model
    validate(RunConfig(**FLAGS, strategy="allreduce", workers=2, compute="device",
                       device_profile=str(out)))
    for bad, match in ((["--step-ms", "90", "--forward-ms", "1"], "not both"),
                       ([], "needs the device's times"),
                       (["--forward-ms", "-1", "--backward-ms", "2"], "--forward-ms must be")):
        proc = cli_here("profile", "--on-paper", "--model", "mlp", *bad, "--out",
                        tmp_path / "x")
        assert proc.returncode == 2 and match in proc.stderr, proc.stderr
    proc = cli_here("profile", "--model", "mlp", "--step-ms", "3")
    assert proc.returncode == 2 and "add --on-paper" in proc.stderr


def test_on_paper_gradients_are_ready_when_backwards_flops_reach_them():
    """VGG-16 at ImageNet's image size: the fully connected layers (three quarters of
    the bytes, a few percent of the FLOPs) are ready within backward's first tenth, the
    first convolution at its very end; ready times follow autograd's order."""
    from psring.runs.profiling import paper_profile, profile_config

    cfg = profile_config(model="vgg16", classes=1000, image_size=224, batch_size=64,
                         out="unused")
    prof = paper_profile(cfg, None, None, step_ms=300.0)
    sizes, ready = prof.param_bytes, prof.ready_s
    assert "backward's FLOPs" in prof.source["rule"]
    early = sum(b for b, t in zip(sizes, ready) if t <= 0.1 * prof.backward_s)
    assert early / sum(sizes) > 0.7
    assert ready[0] == pytest.approx(prof.backward_s, rel=1e-3)  # the first layer: last
    assert max(ready) <= prof.backward_s and min(ready) >= 0
    # in autograd's order: the classifier's gradients before the features'
    assert ready[-1] < ready[len(ready) // 2] < ready[0]


@needs_emulation
@pytest.mark.timeout(120)
def test_a_time_scale_slows_device_and_links_alike_and_records_the_clusters_clock(tmp_path,
                                                                                   profile):
    """--time-scale 4 on a 400mbit cluster: links shaped to 100mbit, the device 4x slower;
    the records are in the 400mbit cluster's time (the profile's compute, / speed 2)."""
    out = tmp_path / "scaled"
    t0 = time.monotonic()
    psring("run", "--strategy", "allreduce", "--workers", 2, "--hosts", 2, "--link", "400mbit",
           *SMALL, "--steps", "6", "--compute", "device", "--device-profile", profile,
           "--device-speed", "2", "--time-scale", "4", "--out", out)
    wall = time.monotonic() - t0
    assert json.loads((out / "cluster.json").read_text())["link_bits"] == 1e8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cluster"]["time_scale"] == 4 and manifest["compute"]["time_scale"] == 4
    steps = read_steps(out)
    compute = statistics.median(r["forward_s"] + r["backward_s"] for r in steps[2:])
    assert 0.060 <= compute < 0.060 * 1.3, compute
    assert wall > 6 * 0.060 * 4  # it did run slowed down
    assert_cluster_gone(out)


def test_beyond_this_machines_capacity_a_run_is_warned_with_the_time_scale_to_use(profile,
                                                                                  tmp_path):
    """The rule of docs/emulation.md: the workers' host-side work must fit in the cores'
    time the device's step leaves, and the emulated links in what the cores carry."""
    fast = tmp_path / "fast"
    Profile.on_paper(_sizes(), 1e-5, 2e-5, batch_size=16).save(fast)
    cfg = dict(FLAGS, strategy="allreduce", workers=4, compute="device")
    assert device.capacity(RunConfig(**cfg, device_profile=str(profile)), cores=2) == []
    [why] = device.capacity(RunConfig(**cfg, device_profile=str(fast)), cores=2)
    assert "exceeds" in why and "raise --time-scale to at least" in why
    need = int(why.rsplit(" ", 1)[1])
    assert device.capacity(RunConfig(**cfg, device_profile=str(fast), time_scale=need),
                           cores=2) == []
    # the smallest whole scale that meets the rule (what advise --verify runs at)
    slow = device.required_time_scale(RunConfig(**cfg, device_profile=str(fast)), cores=2)
    assert slow == need and device.capacity(
        RunConfig(**cfg, device_profile=str(fast), time_scale=slow - 1), cores=2) != []
    links = RunConfig(**cfg, device_profile=str(profile), hosts=4, link="10gbit")
    [why] = device.capacity(links, cores=2)
    assert "links add up to 40.0 Gbit/s" in why and why.endswith("at least 10")
    assert device.required_time_scale(links, cores=2) == 10
    assert device.required_time_scale(RunConfig(**cfg, device_profile=str(profile)),
                                      cores=2) == 1
    proc = psring("run", *[f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()],
                  "--device-profile", fast, "--steps", "2", "--out", tmp_path / "r")
    assert "psring: warning: the workers' own work on their gradients" in proc.stderr
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["compute"]["capacity_warnings"]


@needs_emulation
@pytest.mark.timeout(120)
def test_a_link_bound_device_run_carries_near_its_links_rate(tmp_path):
    """A device that computes in no time on a 100 Mbit/s link: the step is the ring's
    bytes crossing it, at close to the rate (docs/benchmarks.md has the 16-worker
    figures)."""
    flags = dict(model="mlp", width=1024, depth=2, features=256, batch_size=32)
    sizes = [p.numel() * p.element_size() for p in meta_model(RunConfig(**flags))[0].parameters()]
    prof = Profile.on_paper(sizes, 1e-4, 2e-4, batch_size=16).save(tmp_path / "prof")
    out = tmp_path / "run"
    psring("run", "--strategy", "allreduce", "--workers", 2, "--hosts", 2, "--link", "100mbit",
           *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()], "--steps", "8",
           "--compute", "device", "--device-profile", prof.parent, "--out", out)
    kept = [r for r in read_steps(out) if r["step"] >= 2]
    step = statistics.median(r["step_s"] for r in kept)
    sent = kept[0]["bytes_sent"]  # 2(n-1)/n of the gradients, across the one host link
    utilization = sent * 8 / step / 100e6
    assert 0.8 < utilization <= 1.0, (sent, step)
    assert_cluster_gone(out)
