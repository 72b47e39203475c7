"""What psring decides for a GPU machine, checked without one: the process group's
backend when workers share a GPU, which GPU a worker takes, where --device auto puts a
run that cannot compute on CUDA, and the refusals. (tests/cuda runs them on a GPU.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psring.comm.interconnect import Staged
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from psring.runs.profiling import profile_config
from workers.entry import _broken_connection, machine_share, process_group_backend


def test_nccl_only_with_a_gpu_per_worker_else_gloo_over_cuda_tensors():
    assert process_group_backend("cpu", 4, 0)[0] == "gloo"
    assert process_group_backend("cuda", 1, 1) == ("nccl", "one GPU per worker")
    assert process_group_backend("cuda", 8, 8)[0] == "nccl"
    backend, why = process_group_backend("cuda", 2, 1)
    assert backend == "gloo" and "2 workers share this machine's 1 GPU" in why


def test_the_gpus_are_dealt_over_the_machines_workers(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "PSRING_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    # psring's launcher: every worker on this machine, emulated hosts included
    monkeypatch.setenv("PSRING_RUN_ID", "r")
    assert machine_share(rank=3, local_rank=1, local_world=2, workers=4) == (3, 4)
    # torchrun: LOCAL_WORLD_SIZE per machine
    monkeypatch.delenv("PSRING_RUN_ID")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert machine_share(rank=3, local_rank=1, local_world=2, workers=4) == (1, 2)


def test_auto_keeps_cpu_only_runs_on_the_cpu_of_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert RunConfig(strategy="allreduce", workers=2).resolved_device == "cuda"
    # hogwild's workers share CPU memory; device mode emulates the GPU on the CPU
    assert RunConfig(strategy="hogwild", workers=2).resolved_device == "cpu"
    assert RunConfig(strategy="allreduce", workers=2, compute="device").resolved_device == "cpu"
    assert RunConfig(strategy="allreduce", workers=2, device="cpu").resolved_device == "cpu"


def test_cuda_is_refused_where_a_run_cannot_use_it():
    with pytest.raises(ConfigError, match="computes on cpu only"):
        validate(RunConfig(strategy="hogwild", workers=2, device="cuda"))
    with pytest.raises(ConfigError, match="emulates the accelerator on the CPU"):
        validate(RunConfig(strategy="allreduce", workers=2, device="cuda", compute="device"))


def test_a_staged_collective_lands_in_the_device_tensor_once_waited_for():
    class Work:
        waited = False

        def wait(self):
            Work.waited = True
            return True

    host, out = torch.arange(4.0), torch.zeros(4)
    handle = Staged(Work(), host, out)
    assert out.sum() == 0  # nothing copied before the wait
    assert handle.wait() and Work.waited
    assert torch.equal(out, host)


def test_nccls_own_refusal_is_not_called_a_broken_connection():
    assert _broken_connection(RuntimeError("NCCL error in: x, remote process exited"))
    assert not _broken_connection(RuntimeError(
        "NCCL error in: ..., invalid usage (run with NCCL_DEBUG=WARN for details), "
        "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"))


def test_a_profile_reads_only_the_rows_its_steps_need():
    cfg = profile_config(model="resnet50", batch_size=64, steps=8)
    assert (cfg.samples, cfg.eval_samples) == (512, 0)
    assert profile_config(batch_size=64, steps=100).samples == RunConfig.samples


def test_device_mode_spends_a_gpus_host_copies_at_the_time_scale():
    import time

    from psring.records.profile import Profile
    from psring.train.device import DeviceCompute, DeviceTimes

    prof = Profile(param_bytes=[4], ready_s=[0.01], forward_s=0.01, backward_s=0.01,
                   update_s=0.0, batch_size=4,
                   host_copy={"d2h": [0.02, 1e9], "h2d": [0.0, 1e9], "source": "test"})
    dev = DeviceCompute(DeviceTimes.of(prof, 1.0, 4, time_scale=2.0), 0, 0, "features", 2, 2.0)
    t = time.perf_counter()
    dev.copy("d2h", 10_000_000)  # (0.02 s + 10 MB at 1 GB/s) x 2
    assert 0.06 <= time.perf_counter() - t < 0.5
    plain = DeviceCompute(DeviceTimes.of(dataclasses.replace(prof, host_copy=None), 1.0, 4),
                          0, 0, "features", 2)
    taken = []  # (what it would sleep, not a wall clock a loaded machine stretches)
    plain.on_time.take = taken.append
    plain.copy("d2h", 10_000_000)  # a profile without host copies: a CPU's, nothing
    assert taken == []
