"""What the cost model's numbers are on one machine: the measured :class:`Calibration`.

    from psring.predict.calibration import Calibration, find_calibration

    path = find_calibration("runs/compare")        # or None: run `psring calibrate`
    cal = Calibration.load(path)
    alpha, beta = cal.link("ring")                  # the transport ring all-reduce uses

One α, β pair (seconds, seconds per byte) for ZeroMQ (the parameter servers' transport)
and one for torch.distributed's gloo (ring all-reduce's), γ (seconds per byte added
locally), gloo's own collectives per ring step, and the same per emulated link rate; each
measured by ``psring calibrate`` (psring.predict.measure). The closed forms that use them
are psring.predict.analytic's; the simulator's cost models are psring.predict.sim's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from psring.cluster.spec import link_key
from psring.errors import ConfigError
from psring.records.runlog import atomic_write_json, usable_cores
from psring.units import payload_beta

#: the calibration file's name inside a run or comparison directory
CALIBRATION_FILE = "calibration.json"
#: bumped when the file's meaning changes; load() refuses other formats
FORMAT = 1

_FIX = "run `psring calibrate` to measure this machine again"


#: the transport each built-in cost model's messages take: torch.distributed ("dist",
#: gloo or NCCL) or the parameter servers' protocol over ZeroMQ ("zmq")
TRANSPORT = {"ring": "dist", "hring": "dist", "ps": "zmq", "ps-async": "zmq",
             "byteps": "zmq"}


# -- measured parameters ------------------------------------------------------------------

#: the workers of the measured PS round (psring.predict.psprobe.WORKERS)
PS_ROUND_WORKERS = 2
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
    #: message end (psring.predict.sim.simulate); None in calibrations made before it was
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
    #: psring's own parameter-server round on this machine (psring.predict.psprobe): [α,
    #: β] of round(M) = α + M·β, two workers each pushing M bytes to one server and
    #: pulling M back, the server with the threads a run gives it on these cores; empty
    #: in calibrations made before it was measured (the ping-pong's figures then stand)
    ps_round: list[float] = field(default_factory=list)

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
        if self.ps_round:
            if not isinstance(self.ps_round, (list, tuple)) or len(self.ps_round) != 2:
                raise ValueError(f"ps_round is {self.ps_round!r}: expected [alpha, beta]")
            check_positive("ps_round alpha", self.ps_round[0])
            check_positive("ps_round beta", self.ps_round[1])
        for rate, numbers in self.links.items():
            for name in ("zmq_alpha", "zmq_beta", "dist_alpha", "dist_beta"):
                check_positive(f"links[{rate!r}].{name}", (numbers or {}).get(name))

    def link(self, cost_model: str) -> tuple[float, float]:
        """(α, β) of the transport ``cost_model`` runs over, inside one host (loopback):
        a built-in cost model's name (:data:`TRANSPORT`), or a transport's, "dist"
        (torch.distributed) or "zmq" (the PS protocol), as a plugin's
        CostModel.transport says."""
        transport = TRANSPORT.get(cost_model, cost_model)
        if transport == "dist":
            return self.dist_alpha, self.dist_beta
        if transport == "zmq":
            return self.ps_transport()
        raise ValueError(f"unknown cost model {cost_model!r}; known: "
                         f"{', '.join(TRANSPORT)}, or a transport: dist, zmq")

    def elsewhere(self, host: str | None = None, cores: int | None = None) -> str | None:
        """How the machine this was measured on differs from ``host`` with ``cores``
        (this machine's by default), or None where nothing recorded differs."""
        host = host if host is not None else socket.gethostname()
        cores = cores if cores is not None else usable_cores()
        diffs = []
        if self.host and host and self.host != host:
            diffs.append(f"host {self.host!r}, not {host!r}")
        if self.cores and cores and self.cores != cores:
            diffs.append(f"{self.cores} cores, not {cores}")
        return "; ".join(diffs) or None

    def warn_if_elsewhere(self, path: str | os.PathLike, host: str | None = None,
                          cores: int | None = None, where: str = "this machine") -> None:
        """One line on stderr when :meth:`elsewhere` finds a difference: the predictions
        then carry another machine's costs."""
        why = self.elsewhere(host, cores)
        if why:
            print(f"psring: warning: the calibration {path} was measured on another machine "
                  f"({why}); predictions for {where} use that machine's costs — run "
                  f"`psring calibrate` on {where}.", file=sys.stderr, flush=True)

    def ps_transport(self) -> tuple[float, float]:
        """(α, β) of the parameter servers' transport on loopback: the ZeroMQ ping-pong's,
        but never faster than psring's own PS round measured on this machine allows
        (``ps_round``). The cost models play that round (two workers, one server, one
        push and one pull) as two messages' latency and 2·workers passes of the bytes
        through the server's transport, so α is at least half the round's and β at
        least its β over 2·workers (tests/unit/test_psprobe.py plays the round back
        through the simulator). What the ping-pong leaves out and the round pays — the
        server's one Python thread, validation, the client, the copies — then lands on
        the transport, where a machine's extra cores do not take it off."""
        if not self.ps_round:
            return self.zmq_alpha, self.zmq_beta
        alpha, beta = self.ps_round
        return max(self.zmq_alpha, alpha / 2), max(self.zmq_beta, beta / (2 * PS_ROUND_WORKERS))

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

    def between_hosts(self, cost_model: str, link_bits: float | None,
                      delay_s: float = 0.0, loss: float = 0.0) -> tuple[float, float, str]:
        """:meth:`between_clean` on links that drop ``loss`` of each direction's
        packets: TCP's loss recovery priced by :func:`tcp_under_loss`. (Not priced:
        bounded-loss pushes, --loss-tolerance, whose datagrams' CPU and resend rounds
        the calibration does not measure; psring.predict.replay skips those runs.)"""
        alpha, beta, source = self.between_clean(cost_model, link_bits, delay_s)
        if not loss:
            return alpha, beta, source
        alpha, beta = tcp_under_loss(alpha, beta, loss)
        return alpha, beta, f"{source}, TCP under {loss:g} loss"

    def between_clean(self, cost_model: str, link_bits: float | None,
                      delay_s: float = 0.0) -> tuple[float, float, str]:
        """(α, β, source) of the transport between two hosts joined by links of
        ``link_bits``/s: measured by ``psring calibrate --hosts 2 --link RATE [--delay D]``
        when this calibration has that rate (with that delay; a calibration without the
        delay gets 2·delay added to its α); else, on paper, loopback's α plus the delay of the
        two links a message crosses, and the rate's β for TCP payload
        (psring.units.payload_beta). β is never below loopback's: a link faster than
        the transport's software does not make it faster. Unshaped links (None): the
        loopback figures."""
        alpha, beta = self.link(cost_model)
        if link_bits is None:
            return alpha, beta, "loopback"

        key = "dist" if cost_model in ("ring", "hring", "dist") else "zmq"
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
                                    for op, (a, b) in self.collectives.items()},
                       ps_round=[x / scale for x in self.ps_round])

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


