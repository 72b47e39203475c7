"""Published scaling figures psring's predictions are held against: the setting each
names (model, GPUs, GPUs a host, link) and its scaling efficiency. ``psring advise
--max-workers`` marks the ones its question names on scaling.png;
experiments/published.py predicts them from their published compute.

    from psring.predict.published import matching
    marks = matching("resnet101", per_host=4, link_bits=25e9)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    source: str
    #: the model, by psring's name for it (psring models)
    model: str
    workers: int
    per_host: int
    link_bits: float
    #: throughput of ``workers`` GPUs over ``workers`` times one GPU's
    efficiency: float
    #: the strategy it was measured with, by psring's name
    strategy: str = "allreduce"


POINTS = (
    # Horovod's README and Sergeev & Del Balso, arXiv:1802.05799 (2018), Fig. 6: 128
    # servers of 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64 a GPU
    Published("Horovod, 512 Pascal GPUs", "inception_v3", 512, 4, 25e9, 0.90),
    Published("Horovod, 512 Pascal GPUs", "resnet101", 512, 4, 25e9, 0.90),
    Published("Horovod, 512 Pascal GPUs", "vgg16", 512, 4, 25e9, 0.68),
    # PyTorch's DDP benchmark (benchmarks/distributed/ddp/README.md): ResNet-50 at batch
    # 32, p50 0.097 s on one V100 and 0.104 s on 8 (one machine) and 16 (two), 4 x 100
    # Gbit/s InfiniBand a machine
    Published("PyTorch DDP benchmark", "resnet50", 8, 8, 400e9, 0.097 / 0.104, "ddp"),
    Published("PyTorch DDP benchmark", "resnet50", 16, 8, 400e9, 0.097 / 0.104, "ddp"),
)


def matching(model: str | None, per_host: int, link_bits: float | None) -> list[Published]:
    """The published points of ``model`` on hosts of ``per_host`` GPUs joined by links
    within 10% of ``link_bits``."""
    if not model or not link_bits:
        return []
    return [p for p in POINTS if p.model == model and p.per_host == per_host
            and abs(p.link_bits - link_bits) <= 0.1 * p.link_bits]
