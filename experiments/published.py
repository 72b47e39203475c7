"""The simulator on paper: published clusters and scaling figures, predicted from their
published per-device compute times (docs/results/2026-11-23-prediction-accuracy.md has the
sources and the reading; docs/prediction.md the latest figures).

    python experiments/published.py            # prints the two Markdown tables
    python experiments/published.py --json     # the published rows: {setting, published,
                                               # predicted, points_off, ...}

1. Against published figures: Horovod's 512 Pascal GPUs (128 servers x 4, 25 Gbit/s
   RoCE; Inception V3, ResNet-101, VGG-16 at batch 64 per GPU), and PyTorch's DDP
   benchmark (ResNet-50, batch 32 per GPU, 8 and 16 V100s, 8 per machine, 4 x 100 Gbit/s
   InfiniBand per machine).
2. Beyond this machine: ring all-reduce and a sharded PS (servers on hosts of their own,
   as many as the workers' hosts, BytePS's setting) for 8 to 256 workers at 10, 25 and
   100 Gbit/s.

Every number the simulator is given is stated below with its source; nothing here is
measured on this machine.
"""

from __future__ import annotations

import json
import sys

from psring.cluster.spec import Cluster
from psring.predict.calibration import Calibration
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile

# -- the hardware, on paper ------------------------------------------------------------
#: GPU clusters: NCCL over RDMA; per-message latency ~10 µs; inside a server PCIe/NVLink
#: at ~10 GB/s (β 1e-10 s/byte); a GPU adds at several hundred GB/s (γ 2e-12 s/byte).
#: Between servers the link's nominal rate sets β (psring.units.payload_beta: TCP
#: payload at a 1500-byte MTU, a conservative reading of RoCE's).
GPU = Calibration(zmq_alpha=1e-5, zmq_beta=1e-10, dist_alpha=1e-5, dist_beta=1e-10,
                  gamma=2e-12, host="on paper: GPU servers")

# -- the models' parameters, layer by layer ----------------------------------------------


def _sizes(build) -> list[int]:
    import torch

    with torch.device("meta"):
        model = build()
    return [p.numel() * 4 for p in model.parameters()]


def resnet(layers: list[int]) -> list[int]:
    from psring.zoo.vision import Bottleneck, ResNet

    return _sizes(lambda: ResNet(Bottleneck, layers, 1000, 64, 3))


def zoo(name: str, image_size: int = 224) -> list[int]:
    from psring.train.models import ModelSettings, build_model

    def build():
        return build_model(name, ModelSettings(classes=1000, image_size=image_size), 0)[0]

    return _sizes(build)


def vgg16() -> list[int]:
    return zoo("vgg16")


def profile(sizes: list[int], per_gpu_img_s: float, batch: int, name: str) -> Profile:
    """A step of ``batch`` images at the published images/s: one third forward, two
    thirds backward (the usual split), the update on the GPU (3 passes over the
    parameters at ~500 GB/s)."""
    step = batch / per_gpu_img_s
    update = 3 * sum(sizes) / 500e9
    compute = step - update
    return Profile.on_paper(sizes, forward_s=compute / 3, backward_s=2 * compute / 3,
                            update_s=update, batch_size=batch, source={"model": name})


def published() -> list[dict]:
    """Each published setting: its cluster, gradients, published compute, published and
    predicted efficiency, and what bounds the prediction."""
    r50, r101 = resnet([3, 4, 6, 3]), resnet([3, 4, 23, 3])
    rows = []
    horovod = Cluster.of(hosts=128, workers_per_host=4, link_bits=25e9)
    # Horovod's own single-GPU baselines at batch 64 (its README's table, PR #44):
    # Inception V3 134.4, ResNet-101 119.4, VGG-16 130.9 images/s
    for name, sizes, ips, eff in (
            ("Inception V3", zoo("inception_v3", 299), 134.4, 0.90),
            ("ResNet-101", r101, 119.4, 0.90),
            ("VGG-16", vgg16(), 130.9, 0.68)):
        prof = profile(sizes, ips, 64, name)
        p = simulate(prof, horovod, "ring", GPU, steps=3)
        rows.append(_row(f"Horovod, {name}", "512 Pascal GPUs (128 x 4), 25 Gbit/s RoCE",
                         sizes, prof, eff, p))
    # PyTorch's DDP benchmark (benchmarks/distributed/ddp/README.md): ResNet-50 at batch
    # 32, p50 0.097 s on one GPU, 0.104 s on 8 (one machine) and 16 (two machines).
    prof = profile(r50, 32 / 0.097, 32, "ResNet-50")
    for gpus, hosts, measured in ((8, 1, 0.104), (16, 2, 0.104)):
        cl = Cluster.of(hosts=hosts, workers_per_host=8, link_bits=400e9)
        p = simulate(prof, cl, "ring", GPU, steps=3)
        rows.append(_row(f"PyTorch DDP benchmark, ResNet-50 ({gpus} GPUs)",
                         f"{hosts} x 8 V100, 4 x 100 Gbit/s InfiniBand per machine", r50,
                         prof, 0.097 / measured, p))
    return rows


def _row(setting: str, cluster: str, sizes: list[int], prof: Profile, published_eff: float,
         p) -> dict:
    return {"setting": setting, "cluster": cluster, "gradient_mb": sum(sizes) / 1e6,
            "compute_ms": prof.compute_s * 1e3, "published": published_eff,
            "predicted": p.efficiency, "points_off": 100 * (p.efficiency - published_eff),
            "bound": p.bound}


def beyond() -> list[list[str]]:
    prof = profile(resnet([3, 4, 6, 3]), 32 / 0.097, 32, "ResNet-50")
    big = profile(vgg16(), 130.9, 64, "VGG-16")
    rows = []
    for name, pr in (("ResNet-50", prof), ("VGG-16", big)):
        for rate in (10e9, 25e9, 100e9):
            cells = []
            for n in (8, 32, 128, 256):
                ring = simulate(pr, Cluster.of(hosts=n // 4, workers_per_host=4,
                                               link_bits=rate),
                                "ring", GPU, steps=3)
                k = n // 4  # a server host per worker host (BytePS)
                ps = simulate(pr, Cluster.of(hosts=n // 4, workers_per_host=4, link_bits=rate,
                                             servers=k, placement="own-hosts"), "ps", GPU,
                              steps=3)
                cells.append(f"{ring.efficiency:.0%} / {ps.efficiency:.0%}")
            rows.append([name, f"{rate / 1e9:g} Gbit/s", *cells])
    return rows


def md(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def main() -> int:
    if "--json" in sys.argv[1:]:  # rows of {setting, published, predicted, ...}
        print(json.dumps(published(), indent=1))
        return 0
    rows = [[r["setting"], r["cluster"], f"{r['gradient_mb']:.0f} MB",
             f"{r['compute_ms']:.0f} ms", f"{r['published']:.0%}", f"{r['predicted']:.0%}",
             r["bound"]] for r in published()]
    print(md(["published setting", "cluster", "gradients", "compute per step (published)",
              "published efficiency", "predicted", "predicted bound"], rows))
    print()
    print("Scaling efficiency predicted, ring / sharded PS (one server host per worker "
          "host, BytePS's setting), 4 GPUs per host:")
    print()
    print(md(["model", "link", "8 workers", "32", "128", "256"], beyond()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
