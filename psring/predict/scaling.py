"""How each strategy scales: its best setting priced at 1, 2, 4, … N workers, the
largest count that keeps a target efficiency, the servers a parameter server needs
there, the per-worker batch that would keep it, and where communication stops hiding
under backward (``psring advise --max-workers``).

    from psring.predict.scaling import scale
    curves = scale(profile, cal, classes, max_workers=1024, per_host=8, link_bits=25e9)
    for name, curve in curves.items():
        print(name, curve.recommended(0.8), [round(p.efficiency, 2) for p in curve.points])

Each size is a cluster of ``per_host`` workers a host (fewer workers than that: one
host holding them), the per-worker batch the profile's (weak scaling: the global batch
grows with the workers). Every setting :func:`psring.predict.advise.candidates` tries
(bucket size; servers 1, 2, 4, … up to twice the hosts, with the workers or on hosts of
their own; byteps's update site) is priced, and the best synchronous uncompressed one
kept (what one worker would train). The rings are played by the simulator's
timeline; the parameter servers' settings are ranked by its fluid
(psring.predict.sim.fluid), whose cost does not grow with workers × servers, and on
small clusters (:func:`by_fluid`) its best with the servers among the workers and its
best with them on hosts of their own are priced again by its events, TCP's uneven
shares drawn (the mean of several draws, as advise ranks), and the faster kept: the
fluid leaves that cost out (:func:`by_events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from psring.cluster.spec import Cluster
from psring.errors import ConfigError
from psring.predict.advise import Candidate, candidates
from psring.predict.published import Published
from psring.predict.sim.cost_models import COST_MODELS
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile

#: the most workers the scaling question takes (a ladder of 17 sizes)
MAX_WORKERS = 65536
#: a step is compute-bound while the communication it exposes is under this share of it
#: (psring.predict.sim.cost_models.finish names such a step's bound "compute")
HIDDEN = 0.05
#: settings whose steps differ by less than this share are as fast as each other
TIE = 0.005
#: the parameter servers' chosen settings are priced by their events (the mean of
#: EVENTS_DRAWS draws of TCP's uneven shares) up to this many workers, where the
#: events' messages a step, workers × (servers + buckets), are at most EVENTS_MESSAGES
#: (their cost grows with that count: the pricing of 1 to 1024 workers stays within
#: seconds); else by the fluid
EVENTS_UP_TO = 16
EVENTS_MESSAGES = 320
EVENTS_DRAWS = 2


def by_fluid(profile: Profile, cluster: Cluster, bucket_mb: float) -> bool:
    """Whether a parameter server's step on ``cluster`` is priced by the fluid rather
    than by its events."""
    if not 1 < cluster.workers <= EVENTS_UP_TO:
        return True  # (one worker's flows share nothing; many: the events' cost)
    return cluster.workers * (max(1, cluster.servers) + len(profile.buckets(bucket_mb))) \
        > EVENTS_MESSAGES


def priced(profile: Profile, cal: Any, cost_model: str, cluster: Cluster, bucket_mb: float,
           compress: str = "none", update_on: str = "server",
           inside: tuple[float, float] | None = None, draws: int = EVENTS_DRAWS):
    """A setting's step as the scaling question prices it: the rings by their timeline,
    the parameter servers by their events (the mean of ``draws`` draws of TCP's
    shares) where :func:`by_fluid` allows, else by the fluid."""
    fluid = by_fluid(profile, cluster, bucket_mb)
    return simulate(profile, cluster, cost_model, cal, compress=compress,
                    bucket_mb=bucket_mb, update_on=update_on,
                    inside=inside if cluster.workers > cluster.hosts else None,
                    fluid=fluid, draws=1 if fluid else draws)


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, … up to ``max_workers``, and ``max_workers`` itself."""
    out = [1 << i for i in range(max_workers.bit_length()) if 1 << i <= max_workers]
    return out if out[-1] == max_workers else [*out, max_workers]


def check_scaling(max_workers: int, target: float, per_host: int) -> None:
    """The flags of the scaling question, or a ConfigError that names the fix."""
    if isinstance(max_workers, bool) or not 1 <= max_workers <= MAX_WORKERS:
        raise ConfigError(f"--max-workers {max_workers}: give a worker count from 1 to "
                          f"{MAX_WORKERS} (the largest cluster to price; the sizes are 1, 2, "
                          f"4, … and it).")
    if not (0 < target <= 1):
        raise ConfigError(f"--target-efficiency {target:g}: give a share in (0, 1], e.g. 0.8 "
                          f"(the throughput N workers must keep of N times one worker's).")
    odd = [n for n in worker_counts(max_workers) if n > per_host and n % per_host]
    if odd:
        raise ConfigError(f"--workers-per-host {per_host} does not divide "
                          f"{', '.join(map(str, odd[:4]))} of the sizes priced (1, 2, 4, … "
                          f"{max_workers}): give a power of two, and a --max-workers that "
                          f"is a multiple of it.")


def cluster_at(n: int, per_host: int, link_bits: float | None, delay_s: float = 0.0,
               loss: float = 0.0) -> Cluster:
    """The cluster of ``n`` workers, ``per_host`` a host (one host for fewer)."""
    g = min(per_host, n)
    return Cluster.of(hosts=n // g, workers_per_host=g, link_bits=link_bits,
                      delay_s=delay_s, loss=loss)


@dataclass
class Point:
    """A strategy's best setting at one size, and its predicted step."""

    workers: int
    hosts: int
    servers: int
    placement: str
    bucket_mb: float
    step_s: float
    comm_s: float
    samples_per_s: float
    efficiency: float
    bound: str
    setting: str
    update_on: str | None = None
    #: the step with fp16 gradients where that is faster (an option: it changes the
    #: training's precision); None where the strategy cannot compress or gains nothing
    compressed_step_s: float | None = None
    #: the setting as advise ranks it (what --verify runs)
    candidate: Candidate | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, c: Candidate, uses_servers: bool, compresses: bool) -> "Point":
        p, cl = c.prediction, c.cluster
        return cls(cl.workers, cl.hosts, cl.servers if uses_servers else 0,
                   cl.placement if uses_servers else "", c.bucket_mb, p.step_s,
                   p.phases["comm_s"], p.samples_per_s, p.efficiency, p.bound,
                   c.setting(uses_servers, compresses), p.settings.get("update_on"),
                   candidate=c)

    def to_dict(self, epoch_samples: int = 0) -> dict[str, Any]:
        out = {"workers": self.workers, "hosts": self.hosts, "servers": self.servers,
               "placement": self.placement, "bucket_mb": self.bucket_mb,
               "step_s": self.step_s, "comm_s": self.comm_s,
               "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
               "bound": self.bound, "setting": self.setting}
        if self.update_on:
            out["update_on"] = self.update_on
        if self.compressed_step_s is not None:
            out["compressed_step_s"] = self.compressed_step_s
        if epoch_samples and self.samples_per_s:
            out["epoch_s"] = epoch_samples / self.samples_per_s
        return out


@dataclass
class Curve:
    strategy: str
    points: list[Point]

    def recommended(self, target: float) -> int:
        """The largest worker count priced whose efficiency meets ``target`` (1: none
        beyond one worker does)."""
        ok = [p.workers for p in self.points if p.efficiency >= target - 1e-9]
        return max(ok, default=1)

    def at(self, workers: int) -> Point | None:
        return next((p for p in self.points if p.workers == workers), None)

    def knee(self) -> Point | None:
        """The first size at which communication stops hiding under backward: its
        exposed share of the step grows by HIDDEN or more over the size before (a
        strategy that exposes a little at every size, the last bucket's reduction or a
        PS's pull, has its knee where that starts to grow)."""
        share = [p.comm_s / p.step_s if p.step_s else 0.0 for p in self.points]
        return next((p for i, p in enumerate(self.points)
                     if i and share[i] - share[i - 1] >= HIDDEN), None)


def runnable(classes: dict[str, Any], n: int, hosts: int) -> dict[str, Any]:
    """The strategies of ``classes`` that run ``n`` workers on ``hosts`` hosts."""
    return {name: cls for name, cls in classes.items()
            if (cls.caps.max_workers is None or n <= cls.caps.max_workers)
            and (cls.caps.max_hosts is None or hosts <= cls.caps.max_hosts)}


def scale(profile: Profile, cal: Any, classes: dict[str, Any], max_workers: int,
          per_host: int = 1, link_bits: float | None = None, delay_s: float = 0.0,
          loss: float = 0.0, inside: tuple[float, float] | None = None,
          sizes: list[int] | None = None) -> dict[str, Curve]:
    """Each strategy's best setting at every size (``sizes``, default
    :func:`worker_counts`), on clusters of ``per_host`` workers a host joined by
    ``link_bits`` links (``inside``: a host's own interconnect, as advise takes it);
    a strategy that cannot run a size (single beyond one worker, hogwild beyond one
    host) has no point there."""
    curves: dict[str, Curve] = {name: Curve(name, []) for name in classes}
    for n in sizes or worker_counts(max_workers):
        base = cluster_at(n, per_host, link_bits, delay_s, loss)
        can = runnable(classes, n, base.hosts)
        if link_bits is None and base.hosts > 1:
            raise ConfigError(f"{n} workers at {per_host} a host span {base.hosts} hosts: "
                              f"give the link between them, --link RATE.")
        own = 2 * base.hosts if link_bits else base.hosts
        cands = candidates(profile, base, cal, can, max_servers=max(1, own), cores=None,
                           inside=inside if base.workers > base.hosts else None, fluid=True)
        best = by_events(profile, cal, classes, cands, inside)
        squeezed = best_of_each(cands, compressed=True)
        for c in best.values():
            caps = classes[c.strategy].caps
            point = Point.of(c, caps.uses_servers, caps.supports_compression)
            fp16 = squeezed.get(c.strategy)
            if fp16 is not None and fp16.prediction.step_s < point.step_s:
                point.compressed_step_s = fp16.prediction.step_s
            curves[c.strategy].points.append(point)
    return {k: v for k, v in curves.items() if v.points}


def by_events(profile: Profile, cal: Any, classes: dict[str, Any], cands: list[Candidate],
              inside: tuple[float, float] | None) -> dict[str, Candidate]:
    """Each strategy's best uncompressed setting (:func:`best_of_each`); a parameter
    server's fluid ranks its settings, and where :func:`by_fluid` allows, the fluid's
    best with the servers among the workers and its best with them on hosts of their
    own are priced again by the events and the faster kept: TCP's uneven shares, which
    the fluid leaves out, cost a round whose hosts carry replies beside their pushes
    far more than one whose servers have hosts of their own."""
    best = best_of_each(cands)
    for name, c in best.items():
        model = classes[name].caps.cost_model
        if not model or COST_MODELS.get(model).fluid is None \
                or by_fluid(profile, c.cluster, c.bucket_mb):
            continue
        other = best_of_each([x for x in cands if x.strategy == name
                              and x.cluster.placement != c.cluster.placement]).get(name)
        tried = [c] if other is None or by_fluid(profile, other.cluster, other.bucket_mb) \
            else [c, other]
        for x in tried:
            x.prediction = priced(profile, cal, model, x.cluster, x.bucket_mb, x.compress,
                                  x.prediction.settings.get("update_on", "server"), inside)
        best[name] = min(tried, key=lambda x: x.prediction.step_s)
    return best


def best_of_each(cands: list[Candidate], compressed: bool = False) -> dict[str, Candidate]:
    """Each strategy's fastest uncompressed setting (``compressed``: its fastest
    compressed one, an option that changes training), asynchronous ones included (they
    scale too; ``changes_training`` says what they change); of the settings within TIE
    of the fastest, the one with the fewest servers (advise's 0.5% a server would price
    a thousand servers out of a cluster that needs them)."""
    by: dict[str, list[Candidate]] = {}
    for c in cands:
        if (c.compress != "none") == compressed:
            by.setdefault(c.strategy, []).append(c)
    out = {}
    for name, group in by.items():
        fastest = min(c.prediction.step_s for c in group)
        near = [c for c in group if c.prediction.step_s <= fastest * (1 + TIE)]
        out[name] = min(near, key=lambda c: (c.cluster.servers, c.prediction.step_s))
    return out


def at_batch(profile: Profile, batch: int) -> Profile:
    """The profile at a per-worker batch of ``batch``: its data, forward and backward
    (and each gradient's ready time) in proportion to the batch, the optimizer's step
    as it is (it does not depend on the batch). A device's time per sample falls as
    the batch grows until the device is full, so below the profiled batch this is
    optimistic: profile the batch it finds to be sure."""
    if not profile.batch_size:
        raise ConfigError("the profile has no batch size: profile the model with "
                          "`psring profile` to ask for a batch.")
    r = batch / profile.batch_size
    return replace(profile, ready_s=[t * r for t in profile.ready_s],
                   forward_s=profile.forward_s * r, backward_s=profile.backward_s * r,
                   data_s=profile.data_s * r, batch_size=batch,
                   source=dict(profile.source, batch_from=profile.batch_size))


def batch_for(profile: Profile, cal: Any, cls: Any, point: Point, target: float,
              inside: tuple[float, float] | None = None,
              factors: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
              ) -> tuple[int, float] | None:
    """The guidelines' batch: the smallest per-worker batch, the profile's times a
    power of two up to 64, whose efficiency at ``point``'s size and setting (its
    candidate's cluster, bucket and update site) meets ``target`` (compute grows with
    the batch, communication does not); (batch, efficiency), or None when even 64
    times the batch falls short. (A larger global batch changes training: the learning
    rate and its warm-up must follow it.)"""
    cl = point.candidate.cluster
    for f in factors:
        prof = at_batch(profile, profile.batch_size * f)
        p = priced(prof, cal, cls.caps.cost_model, cl, point.bucket_mb,
                   update_on=point.update_on or "server", inside=inside)
        if p.efficiency >= target - 1e-9:
            return prof.batch_size, p.efficiency
    return None


def knee_sentence(curve: Curve, target: float) -> str:
    """Where this strategy's communication stops hiding under backward, in numbers."""
    k = curve.knee()
    rec = curve.recommended(target)
    if k is None:
        first, last = curve.points[0], curve.points[-1]
        exposed = first.comm_s / first.step_s if first.step_s else 0.0
        how = (f"exposes about {exposed:.0%} of the step at every size from "
               f"{first.workers}" if exposed >= HIDDEN and first.workers > 1 else
               "hides under backward")
        return (f"{curve.strategy}: communication {how} up to {last.workers} worker(s) "
                f"(efficiency {last.efficiency:.0%}); {rec} worker(s) keep {target:.0%}.")
    before = [p for p in curve.points if p.workers < k.workers]
    where = f"between {before[-1].workers} and {k.workers}" if before else f"at {k.workers}"
    return (f"{curve.strategy}: communication stops hiding under backward {where} "
            f"workers (at {k.workers}: {k.comm_s * 1e3:.1f} of {k.step_s * 1e3:.1f} ms "
            f"exposed, bound by {k.bound}); {rec} worker(s) keep {target:.0%}"
            + (f" ({_at(curve, rec)})" if rec > 1 else "") + ".")


def _at(curve: Curve, n: int) -> str:
    p = curve.at(n)
    return f"{p.setting}, efficiency {p.efficiency:.0%}" if p else ""


def plot(curves: dict[str, Curve], title: str, path: Path, target: float,
         marks: list[Published] = ()) -> Path:
    """scaling.png: efficiency against workers (log2), one line per strategy, the
    target as a dashed line, and ``marks`` (published points) as stars."""
    # matplotlib is imported here, not at the top: it costs ~0.5 s and only the picture
    # needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    # (strategies that share a cost model draw the same line: styles tell them apart)
    styles = ("-", "--", ":", "-.")
    for i, (name, c) in enumerate(curves.items()):
        if len(c.points) > 1:
            ax.plot([p.workers for p in c.points], [p.efficiency for p in c.points],
                    marker="os^dv"[i % 5], ms=3, ls=styles[i % 4], label=name)
    for m in marks:
        ax.plot([m.workers], [m.efficiency], marker="*", ms=14, color="black", ls="none")
        ax.annotate(f"{m.source} ({m.strategy})", (m.workers, m.efficiency),
                    textcoords="offset points", xytext=(-8, 8), ha="right", fontsize=7)
    ax.axhline(target, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency (predicted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["MAX_WORKERS", "Curve", "Point", "at_batch", "batch_for", "best_of_each",
           "check_scaling", "cluster_at", "knee_sentence", "plot", "scale", "worker_counts"]
