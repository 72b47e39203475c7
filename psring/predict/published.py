"""Published scaling figures psring's predictions are held against: the setting each
names (model, GPUs, GPUs a host, link) and its scaling efficiency. ``psring advise
--max-workers`` marks the ones its question names on scaling.png;
experiments/published.py predicts them from their published compute, with the terms
below: what a published cluster adds to the simulator's step (NCCL's own latency
model, each transport's payload, the slowest of n workers), each with its source.

    from psring.predict.published import matching
    marks = matching("resnet101", per_host=4, link_bits=25e9)
"""

from __future__ import annotations

import math
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
    # Horovod's README (PR #44, 2017): 128 of the same GPUs (32 servers x 4)
    Published("Horovod, 128 Pascal GPUs", "inception_v3", 128, 4, 25e9, 0.90),
    Published("Horovod, 128 Pascal GPUs", "resnet101", 128, 4, 25e9, 0.90),
    Published("Horovod, 128 Pascal GPUs", "vgg16", 128, 4, 25e9, 0.79),
    # PyTorch's DDP benchmark (benchmarks/distributed/ddp/README.md): ResNet-50 at batch
    # 32, p50 0.097 s on one V100 and 0.104 s on 8 (one machine) and 16 (two), 4 x 100
    # Gbit/s InfiniBand a machine
    Published("PyTorch DDP benchmark", "resnet50", 8, 8, 400e9, 0.097 / 0.104, "ddp"),
    Published("PyTorch DDP benchmark", "resnet50", 16, 8, 400e9, 0.097 / 0.104, "ddp"),
    Published("PyTorch DDP benchmark", "resnet101", 8, 8, 400e9, 0.162 / 0.179, "ddp"),
    Published("PyTorch DDP benchmark", "resnet101", 16, 8, 400e9, 0.162 / 0.179, "ddp"),
)


def matching(model: str | None, per_host: int, link_bits: float | None) -> list[Published]:
    """The published points of ``model`` on hosts of ``per_host`` GPUs joined by links
    within 10% of ``link_bits``."""
    if not model or not link_bits:
        return []
    return [p for p in POINTS if p.model == model and p.per_host == per_host
            and abs(p.link_bits - link_bits) <= 0.1 * p.link_bits]


# -- what a published cluster adds to the simulator's step, each with its source --------

#: the share of a link's bits that reaches the application as payload, per transport at
#: its usual MTU, counting every byte a frame takes on the wire. TCP over Ethernet's
#: 1500-byte MTU: 1448 payload (IPv4 20, TCP 20 + 12 of timestamps) of 1538 (header 14,
#: FCS 4, preamble 8, gap 12). RoCE v2: 1024-byte payloads, the path MTU over a
#: 1500-byte Ethernet MTU, under IPv4 20, UDP 8, BTH 12, ICRC 4 and Ethernet's 38: 1024
#: of 1106. InfiniBand: 4096-byte payloads under LRH 8, BTH 12, ICRC 4, VCRC 2 (its data
#: rates are after 64b/66b coding): 4096 of 4122.
PAYLOAD = {"tcp": 1448 / 1538, "roce": 1024 / 1106, "ib": 4096 / 4122}

#: NCCL's own latency model of a ring all-reduce (NVIDIA/nccl src/graph/tuning.cc, the
#: Simple protocol large messages use): a base of 8.4 µs, each intra-host step 5.7 µs
#: over PCIe or 3.4 µs over NVLink, each step across the network 9.6 µs, and the whole
#: ×1.9 across hosts for messages of at least n/16 × 64 KiB ("plateau effect of ring")
NCCL_BASE_S, NCCL_NET_STEP_S = 8.4e-6, 9.6e-6
NCCL_INTRA_STEP_S = {"pci": 5.7e-6, "nvlink": 3.4e-6}
NCCL_PLATEAU = 1.9


def nccl_ring_latency(per_host: int, hosts: int, intra: str = "pci",
                      nbytes: float = float("inf")) -> float:
    """Seconds of latency of one ring all-reduce of ``nbytes`` among ``hosts`` hosts of
    ``per_host`` GPUs, by NCCL's model: 2(n−1) steps, 2(H−1) of them across hosts."""
    n = per_host * hosts
    steps, across = 2 * (n - 1), 2 * (hosts - 1)
    latency = NCCL_BASE_S + (steps - across) * NCCL_INTRA_STEP_S[intra] \
        + across * NCCL_NET_STEP_S
    if hosts > 1 and nbytes >= n / 16 * 65536:
        latency *= NCCL_PLATEAU
    return latency


def negotiation_s(ranks: int) -> float:
    """Seconds a Horovod cycle spends agreeing which tensors are ready on every rank:
    a gather to rank 0 and a broadcast back (MPI's binomial trees: ⌈log2 n⌉ network
    steps each, at NCCL's network step's latency)."""
    return 2 * math.ceil(math.log2(max(ranks, 2))) * NCCL_NET_STEP_S


def expected_max_normal(n: int) -> float:
    """E[max of n standard normal draws] (numerically: ∫ x·n·φ(x)·Φ(x)^(n−1) dx); 0 for
    one."""
    if n <= 1:
        return 0.0
    xs = [-8 + 16 * i / 4000 for i in range(4001)]
    dens = [x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
            * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) for x in xs]
    return sum(dens) * 16 / 4000


def straggler_factor(n: int, spread: float) -> float:
    """How much longer a synchronous step's compute is than one worker's median when n
    workers' compute times spread with relative σ ``spread``: the slowest one's,
    1 + σ·E[max of n]."""
    return 1 + spread * expected_max_normal(n)
