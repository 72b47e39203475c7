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


def build_manifest(cfg: RunConfig, work, strategy_cls, threads: int,
                   launch: dict | None = None, per_host: int = 1) -> dict:
    """``work``: the run's psring.train.workload.Workload; ``launch``: who started the workers
    and where they ran (psring.runtime.rendezvous: under torchrun, every rank's host);
    ``per_host``: workers on each host (LOCAL_WORLD_SIZE)."""
    model, ds = work.model, work.data.train
    pbytes = parameter_bytes(model)
    # gradients as they travel: half the bytes with --compress fp16/bf16
    wire = wire_bytes(pbytes, cfg.compress) if strategy_cls.caps.supports_compression else pbytes
    sent, recv = strategy_cls.bytes_per_step(wire, cfg.workers, per_host)
    fps = flops_per_sample(model, work.inputs)
    flops_worker_step = fps * cfg.per_worker_batch * cfg.accumulate
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
        "data": {"samples": len(ds), "features": ds.features, "classes": ds.classes,
                 "held_out": len(work.data.held_out), "kind": work.inputs.kind,
                 "shape": list(work.inputs.shape)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": pbytes,
        # each trainable parameter's gradient bytes, in model.parameters() order: what
        # psring.predict.profile rebuckets at any bucket size
        "parameter_sizes": [p.numel() * p.element_size() for p in model.parameters()
                            if p.requires_grad],
        "wire_bytes": wire,
        "bytes_per_step": {"sent": sent, "recv": recv},
        "flops_per_sample": fps,
        "flops_per_worker_step": flops_worker_step,
        # FLOPs a worker computes per byte it communicates in one optimizer step.
        "arithmetic_intensity": (flops_worker_step / (sent + recv)) if sent + recv else None,
    }


def write_manifest(run_dir: Path, cfg: RunConfig, work, strategy_cls, threads: int,
                   launch: dict | None = None, per_host: int = 1) -> dict:
    m = build_manifest(cfg, work, strategy_cls, threads, launch, per_host)
    atomic_write_json(Path(run_dir) / MANIFEST, m)
    return m
