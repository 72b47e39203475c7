"""manifest.json: everything needed to interpret a run's step log later."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from psring.comm.compress import wire_bytes
from psring.config import RunConfig
from psring.records.runlog import MANIFEST, atomic_write_json, git_commit, host_facts, versions
from psring.train import device as psring_device
from psring.train.models import flops_per_sample, parameter_bytes


def accelerator() -> dict:
    """This process's GPU, named (its CUDA runtime is already up: the worker's)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "torch_cuda": torch.version.cuda,
            "driver": _driver_version()}


def _driver_version() -> str | None:
    """nvidia-smi's driver version, if it is there to ask."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
        else None


def build_manifest(cfg: RunConfig, work, strategy_cls, threads: int,
                   launch: dict | None = None, per_host: int = 1) -> dict:
    """``work``: the run's psring.train.workload.Workload; ``launch``: who started the workers
    and where they ran (psring.runtime.rendezvous: under torchrun, every rank's host);
    ``per_host``: workers on each host (LOCAL_WORLD_SIZE)."""
    ds = work.data.train
    data = {"samples": len(ds), "features": ds.features, "classes": ds.classes,
            "held_out": len(work.data.held_out), "kind": work.inputs.kind,
            "shape": list(work.inputs.shape)}
    return run_facts(cfg, work.model, strategy_cls, threads,
                     flops_per_sample(work.model, work.inputs), data, launch, per_host)


def run_facts(cfg: RunConfig, model, strategy_cls, threads: int, fps: float | None,
              data: dict, launch: dict | None = None, per_host: int = 1) -> dict:
    """The manifest of a run of ``model`` (``fps``: its FLOPs per sample, forward and
    backward; ``data``: what it trained on), psring's loop's or a script's."""
    pbytes = parameter_bytes(model)
    # gradients as they travel: half the bytes with --compress fp16/bf16
    wire = wire_bytes(pbytes, cfg.compress) if strategy_cls.caps.supports_compression else pbytes
    sent, recv = strategy_cls.bytes_per_step(wire, cfg.workers, per_host)
    flops_worker_step = fps * cfg.per_worker_batch * cfg.accumulate if fps else None
    return {
        "config": cfg.to_dict(),
        "versions": versions(),
        "host": host_facts(),
        "threads_per_process": threads,
        "git_commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        # which process ran on which (emulated) host, the links and the placement
        "cluster": cfg.cluster.describe(),
        "launch": launch or {},
        # --compute device: times from a profile, communication real; nothing learnt
        "compute": psring_device.describe(cfg),
        "timing_only": cfg.compute == "device",
        "device": cfg.resolved_device,
        # the GPU's name, its driver's CUDA and torch's (CUDA runs): what a profile names
        "accelerator": accelerator() if cfg.resolved_device == "cuda" else None,
        "data": data,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": pbytes,
        # each trainable parameter's gradient bytes, in model.parameters() order: what
        # psring.records.profile rebuckets at any bucket size
        "parameter_sizes": [p.numel() * p.element_size() for p in model.parameters()
                            if p.requires_grad],
        "wire_bytes": wire,
        "bytes_per_step": {"sent": sent, "recv": recv},
        "flops_per_sample": fps,
        "flops_per_worker_step": flops_worker_step,
        # FLOPs a worker computes per byte it communicates in one optimizer step.
        "arithmetic_intensity": (flops_worker_step / (sent + recv))
        if flops_worker_step and sent + recv else None,
    }


def write_manifest(run_dir: Path, cfg: RunConfig, work, strategy_cls, threads: int,
                   launch: dict | None = None, per_host: int = 1) -> dict:
    m = build_manifest(cfg, work, strategy_cls, threads, launch, per_host)
    atomic_write_json(Path(run_dir) / MANIFEST, m)
    return m
