"""The α-β-γ cost model: predicted communication time per step for each strategy.

    from psring.predict.costmodel import (Calibration, find_calibration, predict_comm,
                                          crossover_bytes)

    path = find_calibration("runs/compare")        # or None: run `psring calibrate`
    cal = Calibration.load(path)
    t = predict_comm("ring", n=2, K=1, M=36e6, cal=cal)   # seconds per step
    m = crossover_bytes("ring", "ps", n=2, K=1, cal=cal)  # bytes, or None

Symbols (docs/cost-model.md has the full story and sources):

- ``n``  workers, ``K`` parameter-server shards (servers), ``M`` gradient bytes per step;
- ``alpha``  seconds per message (latency), ``beta`` seconds per byte on one link
  (1/bandwidth) — the Hockney model t(M) = α + M·β;
- ``gamma``  seconds per byte to reduce (add) locally.

The formulas below are pure functions of these numbers. :class:`Calibration` holds the
numbers measured on this machine by ``psring calibrate`` (``psring.predict.calibrate``):
one α, β pair for ZeroMQ (what the parameter-server strategies use) and one for
torch.distributed's gloo (what ring all-reduce and DDP use), and one γ.

Which formula a strategy follows is its cost model, ``caps.cost_model``
(``psring.strategies.base.Capabilities``): ``"ring"``, ``"ps"``, ``"ps-async"``,
``"byteps"``, ``"hring"`` (hallreduce), or ``None`` when it sends no messages (single,
hogwild); psring.predict.costs.COST_MODELS holds each one's formula and timeline.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from psring.cluster.spec import Cluster, link_key
from psring.errors import ConfigError
from psring.records.runlog import atomic_write_json
from psring.units import payload_beta

#: the built-in cost models' names (``caps.cost_model``): which α-β-γ formula predicts its
#: communication; None: it sends nothing (single) or shares memory (hogwild)
COMM_MODELS = (None, "ring", "hring", "ps", "ps-async", "byteps")

#: the calibration file's name inside a run or comparison directory
CALIBRATION_FILE = "calibration.json"
#: bumped when the file's meaning changes; load() refuses other formats
FORMAT = 1

_FIX = "run `psring calibrate` to measure this machine again"


# -- the formulas -----------------------------------------------------------------------

def ring_allreduce(n: int, M: float, alpha: float, beta: float, gamma: float) -> float:
    """Ring all-reduce of M bytes across n ranks, in seconds.

    ``2(n-1)·α + 2(n-1)/n·M·β + (n-1)/n·M·γ``: a reduce-scatter then an all-gather, each
    n-1 steps that send one M/n chunk per rank; the reduce-scatter adds each received
    chunk (Thakur, Rabenseifner & Gropp, IJHPCA 2005; bandwidth-optimal per Patarasuk &
    Yuan, JPDC 69(2), 2009). One rank communicates nothing: 0.

    gloo's all_reduce may pick recursive halving-doubling instead (latency term
    2·log2(n)·α, same bandwidth term); at n = 2 and 4 the two differ by at most 2α.
    """
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    return 2 * (n - 1) * alpha + 2 * frac * M * beta + frac * M * gamma


def ps_sync(n: int, M: float, K: int, alpha: float, beta: float, gamma: float) -> float:
    """One synchronous parameter-server round per worker step, in seconds.

    ``2α + 2n·M·β/K + (n-1)·M·γ/K``: every worker pushes M and pulls M (two messages:
    2α); the servers' links are the bottleneck — together they receive n·M and send n·M
    bytes (half-duplex view: both directions share the link's time) — and sum n
    gradients (n-1 adds of M). K shards, each with its own link and core, divide the
    server terms (anchors: Hockney α-β; the PS view of BytePS, Jiang et al., OSDI 2020).
    On one host the shards share memory bandwidth and cores, so a measured gain from K
    is capped below K.
    """
    return 2 * alpha + 2 * n * M * beta / K + (n - 1) * M * gamma / K


def ps_async(n: int, M: float, K: int, alpha: float, beta: float, gamma: float) -> float:
    """One asynchronous (Downpour) worker's push and pull, in seconds.

    ``2α + 2n·M·β/K + M·γ/K``. Choice made here: the bandwidth term is the synchronous
    one, because in steady state the server links still carry n pushes and n pulls per n
    worker-steps, so a busy server gives each worker a 1/n share of its link. The γ term
    is the server applying this worker's own push (one pass over M): pushes are applied
    on arrival, never summed with others'. What the model does not show is async's real
    gain — workers do not wait for each other, so a slow worker does not hold up the
    rest — nor its cost, staleness (both are measured per step, not predicted).
    """
    return 2 * alpha + 2 * n * M * beta / K + M * gamma / K


def ps_sync_placed(n: int, M: float, K: int, alpha: float, beta_link: float,
                   beta_local: float, gamma: float, cross: float) -> float:
    """A synchronous parameter-server round with hosts joined by links, in seconds.

    ``2α + 2·max(cross·M·β_link, n·M·β_local/K) + (n-1)·M·γ/K``. The push and then the
    pull (sequential: a pull is answered once every push is summed) each take the longer
    of: the busiest host link, which carries ``cross·M`` bytes in one direction (full
    duplex: each direction on its own; see :func:`ps_link_load`), and a server receiving
    (or sending) its n·M/K bytes through its transport at the loopback β. With every
    process on one host ``cross`` is 0 and this is :func:`ps_sync`."""
    phase = max(cross * M * beta_link, n * M * beta_local / K)
    return 2 * alpha + 2 * phase + (n - 1) * M * gamma / K


def ps_async_placed(n: int, M: float, K: int, alpha: float, beta_link: float,
                    beta_local: float, gamma: float, cross: float) -> float:
    """:func:`ps_async` with hosts joined by links: the links' and servers' load of a
    synchronous round (every worker pushes and pulls once per n worker-steps), the
    server applying only this worker's push."""
    phase = max(cross * M * beta_link, n * M * beta_local / K)
    return 2 * alpha + 2 * phase + M * gamma / K


def host_reduce(G: int, M: float, rs: tuple[float, float], ag: tuple[float, float]) -> float:
    """A host's reduce-scatter then all-gather of M bytes among its G workers, in seconds:
    ``(G-1)·(α_rs + M/G·β_rs) + (G-1)·(α_ag + M/G·β_ag)``, a ring's G-1 steps each on an
    M/G chunk; ``rs`` and ``ag`` are one step's (α, β), its adds included
    (:meth:`Calibration.gloo_step` on loopback; a device link's own α and β, whose sums
    run on the devices). One worker a host: 0."""
    if G <= 1:
        return 0.0
    c = M / G
    return (G - 1) * (rs[0] + c * rs[1]) + (G - 1) * (ag[0] + c * ag[1])


def hring_allreduce(G: int, H: int, M: float, alpha: float, beta: float, gamma: float,
                    inside: float) -> float:
    """Hierarchical all-reduce (hallreduce) on H hosts of G workers, in seconds.

    ``inside`` (the host's reduce-scatter and all-gather: :func:`host_reduce`) ``+
    2(H-1)·α + 2(H-1)/H·M·β + (H-1)/H·M/G·γ``: G rings of H ranks across the hosts, each
    on a 1/G slice, in parallel over each host link, which carries their M/H a step
    (Horovod PR #411's scheme). Against the flat ring over N = GH ranks numbered host by
    host, whose host links carry 2(N-1)/N·M each way, they carry 2(H-1)/H·M, in 2(H-1)
    latency terms instead of 2(N-1)."""
    across = 0.0 if H <= 1 else \
        2 * (H - 1) * alpha + 2 * (H - 1) / H * M * beta + (H - 1) / H * M / G * gamma
    return inside + across


def byteps_sync(hosts: int, M: float, K: int, alpha: float, beta_link: float,
                beta_local: float, gamma: float, cross: float, inside: float) -> float:
    """A synchronous BytePS round (per-host aggregation) on ``hosts`` hosts.

    ``inside + 2α + 2·max(cross·M·β_link, hosts·M·β_local/K) + (hosts-1)·M·γ/K``, with
    ``inside`` the host's reduce-scatter and all-gather (:func:`host_reduce`), then
    :func:`ps_sync_placed` with one pusher per host — each host sends its gradients
    once (its G workers a 1/G part each), so ``cross`` is :func:`ps_link_load` of one
    worker per host, and the servers sum ``hosts`` pushes, not n (Jiang et al., OSDI
    2020, §3)."""
    phase = max(cross * M * beta_link, hosts * M * beta_local / K)
    return inside + 2 * alpha + 2 * phase + (hosts - 1) * M * gamma / K


def ps_link_load(worker_host: list[int], server_host: list[int]) -> float:
    """The most bytes any host link carries in one direction during a PS push (a pull
    mirrors it), as a multiple of M: each worker sends M/K to each of the K servers, and
    a transfer between two processes of one host crosses no link."""
    K = len(server_host)
    egress: dict[int, float] = {}
    ingress: dict[int, float] = {}
    for hw in worker_host:
        for hk in server_host:
            if hw != hk:
                egress[hw] = egress.get(hw, 0.0) + 1 / K
                ingress[hk] = ingress.get(hk, 0.0) + 1 / K
    return max([*egress.values(), *ingress.values(), 0.0])


# -- measured parameters ------------------------------------------------------------------

_NUMBERS = ("zmq_alpha", "zmq_beta", "dist_alpha", "dist_beta", "gamma")
#: the gloo collectives psring's strategies use on one host, each fitted per ring step
GLOO_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass
class Calibration:
    """α, β (per transport) and γ measured on one machine; seconds and seconds/byte."""

    zmq_alpha: float
    zmq_beta: float
    dist_alpha: float
    dist_beta: float
    gamma: float
    #: seconds per float32 byte to cast to float16 (or back): --compress's cost per
    #: message end (psring.predict.simulate); None in calibrations made before it was
    #: measured
    cast: float | None = None
    #: where and when: hostname, ISO time, cores, torch / pyzmq / libzmq versions
    host: str = ""
    time: str = ""
    cores: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    #: message sizes (bytes) of the ping-pongs, and the γ tensor's size
    sizes: list[int] = field(default_factory=list)
    gamma_bytes: int | None = None
    quick: bool = False
    #: what the fit used: "zmq" and "dist" rows [bytes, median one-way s, 25th, 75th
    #: percentile], "gamma" [[bytes, median seconds of one add]], and "dist_allreduce",
    #: "dist_reduce_scatter", "dist_all_gather" [[bytes, median s]]: gloo's own
    #: collectives on 2 ranks (``collectives`` is fitted to them)
    measurements: dict[str, Any] = field(default_factory=dict)
    #: gloo's collectives on loopback, one ring step each: {"all_reduce" |
    #: "reduce_scatter" | "all_gather": [α, β]}, a step on a chunk of c bytes costing
    #: α + c·β, its sums included (see :meth:`gloo_step`); empty in calibrations made
    #: before they were measured
    collectives: dict[str, list[float]] = field(default_factory=dict)
    #: emulated links measured by ``psring calibrate --hosts 2 --link RATE [--delay D]``,
    #: by rate and delay (psring.cluster.spec.link_key: "1gbit", "1gbit+2000us"):
    #: {"zmq_alpha", "zmq_beta", "dist_alpha", "dist_beta", "time", "measurements"}
    #: between two emulated hosts
    links: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _NUMBERS:
            check_positive(name, getattr(self, name))
        if self.cast is not None:
            check_positive("cast", self.cast)
        if not isinstance(self.links, dict):
            raise ValueError(f"links is {type(self.links).__name__}, not an object")
        if not isinstance(self.collectives, dict):
            raise ValueError(f"collectives is {type(self.collectives).__name__}, not an "
                             f"object")
        for op, ab in self.collectives.items():
            if op not in GLOO_COLLECTIVES or not isinstance(ab, (list, tuple)) or len(ab) != 2:
                raise ValueError(f"collectives[{op!r}] is {ab!r}: expected one of "
                                 f"{', '.join(GLOO_COLLECTIVES)} with [alpha, beta]")
            check_positive(f"collectives[{op!r}] alpha", ab[0])
            check_positive(f"collectives[{op!r}] beta", ab[1])
        for rate, numbers in self.links.items():
            for name in ("zmq_alpha", "zmq_beta", "dist_alpha", "dist_beta"):
                check_positive(f"links[{rate!r}].{name}", (numbers or {}).get(name))

    def link(self, comm_model: str) -> tuple[float, float]:
        """(α, β) of the transport ``comm_model`` runs over, inside one host (loopback):
        a built-in cost model's name, or a transport's, "dist" (torch.distributed) or
        "zmq" (the PS protocol), as a plugin's CostModel.transport says."""
        if comm_model in ("ring", "hring", "dist"):
            return self.dist_alpha, self.dist_beta
        if comm_model in ("ps", "ps-async", "byteps", "zmq"):
            return self.zmq_alpha, self.zmq_beta
        raise ValueError(f"unknown comm_model {comm_model!r}; known: "
                         f"{', '.join(m for m in COMM_MODELS if m)}")

    def gloo_step(self, op: str) -> tuple[float, float]:
        """(α, β) of one ring step of gloo's collective ``op`` ("all_reduce",
        "reduce_scatter", "all_gather") among processes of one host: a step moving (and,
        reducing, adding) a chunk of c bytes costs α + c·β. Fitted to gloo's own
        collectives where measured (``collectives``): on this project's machine they
        cost 2-4x what a send/recv ping-pong plus γ predicts (their copies, their
        chunking, their extra threads). Else the ping-pong's α and β, plus γ where the
        step adds (half an all-reduce's steps do), as the ring formula has it."""
        if op not in GLOO_COLLECTIVES:
            raise ValueError(f"op {op!r}: one of {', '.join(GLOO_COLLECTIVES)}")
        fitted = self.collectives.get(op)
        if fitted:
            return float(fitted[0]), float(fitted[1])
        adds = {"all_reduce": 0.5, "reduce_scatter": 1.0, "all_gather": 0.0}[op]
        return self.dist_alpha, self.dist_beta + adds * self.gamma

    def host_steps(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(α, β) of one step of a host's reduce-scatter and of its all-gather on
        loopback: :meth:`gloo_step`'s, the pair :func:`host_reduce` takes."""
        return self.gloo_step("reduce_scatter"), self.gloo_step("all_gather")

    def between_hosts(self, comm_model: str, link_bits: float | None,
                      delay_s: float = 0.0, loss: float = 0.0) -> tuple[float, float, str]:
        """:meth:`between_clean` on links that drop ``loss`` of each direction's
        packets: TCP's loss recovery priced by :func:`tcp_under_loss`. (Not priced:
        bounded-loss pushes, --loss-tolerance, whose datagrams' CPU and resend rounds
        the calibration does not measure; psring.predict.replay skips those runs.)"""
        alpha, beta, source = self.between_clean(comm_model, link_bits, delay_s)
        if not loss:
            return alpha, beta, source
        alpha, beta = tcp_under_loss(alpha, beta, loss)
        return alpha, beta, f"{source}, TCP under {loss:g} loss"

    def between_clean(self, comm_model: str, link_bits: float | None,
                      delay_s: float = 0.0) -> tuple[float, float, str]:
        """(α, β, source) of the transport between two hosts joined by links of
        ``link_bits``/s: measured by ``psring calibrate --hosts 2 --link RATE [--delay D]``
        when this calibration has that rate (with that delay; a calibration without the
        delay gets 2·delay added to its α); else, on paper, loopback's α plus the delay of the
        two links a message crosses, and the rate's β for TCP payload
        (psring.units.payload_beta). β is never below loopback's: a link faster than
        the transport's software does not make it faster. Unshaped links (None): the
        loopback figures."""
        alpha, beta = self.link(comm_model)
        if link_bits is None:
            return alpha, beta, "loopback"

        key = "dist" if comm_model in ("ring", "hring", "dist") else "zmq"
        # a calibration of this rate and delay; else of this rate, without the delay
        for name, extra in ((link_key(link_bits, delay_s), 0.0),
                            (link_key(link_bits), 2 * delay_s)):
            measured = self.links.get(name)
            if measured is not None:
                return (measured[f"{key}_alpha"] + extra,
                        max(measured[f"{key}_beta"], beta), f"calibrated {name}")
        return alpha + 2 * delay_s, max(payload_beta(link_bits), beta), "nominal rate"

    def faster(self, scale: float) -> "Calibration":
        """This machine's figures on the clock of a run slowed ``scale``-fold
        (--time-scale): its software costs (α, β, γ, the cast) take the same wall time,
        so 1/scale of it on the described cluster's clock. Emulated links are priced at
        the described rate (between_hosts' nominal rate), not from ``links``, which are
        this machine's measurements at the rates it shaped."""
        if scale == 1:
            return self
        return replace(self, **{n: getattr(self, n) / scale for n in _NUMBERS},
                       cast=self.cast / scale if self.cast is not None else None, links={},
                       collectives={op: [a / scale, b / scale]
                                    for op, (a, b) in self.collectives.items()})

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a crash never leaves half a file); creates the directory."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """Read and validate; anything wrong is a ConfigError naming the file and the fix."""
        path = Path(path).expanduser()
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no calibration file at {path}; {_FIX} "
                              f"(it writes {default_path()} unless given --out).") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"calibration file {path} is unreadable or not JSON "
                              f"({e}); {_FIX}.") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"calibration file {path} holds a {type(obj).__name__}, not "
                              f"a JSON object; {_FIX}.")
        if obj.get("format") != FORMAT:
            raise ConfigError(f"calibration file {path} has format {obj.get('format')!r}, "
                              f"this psring reads format {FORMAT}; {_FIX}.")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in obj.items() if k in known}
        missing = [k for k in _NUMBERS if k not in kwargs]
        if missing:
            raise ConfigError(f"calibration file {path} lacks {', '.join(missing)}; {_FIX}.")
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"calibration file {path}: {e}; {_FIX}.") from None


def check_positive(name: str, value: Any) -> float:
    """A positive, finite number (bools are not numbers here), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is {value!r}, not a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} is {value!r}, not a positive finite number")
    return float(value)


def default_path() -> Path:
    """``$PSRING_CALIBRATION``, else ``~/.cache/psring/calibration.json`` (read each call,
    so tests and scripts can redirect it)."""
    env = os.environ.get("PSRING_CALIBRATION")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/psring").expanduser() / CALIBRATION_FILE


def find_calibration(*dirs: str | os.PathLike) -> Path | None:
    """The calibration file to use: a ``calibration.json`` inside the first of ``dirs``
    that has one (a comparison calibrated for itself wins over the machine-wide file),
    else the default path if it exists, else None. Returns the path; load it with
    :meth:`Calibration.load` (which validates it)."""
    for d in dirs:
        p = Path(d) / CALIBRATION_FILE
        if p.is_file():
            return p
    p = default_path()
    return p if p.is_file() else None


# -- loss on the links ---------------------------------------------------------------------

#: TCP's payload bytes per segment on a 1500-byte MTU with timestamps
MSS = 1448
#: what one lost segment costs a bulk TCP flow (Linux: CUBIC, SACK, RACK and tail loss
#: probes), in round trips: fitted to experiments/loss.toml's ring (2 hosts, 100 Mbit/s,
#: 4 ms round trip, 0.1-5% loss; docs/prediction.md, "Loss"). SACK keeps the pipe busy
#: through a loss, so a loss costs a sliver of a round trip, not the round trips of
#: Mathis et al.'s steady-state bound (which priced the step at 5% loss 8x what was measured)
LOSS_RTT_PER_SEGMENT = 0.09


def tcp_under_loss(alpha: float, beta: float, loss: float) -> tuple[float, float]:
    """(α, β) of a TCP message crossing two link directions that each drop ``loss`` of
    the packets independently (psring.cluster.link): each payload segment is lost with
    p = 1 - (1 - loss)², and each loss costs LOSS_RTT_PER_SEGMENT round trips (2α).
    An estimate fitted on one cluster: bursts (--loss-burst), much larger windows and
    retransmission timeouts (a lost retransmission, a whole window lost) are not priced
    (docs/prediction.md, "Loss")."""
    p = 1 - (1 - loss) ** 2
    if p <= 0:
        return alpha, beta
    return alpha, beta + p * LOSS_RTT_PER_SEGMENT * 2 * alpha / MSS


# -- predictions --------------------------------------------------------------------------

def predict_comm(comm_model: str | None, n: int, K: int, M: float, cal: Calibration,
                 topo: Cluster | None = None) -> float | None:
    """Predicted communication seconds per worker step for a strategy whose
    ``comm_model`` is given, with n workers, K servers and M gradient bytes; None for a
    strategy that sends no messages. Ring runs over gloo (dist_alpha, dist_beta), the
    parameter servers over ZeroMQ (zmq_alpha, zmq_beta); γ is shared.

    ``topo`` places them on emulated hosts (None: one host). Then traffic between hosts
    costs the link's α and β (:meth:`Calibration.between_hosts`) and traffic inside a
    host loopback's: a ring spanning hosts moves at its slowest edge, a link (each step
    of the ring waits for every edge); a PS round at its busiest link or server
    (:func:`ps_sync_placed`)."""
    if comm_model is None:
        return None
    alpha, beta = cal.link(comm_model)
    if comm_model == "ring":
        if topo is not None and len(set(topo.worker_host)) > 1:
            alpha, beta, _ = cal.between_hosts(comm_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
            return ring_allreduce(n, M, alpha, beta, cal.gamma)
        return ring_allreduce(n, M, *cal.gloo_step("all_reduce"), 0.0)  # (adds in β)
    if K < 1:
        raise ValueError(f"K (servers) must be at least 1, not {K}")
    if comm_model == "hring":
        H = len(set(topo.worker_host)) if topo is not None else 1
        a_link, b_link = alpha, beta
        if H > 1:
            a_link, b_link, _ = cal.between_hosts(comm_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
        G = max(1, n // H)
        return hring_allreduce(G, H, M, a_link, b_link, cal.gamma,
                               host_reduce(G, M, *cal.host_steps()))
    if comm_model == "byteps":
        hosts = sorted(set(topo.worker_host)) if topo is not None else [0]
        G = max(1, n // len(hosts))
        cross, a, b_link = 0.0, alpha, beta
        if topo is not None and topo.multi_host:
            cross = ps_link_load(hosts, list(topo.server_host))
            a_link, b_link, _ = cal.between_hosts(comm_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
            a = a_link if cross > 0 else alpha
        return byteps_sync(len(hosts), M, K, a, b_link, beta, cal.gamma, cross,
                           host_reduce(G, M, *cal.host_steps()))
    if topo is None or not topo.multi_host:
        if comm_model == "ps":
            return ps_sync(n, M, K, alpha, beta, cal.gamma)
        return ps_async(n, M, K, alpha, beta, cal.gamma)
    cross = ps_link_load(list(topo.worker_host), list(topo.server_host))
    a_link, b_link, _ = cal.between_hosts(comm_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
    formula = ps_sync_placed if comm_model == "ps" else ps_async_placed
    return formula(n, M, K, a_link if cross > 0 else alpha, b_link, beta, cal.gamma, cross)


#: the size at which the linear coefficients are read off (see _linear)
_M_REF = float(2**30)


def _linear(comm_model: str, n: int, K: int, cal: Calibration,
            topo: Cluster | None = None, price=None) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of a prediction: every formula is a + b·M, so
    two evaluations give both, without restating the formulas. Reading b off at 1 GiB
    rather than 1 byte keeps the subtraction's rounding far below b."""
    price = price or predict_comm
    a = price(comm_model, n, K, 0.0, cal, topo)
    at_ref = price(comm_model, n, K, _M_REF, cal, topo)
    assert a is not None and at_ref is not None
    return a, (at_ref - a) / _M_REF


def crossover_bytes(model_a: str | None, model_b: str | None, n: int, K: int,
                    cal: Calibration, topo_a: Cluster | None = None,
                    topo_b: Cluster | None = None, price=None) -> float | None:
    """The gradient size M (bytes) at which both models predict the same time; None when
    the lines never meet at a positive M (parallel, or crossing only at M <= 0), or when
    either strategy sends no messages. Below M the model with the smaller fixed cost is
    faster, above it the one with the smaller per-byte cost. ``price``: the closed form
    by cost model name, :func:`predict_comm`'s signature (default: it; reports pass
    psring.predict.simulate.comm_seconds, which knows a plugin's cost models too)."""
    if model_a is None or model_b is None:
        return None
    a1, b1 = _linear(model_a, n, K, cal, topo_a, price)
    a2, b2 = _linear(model_b, n, K, cal, topo_b, price)
    # Parallel within rounding: they never cross (or coincide everywhere).
    if abs(b1 - b2) <= 1e-12 * max(abs(b1), abs(b2)):
        return None
    m = (a2 - a1) / (b1 - b2)
    return m if math.isfinite(m) and m > 0 else None
