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
from dataclasses import replace

from psring.cluster.spec import Cluster, link_key
from psring.predict.calibration import Calibration
from psring.predict.published import (
    NCCL_INTRA_STEP_S,
    NCCL_NET_STEP_S,
    PAYLOAD,
    nccl_ring_latency,
    negotiation_s,
    straggler_factor,
)
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile
from psring.train.models import (
    ModelSettings,
    backward_shares,
    flops_per_sample,
    meta_build,
)

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


def profile(sizes: list[int], per_gpu_img_s: float, batch: int, name: str,
            shares: list[float] | None = None) -> Profile:
    """A step of ``batch`` images at the published images/s: one third forward, two
    thirds backward (the usual split), the update on the GPU (3 passes over the
    parameters at ~500 GB/s). ``shares``: where in backward each gradient is ready
    (backward's FLOPs, psring.train.models.backward_shares); else by bytes."""
    step = batch / per_gpu_img_s
    update = 3 * sum(sizes) / 500e9
    compute = step - update
    return Profile.on_paper(sizes, forward_s=compute / 3, backward_s=2 * compute / 3,
                            update_s=update, batch_size=batch, shares=shares,
                            source={"model": name})


def flop_ordered(model: str, image_size: int, per_gpu_img_s: float, batch: int) -> Profile:
    """:func:`profile` of psring's ``model``, each gradient ready when backward's FLOPs
    reach it (counted on the meta device: no compute)."""
    net, inputs = meta_build(model, ModelSettings(classes=1000, image_size=image_size))
    sizes = [p.numel() * 4 for p in net.parameters() if p.requires_grad]
    return profile(sizes, per_gpu_img_s, batch, model, backward_shares(net, inputs))


def slowed(prof: Profile, wrapper: float = 1.0, beside: float = 0.0,
           straggle: float = 1.0) -> Profile:
    """``prof`` with a framework's own cost on the device (``wrapper``: forward and
    backward that many times as long), NCCL's kernels beside backward (``beside``: its
    share of the device while they run, on backward and its gradients' times) and the
    slowest of the workers (``straggle``: every compute phase)."""
    f = wrapper * straggle
    return replace(prof, forward_s=prof.forward_s * f,
                   backward_s=prof.backward_s * f * (1 + beside),
                   ready_s=[t * f * (1 + beside) for t in prof.ready_s])


def on_link(cal: Calibration, bits: float, transport: str, step_alpha: float,
            achieved: float = 1.0) -> Calibration:
    """``cal`` with its links of ``bits``/s carrying ``transport``'s payload
    (psring.predict.published.PAYLOAD; ``achieved``: the share of it a collective
    reaches) at ``step_alpha`` seconds a ring step."""
    beta = 8 / (bits * PAYLOAD[transport] * achieved)
    return replace(cal, links={link_key(bits): {"dist_alpha": step_alpha, "dist_beta": beta,
                                                "zmq_alpha": step_alpha, "zmq_beta": beta}})


def ladder(rungs: list[tuple[str, float]], published_eff: float) -> list[dict]:
    return [{"term": term, "predicted": eff, "points_off": 100 * (eff - published_eff)}
            for term, eff in rungs]


#: Horovod's Tensor Fusion as its 2017-2018 releases ran it: a 64 MiB buffer, a 5 ms
#: cycle (docs/tensor-fusion.rst; v0.21.0's changelog, PR #2468, raised them to 128 MiB
#: and 1 ms)
HOROVOD_BUFFER, HOROVOD_CYCLE = 64 * 2**20, 5e-3
#: PyTorch's DDP benchmark (benchmarks/distributed/ddp/README.md, V100s, batch 32): p50
#: seconds without DDP on one GPU, with DDP on one, on two (one machine), on eight (one
#: machine) and on sixteen (two)
DDP_TABLE = {"resnet50": (0.097, 0.100, 0.103, 0.104, 0.104),
             "resnet101": (0.162, 0.171, 0.176, 0.179, 0.179)}
#: NCCL's kernels beside backward: a second GPU (all-reduces begin, over NVLink, where
#: they hide) costs ResNet-50's DDP step 0.103 / 0.100 (the table above); Horovod's
#: Pascal GPUs get the same share (no figure of their own was found)
BESIDE = DDP_TABLE["resnet50"][2] / DDP_TABLE["resnet50"][1] - 1
#: the spread of one GPU's step, relative: the table's p95 equals its p50 to the
#: millisecond at 97 ms, so σ ≤ 0.5 ms / 1.645 / 97 ms; the bound is used
SPREAD = 0.0005 / 1.645 / 0.097


#: Horovod's README (PR #44, October 2017): speed-up of 16 GPUs (4 servers of 4, NCCL
#: over RDMA) over one, batch 64: Inception V3 15.0, ResNet-101 14.6, VGG-16 13.7
HOROVOD_16 = {"inception_v3": 15.0 / 16, "resnet101": 14.6 / 16, "vgg16": 13.7 / 16}
#: the published points predicted: GPUs -> efficiency (128: the README; 512:
#: docs/benchmarks.rst and arXiv:1802.05799), and the single GPU's images/s (README)
HOROVOD = (("inception_v3", 299, 134.4, {128: 0.90, 512: 0.90}),
           ("resnet101", 224, 119.4, {128: 0.90, 512: 0.90}),
           ("vgg16", 224, 130.9, {128: 0.79, 512: 0.68}))


def horovod_step(prof: Profile, gpus: int, terms: int = 6, own: float = 1.0,
                 achieved: float = 1.0) -> float:
    """The step of Horovod's Pascal GPUs (4 a server over PCIe, 25 Gbit/s RoCE between
    servers), ``gpus`` of them, with the first ``terms`` of :data:`HOROVOD_TERMS`;
    ``own``: Horovod's own cost on the device (compute that many times as long),
    ``achieved``: the share of RoCE's payload rate its rings reach."""
    hosts = gpus // 4
    cl = Cluster.of(hosts=hosts, workers_per_host=4, link_bits=25e9)
    fusion = (HOROVOD_BUFFER, HOROVOD_CYCLE, negotiation_s(gpus)) if terms >= 3 else None
    cal = GPU if terms < 4 else on_link(
        GPU, 25e9, "roce",
        nccl_ring_latency(4, hosts, "pci", HOROVOD_BUFFER) / (2 * (gpus - 1)), achieved)
    if terms == 1:  # (the simulator's own on-paper profile: gradients ready by bytes)
        prof = Profile.on_paper(prof.param_bytes, prof.forward_s, prof.backward_s,
                                prof.update_s, prof.batch_size, prof.source)
    slow = slowed(prof, own, BESIDE if terms >= 5 else 0.0,
                  straggler_factor(gpus, SPREAD) if terms >= 6 else 1.0)
    return simulate(slow, cl, "ring", cal, steps=3, fusion=fusion).step_s


HOROVOD_TERMS = ("the simulator (gradients by bytes, 25 MB buckets, TCP payload)",
                 "+ gradients in backward's FLOP order",
                 "+ Tensor Fusion (64 MiB, 5 ms cycle, negotiation through rank 0)",
                 "+ NCCL's ring latency, RoCE v2's payload",
                 f"+ NCCL's kernels beside backward ({BESIDE:.0%})",
                 f"+ the slowest of the GPUs (σ {SPREAD:.2%})")


def _solve(f, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] where the increasing f(x) meets target (bisection)."""
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def horovod_own_costs(profs: dict[str, Profile]) -> tuple[dict[str, float], float]:
    """Horovod's own cost on the device per model and the share of RoCE's payload its
    rings reach, from its 16-GPU points (:data:`HOROVOD_16`), as DDP's are from its
    table's one and two GPUs: Inception V3's and ResNet-101's steps (their
    communication hides under backward) give their own costs; VGG-16's (bound by the
    links) the achieved share, at the mean of the others' own costs. Solved together:
    each moves the other a little."""
    achieved, own = 1.0, {}
    for _ in range(3):
        for m in ("inception_v3", "resnet101"):
            p = profs[m]
            own[m] = _solve(lambda w, p=p, a=achieved: horovod_step(p, 16, own=w, achieved=a),
                            p.compute_s / HOROVOD_16[m], 0.9, 2.0)
        own["vgg16"] = (own["inception_v3"] + own["resnet101"]) / 2
        p = profs["vgg16"]
        achieved = _solve(lambda a, p=p: -horovod_step(p, 16, own=own["vgg16"], achieved=a),
                          -p.compute_s / HOROVOD_16["vgg16"], 0.05, 1.0)
    return own, achieved


def horovod_rows() -> list[dict]:
    """Horovod's published 128- and 512-GPU points, the terms added one by one, the last
    from its 16-GPU points."""
    profs = {m: flop_ordered(m, size, ips, 64) for m, size, ips, _ in HOROVOD}
    own, achieved = horovod_own_costs(profs)
    rows = []
    for model, _, _, effs in HOROVOD:
        prof = profs[model]
        for gpus, eff in effs.items():
            rungs = [(term, prof.compute_s / horovod_step(prof, gpus, k + 1))
                     for k, term in enumerate(HOROVOD_TERMS)]
            rungs.append((f"+ Horovod's own cost ({own[model] - 1:.1%}) and its rings' "
                          f"share of the payload rate ({achieved:.0%}), from its 16-GPU "
                          f"points", prof.compute_s / horovod_step(prof, gpus, own=own[model],
                                                                   achieved=achieved)))
            rows.append(_row(f"Horovod, {model} ({gpus} GPUs)",
                             f"{gpus} Pascal GPUs ({gpus // 4} x 4), 25 Gbit/s RoCE", prof,
                             eff, rungs))
    return rows


def ddp_rows() -> list[dict]:
    """PyTorch's DDP benchmark: V100s, 8 a machine over NVLink, 4 x 100 Gbit/s
    InfiniBand a machine, batch 32; each model's own cost of DDP (one GPU, with DDP
    over without) and of NCCL beside backward (two GPUs over one) from the same table,
    the 8- and 16-GPU points predicted."""
    rows = []
    for model, (plain, one, two, eight, sixteen) in DDP_TABLE.items():
        bare = flop_ordered(model, 224, 32 / plain, 32)
        wrapper, beside = one / plain, two / one - 1
        for gpus, hosts, measured in ((8, 1, eight), (16, 2, sixteen)):
            cl = Cluster.of(hosts=hosts, workers_per_host=8, link_bits=400e9)
            step_alpha = nccl_ring_latency(8, hosts, "nvlink") / (2 * (gpus - 1))
            ib = on_link(GPU, 400e9, "ib", step_alpha)
            strag = straggler_factor(gpus, SPREAD)
            rungs = []
            for term, prof, cal in (
                    ("the simulator", bare, GPU),
                    (f"+ DDP's own cost on the device ({wrapper - 1:.1%})",
                     slowed(bare, wrapper), GPU),
                    (f"+ NCCL's kernels beside backward ({beside:.1%})",
                     slowed(bare, wrapper, beside), GPU),
                    ("+ NCCL's ring latency, InfiniBand's payload",
                     slowed(bare, wrapper, beside), ib),
                    (f"+ the slowest of {gpus} (σ {SPREAD:.2%})",
                     slowed(bare, wrapper, beside, strag), ib)):
                p = simulate(prof, cl, "ring", cal, steps=3)
                rungs.append((term, bare.compute_s / p.step_s))
            rows.append(_row(f"PyTorch DDP benchmark, {model} ({gpus} GPUs)",
                             f"{hosts} x 8 V100, 4 x 100 Gbit/s InfiniBand per machine",
                             bare, plain / measured, rungs))
    return rows


#: BytePS's README and docs/performance.md, their charts (docs/images/perf_tcp_*.png at
#: commit c1b20f85^, bars read to about ±100): 8 V100s a machine over NVLink, 20 Gbit/s
#: TCP between machines, batch 64; images/s of Horovod (NCCL) and of BytePS at 8, 16,
#: 32 and 64 GPUs. The headline: +44% for ResNet-50 and +100% for VGG-16 at 64.
BYTEPS_BARS = {"resnet50": {8: (2500, 2600), 16: (4000, 4800), 32: (7700, 8900),
                            64: (11500, 16600)},
               "vgg16": {8: (1650, 1750), 16: (1600, 2450), 32: (2100, 4200),
                         64: (3350, 6650)}}
BYTEPS_GAIN = {"resnet50": 0.44, "vgg16": 1.00}
#: NVLink between a machine's V100s, on paper: NCCL's NVLink step latency, ~130 GB/s
NVLINK = (NCCL_INTRA_STEP_S["nvlink"], 1 / 130e9)


def byteps_pair(model: str, gpus: int, ring_share: float = 1.0,
                byteps_share: float = 1.0) -> tuple[float, float]:
    """(Horovod's, BytePS's) efficiency on BytePS's cloud (:data:`BYTEPS_BARS`) at
    ``gpus``: the ring with Horovod's terms, and byteps with summation servers on as
    many machines of their own (BytePS's best practice: as much server bandwidth as
    worker bandwidth), updates on the workers; each reaching its ``share`` of TCP's
    payload rate. A GPU's own rate: the 8-GPU Horovod bar (one machine, over NVLink)."""
    hosts, bits = gpus // 8, 20e9
    ips = BYTEPS_BARS[model][8][0] / 8
    bare = flop_ordered(model, 224, ips, 64)
    prof = slowed(bare, beside=BESIDE, straggle=straggler_factor(gpus, SPREAD))
    ring_cal = on_link(GPU, bits, "tcp", nccl_ring_latency(8, hosts, "nvlink", HOROVOD_BUFFER)
                       / (2 * (gpus - 1)), ring_share)
    ring = simulate(prof, Cluster.of(hosts=hosts, workers_per_host=8, link_bits=bits),
                    "ring", ring_cal, steps=3, inside=NVLINK,
                    fusion=(HOROVOD_BUFFER, HOROVOD_CYCLE, negotiation_s(gpus)))
    byteps = simulate(prof, Cluster.of(hosts=hosts, workers_per_host=8, link_bits=bits,
                                       servers=hosts, placement="own-hosts"), "byteps",
                      on_link(GPU, bits, "tcp", NCCL_NET_STEP_S, byteps_share),
                      update_on="worker", inside=NVLINK)
    return bare.compute_s / ring.step_s, bare.compute_s / byteps.step_s


def byteps_rows() -> list[dict]:
    """BytePS's headline gains at 64 GPUs; the share of TCP's payload rate each side
    reaches is solved from its own 16-GPU VGG-16 bar (two machines: the links bound
    it), as Horovod's own costs are from its 16-GPU points. Published and predicted
    are gains (BytePS's images/s over Horovod's, less one), not efficiencies."""
    bars = BYTEPS_BARS["vgg16"][16]
    one = BYTEPS_BARS["vgg16"][8][0] / 8 * 16
    ring_share = _solve(lambda a: byteps_pair("vgg16", 16, a)[0], bars[0] / one, 0.02, 1.0)
    byteps_share = _solve(lambda a: byteps_pair("vgg16", 16, 1.0, a)[1], bars[1] / one,
                          0.02, 1.0)
    rows = []
    for model, gain in BYTEPS_GAIN.items():
        horovod, byteps = byteps_pair(model, 64, ring_share, byteps_share)
        h_bar, b_bar = BYTEPS_BARS[model][64]
        per = BYTEPS_BARS[model][8][0] / 8 * 64
        predicted = byteps / horovod - 1
        rows.append({
            "setting": f"BytePS over Horovod, {model} (64 GPUs)",
            "cluster": "8 x 8 V100 (NVLink), 20 Gbit/s TCP, 8 server machines",
            "published": gain, "predicted": predicted,
            "points_off": 100 * (predicted - gain), "within": abs(predicted - gain) <= 0.03,
            "efficiency": {"horovod": {"published": h_bar / per, "predicted": horovod},
                           "byteps": {"published": b_bar / per, "predicted": byteps}},
            "terms": [{"term": f"TCP payload reached, from the 16-GPU VGG-16 bars: the "
                               f"ring {ring_share:.0%}, byteps {byteps_share:.0%}"}]})
    return rows


#: sentiment-discovery (NVIDIA, its README): mLSTMs of 4,096 and 8,192 units trained
#: on up to 128 V100s (16 DGX-1V of 8), scaling near-linearly over InfiniBand and worse
#: over 10 Gbit/s Ethernet, better for the larger model. No step times are published:
#: the device's rate is swept instead (fp16 on a V100, sustained), batch 32 of 256
#: characters a GPU.
SENTIMENT_RATES = (10e12, 30e12, 100e12)


def mlstm_profile(units: int, rate: float) -> Profile:
    """psring's mlstm of ``units`` at 256 characters, batch 32, computed at ``rate``
    FLOP/s; its recurrent weights' gradients are ready only when backward ends."""
    net, inputs = meta_build("mlstm", ModelSettings(classes=256, width=units, depth=1,
                                                    seq_len=256))
    sizes = [p.numel() * 4 for p in net.parameters() if p.requires_grad]
    compute = 32 * flops_per_sample(net, inputs) / rate
    return Profile.on_paper(sizes, compute / 3, 2 * compute / 3, 0.0, 32,
                            {"model": f"mlstm {units}"}, backward_shares(net, inputs))


def sentiment_rows() -> list[dict]:
    """The two directions, each at every rate of :data:`SENTIMENT_RATES`: 128 GPUs over
    4 x 100 Gbit/s InfiniBand a machine against 10 Gbit/s Ethernet (TCP), and the
    8,192-unit mLSTM against the 4,096 (over InfiniBand)."""
    gpus, hosts = 128, 16
    effs = {}
    for units in (4096, 8192):
        for rate in SENTIMENT_RATES:
            prof = mlstm_profile(units, rate)
            for link, bits, transport in (("ib", 400e9, "ib"), ("ethernet", 10e9, "tcp")):
                cal = on_link(GPU, bits, transport, nccl_ring_latency(8, hosts, "nvlink")
                              / (2 * (gpus - 1)))
                cl = Cluster.of(hosts=hosts, workers_per_host=8, link_bits=bits)
                effs[units, rate, link] = simulate(prof, cl, "ring", cal, steps=3,
                                                   inside=NVLINK).efficiency
    ib_better = all(effs[4096, r, "ib"] > effs[4096, r, "ethernet"] for r in SENTIMENT_RATES)
    larger = [effs[8192, r, "ib"] - effs[4096, r, "ib"] for r in SENTIMENT_RATES]
    return [
        {"setting": "sentiment-discovery, mLSTM 4096 (128 GPUs): InfiniBand over 10 GbE",
         "published": "better", "predicted": "better" if ib_better else "not better",
         "within": ib_better,
         "efficiency": {f"{r / 1e12:g} TFLOP/s": {"ib": effs[4096, r, "ib"],
                                                  "ethernet": effs[4096, r, "ethernet"]}
                        for r in SENTIMENT_RATES}, "terms": []},
        {"setting": "sentiment-discovery, mLSTM 8192 over 4096 (128 GPUs, InfiniBand)",
         "published": "better", "predicted": "better" if min(larger) > 0 else "not better",
         "within": min(larger) > 0,
         "efficiency": {f"{r / 1e12:g} TFLOP/s": {"4096": effs[4096, r, "ib"],
                                                  "8192": effs[8192, r, "ib"]}
                        for r in SENTIMENT_RATES},
         "terms": [{"term": f"better by {100 * min(larger):.1f} to {100 * max(larger):.1f} "
                            f"points only: gradients and FLOPs both grow as the units "
                            f"squared, and the larger amortizes the ring's latency over "
                            f"4x the bytes; a larger gain would need each size's own "
                            f"step time, which is not published"}]}]


def published() -> list[dict]:
    """Each published setting: its cluster, gradients, published compute, published and
    predicted efficiency, what bounds the prediction, and the ladder of terms that
    took the simulator's figure to the prediction."""
    return horovod_rows() + ddp_rows() + byteps_rows() + sentiment_rows()


def _row(setting: str, cluster: str, prof: Profile, published_eff: float,
         rungs: list[tuple[str, float]]) -> dict:
    predicted = rungs[-1][1]
    return {"setting": setting, "cluster": cluster,
            "gradient_mb": sum(prof.param_bytes) / 1e6,
            "compute_ms": prof.compute_s * 1e3, "published": published_eff,
            "predicted": predicted, "points_off": 100 * (predicted - published_eff),
            "within": abs(predicted - published_eff) <= 0.03,
            "terms": ladder(rungs, published_eff)}


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
                # (the PS round closed-form, as advise --max-workers prices it: events
                # among hundreds of workers take minutes)
                ps = simulate(pr, Cluster.of(hosts=n // 4, workers_per_host=4, link_bits=rate,
                                             servers=k, placement="own-hosts"), "ps", GPU,
                              steps=3, fluid=True)
                cells.append(f"{ring.efficiency:.0%} / {ps.efficiency:.0%}")
            rows.append([name, f"{rate / 1e9:g} Gbit/s", *cells])
    return rows


def md(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def _cell(v) -> str:
    return f"{v:.1%}" if isinstance(v, float) else str(v)


def main() -> int:
    rows = published()
    if "--json" in sys.argv[1:]:  # rows of {setting, published, predicted, within, ...}
        print(json.dumps(rows, indent=1))
        return 0
    print(md(["published setting", "published", "the simulator alone", "predicted, every "
              "term", "points off", "within 3 points"],
             [[r["setting"], _cell(r["published"]),
               _cell(r["terms"][0]["predicted"]) if "predicted" in (r["terms"] or [{}])[0]
               else "", _cell(r["predicted"]),
               f"{r['points_off']:+.1f}" if "points_off" in r else "",
               "yes" if r["within"] else "no"] for r in rows]))
    print()
    print("Scaling efficiency predicted, ring / sharded PS (one server host per worker "
          "host, BytePS's setting), 4 GPUs per host:")
    print()
    print(md(["model", "link", "8 workers", "32", "128", "256"], beyond()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
