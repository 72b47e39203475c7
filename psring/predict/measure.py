"""Measure this machine's α, β (ZeroMQ and gloo) and γ for the cost model.

    psring calibrate [--quick] [--out FILE]
    psring calibrate --hosts 2 --link 1gbit [--quick] [--out FILE]   # across a link
    python -m psring.commands.calibrate [--quick] [--out FILE]   # without the psring CLI

(The command is psring.commands.calibrate; this module measures, with the processes
of psring.predict.pingpong.)

Four measurements, one after another (never concurrently: on a small machine they
would compete for the same cores):

- ZeroMQ: two processes ping-pong raw byte messages over tcp on 127.0.0.1 (a PAIR
  socket each; zero-copy above 64 KB, as the parameter-server protocol does), sizes
  1 KB ... 16 MB. One-way time = median round trip / 2.
- torch.distributed gloo: two processes (one torch thread each) ping-pong a tensor with
  send/recv over the same sizes; same one-way time. They then time gloo's own
  all_reduce, reduce-scatter and all-gather at those sizes
  (``measurements["dist_allreduce"]`` ...), fitted per ring step into
  ``Calibration.collectives``: what the strategies' collectives on one host cost
  (here gloo's all_reduce took 2-4x what the ping-pong's β and γ add up to).
- γ: an in-place ``torch.add_`` of two float32 tensors of 64 MB (larger than the
  last-level cache), one thread; seconds per byte of one operand.
- the PS round (psring.predict.psprobe): psring's own server and clients, two workers
  pushing and pulling 1-16 MB each, fitted to round(M) = α + M·β
  (``Calibration.ps_round``): what the ping-pong leaves out of a PS step on this
  machine's cores.

With ``--hosts 2 --link RATE`` the ZeroMQ and gloo pairs run on two emulated hosts
(psring.cluster.emulate) joined by links of RATE, over messages up to what crosses the link in
~0.1 s; the result is kept per rate in ``Calibration.links`` beside the loopback figures,
and the cost model uses it for traffic between hosts.

Each transport's one-way times are fitted to t(M) = α + M·β (see :func:`fit`: α is
the smallest message's time, β the least-squares slope through it). The
result is a :class:`psring.predict.calibration.Calibration`, saved atomically to --out
(default ``$PSRING_CALIBRATION`` or ``~/.cache/psring/calibration.json``).

Every measuring process runs under a hard deadline: it is joined, and killed if it
overruns; it also dies with this process (PR_SET_PDEATHSIG), so nothing outlives it.
"""


from __future__ import annotations

import math
import platform
import socket
import statistics as st
import time
from typing import Any, Callable

from psring.cluster.emulate import standalone
from psring.comm.endpoints import ABSTRACT_IPC
from psring.errors import PsringError
from psring.predict.calibration import PS_ROUND_WORKERS, Calibration
from psring.predict.pingpong import (
    KB,
    QUICK_SIZES,
    SIZES,
    Link,
    measure_gloo,
    measure_zmq,
)
from psring.predict.psprobe import fit_round, measure_ps_round, probe_threads
from psring.records.runlog import usable_cores
from psring.units import parse_rate

#: γ's tensor size, in quick mode too: it must not fit in the last-level cache (32 MB on
#: the machine this was written on, where a 16 MB add ran ~2x faster than a 64 MB one);
#: the gradients a server or ring reduces are that large, and 64 MB costs ~3 ms a pass
GAMMA_BYTES = 64 * 1024 * 1024


# -- γ ------------------------------------------------------------------------------------------

def _single_thread_median(step, reps: int) -> float:
    """Median seconds of ``step()`` on one torch thread (after one untimed call, which
    faults the pages in); the thread count is restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return st.median(times)
    finally:
        torch.set_num_threads(threads)


def measure_gamma(nbytes: int, reps: int = 9) -> float:
    """Seconds per byte (of one operand) of ``a.add_(b)`` on float32, one thread."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.ones(nbytes // 4)
    return _single_thread_median(lambda: a.add_(b), reps) / nbytes


def measure_cast(nbytes: int, reps: int = 5) -> float:
    """Seconds per float32 byte to cast to float16 and back (what --compress costs per
    message on each side, into buffers allocated once as the strategies do), one thread."""
    import torch

    a = torch.ones(nbytes // 4)
    half = torch.empty(nbytes // 4, dtype=torch.float16)

    def there_and_back() -> None:
        half.copy_(a)
        a.copy_(half)

    return _single_thread_median(there_and_back, reps) / 2 / nbytes


# -- the fit ---------------------------------------------------------------------------------

def fit(points: list[list[float]], what: str = "") -> tuple[float, float]:
    """(α, β) of t(M) = α + M·β through [[M, t], ...]; both positive and finite.

    α is the smallest message's measured one-way time, and β the least-squares slope
    through the points with that intercept fixed: β = Σ M·(t − α) / Σ M².

    Why not plain least squares for both: on a doubling ladder of sizes the largest
    messages decide the fit, and the intercept becomes a small difference of large,
    noisy numbers. On this project's 2-core machine it came out at or below 0, or above
    the smallest message's own time (impossible: t(M_min) = α + M_min·β >= α), in 7 of 8
    fits, and in the 8th at 2.7 µs against a measured 21 µs. The smallest message's time
    is a direct measurement of the latency (median of hundreds of round trips; it
    overstates α by M_min·β, ~0.1 µs at 1 KB), so it is used always, not only as a
    fallback. β, fitted with α fixed, is still decided by the large messages: the
    bandwidth regime per-step gradients (MBs) live in.
    """
    pts = [(float(p[0]), float(p[1])) for p in points]  # [M, t, anything else]
    if len({m for m, _ in pts}) < 2:
        raise ValueError("fit needs at least two different sizes")
    _, alpha = min(pts)
    beta = sum(m * (t - alpha) for m, t in pts) / sum(m * m for m, _ in pts)
    if not (math.isfinite(alpha) and alpha > 0 and math.isfinite(beta) and beta > 0):
        shown = ", ".join(f"{m / KB:.0f} KB: {t * 1e6:.0f} µs" for m, t in pts)
        raise PsringError(f"calibrate: {what + ' ' if what else ''}one-way times do not "
                          f"grow with message size ({shown}); the machine was probably too "
                          f"busy — retry.")
    return alpha, beta


#: how many ring steps, and on what share of the full tensor, each collective measured
#: on 2 ranks takes: an all-reduce 2 steps on halves; a reduce-scatter or an all-gather
#: 1 step on a half
_STEPS = {"dist_allreduce": ("all_reduce", 2), "dist_reduce_scatter": ("reduce_scatter", 1),
          "dist_all_gather": ("all_gather", 1)}


def fit_collectives(timed: dict[str, list[list[float]]]) -> dict[str, list[float]]:
    """One ring step's (α, β) of each collective timed on 2 ranks
    (Calibration.collectives): a measured t(M) = s·(α + (M/2)·β) over s steps, fitted as
    :func:`fit` does. A collective whose times do not fit a line is left out (the cost
    model then prices it from the send/recv ping-pong)."""
    out = {}
    for name, (op, steps) in _STEPS.items():
        if name not in timed:
            continue
        try:
            a0, slope = fit(timed[name], op)
        except (PsringError, ValueError):
            continue
        out[op] = [a0 / steps, 2 * slope / steps]
    return out


# -- all together ------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    import torch
    import zmq

    return {"python": platform.python_version(), "torch": torch.__version__,
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


#: measurements per transport before giving up on one whose times do not fit a line
ATTEMPTS = 3


def _measure_and_fit(what: str, measure: Callable[..., tuple[list, dict]],
                     sizes: list[int], quick: bool, say: Callable[[str], None],
                     link: Link | None = None
                     ) -> tuple[list[list[float]], dict, tuple[float, float]]:
    """Measure and fit, measuring again when the fit fails: on this 2-core VM a whole
    ladder was once measured at ~2 ms for every size (each wake-up of a blocked process
    waiting for a host scheduler tick), which no line with β > 0 fits."""
    for attempt in range(1, ATTEMPTS + 1):
        points, extra = measure(sizes, quick, link)
        try:
            return points, extra, fit(points, what)
        except PsringError as e:
            if attempt == ATTEMPTS:
                raise
            say(f"{e} Measuring again ({attempt + 1}/{ATTEMPTS}).")
    raise AssertionError("unreachable")


def calibrate(quick: bool = False, log: Callable[[str], None] | None = None) -> Calibration:
    """Measure and fit everything; ``log`` (e.g. print to stderr) hears progress.
    On 2 cores it took ~2-5 s with ``quick`` and ~10-20 s without (budgets: 20 s and
    90 s)."""
    say = log or (lambda _msg: None)
    sizes = QUICK_SIZES if quick else SIZES
    gamma_bytes = GAMMA_BYTES
    say("calibrate: ZeroMQ ping-pong on this host (Unix sockets on Linux, as runs use) ...")
    zmq_points, _, (zmq_alpha, zmq_beta) = _measure_and_fit("ZeroMQ", measure_zmq, sizes,
                                                            quick, say)
    say("calibrate: gloo send/recv ping-pong ...")
    dist_points, dist_extra, (dist_alpha, dist_beta) = _measure_and_fit(
        "gloo", measure_gloo, sizes, quick, say)
    say("calibrate: local add (gamma) ...")
    gamma = measure_gamma(gamma_bytes, reps=5 if quick else 9)
    cast = measure_cast(gamma_bytes // 4, reps=3 if quick else 5)
    say(f"calibrate: psring's parameter-server round ({PS_ROUND_WORKERS} workers, one "
        f"server with {probe_threads()} torch thread(s)) ...")
    ps_points = _measure_round(quick)
    return Calibration(
        zmq_alpha=zmq_alpha, zmq_beta=zmq_beta, dist_alpha=dist_alpha, dist_beta=dist_beta,
        gamma=gamma, cast=cast, host=socket.gethostname(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        cores=usable_cores(), versions=_versions(), sizes=list(sizes),
        gamma_bytes=gamma_bytes, quick=quick,
        measurements={"zmq": zmq_points, "dist": dist_points, **dist_extra,
                      "gamma": [[gamma_bytes, gamma * gamma_bytes]], "ps_round": ps_points},
        collectives=fit_collectives(dist_extra), ps_round=list(fit_round(ps_points)))


def _measure_round(quick: bool) -> list[list[float]]:
    """The PS round's points, measured again (up to ATTEMPTS times) when they do not fit
    a growing line."""
    for attempt in range(1, ATTEMPTS + 1):
        points = measure_ps_round(quick)
        try:
            fit_round(points)
            return points
        except PsringError:
            if attempt == ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def calibrate_link(link: str, delay: str = "", quick: bool = False,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """α and β of ZeroMQ and gloo between two emulated hosts joined by ``link``
    (psring.cluster.emulate): the entry ``Calibration.links[rate]``."""

    say = log or (lambda _msg: None)
    bits = parse_rate(link)
    sizes = QUICK_SIZES if quick else SIZES
    with standalone(2, link, delay) as cluster:
        where = Link(cluster, bits, quick)
        sizes = where.sizes(sizes)
        say(f"calibrate: ZeroMQ ping-pong between two emulated hosts ({link} links) ...")
        zmq_points, _, (zmq_alpha, zmq_beta) = _measure_and_fit(
            "ZeroMQ", measure_zmq, sizes, quick, say, where)
        say("calibrate: gloo send/recv ping-pong between them ...")
        dist_points, dist_extra, (dist_alpha, dist_beta) = _measure_and_fit(
            "gloo", measure_gloo, sizes, quick, say, where)
    return {"zmq_alpha": zmq_alpha, "zmq_beta": zmq_beta, "dist_alpha": dist_alpha,
            "dist_beta": dist_beta, "link_bits": bits, "delay": delay,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick, "sizes": sizes,
            "measurements": {"zmq": zmq_points, "dist": dist_points, **dist_extra}}


def describe(cal: Calibration) -> str:
    """The values in human units: latency in µs, bandwidth in GB/s (10^9 bytes/s)."""
    def link(name: str, alpha: float, beta: float) -> str:
        return f"{name:<21} α = {alpha * 1e6:8.1f} µs   1/β = {1 / beta / 1e9:7.3g} GB/s"

    lines = [
        # on Linux measured over the Unix sockets runs use on one host (measure_zmq)
        link("ZeroMQ (ipc)" if ABSTRACT_IPC else "ZeroMQ (tcp lo)",
             cal.zmq_alpha, cal.zmq_beta),
        link("gloo send/recv", cal.dist_alpha, cal.dist_beta),
        *[link(f"gloo {op} step", a, b) for op, (a, b) in cal.collectives.items()],
        f"{'local add':<18} γ = {cal.gamma * 1e9:8.3f} ns/B  1/γ = {1 / cal.gamma / 1e9:6.2f} GB/s",
    ]
    if cal.cast:
        lines.append(f"{'fp16 cast':<18}   {cal.cast * 1e9:8.3f} ns per float32 byte, each way")
    if cal.ps_round:
        a, b = cal.ps_round
        lines.append(f"{'PS round':<21} α = {a * 1e6:8.1f} µs   1/β = {1 / b / 1e9:7.3g} GB/s "
                     f"per worker ({PS_ROUND_WORKERS} workers, one server)")
    for rate, m in sorted(cal.links.items(), key=lambda kv: kv[1].get("link_bits", 0)):
        lines += [link(f"ZeroMQ ({rate} link)", m["zmq_alpha"], m["zmq_beta"]),
                  link(f"gloo ({rate} link)", m["dist_alpha"], m["dist_beta"])]
    return "\n".join(lines)
