"""The sections of a run's config: one small frozen dataclass per concern, each field a
flag of ``psring run`` with its help text; :class:`psring.config.RunConfig` is their
composition, so its fields stay flat (``cfg.lr``, ``cfg.hosts``).

A section is a run of consecutive fields in the order manifests have always recorded
them (``manifest.json`` and ``launch.json`` are read back by reports and ``--resume``),
so a concern split in two runs (the device, the gradients, the run) is two classes that
share a ``title``: one group of ``psring run --help`` each title.

    >>> [s.__name__ for s in SECTIONS][:3]
    ['Parallelism', 'Model', 'Data']
    >>> [s.__name__ for s in SECTIONS if s.title == "device"]
    ['TorchDevice', 'DeviceMode']
    >>> own_fields(DeviceMode)
    ['compute', 'device_profile', 'device_speed', 'time_scale', 'device_link']

``Literal`` fields list their choices: ``RunConfig`` refuses other values, and argparse
offers them (``--device {auto,cpu,cuda}``) unless a field says ``argparse_choices=False``
(``--update-on``, whose empty default, the strategy's own choice, is no value to give).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal


def _flag(help: str, **kw: Any) -> dict:
    return {"help": help, **kw}


@dataclass(frozen=True)
class Parallelism:
    """What is compared: the strategy and its data-parallel workers."""

    title: ClassVar[str] = "strategy"
    strategy: str = field(default="single", metadata=_flag(
        "training strategy (see `psring strategies`)"))
    workers: int = field(default=1, metadata=_flag(
        "number of worker processes (data-parallel ranks); under torchrun taken from WORLD_SIZE"))


@dataclass(frozen=True)
class Model:
    """The model every worker trains, and its size."""

    title: ClassVar[str] = "model"
    model: str = field(default="mlp", metadata=_flag(
        "mlp, cnn, resnet18, resnet50, resnet101, vgg11, vgg16, mlstm, gpt (`psring models` lists "
        "them), or your own as package.module:factory (examples/my_model.py)"))
    width: int = field(default=0, metadata=_flag(
        "model width: hidden units (mlp, mlstm), channels (cnn), base channels (resnet, "
        "vgg; 64 = the paper's), embedding (gpt); 0 = the model's default"))
    depth: int = field(default=0, metadata=_flag(
        "model depth: hidden layers (mlp), conv blocks (cnn), layers (mlstm), blocks "
        "(gpt); 0 = the model's default"))


@dataclass(frozen=True)
class Data:
    """The data set, and the shape of the synthetic one."""

    title: ClassVar[str] = "data"
    data: str = field(default="synthetic", metadata=_flag(
        "data set: synthetic, digits (needs the [digits] extra) or a path to an .npz with "
        "arrays x and y"))
    samples: int = field(default=4096, metadata=_flag("rows in the synthetic data set"))
    features: int = field(default=256, metadata=_flag(
        "input features of the synthetic data set (a perfect square for cnn)"))
    classes: int = field(default=10, metadata=_flag(
        "classes of the synthetic data set (the vocabulary, for token models)"))
    image_size: int = field(default=32, metadata=_flag(
        "side of the synthetic images for image models (resnet, vgg; 224 = ImageNet's)"))
    seq_len: int = field(default=32, metadata=_flag(
        "tokens per sequence for sequence models (mlstm, gpt)"))


@dataclass(frozen=True)
class Evaluation:
    """Held-out rows, how often they are evaluated, and the accuracy to reach."""

    title: ClassVar[str] = "evaluation"
    eval_samples: int = field(default=1024, metadata=_flag(
        "held-out rows, never trained on, that evaluations use (a synthetic set gets them "
        "on top of --samples; a file gives up to a fifth of its rows); 0 = no evaluation"))
    eval_every: int = field(default=0, metadata=_flag(
        "evaluate on the held-out rows before the first step and every N optimizer steps "
        "(and after the last), outside the step timing, into evals.jsonl; 0 = about ten "
        "times per run (every max(1, steps // 10) steps)"))
    target_accuracy: float = field(default=0.0, metadata=_flag(
        "held-out accuracy whose first evaluation at or above it ends the time to "
        "accuracy (MLPerf's definition); reports show it per strategy; 0 = none"))


@dataclass(frozen=True)
class Optimization:
    """Batches, steps and SGD's settings."""

    title: ClassVar[str] = "optimization"
    batch_size: int = field(default=64, metadata=_flag(
        "GLOBAL batch per micro-step, split evenly across the workers"))
    steps: int = field(default=20, metadata=_flag(
        "optimizer steps to run; under psring launch the most a script's run takes (left "
        "out there: as many as the script trains)"))
    accumulate: int = field(default=1, metadata=_flag(
        "micro-batches per optimizer step; gradients are synchronized only on the last one"))
    lr: float = field(default=0.05, metadata=_flag("learning rate"))
    momentum: float = field(default=0.9, metadata=_flag("SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=_flag("SGD weight decay"))
    seed: int = field(default=0, metadata=_flag("seed for the data and the initial parameters"))


@dataclass(frozen=True)
class TorchDevice:
    """The torch device each worker computes on."""

    title: ClassVar[str] = "device"
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=_flag(
        "cpu, cuda, or auto (cuda when available)"))


@dataclass(frozen=True)
class Buckets:
    """How the backward pass's gradients are bucketed for sending."""

    title: ClassVar[str] = "gradients"
    bucket_mb: float = field(default=25.0, metadata=_flag(
        "gradient bucket size in MB for bucketed strategies (DDP's bucket_cap_mb)"))


@dataclass(frozen=True)
class Servers:
    """The parameter servers of ps, async-ps and byteps."""

    title: ClassVar[str] = "servers"
    servers: int = field(default=1, metadata=_flag(
        "parameter servers the launcher starts for ps/async-ps/byteps (parameters sharded "
        "across them)"))
    server_addrs: str = field(default="", metadata=_flag(
        "comma-separated addresses of running parameter servers (psring server) to use "
        "instead of starting them, e.g. tcp://10.0.0.5:5555,tcp://10.0.0.6:5555"))
    transport: Literal["auto", "tcp", "ipc"] = field(default="auto", metadata=_flag(
        "ps/async-ps/byteps: how workers reach the servers psring starts: ipc (Unix domain "
        "sockets, one host; less kernel work per message than TCP), tcp (loopback TCP, as "
        "across hosts), auto = ipc on Linux without emulated hosts, else tcp"))
    secret_file: str = field(default="", metadata=_flag(
        "ps/async-ps/byteps: file holding the servers' shared secret; every message is then signed "
        "(HMAC-SHA256). Default: the environment variable PSRING_SECRET, else none. Needed "
        "for --server-addrs beyond loopback"))
    max_staleness: int = field(default=-1, metadata=_flag(
        "async-ps: most updates a worker's gradient may be behind (-1 = unbounded)"))


@dataclass(frozen=True)
class Gradients:
    """How the workers' gradients are cast, weighed and combined, and where the update runs."""

    title: ClassVar[str] = "gradients"
    compress: Literal["none", "fp16", "bf16"] = field(default="none", metadata=_flag(
        "cast what is sent to fp16 or bf16 (half the bytes; allreduce, ddp, ps, async-ps; "
        "computation and the servers' state stay float32)"))
    worker_batch: str = field(default="", metadata=_flag(
        "uneven workers (HetSeq): each worker's share of --batch-size, comma-separated in "
        "rank order (e.g. 48,16 for a worker 3x as fast), or proportional:RUN_DIR for "
        "shares in proportion to the speeds measured in an earlier run (its workers' "
        "median forward + backward); gradients are weighed by samples, so a synchronous "
        "strategy still trains what single trains on the global batch. Default: equal "
        "shares"))
    reduce: Literal["sum", "adasum"] = field(default="sum", metadata=_flag(
        "allreduce, hallreduce: how the workers' gradients combine: sum (their average, what "
        "single computes on the global batch) or adasum (Maleki et al.'s adaptive sum, as in "
        "Horovod: orthogonal gradients add, equal ones average; a power-of-two --workers; "
        "psring.comm.adasum); with hallreduce, Adasum across a power-of-two number of hosts of "
        "each host's average"))
    update_on: Literal["", "server", "worker"] = field(default="", metadata=_flag(
        "byteps: where the optimizer runs: server (the servers update the parameters, as "
        "for ps) or worker (BytePS's summation servers only add; every worker updates its "
        "own copy). Default: the strategy's only choice (byteps: server)",
        argparse_choices=False))


@dataclass(frozen=True)
class ClusterFlags:
    """The hosts the workers are spread over (emulated on this machine) and their links."""

    title: ClassVar[str] = "cluster"
    hosts: int = field(default=1, metadata=_flag(
        "emulated hosts to spread the workers over: Linux network namespaces joined by one "
        "switch, each host's link shaped to --link (docs/emulation.md); 1 = this machine's "
        "own network"))
    workers_per_host: int = field(default=0, metadata=_flag(
        "workers on each emulated host, filled in rank order (without --hosts: as many "
        "hosts as that takes); 0 = spread evenly over --hosts"))
    link: str = field(default="", metadata=_flag(
        "rate of every emulated host's link, each direction, in tc's syntax: 100mbit, 1gbit, "
        "10gbit, ...; empty = unshaped (as fast as the CPU moves packets)"))
    delay: str = field(default="", metadata=_flag(
        "one-way delay added to each direction of every emulated link, e.g. 100us, 2ms "
        "(a user-space link: psring.cluster.link)"))
    server_placement: Literal["colocated", "own-hosts"] = field(
        default="colocated", metadata=_flag(
            "ps/async-ps/byteps with --hosts: colocated (servers spread over the workers' "
            "hosts, sharing their links) or own-hosts (each server on a host of its own, "
            "with its own link)"))
    slow_worker: str = field(default="", metadata=_flag(
        "I:FACTOR makes worker I's compute FACTOR times slower (straggler experiments)"))


@dataclass(frozen=True)
class Run:
    """The run directory, waits, the rendezvous, threads and checkpoints."""

    title: ClassVar[str] = "run"
    out: str = field(default="", metadata=_flag(
        "run directory (default: runs/<strategy>-w<workers>-<time>)"))
    timeout: float = field(default=300.0, metadata=_flag(
        "seconds any blocking wait may take before the run fails"))
    master_addr: str = field(default="127.0.0.1", metadata=_flag(
        "address of rank 0's rendezvous store"))
    master_port: int = field(default=0, metadata=_flag(
        "port of rank 0's rendezvous store; 0 = pick a free one"))
    threads: int = field(default=0, metadata=_flag(
        "torch threads per worker; 0 = cores divided by workers on this host (at least 1)"))
    checkpoint_every: int = field(default=0, metadata=_flag(
        "write a checkpoint every N optimizer steps (and at the end) into DIR/checkpoints; "
        "0 = never"))
    resume: str = field(default="", metadata=_flag(
        "continue the run in this directory from its last complete checkpoint; its other "
        "settings are the run's own unless given again"))


@dataclass(frozen=True)
class DeviceMode:
    """A timing-only run of an accelerator cluster: the device's times replace the compute."""

    title: ClassVar[str] = "device"
    compute: Literal["real", "device"] = field(default="real", metadata=_flag(
        "real: each worker computes on this machine; device: each worker's forward, "
        "backward and optimizer step take a device's times (--device-profile) as waits, "
        "its communication real: a timing-only run of an accelerator cluster "
        "(docs/emulation.md)"))
    device_profile: str = field(default="", metadata=_flag(
        "--compute device: the device's times, a profile directory from `psring profile`"))
    device_speed: float = field(default=1.0, metadata=_flag(
        "--compute device: the device's speed relative to the profile's (2 = twice as fast)"))
    time_scale: float = field(default=1.0, metadata=_flag(
        "--compute device: run S times slower than the cluster described, the device's "
        "times x S and every emulated link's rate / S, for links faster than this machine "
        "can carry; step times are recorded divided by S (docs/emulation.md)"))
    device_link: str = field(default="", metadata=_flag(
        "--compute device, hosts of several workers: the hosts' own interconnect "
        "(nvlink, nvlink3, nvlink4, pcie, pcie4, pcie5: psring.comm.interconnect.LINKS; "
        "or a rate such as 1200gbit): the traffic among a host's workers (byteps's and "
        "hallreduce's collectives, a flat ring's hops in allreduce and ddp) takes its "
        "time, as on GPUs, instead of running over this machine's loopback and cores "
        "(psring.comm.interconnect, psring.comm.hostring); a parameter server's worker "
        "(ps, async-ps, byteps) copies its gradients to host memory and the parameters "
        "back at the host's PCIe rate. Default: loopback, the profile's host copies"))


@dataclass(frozen=True)
class Tracing:
    """Spans of every step, for a picture of the run."""

    title: ClassVar[str] = "run"
    trace: bool = field(default=False, metadata=_flag(
        "record spans of every step and write trace.json (Chrome trace / Perfetto) in the "
        "run directory; `psring trace DIR` renders it as a PNG"))


@dataclass(frozen=True)
class Faults:
    """Faults placed from the command line, and what the run does when a process dies."""

    title: ClassVar[str] = "faults"
    kill_worker: str = field(default="", metadata=_flag(
        "I:STEP kills worker I (SIGKILL) once it has finished step STEP - 1, so it never "
        "finishes STEP; a worker alone on an emulated host takes the host down with it "
        "(its link cut first, so its peers hear nothing). Repeatable, or comma-separated",
        repeatable=True))
    kill_server: str = field(default="", metadata=_flag(
        "K:STEP kills parameter server K (SIGKILL) as worker 0 begins step STEP (worker "
        "0 waits for it; a server alone on an emulated host: the host). Repeatable, or "
        "comma-separated", repeatable=True))
    max_restarts: int = field(default=0, metadata=_flag(
        "when a worker or server dies and the run cannot go on without it, restart the "
        "whole run from its last complete "
        "checkpoint (--checkpoint-every; from the start when none is written yet), at "
        "most K times; each restart is logged in DIR/restarts.jsonl. 0 = fail-stop. "
        "Under torchrun give torchrun --max-restarts K too: its restarts then resume "
        "from the newest checkpoint every host holds"))
    backup_workers: int = field(default=0, metadata=_flag(
        "ps: each step the servers take the gradients of the first N - B workers to "
        "finish pushing it (the same workers for every key) and drop the others' "
        "(backup workers, Chen et al. 2016); a straggler or a lost worker costs at most "
        "its share, and the run goes on past up to B lost workers. 0 = wait for all"))


@dataclass(frozen=True)
class Sampling:
    """Which training samples the batches are drawn from (after the sections above:
    manifests keep their order)."""

    title: ClassVar[str] = "data"
    eliminate_every: int = field(default=0, metadata=_flag(
        "sample elimination for margin classifiers (--model svm): every K steps each "
        "worker scores the training set, and samples whose margin is 1 or more leave "
        "the batches until the next check brings back those that fell inside it. "
        "0 = off"))


@dataclass(frozen=True)
class Links:
    """Emulated links under pressure: loss and shallow queues (after the sections above:
    manifests keep their order)."""

    title: ClassVar[str] = "links"
    loss: float = field(default=0.0, metadata=_flag(
        "fraction of IPv4 packets each direction of every emulated link drops, in [0, 1), "
        "e.g. 0.01; seeded by --seed, so runs of one seed drop the same packet numbers "
        "(a user-space link, --loss-in; the drops are logged in DIR/links)"))
    loss_burst: float = field(default=1.0, metadata=_flag(
        "mean number of packets --loss drops in a row: 1 = independent losses, more = "
        "bursts (a Gilbert-Elliott chain with --loss as its long-run rate)"))
    loss_in: Literal["forwarder", "kernel"] = field(default="forwarder", metadata=_flag(
        "where --loss drops: forwarder (a user-space process per host: seeded, bursts, "
        "--delay, --switch priority, the drops logged; a frame costs it a few "
        "microseconds of a core, which caps the links it carries) or kernel (a BPF "
        "classifier on each link's far end: independent losses at any rate, not seeded, "
        "counted)"))
    tcp_rto_min: str = field(default="", metadata=_flag(
        "the emulated hosts' least TCP retransmission timeout (net.ipv4.tcp_rto_min_us "
        "in each host; tc's times: 5ms), as a datacenter may lower Linux's 200ms; slowed "
        "by --time-scale as the links are. Empty = the kernel's"))
    link_buffer: str = field(default="", metadata=_flag(
        "bytes each emulated link's queue holds before it drops (tc's sizes: 64kb, 1mb); "
        "a shallow switch port, for incast; empty = deep (100 ms of the rate, at least "
        "4 MiB: no drops)"))
    switch: Literal["fifo", "priority"] = field(default="fifo", metadata=_flag(
        "the emulated switch's ports: fifo (a loss or a full queue takes whatever packet "
        "comes), or priority (DLCP's: bounded-loss datagrams carry a priority from their "
        "layer and gradients' magnitude, and a loss or a full queue takes the lowest "
        "first; TCP ranks above them). priority needs --loss-tolerance"))
    credit_window: str = field(default="", metadata=_flag(
        "with --loss-tolerance: receiver-driven pacing (NDP's, Homa's): each receiver (a "
        "parameter server, or a transpose all-reduce's rank) grants its bounded-loss "
        "senders the datagrams they may send, keeping at most this many bytes (tc's "
        "sizes: 64kb) granted and not yet arrived over all of them, so N senders into one "
        "port never exceed it; a "
        "lost grant or datagram costs a bounded wait. Empty: every sender paces itself "
        "to its own link"))
    loss_tolerance: float = field(default=0.0, metadata=_flag(
        "ps, async-ps, byteps: push gradients as UDP datagrams and let each push lose at "
        "most this fraction of its elements (DLCP's bounded loss): the servers sum what "
        "arrived, scaled to stay unbiased, and ask for the rest again only beyond the "
        "bound; pulls lose nothing (sync runs: as datagrams, asked again after a few "
        "ms). allreduce: a transpose all-reduce whose scatter "
        "goes as datagrams under the same bound and whose all-gather is reliable "
        "(OptiReduce's). The delivered fraction is logged per step. 0 = every byte "
        "over TCP"))


#: the sections in the order of their fields (RunConfig's, the manifests')
SECTIONS: tuple[type, ...] = (Parallelism, Model, Data, Evaluation, Optimization, TorchDevice,
                              Buckets, Servers, Gradients, ClusterFlags, Run, DeviceMode, Tracing,
                              Faults, Sampling, Links)


def own_fields(section: type) -> list[str]:
    """The fields a section declares itself (a dataclass's ``fields`` would also list
    inherited ones; sections inherit none, but RunConfig inherits them all)."""
    own = section.__dict__.get("__annotations__", {})
    return [f.name for f in fields(section) if f.name in own]

