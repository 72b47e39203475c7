"""Which strategy, bucket size and servers for a model on a cluster, and why: every
setting of every strategy the cluster can run, simulated (psring.predict.sim.simulate) and
ranked, with the sentence that says what bounds each.

    from psring.predict.advise import candidates, rank, recommendations
    cands = refine(candidates(profile, Cluster.of(hosts=4, link_bits=10e9), cal, classes))
    ranking = rank(cands)         # the best synchronous setting of each strategy, best first
    print(*recommendations(cands, ranking, classes), sep="\n")
    print(*options(cands, ranking, classes), sep="\n")   # async, compressed: what they change

``classes`` maps strategy names to their classes (psring.strategies), so this module
needs neither torch nor the registry. ``psring advise`` (psring.commands.advise)
profiles the model, prints the ranking and with ``--verify`` measures it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from psring.cluster.spec import Cluster
from psring.predict.analytic import ps_link_load
from psring.predict.failures import with_failures
from psring.predict.sim.simulate import COST_MODELS, FLOW_DRAWS, Prediction, simulate
from psring.records.profile import Profile

BUCKET_MB = (1.0, 5.0, 25.0, 100.0)


@dataclass
class Candidate:
    strategy: str
    prediction: Prediction
    #: the simulation again (its keywords: simulate's ``draws``), where the prediction is
    #: one draw of the flows' shares; None where nothing is drawn
    play: Callable[..., Prediction] | None = field(default=None, repr=False)

    @property
    def cluster(self) -> Cluster:
        return self.prediction.cluster

    @property
    def bucket_mb(self) -> float:
        return self.prediction.settings["bucket_mb"]

    @property
    def compress(self) -> str:
        return self.prediction.settings["compress"]

    def setting(self, uses_servers: bool, compresses: bool) -> str:
        c = self.cluster
        parts = [f"bucket {self.bucket_mb:g} MB"]
        if uses_servers:
            where = "on own hosts" if c.placement == "own-hosts" else "colocated"
            parts.append(f"{c.servers} server{'s' if c.servers > 1 else ''} {where}")
        if compresses and self.compress != "none":
            parts.append(self.compress)
        if "update_on" in self.prediction.settings:
            parts.append(f"update on the {self.prediction.settings['update_on']}s")
        return ", ".join(parts)

    def run_flags(self) -> dict[str, Any]:
        c = self.cluster
        flags = {"strategy": self.strategy, "bucket_mb": self.bucket_mb, "servers": c.servers,
                 "server_placement": c.placement, "compress": self.compress}
        if "update_on" in self.prediction.settings:
            flags["update_on"] = self.prediction.settings["update_on"]
        return flags


def candidates(profile: Profile, base: Cluster, cal: Any, classes: dict[str, Any],
               max_servers: int = 8, cores: int | None = None,
               link_bits: float | None = None, delay_s: float | None = None,
               inside: tuple[float, float] | None = None,
               cal_of: Callable[[Cluster], Any] | None = None,
               fluid: bool = False) -> list[Candidate]:
    """Every setting of every strategy the cluster can run, simulated: servers up to
    ``max_servers`` (and twice the hosts); ``cores``: shared by every process (the
    cluster emulated on one machine), as psring.predict.sim.simulate takes them.
    ``link_bits``, ``delay_s``: the link a server on a host of its own is reached over
    (default: the base cluster's; one host's base cluster has none, as nothing crosses).
    ``inside``: (α, β) of each host's own interconnect (--device-link), for the
    traffic among a host's workers (a flat ring's hops, byteps's and hallreduce's
    collectives); None: loopback's gloo.
    ``cal_of``: the calibration to price a cluster with (advise: this machine's costs
    on the clock of the run that would verify it); None: ``cal`` for every one.
    A prediction is one draw of the flows' shares where its cost model draws them
    (psring.predict.sim.engine.Flows); :func:`refine` averages the ones that matter.
    ``fluid``: the parameter servers priced in closed form (simulate's ``fluid``: no
    draws, a cost that does not grow with workers x servers; the scaling question)."""
    link = base.link_bits if link_bits is None else link_bits
    delay = base.delay_s if delay_s is None else delay_s
    out = []
    seen_buckets: list[float] = []
    for mb in BUCKET_MB:  # bucket sizes that bucket this model differently
        if not any(profile.buckets(mb) == profile.buckets(m) for m in seen_buckets):
            seen_buckets.append(mb)
    max_k = max(1, min(max_servers, 2 * base.hosts))
    for name, cls in classes.items():
        if cls.caps.cost_model is None:
            out.append(Candidate(name, simulate(profile, base, None,
                                                cal_of(base) if cal_of else cal,
                                                cores=cores, inside=inside)))
            continue
        if cls.caps.needs_equal_hosts and base.workers // base.hosts < 2:
            continue  # per-host aggregation with one worker a host: its flat twin's setting
        # where the optimizer runs, when the strategy offers a choice (byteps)
        updates = list(cls.caps.update_sites) if len(cls.caps.update_sites) > 1 else ["server"]
        servers = [1 << i for i in range(max_k.bit_length())] if cls.caps.uses_servers \
            else [1]
        placements = ["colocated", "own-hosts"] if cls.caps.uses_servers and link \
            else ["colocated"]
        compress = ["none", "fp16"] if cls.caps.supports_compression else ["none"]
        for mb in seen_buckets:
            for k in servers:
                for place in placements:
                    for comp, up in itertools.product(compress, updates):
                        cl = Cluster.of(hosts=base.hosts,
                                        workers_per_host=base.workers // base.hosts,
                                        link_bits=link, delay_s=delay, servers=k,
                                        placement=place, loss=base.loss)
                        priced = cal_of(cl) if cal_of else cal
                        play = partial(simulate, profile, cl, cls.caps.cost_model, priced,
                                       compress=comp, bucket_mb=mb, cores=cores,
                                       update_on=up, inside=inside, fluid=fluid)
                        draws = COST_MODELS.get(cls.caps.cost_model).draws_flows \
                            and not (fluid and COST_MODELS.get(cls.caps.cost_model).fluid)
                        out.append(Candidate(name, play(), play if draws else None))
    return out


def refine(cands: list[Candidate], draws: int = FLOW_DRAWS) -> list[Candidate]:
    """Each strategy's best settings priced again as the mean of ``draws`` draws of the
    flows' shares, until the best of each strategy (and compression) is such a mean: a
    synchronous PS whose workers can fall out of step is a random process, and ranking
    one draw of every setting would pick the luckiest. Cheaper than averaging every
    setting: most are never near the top. Returns ``cands``, changed in place."""
    groups: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
    for c in cands:
        if c.play is not None and draws > 1:
            groups[(c.strategy, c.compress)].append(c)
    for group in groups.values():
        done: set[int] = set()
        while (best := min(group, key=preference)) and id(best) not in done:
            best.prediction = best.play(draws=draws)
            done.add(id(best))
    return cands


def changes_training(c: Candidate) -> str:
    """What a setting changes in what is trained ('' when nothing): asynchronous updates
    (staleness) and compressed gradients (precision). Faster per step is not faster to
    a trained model, and the simulator prices steps, not steps to a target."""
    what = []
    if c.prediction.cost_model == "ps-async":
        what.append("workers apply gradients of parameters some updates old (staleness: "
                    "more steps to a target, --max-staleness bounds it)")
    if c.compress != "none":
        what.append(f"gradients travel in {c.compress} (rounded to about 3 significant "
                    f"digits)")
    return "; ".join(what)


def preference(c: Candidate) -> float:
    """The predicted step, handicapped by 0.5% per server beyond the first (processes,
    and machines, that must pay for themselves)."""
    name = c.prediction.cost_model
    k = 1 + 0.005 * (c.cluster.servers - 1) \
        if name is not None and COST_MODELS.get(name).servers else 1.0
    return c.prediction.step_s * k


def rank(cands: list[Candidate]) -> list[Candidate]:
    """The answer: the best synchronous, uncompressed setting of each strategy, best
    first (:func:`preference`): they train what one worker would. Settings that change
    the training are :func:`options`."""
    best: dict[str, Candidate] = {}
    for c in cands:
        if changes_training(c):
            continue
        if c.strategy not in best or preference(c) < preference(best[c.strategy]):
            best[c.strategy] = c
    return sorted(best.values(), key=preference)


def options(cands: list[Candidate], ranking: list[Candidate],
            classes: dict[str, Any]) -> list[str]:
    """Settings that change what is trained, with their predicted gain over the answer
    and what they change: the best of each asynchronous strategy, and the answer's own
    strategy with compression (or the best that compresses, when it cannot)."""
    win = ranking[0]
    picks: list[Candidate] = []
    for name in sorted({c.strategy for c in cands if c.prediction.cost_model == "ps-async"}):
        same = [c for c in cands if c.strategy == name and c.compress == "none"]
        if same:
            picks.append(min(same, key=preference))
    # compression of the answer's strategy, or, when it cannot compress (byteps), of the
    # best ranked one that can
    base = next((c for c in ranking if classes[c.strategy].caps.supports_compression), win)
    squeezed = [c for c in cands if c.strategy == base.strategy and c.compress != "none"
                and c.bucket_mb == base.bucket_mb and c.cluster.servers == base.cluster.servers
                and c.cluster.placement == base.cluster.placement]
    if squeezed:
        picks.append(min(squeezed, key=preference))
    lines = []
    for c in sorted(picks, key=preference):
        cls = classes[c.strategy]
        gain = 1 - c.prediction.step_s / win.prediction.step_s
        verdict = f"{gain:.0%} less per step than the answer" if gain > 0 else \
            f"no faster per step ({-gain:.0%} more)"
        setting = c.setting(cls.caps.uses_servers, cls.caps.supports_compression)
        lines.append(f"Option: {c.strategy} ({setting}), {c.prediction.step_s * 1e3:.1f} ms "
                     f"per step, {verdict}; it changes the "
                     f"training: {changes_training(c)}. Worth it only if the steps it saves "
                     f"outweigh the extra steps it needs to the same accuracy "
                     f"(experiments/async_tta.toml measures both).")
    return lines


def with_failure_rate(cands: list[Candidate], ranking: list[Candidate],
                      classes: dict[str, Any], f: Any) -> tuple[list[dict], list[str]]:
    """The ranking's strategies, and the best of each that goes on without a lost worker
    (async-ps, an option), priced with failures (psring.predict.failures): each one's
    expected step and why, fastest first, and the lines that say whether the failures
    change the answer."""

    picks = list(ranking)
    for name, cls in classes.items():
        if cls.caps.survives_lost_workers and name not in {c.strategy for c in picks}:
            own = [c for c in cands if c.strategy == name and c.compress == "none"]
            if own:
                picks.append(min(own, key=preference))
    rows = []
    for c in picks:
        caps = classes[c.strategy].caps
        step, why_ = with_failures(c.prediction.step_s, caps, c.cluster.workers,
                                   c.cluster.servers if caps.uses_servers else 0, f)
        rows.append({"strategy": c.strategy, "step_s": c.prediction.step_s,
                     "with_failures_s": step, "why": why_,
                     "changes_training": bool(changes_training(c))})
    rows.sort(key=lambda r: r["with_failures_s"])
    same = [r for r in rows if not r["changes_training"]]
    lines = [f"With failures (a process fails every {f.mtbf_s / 3600:g} h on average, a "
             f"checkpoint every {f.checkpoint_s / 60:g} min, {f.restart_s:g} s a restart, "
             f"a {f.job_s / 3600:g} h job): " + ", ".join(
                 f"{r['strategy']} {r['with_failures_s'] * 1e3:.1f} ms" for r in rows) + "."]
    if same and same[0]["strategy"] != ranking[0].strategy:
        lines.append(f"Failures change the answer: {same[0]['strategy']} is the fastest "
                     f"with them ({ranking[0].strategy} without).")
    else:
        lines.append(f"Failures at this rate do not change the answer "
                     f"({ranking[0].strategy}).")
    return rows, lines


def why(c: Candidate, cls: Any) -> str:
    """One sentence: what bounds this strategy's step on this cluster, in numbers."""
    p, cl = c.prediction, c.cluster
    n = cl.workers
    M = p.gradient_bytes * (0.5 if c.compress != "none" else 1.0)
    mb = lambda b: f"{b / 1e6:.3g} MB"  # noqa: E731
    comm = f"{p.phases['comm_s'] * 1e3:.1f} ms of communication exposed"
    if cls.caps.cost_model is None:
        return (f"no messages: the step is compute ({p.step_s * 1e3:.1f} ms); "
                + ("workers share one memory" if n > 1 else "one worker"))
    if p.bound == "compute":
        return f"compute-bound: communication hides under backward ({comm})"
    if p.bound == "latency":
        return (f"latency-bound: per-message costs (α) outweigh the bytes; {comm}")
    if p.bound == "cores (shared)":
        return (f"bound by this machine's shared cores: the workers' compute and every "
                f"message's software cost exceed the cores' time ({comm})")
    if cls.caps.cost_model == "hring":
        h = len(set(cl.worker_host))
        return (f"bound by the {p.bound}: each host link carries 2(H−1)/H·M = "
                f"{mb(2 * (h - 1) / h * M)} each way per step, in 2(H−1) = {2 * (h - 1)} "
                f"steps, after the host's reduce-scatter ({comm})")
    if cls.caps.cost_model == "ring":
        return (f"bound by the {p.bound}: each worker sends and receives 2(n−1)/n·M = "
                f"{mb(2 * (n - 1) / n * M)} per step ({comm})")
    if cls.caps.cost_model not in ("ps", "ps-async", "byteps"):  # a plugin's cost model
        return (f"bound by the {p.bound} (cost model {cls.caps.cost_model}; {comm})")
    tail = "; no worker waits for another (staleness: see the option)" \
        if cls.caps.cost_model == "ps-async" else ""
    if "link" in p.bound:
        # byteps: one push a host (its workers' parts), so one pusher per host
        pushers = sorted(set(cl.worker_host)) if cls.caps.cost_model == "byteps" else cl.worker_host
        cross = ps_link_load(pushers, cl.server_host)
        return (f"bound by the {p.bound}: the busiest host link carries {mb(cross * M)} each way "
                f"per step, {cl.servers} server(s) {cl.placement} ({comm}){tail}")
    if "CPU" in p.bound:
        return (f"bound by the {p.bound}: each server adds n·M/K = "
                f"{mb(n * p.gradient_bytes / cl.servers)} of gradients and updates its shard "
                f"per step ({comm}){tail}")
    if p.bound.endswith(("d2h", "h2d")):
        return (f"bound by the {p.bound} copy: each worker copies its gradients to host "
                f"memory and the parameters back, {mb(M)} each way per step, at the host's "
                f"PCIe rate ({comm}){tail}")
    if p.bound.startswith("worker"):
        return (f"bound by the {p.bound}: each worker sends and receives 2·M = {mb(2 * M)} "
                f"per step ({comm}){tail}")
    return (f"bound by the {p.bound}: each server's transport carries 2n·M/K = "
            f"{mb(2 * n * M / cl.servers)} per step ({comm}){tail}")


def recommendations(cands: list[Candidate], ranking: list[Candidate],
                    classes: dict[str, Any]) -> list[str]:
    win = ranking[0]
    cls = classes[win.strategy]
    setting = win.setting(cls.caps.uses_servers, cls.caps.supports_compression)
    lines = [f"Fastest: {win.strategy} ({setting}), "
             f"{win.prediction.step_s * 1e3:.1f} ms per step, scaling efficiency "
             f"{win.prediction.efficiency:.0%}."]
    if cls.caps.cost_model is not None:
        same = [c for c in cands if c.strategy == win.strategy
                and c.cluster.servers == win.cluster.servers
                and c.cluster.placement == win.cluster.placement
                and c.compress == win.compress
                and c.prediction.settings.get("update_on")
                == win.prediction.settings.get("update_on")]  # (byteps: one line a size)
        by_mb = sorted(same, key=lambda c: c.bucket_mb)
        lines.append("Bucket size: " + f"{win.bucket_mb:g} MB (" + ", ".join(
            f"{c.bucket_mb:g} MB {c.prediction.step_s * 1e3:.1f} ms" for c in by_mb)
            + ").")
    ps = [c for c in cands if classes[c.strategy].caps.uses_servers
          and classes[c.strategy].caps.cost_model == "ps" and not changes_training(c)]
    if ps:
        best = min(ps, key=preference)
        one = min((c for c in ps if c.cluster.servers == 1), key=preference)
        where = ("on hosts of their own" if best.cluster.placement == "own-hosts"
                 else "colocated with the workers")
        lines.append(f"Parameter servers: {best.cluster.servers} {where}"
                     f" ({best.prediction.step_s * 1e3:.1f} ms per step; one colocated or not: "
                     f"{one.prediction.step_s * 1e3:.1f} ms).")
    return lines


def table(ranking: list[Candidate], classes: dict[str, Any]) -> list[list[str]]:
    rows = []
    for i, c in enumerate(ranking, 1):
        p, cls = c.prediction, classes[c.strategy]
        rows.append([str(i), c.strategy,
                     c.setting(cls.caps.uses_servers, cls.caps.supports_compression),
                     f"{p.step_s * 1e3:.1f}",
                     f"{(p.step_s - p.phases['comm_s']) * 1e3:.1f}",
                     f"{p.phases['comm_s'] * 1e3:.1f}", f"{p.samples_per_s:.0f}",
                     f"{p.efficiency:.0%}", why(c, cls)])
    return rows


HEADER = ["#", "strategy", "best setting", "step ms", "compute ms", "comm ms (exposed)",
          "samples/s", "efficiency", "why"]


def plot(ranking: list[Candidate], title: str, path: Path) -> Path:
    """advise.png: each strategy's best predicted step, compute and exposed communication."""
    # matplotlib is imported here, not at the top: it costs ~0.5 s and only the picture
    # needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.strategy for c in ranking][::-1]
    comp = [(c.prediction.step_s - c.prediction.phases["comm_s"]) * 1e3 for c in ranking][::-1]
    comm = [c.prediction.phases["comm_s"] * 1e3 for c in ranking][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.6))
    ax.barh(names, comp, color="#4c72b0", label="compute")
    ax.barh(names, comm, left=comp, color="#dd8452", label="communication (exposed)")
    for y, (a, b, c) in enumerate(zip(comp, comm, ranking[::-1])):
        ax.text(a + b, y, f" {a + b:.1f} ms · {c.prediction.bound}", va="center", fontsize=8)
    ax.set_xlabel("predicted ms per step (best setting of each strategy)")
    ax.set_xlim(0, max(a + b for a, b in zip(comp, comm)) * 1.5)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verify_candidates(ranking: list[Candidate], classes: dict[str, Any]) -> list[Candidate]:
    """The winner, the runner-up, and the best of the other family (ring or PS)."""
    # ring or parameter server (async-ps is of the PS family)
    family = lambda c: {"ps-async": "ps", "byteps": "ps", "hring": "ring"}.get(  # noqa: E731
        classes[c.strategy].caps.cost_model, classes[c.strategy].caps.cost_model)
    # (device mode emulates each worker's device: strategies whose workers share one
    # memory, hogwild, have none to emulate)
    ranking = [c for c in ranking if classes[c.strategy].caps.emulates_device]
    top = ranking[:2]
    other = next((c for c in ranking if c not in top and family(c) not in
                  {family(t) for t in top} and family(c) is not None), None)
    if other is not None:
        top.append(other)
    return top
