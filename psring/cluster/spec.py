"""The cluster a run runs on, described once: hosts, workers per host, the link between
hosts, its delay, and where the parameter servers are.

Pure (no torch, no processes, no syscalls): computed from a run's config alone, so the
launcher, every worker (its manifest), the emulated network (psring.cluster.emulate), the cost
model, the simulator, ``psring advise`` and the reports all agree on one cluster.

    >>> c = Cluster(workers=4, hosts=2, servers=2, link="1gbit")
    >>> c.worker_host, c.server_host, c.link_bits
    ((0, 0, 1, 1), (0, 1), 1000000000.0)
    >>> c.text()
    '2 hosts, 1gbit links, servers colocated'

One host (``hosts=1`` and no server on a host of its own) is this machine, with no
network emulated; more are emulated hosts in 198.18.0.0/15, RFC 2544's range for
benchmarking network devices (docs/emulation.md).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlparse

from psring.errors import ConfigError
from psring.units import format_rate, parse_delay, parse_rate, parse_size

#: seconds of link time a paced datagram sender may run ahead or catch up on at a deep
#: port (Cluster.pacing_burst): a busy process's threads wake late
PACING_BURST_S = 0.004

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

#: the emulated network: RFC 2544's benchmarking range, never a real network's
NETWORK = ipaddress.ip_network("198.18.0.0/15")
#: colocated: server k on worker host k mod hosts; own-hosts: each on a host of its own
PLACEMENTS = ("colocated", "own-hosts")
#: a run's cluster settings as a config records them, for configs (manifests) written
#: before a setting existed: every run then was on this machine
DEFAULTS: Mapping[str, Any] = {"workers": 1, "hosts": 1, "workers_per_host": 0, "link": "",
                               "delay": "", "servers": 1, "server_placement": "colocated",
                               "master_addr": "127.0.0.1", "time_scale": 1.0,
                               "loss": 0.0, "loss_burst": 1.0, "link_buffer": "", "seed": 0,
                               "switch": "fifo", "loss_in": "forwarder",
                               "tcp_rto_min": ""}
#: the emulated switch's ports: one queue dropping whatever comes (fifo), or DLCP's
#: priorities for bounded-loss datagrams (psring.cluster.link, psring.comm.lossy.Marks)
SWITCHES = ("fifo", "priority")
#: where --loss drops: a forwarder per host in user space (seeded, bursts, delay, the
#: priority switch, a trace), or the kernel (independent losses at any rate the links
#: carry, no Python per frame: psring.cluster.link.kernel_loss)
LOSS_PATHS = ("forwarder", "kernel")

def link_key(bits: float, delay_s: float = 0.0) -> str:
    """How a calibration names a link: its rate, and its delay when it has one."""
    return format_rate(bits) + (f"+{round(delay_s * 1e6)}us" if delay_s else "")


def in_network(endpoint: str) -> bool:
    """Is a tcp:// endpoint's host inside the emulated network's range?"""
    try:
        return ipaddress.ip_address(urlparse(endpoint).hostname or "") in NETWORK
    except ValueError:
        return False


def host_address(index: int) -> str:
    """Emulated host ``index``'s address (host-0 is the network's first)."""
    return str(NETWORK.network_address + 1 + index)


def derived_hosts(workers: int, hosts: int, per_host: int) -> int:
    """--workers-per-host G without --hosts: as many hosts as the workers need."""
    if per_host > 0 and hosts == 1 and workers > per_host:
        return -(-workers // per_host)
    return hosts


def worker_counts(n: int, hosts: int, per_host: int) -> list[int]:
    """Workers on each host: ``per_host`` each (the last host gets the rest), or spread
    evenly, the first ``n mod hosts`` hosts one more."""
    if per_host:
        return [min(per_host, n - h * per_host) for h in range(hosts)]
    return [n // hosts + (1 if h < n % hosts else 0) for h in range(hosts)]


@dataclass
class Host:
    name: str
    index: int
    address: str
    #: what runs there, e.g. ["worker-0", "server-1"]
    processes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Cluster:
    """Where every process of a run lives, and what joins the hosts. Validated on
    construction, with errors that name the flags to change."""

    workers: int = 1
    #: hosts holding workers; servers of ``own-hosts`` placement get more besides
    hosts: int = 1
    #: workers on each host (the last gets the rest); 0: spread evenly
    workers_per_host: int = 0
    #: each host link's rate, as tc reads it ('1gbit'); '': unshaped
    link: str = ""
    #: one-way delay added to each link direction ('1ms'; psring.cluster.link); '': none
    delay: str = ""
    #: fraction of IPv4 packets each link direction drops (psring.cluster.link)
    loss: float = 0.0
    #: mean length of a run of lost packets; 1 = independent losses
    loss_burst: float = 1.0
    #: bytes each link's queue holds before it drops ('64kb'); '': deep (tbf_params)
    link_buffer: str = ""
    #: seeds the links' loss models (the run's --seed)
    seed: int = 0
    #: --switch: "fifo", or "priority" (DLCP's: the lowest-priority datagrams go first)
    switch: str = "fifo"
    #: --loss-in: "forwarder" or "kernel" (LOSS_PATHS)
    loss_in: str = "forwarder"
    #: --tcp-rto-min: the emulated hosts' TCP retransmission floor ('5ms'); '': Linux's
    tcp_rto_min: str = ""
    #: parameter servers the run starts (0: a strategy without them)
    servers: int = 0
    placement: str = "colocated"
    #: the one host's address when nothing is emulated (the rendezvous address)
    local_address: str = "127.0.0.1"
    #: --time-scale S: the emulation runs S times slower than the cluster it stands for
    #: (psring.train.device): its links carry link/S and its delays last S times longer
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("workers", "hosts", "workers_per_host", "servers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number "
                                  f"(got {v!r}).")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {self.workers}).")
        if self.hosts < 1:
            raise ConfigError(f"--hosts must be at least 1 (got {self.hosts}).")
        if self.hosts > self.workers:
            raise ConfigError(
                f"--hosts {self.hosts} is more than --workers {self.workers}: every emulated "
                f"host holds at least one worker. Use --hosts {self.workers} or fewer (servers "
                f"of --server-placement own-hosts get hosts of their own besides these).")
        if self.workers_per_host < 0:
            raise ConfigError(f"--workers-per-host must be >= 0 (0 = spread evenly; got "
                              f"{self.workers_per_host}).")
        if self.workers_per_host:
            g, h, n = self.workers_per_host, self.hosts, self.workers
            if g * h < n or g * (h - 1) >= n:
                raise ConfigError(
                    f"--workers-per-host {g} on --hosts {h} does not fit --workers {n}: "
                    f"{h} host(s) of {g} {'hold fewer' if g * h < n else 'leave a host empty'}"
                    f"; use --hosts {-(-n // g)}, or drop --workers-per-host to spread them "
                    f"evenly.")
        if self.servers < 0:
            raise ConfigError(f"--servers must be at least 1 (got {self.servers}).")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--server-placement must be one of {', '.join(PLACEMENTS)} "
                              f"(got {self.placement!r}).")
        scale = self.time_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not 0 < scale < float("inf"):
            raise ConfigError(f"--time-scale must be a positive number (got {scale!r}).")
        self.link_bits, self.delay_s, self.buffer_bytes  # noqa: B018 - errors now
        self._check_loss()
        if self.tcp_rto_min and not 0 < self.tcp_rto_min_s <= 120:
            raise ConfigError(f"--tcp-rto-min is the hosts' least retransmission timeout, "
                              f"above 0 and at most 120 s: e.g. 5ms (Linux's default is "
                              f"200ms; got {self.tcp_rto_min!r}).")
        if (self.link or self.delay or self.loss or self.link_buffer
                or self.tcp_rto_min) and not self.emulated:
            raise ConfigError(
                "--link, --delay, --loss, --link-buffer and --tcp-rto-min shape the links "
                "between emulated hosts and their TCP, and with --hosts 1 (and servers, if "
                "any, colocated) nothing crosses one; give --hosts 2 or more, or "
                "--server-placement own-hosts.")
        if self.link_buffer and not self.link:
            raise ConfigError("--link-buffer is the queue of a shaped link: give --link "
                              "RATE too (an unshaped link queues nothing).")
        if self.switch not in SWITCHES:
            raise ConfigError(f"--switch is one of {', '.join(SWITCHES)} (got "
                              f"{self.switch!r}).")
        if self.switch == "priority" and not (self.emulated and (self.loss or self.link)):
            raise ConfigError("--switch priority decides which packets an emulated "
                              "switch drops: give emulated hosts (--hosts 2 or more) whose "
                              "links drop, with --loss F or a shaped --link RATE (its "
                              "queue).")

    def _check_loss(self) -> None:
        loss, burst = self.loss, self.loss_burst
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss < 1:
            raise ConfigError(f"--loss is the fraction of packets each link direction drops, "
                              f"in [0, 1): e.g. 0.01 for 1% (got {loss!r}).")
        if isinstance(burst, bool) or not isinstance(burst, (int, float)) \
                or not 1 <= burst < float("inf"):
            raise ConfigError(f"--loss-burst is the mean number of packets lost in a row, "
                              f">= 1 (1 = independent losses; got {burst!r}).")
        if burst != 1 and not loss:
            raise ConfigError("--loss-burst shapes the losses of --loss: give --loss too.")
        self._check_loss_in()
        if loss > burst / (1 + burst):
            # (the chain's bad state would have to be entered with probability above 1)
            raise ConfigError(f"--loss {loss:g} in bursts of {burst:g} cannot be: bursts "
                              f"of B packets lose at most B / (B + 1) of them; lower --loss "
                              f"or raise --loss-burst.")

    def _check_loss_in(self) -> None:
        if self.loss_in not in LOSS_PATHS:
            raise ConfigError(f"--loss-in is one of {', '.join(LOSS_PATHS)} (got "
                              f"{self.loss_in!r}).")
        if self.loss_in == "forwarder" or not self.loss:
            return  # (without --loss nothing drops: a sweep's lossless row)
        why = ("--loss-burst" if self.loss_burst != 1 else "--delay" if self.delay
               else "--switch priority" if self.switch != "fifo" else "")
        if why:
            raise ConfigError(f"--loss-in kernel drops independent packets only; {why} "
                              f"needs the user-space forwarder: drop --loss-in kernel "
                              f"(at link rates a forwarder carries), or drop {why}.")

    # -- from what a run records -----------------------------------------------------
    @classmethod
    def from_config(cls, cfg: RunConfig, uses_servers: bool) -> "Cluster":
        """From a RunConfig, or a run's config as its manifest stores it (a dict; older
        runs lack the newer settings: DEFAULTS). ``uses_servers``: the strategy's."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda k, d: getattr(cfg, k, d)
        v = {k: get(k, d) for k, d in DEFAULTS.items()}
        servers = v["servers"] if uses_servers else 0
        # without its own servers, nothing is placed: own-hosts would place nothing
        placement = v["server_placement"] if servers else "colocated"
        return cls(workers=v["workers"], hosts=v["hosts"],
                   workers_per_host=v["workers_per_host"], link=v["link"], delay=v["delay"],
                   servers=servers, placement=placement, local_address=v["master_addr"],
                   time_scale=v["time_scale"], loss=v["loss"], loss_burst=v["loss_burst"],
                   link_buffer=v["link_buffer"], seed=v["seed"], switch=v["switch"],
                   loss_in=v["loss_in"], tcp_rto_min=v["tcp_rto_min"])

    @classmethod
    def of(cls, hosts: int = 1, workers_per_host: int = 1, link_bits: float | None = None,
           delay_s: float = 0.0, servers: int = 1, placement: str = "colocated",
           loss: float = 0.0) -> "Cluster":
        """A cluster in numbers, for prediction (the simulator, ``psring advise``): hosts
        of ``workers_per_host`` workers each, links of ``link_bits``/s (None: unshaped)."""
        if isinstance(workers_per_host, bool) or not isinstance(workers_per_host, int) \
                or workers_per_host < 1:
            raise ConfigError(f"workers per host must be a whole number >= 1 (got "
                              f"{workers_per_host!r}).")
        if link_bits is not None and not link_bits > 0:
            raise ConfigError(f"a link's rate must be positive (got {link_bits!r} bit/s).")
        if not delay_s >= 0:
            raise ConfigError(f"a link's delay must be >= 0 (got {delay_s!r} s).")
        multi = hosts > 1 or (placement == "own-hosts" and servers > 0)
        return cls(workers=hosts * workers_per_host, hosts=hosts,
                   workers_per_host=workers_per_host if hosts > 1 else 0,
                   link=format_rate(link_bits) if link_bits and multi else "",
                   delay=f"{delay_s * 1e6:g}us" if delay_s and multi else "",
                   servers=servers, placement=placement, loss=loss if multi else 0.0)

    @classmethod
    def bare(cls, hosts: int, link: str = "", delay: str = "", loss: float = 0.0,
             loss_burst: float = 1.0, seed: int = 0, link_buffer: str = "",
             switch: str = "fifo", loss_in: str = "forwarder",
             tcp_rto_min: str = "") -> "Cluster":
        """``hosts`` emulated hosts, one process slot each (calibration, benchmarks)."""
        return cls(workers=hosts, hosts=hosts, link=link, delay=delay, loss=loss,
                   loss_burst=loss_burst, seed=seed, link_buffer=link_buffer, switch=switch,
                   loss_in=loss_in, tcp_rto_min=tcp_rto_min)

    def replace(self, **changes: Any) -> "Cluster":
        return dataclasses.replace(self, **changes)

    # -- derived ---------------------------------------------------------------------
    @cached_property
    def link_bits(self) -> float | None:
        return parse_rate(self.link) if self.link else None

    @cached_property
    def delay_s(self) -> float:
        return parse_delay(self.delay) if self.delay else 0.0

    @cached_property
    def buffer_bytes(self) -> int | None:
        return parse_size(self.link_buffer) if self.link_buffer else None

    @property
    def pacing_burst(self) -> int:
        """Bytes a paced datagram sender may run ahead of its link's rate, or catch up
        on after a late wake-up, in one go: half of a --link-buffer port, else
        PACING_BURST_S of the rate (the default port holds 100 ms); 0 without emulated
        links (psring.comm.lossy)."""
        bits = self.emulated_link_bits
        if not bits:
            return 0
        most = int(bits / 8 * PACING_BURST_S)
        return min(most, self.buffer_bytes // 2) if self.buffer_bytes else most

    @property
    def emulated_link_bits(self) -> float | None:
        """The rate the emulated links are shaped to: --link slowed by --time-scale."""
        return self.link_bits / self.time_scale if self.link_bits else None

    @property
    def emulated_delay_s(self) -> float:
        return self.delay_s * self.time_scale

    @cached_property
    def tcp_rto_min_s(self) -> float:
        """--tcp-rto-min in seconds (0: the kernel's own floor)."""
        return parse_delay(self.tcp_rto_min) if self.tcp_rto_min else 0.0

    @property
    def emulated(self) -> bool:
        """Does the run need an emulated network (more than one host)?"""
        return self.hosts > 1 or (self.placement == "own-hosts" and self.servers > 0)

    @cached_property
    def worker_host(self) -> tuple[int, ...]:
        """Each worker's host, in rank order (see :func:`worker_counts`)."""
        counts = worker_counts(self.workers, self.hosts, self.workers_per_host)
        return tuple(h for h, c in enumerate(counts) for _ in range(c))

    @cached_property
    def server_host(self) -> tuple[int, ...]:
        """Each server's host: ``own-hosts`` puts server k on host ``hosts + k`` (a
        machine of its own); ``colocated`` spreads them over the worker hosts (host k
        mod hosts), as on a cluster without spare machines."""
        if self.placement == "own-hosts":
            return tuple(self.hosts + k for k in range(self.servers))
        return tuple(k % self.hosts for k in range(self.servers))

    @property
    def multi_host(self) -> bool:
        return len({*self.worker_host, *self.server_host}) > 1

    @cached_property
    def host_list(self) -> tuple[Host, ...]:
        """The hosts with what runs on each."""
        procs = [f"worker-{r}" for r in range(self.workers)] + \
                [f"server-{s}" for s in range(self.servers)]
        if not self.emulated:
            return (Host("local", 0, self.local_address, procs),)
        count = self.hosts + (self.servers if self.placement == "own-hosts" else 0)
        hosts = tuple(Host(f"host-{i}", i, host_address(i)) for i in range(count))
        for r, h in enumerate(self.worker_host):
            hosts[h].processes.append(f"worker-{r}")
        for s, h in enumerate(self.server_host):
            hosts[h].processes.append(f"server-{s}")
        return hosts

    # -- what the launcher needs -----------------------------------------------------
    @property
    def master_addr(self) -> str:
        """The rendezvous address: worker 0's host."""
        return self.host_list[self.worker_host[0]].address

    def server_address(self, k: int) -> str:
        return self.host_list[self.server_host[k]].address

    def local_ranks(self, rank: int) -> tuple[int, int]:
        """(LOCAL_RANK, LOCAL_WORLD_SIZE) of a worker: its place among its host's workers."""
        h = self.worker_host[rank]
        mates = [r for r, hh in enumerate(self.worker_host) if hh == h]
        return mates.index(rank), len(mates)

    def host_of(self, process: str) -> Host:
        return next(h for h in self.host_list if process in h.processes)

    # -- what reports show -----------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """For the manifest and reports."""
        return {"emulated": self.emulated,
                "hosts": [dataclasses.asdict(h) for h in self.host_list],
                "worker_hosts": len({*self.worker_host}), "link": self.link or None,
                "link_bits_per_s": self.link_bits, "delay": self.delay or None,
                "loss": self.loss, "loss_burst": self.loss_burst,
                "link_buffer_bytes": self.buffer_bytes, "switch": self.switch,
                "loss_in": self.loss_in, "tcp_rto_min": self.tcp_rto_min or None,
                "server_placement": self.placement if self.servers else None,
                "time_scale": self.time_scale,
                "emulated_link_bits_per_s": self.emulated_link_bits}

    def text(self) -> str:
        """Where a run ran, in a few words: 'this machine', or e.g. '2 hosts, 1gbit
        links' with the servers' placement when it matters."""
        if not self.emulated:
            return "this machine"
        text = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        if self.placement == "own-hosts" and self.servers:
            text += f" + {self.servers} server host{'s' if self.servers > 1 else ''}"
        text += f", {self.link or 'unshaped'} links"
        if self.delay:
            text += f", {self.delay} delay"
        if self.link_buffer:
            text += f", {self.link_buffer} queues"
        if self.switch != "fifo":
            text += f", {self.switch} switch"
        if self.loss:
            text += f", {self.loss:.3g} loss"
            if self.loss_burst != 1:
                text += f" (bursts of {self.loss_burst:g})"
            if self.loss_in != "forwarder":
                text += f" in the {self.loss_in}"
        if self.tcp_rto_min:
            text += f", TCP's floor {self.tcp_rto_min}"
        if self.time_scale != 1:
            text += f", time scale {self.time_scale:g}"
        if self.servers:
            text += f", servers {self.placement}"
        return text
