"""The α-β-γ closed forms: predicted communication time per step for each strategy.

    from psring.predict.analytic import crossover_bytes, predict_comm
    from psring.predict.calibration import Calibration, find_calibration

    path = find_calibration("runs/compare")        # or None: run `psring calibrate`
    cal = Calibration.load(path)
    t = predict_comm("ring", n=2, K=1, M=36e6, cal=cal)   # seconds per step
    m = crossover_bytes("ring", "ps", n=2, K=1, cal=cal)  # bytes, or None

Symbols (docs/cost-model.md has the full story and sources):

- ``n``  workers, ``K`` parameter-server shards (servers), ``M`` gradient bytes per step;
- ``alpha``  seconds per message (latency), ``beta`` seconds per byte on one link
  (1/bandwidth) — the Hockney model t(M) = α + M·β;
- ``gamma``  seconds per byte to reduce (add) locally.

The formulas below are pure functions of these numbers; the numbers are a
:class:`psring.predict.calibration.Calibration`, measured on this machine by
``psring calibrate`` (psring.predict.measure): one α, β pair for ZeroMQ (what the
parameter-server strategies use) and one for torch.distributed's gloo (what ring
all-reduce and DDP use), and one γ.

Which formula a strategy follows is its cost model, ``caps.cost_model``
(``psring.strategies.base.Capabilities``): ``"ring"``, ``"ps"``, ``"ps-async"``,
``"byteps"``, ``"hring"`` (hallreduce), or ``None`` when it sends no messages (single,
hogwild). The simulator plays each one out step by step (psring.predict.sim), with
these formulas' terms.
"""

from __future__ import annotations

import math

from psring.cluster.spec import Cluster
from psring.predict.calibration import Calibration

#: the built-in cost models' names (``caps.cost_model``): which closed form predicts a
#: strategy's communication; None: it sends nothing (single) or shares memory (hogwild)
FORMULAS = (None, "ring", "hring", "ps", "ps-async", "byteps")


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


# -- the scaling lemmas (docs/prediction.md, "Scaling") ----------------------------------

def hidden_window(backward_s: float, first_ready_s: float) -> float:
    """W, the share of backward communication can hide under: from the first bucket's
    gradients being ready to backward's end. Communication of W or less adds only its
    last bucket's to the step; beyond W the step grows by the excess."""
    return max(0.0, backward_s - first_ready_s)


def ring_knee(M: float, alpha: float, beta: float, gamma: float, window: float,
              collectives: int = 1) -> float:
    """n*, the ring size at which a step's all-reduces (``collectives`` of them, one a
    bucket, M bytes in all: :func:`ring_allreduce` each) take the hidden window W: the
    root of ``2bα(n−1) + c(n−1)/n = W`` with ``c = M(2β + γ)`` and b collectives, i.e.
    ``2bα·n² + (c − 2bα − W)·n − c = 0``. Below n* the ring hides under backward but
    for its last bucket; above it each step grows by ``comm(n) − W``. With α = 0 the
    ring's bytes are bounded by c as n grows: n* = c/(c − W) where c > W, else never
    (inf)."""
    c = M * (2 * beta + gamma)
    a = 2 * collectives * alpha
    if a <= 0:
        return c / (c - window) if c > window else math.inf
    b = c - a - window
    return (-b + math.sqrt(b * b + 4 * a * c)) / (2 * a)


def server_side(beta_link: float, beta_server: float, cpu_per_byte: float) -> float:
    """x, a server's seconds per byte it takes in: the slowest of its host's link, its
    transport and its CPU (the sum's γ and its share of the update)."""
    return max(beta_link, beta_server, cpu_per_byte)


def ps_knee(M: float, G: int, beta_link: float, x: float, window: float) -> float:
    """n*, the workers at which a synchronous PS's pushes stop hiding under backward
    (servers on hosts of their own, G workers a host, x: :func:`server_side`). psring
    shards the flat gradient in K contiguous ranges, so server k's range is produced in
    the k-th K-th of backward and the last server's n·M/K bytes arrive in the last
    W/K: it keeps up while ``n·M·x/K ≤ W/K``, so ``n* = W/(M·x)`` whatever K (more
    servers divide the exposure, ``(n·M·x − W)/K``, they do not move the knee). A
    worker host's link carries its G workers' M each: where ``M·G·β_link ≥ W`` the
    pushes never hide (n* = 1). The pull of n·M/K a server follows backward at every
    size."""
    if M * G * beta_link >= window:
        return 1.0
    return max(1.0, window / (M * x))


def servers_needed(n: int, G: int, beta_link: float, x: float) -> float:
    """K*, the servers (on hosts of their own) at which a synchronous PS stops being
    server-bound: a server takes n workers' 1/K each at x a byte (:func:`server_side`),
    a worker host's link out sends its G workers' bytes at β_link; they meet at
    ``K* = n/G · x/β_link``: H = n/G servers where the link is the slowest (BytePS's
    as many server machines as worker machines), more where a server's transport or
    CPU is slower. Beyond K* the workers' own links bound the step; psring's
    contiguous shards reach that bound from about 2K* (tests/unit/test_scaling.py)."""
    return n / G * x / beta_link


# -- predictions --------------------------------------------------------------------------

def predict_comm(cost_model: str | None, n: int, K: int, M: float, cal: Calibration,
                 topo: Cluster | None = None) -> float | None:
    """Predicted communication seconds per worker step for a strategy whose
    ``cost_model`` is given, with n workers, K servers and M gradient bytes; None for a
    strategy that sends no messages. Ring runs over gloo (dist_alpha, dist_beta), the
    parameter servers over ZeroMQ (zmq_alpha, zmq_beta); γ is shared.

    ``topo`` places them on emulated hosts (None: one host). Then traffic between hosts
    costs the link's α and β (:meth:`Calibration.between_hosts`) and traffic inside a
    host loopback's: a ring spanning hosts moves at its slowest edge, a link (each step
    of the ring waits for every edge); a PS round at its busiest link or server
    (:func:`ps_sync_placed`)."""
    if cost_model is None:
        return None
    alpha, beta = cal.link(cost_model)
    if cost_model == "ring":
        if topo is not None and len(set(topo.worker_host)) > 1:
            alpha, beta, _ = cal.between_hosts(cost_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
            return ring_allreduce(n, M, alpha, beta, cal.gamma)
        return ring_allreduce(n, M, *cal.gloo_step("all_reduce"), 0.0)  # (adds in β)
    if K < 1:
        raise ValueError(f"K (servers) must be at least 1, not {K}")
    if cost_model == "hring":
        H = len(set(topo.worker_host)) if topo is not None else 1
        a_link, b_link = alpha, beta
        if H > 1:
            a_link, b_link, _ = cal.between_hosts(cost_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
        G = max(1, n // H)
        return hring_allreduce(G, H, M, a_link, b_link, cal.gamma,
                               host_reduce(G, M, *cal.host_steps()))
    if cost_model == "byteps":
        hosts = sorted(set(topo.worker_host)) if topo is not None else [0]
        G = max(1, n // len(hosts))
        cross, a, b_link = 0.0, alpha, beta
        if topo is not None and topo.multi_host:
            cross = ps_link_load(hosts, list(topo.server_host))
            a_link, b_link, _ = cal.between_hosts(cost_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
            a = a_link if cross > 0 else alpha
        return byteps_sync(len(hosts), M, K, a, b_link, beta, cal.gamma, cross,
                           host_reduce(G, M, *cal.host_steps()))
    if topo is None or not topo.multi_host:
        if cost_model == "ps":
            return ps_sync(n, M, K, alpha, beta, cal.gamma)
        return ps_async(n, M, K, alpha, beta, cal.gamma)
    cross = ps_link_load(list(topo.worker_host), list(topo.server_host))
    a_link, b_link, _ = cal.between_hosts(cost_model, topo.link_bits, topo.delay_s,
                                           topo.loss)
    formula = ps_sync_placed if cost_model == "ps" else ps_async_placed
    return formula(n, M, K, a_link if cross > 0 else alpha, b_link, beta, cal.gamma, cross)


#: the size at which the linear coefficients are read off (see _linear)
_M_REF = float(2**30)


def _linear(cost_model: str, n: int, K: int, cal: Calibration,
            topo: Cluster | None = None, price=None) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of a prediction: every formula is a + b·M, so
    two evaluations give both, without restating the formulas. Reading b off at 1 GiB
    rather than 1 byte keeps the subtraction's rounding far below b."""
    price = price or predict_comm
    a = price(cost_model, n, K, 0.0, cal, topo)
    at_ref = price(cost_model, n, K, _M_REF, cal, topo)
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
    psring.predict.sim.simulate.comm_seconds, which knows a plugin's cost models too)."""
    if model_a is None or model_b is None:
        return None
    a1, b1 = _linear(model_a, n, K, cal, topo_a, price)
    a2, b2 = _linear(model_b, n, K, cal, topo_b, price)
    # Parallel within rounding: they never cross (or coincide everywhere).
    if abs(b1 - b2) <= 1e-12 * max(abs(b1), abs(b2)):
        return None
    m = (a2 - a1) / (b1 - b2)
    return m if math.isfinite(m) and m > 0 else None
