"""``psring advise``: which strategy, bucket size and servers for this model on that
cluster, and why — predicted by the simulator (psring.predict.sim.simulate), optionally
verified.

    psring advise --model resnet18 --batch-size 64 --hosts 4 --workers-per-host 1 --link 10gbit
    psring advise --model vgg11 --width 8 --hosts 2 --link 1gbit --verify
    psring advise --profile runs/prof-r18 --hosts 16 --link 25gbit     (a saved profile)

Without ``--profile`` it first profiles the model (psring.records.profile: one short traced
``single`` run at the per-worker batch, a few seconds). Then, for every registered
strategy that can run on the cluster, it simulates each of its settings — bucket size
(1, 5, 25, 100 MB), parameter servers K (1, 2, 4, 8, up to twice the hosts) placed with
the workers or on hosts of their own, and fp16 compression where the strategy supports
it — and ranks the strategies by their best synchronous, uncompressed predicted step
time, each with the one sentence that says what bounds it; asynchronous and compressed
settings follow as options, with their gain and what they change. It prints the table,
writes ``advise.png`` and ``advise.json`` into ``--out``, and recommends a bucket size
and the servers. ``--device-speed X`` asks about devices X times as fast as the
profile's (a GPU cluster, from a laptop's profile). ``--device-link nvlink`` (or a rate,
as ``psring run`` takes it; psring.comm.interconnect) gives each host's own interconnect:
the collectives among a host's workers (byteps's and hallreduce's reduce-scatter and
all-gather) are priced at its time instead of this machine's loopback gloo, and
``--verify`` runs those strategies with it. ``--mtbf HOURS`` (with
``--checkpoint-minutes``, ``--restart-s``, ``--job-hours``) prices each strategy's step
with failures too and says whether they change the answer (psring.predict.failures).
A parameter server's settings are one draw of the flows' shares each; each strategy's
best are priced again as the mean of four (psring.predict.advise.refine).

This module is the command: its flags, the profile and calibration it needs, the
printing, and ``--verify``; the ranking itself is psring.predict.advise.

``--verify`` runs the winner, the runner-up and the best of the other family (ring vs
parameter server) on this machine as the cluster's emulation (psring.cluster.emulate: one
network namespace per host, links shaped to ``--link``) and prints predicted against
measured step times. Each worker there is a device with the ranked profile's times
(``--compute device``, psring.train.device): the verified cluster is the described one, a
device per worker, not this machine's shared cores. Clusters larger than this machine
can hold are refused for ``--verify`` with the reason.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from psring.cluster.spec import Cluster
from psring.comm.interconnect import alpha_beta, check_hosts, host_copy, not_timed, on_host, parse
from psring.commands import scaling
from psring.config import RunConfig
from psring.errors import ConfigError
from psring.predict.advise import (
    HEADER,
    Candidate,
    candidates,
    options,
    plot,
    rank,
    recommendations,
    refine,
    table,
    verify_candidates,
    with_failure_rate,
)
from psring.predict.calibration import Calibration, find_calibration
from psring.predict.failures import Failures
from psring.predict.measure import calibrate
from psring.predict.scaling import runnable
from psring.records.profile import MODEL_KEYS, Profile
from psring.records.runlog import atomic_write_json, usable_cores
from psring.report import summarize
from psring.runs.launch import launch
from psring.runs.profiling import profile_config, take_profile
from psring.train.device import required_time_scale
from psring.train.models import ModelSettings, meta_build
from psring.train.shares import check_global_batch
from psring.units import parse_delay, parse_rate

#: the most worker and server processes --verify starts on this machine: its runs are
#: device-mode (their compute off the cores, at the capacity rule's time scale), which
#: held the device's time for 16 workers and 4 servers (docs/benchmarks.md)
VERIFY_MAX_PROCESSES = 24


def _cluster(args: argparse.Namespace) -> tuple[Cluster, int]:
    """The cluster of the flags, or a ConfigError that names the fix."""
    if args.hosts < 1:
        raise ConfigError(f"--hosts {args.hosts}: a cluster has at least one host.")
    if args.workers_per_host < 0 or args.workers < 0:
        raise ConfigError("--workers and --workers-per-host count processes: give "
                          "positive numbers (or leave them out).")
    per_host = args.workers_per_host or max(1, math.ceil((args.workers or args.hosts)
                                                          / args.hosts))
    slots = args.hosts * per_host
    n = args.workers or slots
    if n > slots:
        raise ConfigError(f"--workers {n} do not fit on {args.hosts} host(s) x "
                          f"{per_host} worker(s) per host ({slots} slots): raise --hosts or "
                          f"--workers-per-host, or lower --workers.")
    if n < slots:
        raise ConfigError(f"--workers {n} would leave {slots - n} of {slots} slots empty; "
                          f"the simulator places the same number of workers on every host: "
                          f"give --workers {slots}, or leave it out.")
    link = parse_rate(args.link) if args.link else None
    delay = parse_delay(args.delay) if args.delay else 0.0
    if args.hosts > 1 and link is None:
        raise ConfigError(f"--hosts {args.hosts} needs the link between them: give "
                          f"--link RATE (e.g. 1gbit, 10gbit, 100gbit).")
    if delay and link is None:
        raise ConfigError("--delay is the links' delay: give --link RATE too (one host "
                          "and no link: nothing to delay).")
    if args.verify and n + 1 > VERIFY_MAX_PROCESSES:
        raise ConfigError(f"--verify: {n} workers and a server do not fit this machine for "
                          f"a measurement (at most {VERIFY_MAX_PROCESSES} processes); run "
                          f"advise without --verify for the prediction alone.")
    if not args.profile:

        check_global_batch(args.batch_size, n)
    loss = getattr(args, "loss", 0.0)  # (advise's own flags; --verify's runs lack it)
    if loss and link is None:
        raise ConfigError("--loss is the links' loss: give --link RATE too (one host and "
                          "no link: nothing to lose).")
    return Cluster.of(hosts=args.hosts, workers_per_host=per_host, link_bits=link,
                      delay_s=delay, loss=loss), n


def _where(hosts: int, per_host: int, link_bits: float | None, delay_s: float) -> str:
    link = "loopback" if link_bits is None else f"{link_bits / 1e9:g} Gbit/s"
    delay = f" +{delay_s * 1e3:g} ms" if delay_s else ""
    return f"{hosts} host(s) x {per_host} worker(s), {link}{delay}"


def _calibration(args: argparse.Namespace, out: Path):
    path = args.calibration or find_calibration(out)
    if path:
        cal = Calibration.load(path)
        cal.warn_if_elsewhere(path)
        return cal

    print("psring: no α-β-γ calibration found (psring calibrate); measuring a quick one",
          flush=True)
    cal = calibrate(quick=True)
    cal.save(out / "calibration.json")
    return cal


def _device_run(args: argparse.Namespace, cl: Cluster, batch: int, n: int,
                device_profile: Path) -> dict[str, Any]:
    """The flags of a device-mode run on cluster ``cl``: its workers and hosts, the
    link (where something crosses one), the global batch and the ranked profile."""
    return {"workers": n, "hosts": args.hosts, "workers_per_host": cl.workers_per_host,
            "link": args.link if args.hosts > 1 or cl.placement == "own-hosts" else "",
            "delay": args.delay, "loss": getattr(args, "loss", 0.0), "batch_size": batch,
            "compute": "device",
            "device_profile": str(device_profile)}


def verify_flags(c: Candidate, cls: Any, args: argparse.Namespace, model: dict[str, Any],
                 batch: int, n: int, out: Path, device_profile: Path) -> dict[str, Any]:
    """The RunConfig fields of candidate ``c``'s verifying run (strategy class ``cls``):
    a device-mode run of the profiled ``model`` at global batch ``batch`` on the
    cluster, with only the flags its strategy takes (psring.config refuses the others);
    --device-link where the strategy runs collectives inside a host of several workers."""
    flags = {**model, **c.run_flags(),
             **_device_run(args, c.cluster, batch, n, device_profile),
             "steps": args.verify_steps, "out": str(out / "verify" / _slug(c)),
             "timeout": 300.0}
    if not cls.caps.uses_servers:
        flags.pop("servers"), flags.pop("server_placement")
    if not cls.caps.supports_compression:
        flags.pop("compress")
    if cls.caps.uses_servers and flags["server_placement"] == "own-hosts" and not flags["link"]:
        flags["link"] = args.link

    # (Cluster.of keeps workers_per_host 0 on one host: count them)
    if args.device_link and not not_timed(cls.caps) and c.cluster.workers > c.cluster.hosts:
        flags["device_link"] = args.device_link
    return flags


#: the smallest --time-scale a verifying run takes. The rule's own minimum
#: (psring.train.device.required_time_scale) holds the device's compute: the workers'
#: passes over their gradients fit the cores. It leaves out the servers' and the
#: transports' work, which then waits for busy cores where the calibration measured
#: idle ones, so a run of short steps (one host, no link to wait on) came out far
#: slower than priced at that minimum and close to its price at this floor
#: (docs/prediction.md, "Checked here", on a 2-core machine; a machine of more cores
#: needs less, and loses only time to it). A run the rule already slows further is
#: unchanged.
VERIFY_MIN_TIME_SCALE = 16


def verify_time_scale(flags: dict[str, Any]) -> int:
    """The --time-scale a verifying run of RunConfig fields ``flags`` takes: the device
    rule's, and at least :data:`VERIFY_MIN_TIME_SCALE`."""
    return max(VERIFY_MIN_TIME_SCALE, required_time_scale(RunConfig(**flags)))


def verify_clock(cal: Calibration, args: argparse.Namespace, model: dict[str, Any], n: int,
                 device_profile: Path) -> Callable[[Cluster], Calibration]:
    """The calibration each candidate cluster is priced with: this machine's software
    costs on the clock of the run that would verify it, ``cal.faster(S)`` at its
    --time-scale S (:func:`verify_time_scale`, as :func:`verify` runs
    it, and as psring.predict.replay reads a device-mode run). A described cluster's
    links are then its own: at S = 1 a host link would be floored at this machine's
    loopback (about 31 Gbit/s here), which a GPU cluster's 100 Gbit/s link is not.
    S depends on the cluster's hosts, so on where its servers are; one per shape."""

    scaled: dict[tuple[int, str], Calibration] = {}

    def cal_of(cl: Cluster) -> Calibration:
        key = (cl.servers, cl.placement) if cl.placement == "own-hosts" else (0, "")
        if key not in scaled:
            flags = {**model, **_device_run(args, cl, args.batch_size, n, device_profile),
                     "strategy": "ps" if key[1] else "allreduce"}
            if key[1]:  # (servers on hosts of their own: more hosts, more links)
                flags.update(servers=cl.servers, server_placement=key[1])
            scaled[key] = cal.faster(verify_time_scale(flags))
        return scaled[key]

    return cal_of


def verify(top: list[Candidate], classes: dict[str, Any], args: argparse.Namespace,
           model: dict[str, Any], batch: int, n: int, out: Path,
           device_profile: Path) -> list[dict[str, Any]]:
    """Run each candidate on this machine's emulation of the cluster, each worker a
    device with the ranked profile's times (--compute device: the verified cluster is
    the described one, a device per worker, not these shared cores), the profiled
    ``model`` at global batch ``batch``; predicted vs measured step time. Each run takes
    the --time-scale at which this machine emulates it faithfully
    (:func:`verify_time_scale`)."""

    results = []
    for c in top:
        cls = classes[c.strategy]
        flags = verify_flags(c, cls, args, model, batch, n, out, device_profile)
        scale = verify_time_scale(flags)
        setting = c.setting(cls.caps.uses_servers, cls.caps.supports_compression)
        print(f"psring: verifying {c.strategy} ({setting})"
              f"{f', --time-scale {scale}' if scale > 1 else ''}", flush=True)
        run_dir = launch(RunConfig(**flags, time_scale=scale))
        measured = summarize(run_dir)["step_p50_s"]
        predicted = c.prediction.step_s
        results.append({"strategy": c.strategy, "setting": setting,
                        "predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3,
                        "error": (predicted - measured) / measured, "time_scale": scale,
                        "run": str(run_dir)})
    return results


def _scaling_flags(c: Candidate, cls: Any, args: argparse.Namespace, model: dict[str, Any],
                   batch: int, out: Path, device_profile: Path) -> dict[str, Any]:
    """A scaling point's verifying run: :func:`verify_flags` on its own cluster (its
    hosts and workers) at global batch ``batch``."""
    cl = c.cluster
    w = cl.workers
    here = argparse.Namespace(**{**vars(args), "hosts": cl.hosts,
                                 "workers_per_host": cl.workers_per_host})
    flags = verify_flags(c, cls, here, model, batch, w, out / "scaling-verify",
                         device_profile)
    flags["out"] = str(out / "scaling-verify" / f"{w}-{_slug(c)}")
    return flags


def _measure(flags: dict[str, Any]) -> tuple[float, int]:
    """Run a verifying run at the --time-scale this machine needs for it: (measured step
    p50, that scale)."""
    scale = verify_time_scale(flags)
    run_dir = launch(RunConfig(**flags, time_scale=scale))
    return summarize(run_dir)["step_p50_s"], scale


def strategy_classes(workers: int, hosts: int) -> dict[str, Any]:
    """The registered strategies the simulator can price (scaling_classes) that can run
    ``workers`` workers on ``hosts`` hosts."""
    return runnable(scaling.scaling_classes(), workers, hosts)


def _slug(c: Candidate) -> str:
    cl = c.cluster
    up = c.prediction.settings.get("update_on")
    return (f"{c.strategy}-b{c.bucket_mb:g}-k{cl.servers}-{cl.placement}-{c.compress}"
            + (f"-{up}" if up else ""))


def _model_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("model", *MODEL_KEYS, "seed")}


def _check_device_flags(args: argparse.Namespace) -> None:
    """--device-speed and --verify-steps, or a ConfigError that names the fix."""
    if not (args.device_speed > 0 and args.device_speed != float("inf")):
        raise ConfigError(f"--device-speed must be a positive number, the devices' speed "
                          f"relative to the profile's (got {args.device_speed}).")
    if args.verify_steps < 5:
        raise ConfigError(f"--verify-steps {args.verify_steps}: give at least 5 (the first "
                          f"steps are warm-up, left out of the measured step time).")


def _device_link(args: argparse.Namespace, cluster: Cluster
                 ) -> tuple[dict[str, Any] | None, tuple[float, float] | None]:
    """--device-link as advise.json records it (its name, α and rate) and as the
    simulator takes it (``inside``: α, β), or (None, None) without it; a ConfigError
    that names the fix for a bad name or rate, or for one worker per host."""

    link = parse(args.device_link)  # (a bad name or rate raises, naming the flag)
    if link is None:
        return None, None
    check_hosts(cluster.workers, cluster.hosts)
    return ({"name": args.device_link, "alpha_s": link[0], "bytes_per_s": link[1],
             "host_copy_bytes_per_s": host_copy(args.device_link)["d2h"][1]},
            alpha_beta(link))


def _load_profile(args: argparse.Namespace, n: int,
                  model: dict[str, Any]) -> tuple[Profile, dict[str, Any]]:
    """--profile's profile, and the model --verify runs: the profiled one, at its
    per-worker batch (``args.batch_size`` becomes that batch times ``n`` workers)."""
    prof = Profile.load(args.profile)
    src = prof.source
    if args.verify and not src.get("model"):
        raise ConfigError(f"--verify runs the profiled model, but the profile "
                          f"{args.profile} does not say which model it is (a profile "
                          f"on paper): profile it with `psring profile`, or drop "
                          f"--verify.")
    model = {**model, **{k: src[k] for k in ("model", *MODEL_KEYS)
                         if src.get(k) is not None}}
    if not prof.batch_size:
        raise ConfigError(f"the profile {args.profile} has no batch size; profile the "
                          f"model with `psring profile`.")
    args.batch_size = prof.batch_size * n
    return prof, model


def _profile_now(args: argparse.Namespace, n: int, out: Path) -> Profile:
    """A short traced single run of the flags' model at the per-worker batch."""

    threads = max(1, usable_cores() // n) if args.verify else 0
    cfg = profile_config(**_model_flags(args), batch_size=args.batch_size // n,
                         threads=threads, out=str(out / "profile"))
    meta_build(cfg.model, ModelSettings.from_config(cfg))  # a bad model: exit 2 now
    print(f"psring: profiling {cfg.model} at batch {cfg.batch_size} per worker "
          f"({cfg.steps} steps of single, traced)", flush=True)
    return take_profile(cfg)


def _profile(args: argparse.Namespace, n: int, out: Path) -> tuple[Profile, dict[str, Any]]:
    """The profile to rank by (at --device-speed) and the model --verify runs."""
    model = _model_flags(args)
    if args.profile:
        prof, model = _load_profile(args, n, model)
    else:
        prof = _profile_now(args, n, out)
    if args.device_speed != 1.0:
        prof = prof.scaled(args.device_speed)
    return prof, model


def _print_ranking(title: str, rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=True)
    for h in HEADER:
        t.add_column(h, justify="right" if h in ("step ms", "compute ms", "comm ms (exposed)",
                                                 "samples/s", "efficiency", "#") else "left")
    for r in rows:
        t.add_row(*r)
    Console(width=160).print(t)


def _print_verification(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print --verify's predicted vs measured and whether the recommendation holds;
    return advise.json's "verify"."""
    from rich.console import Console
    from rich.table import Table

    vt = Table(title="predicted vs measured (this machine's emulation of the cluster, "
                     "a device per worker: --compute device)")
    for h in ("strategy", "setting", "predicted ms", "measured ms", "error"):
        vt.add_column(h)
    for r in results:
        vt.add_row(r["strategy"], r["setting"], f"{r['predicted_ms']:.1f}",
                   f"{r['measured_ms']:.1f}", f"{r['error']:+.0%}")
    Console(width=160).print(vt)
    fastest = min(results, key=lambda r: r["measured_ms"])
    rec = results[0]
    ok = rec["measured_ms"] <= 1.05 * fastest["measured_ms"]
    print(f"Recommended {rec['strategy']}: measured {rec['measured_ms']:.1f} ms; the "
          f"measured fastest is {fastest['strategy']} ({fastest['measured_ms']:.1f} ms): "
          + ("the recommendation holds." if ok else "the recommendation is off by "
             f"{rec['measured_ms'] / fastest['measured_ms'] - 1:.0%}."))
    return {"results": results, "recommended_is_fastest_within_5pct": ok,
            "median_abs_error": statistics.median(abs(r["error"]) for r in results)}


def _failure_rate(args: argparse.Namespace) -> Failures | None:
    """--mtbf and its companions, checked before anything runs (None: no failures)."""
    if not args.mtbf:
        return None
    try:
        return Failures(mtbf_s=args.mtbf * 3600, checkpoint_s=args.checkpoint_minutes * 60,
                        restart_s=args.restart_s, job_s=args.job_hours * 3600)
    except ValueError as e:
        raise ConfigError(f"--mtbf {args.mtbf:g}: {e} (give --mtbf, --checkpoint-minutes "
                          f"and --job-hours as positive numbers and --restart-s as one of "
                          f"at least 0).") from None


def _failures(args: argparse.Namespace, cands: list[Candidate], ranking: list[Candidate],
              classes: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    f = _failure_rate(args)
    if f is None:
        return None, []
    rows, lines = with_failure_rate(cands, ranking, classes, f)
    return {"mtbf_s": f.mtbf_s, "checkpoint_s": f.checkpoint_s, "restart_s": f.restart_s,
            "job_s": f.job_s, "ranking": rows, "summary": lines}, lines


def advise_command(args: argparse.Namespace) -> int:
    """psring advise (the module docstring): profile, rank, print, write advise.json
    and advise.png, and with --verify measure the top candidates."""

    cluster, n = _cluster(args)
    scaling.check_flags(args, n // cluster.hosts)
    _check_device_flags(args)
    _failure_rate(args)  # (bad values refused before the profile)
    device_link, inside = _device_link(args, cluster)
    out = Path(args.out or os.path.join("runs", f"advise-{time.strftime('%Y%m%d-%H%M%S')}"))
    prof, model = _profile(args, n, out)
    out.mkdir(parents=True, exist_ok=True)
    # what --verify's device-mode workers take their times from: the profile ranked
    device_profile = prof.save(out / "device-profile")
    prof = on_host(prof, args.device_link)  # (as each verifying run's workers make it)
    cal = _calibration(args, out)
    classes = strategy_classes(n, cluster.hosts)
    link = parse_rate(args.link) if args.link else None
    delay = parse_delay(args.delay) if args.delay else 0.0
    # --verify runs device-mode workers (their compute is off the cores): the cluster's
    # own prediction, with no sharing of this machine's cores (cores=None); and only
    # settings this machine can run (workers and servers <= the limit)
    cands = candidates(prof, cluster, cal, classes,
                       max_servers=min(8, VERIFY_MAX_PROCESSES - n) if args.verify else 8,
                       cores=None, link_bits=link, delay_s=delay, inside=inside,
                       cal_of=verify_clock(cal, args, model, n, device_profile))
    ranking = rank(refine(cands))
    where = _where(cluster.hosts, n // cluster.hosts, link, delay) + \
        (f", {cluster.loss:g} of packets lost each way" if cluster.loss else "") + (
        f", device link {args.device_link} inside each host "
        f"({device_link['bytes_per_s'] / 1e9:g} GB/s; to host memory "
        f"{device_link['host_copy_bytes_per_s'] / 1e9:g} GB/s)" if device_link else "") + (
        ", verified on emulated hosts, a device per worker" if args.verify else "")
    title = (f"psring advise: {prof.source.get('model', 'profiled model')}, "
             f"{prof.total_bytes / 1e6:.2f} MB of gradients, batch {args.batch_size} "
             f"({prof.batch_size} per worker), {n} workers on {where}")
    rows = table(ranking, classes)
    _print_ranking(title, rows)
    recs = recommendations(cands, ranking, classes)
    opts = options(cands, ranking, classes)
    failures, fail_lines = _failures(args, cands, ranking, classes)
    for line in recs + opts + fail_lines:
        print(line)
    png = plot(ranking, title, out / "advise.png")
    report: dict[str, Any] = {
        "title": title, "profile": {**prof.source, "summary": prof.describe()},
        "cluster": {"hosts": cluster.hosts, "workers_per_host": n // cluster.hosts,
                    "link_bits": link, "delay_s": delay, "cores": None},
        "workers": n, "calibration_host": cal.host,
        "ranking": [dict(zip(HEADER, r)) for r in rows],
        "predictions": [{"strategy": c.strategy, **c.prediction.to_dict()} for c in cands],
        "recommendations": recs, "options": opts}
    if failures is not None:
        report["failures"] = failures
    if device_link:
        report["cluster"]["device_link"] = device_link
    curves = None
    if args.max_workers is not None:
        report["scaling"], curves = scaling.answer(args, prof, cal, n // cluster.hosts, link,
                                                   delay, cluster.loss, inside, out)
    atomic_write_json(out / "advise.json", report)  # the prediction, before any run
    if args.verify:
        results = verify(verify_candidates(ranking, classes), classes, args, model,
                         args.batch_size, n, out, device_profile)
        report["verify"] = _print_verification(results)
        if curves:
            report["scaling"]["verify"] = scaling.check(
                curves, scaling.scaling_classes(), prof, cal, inside,
                lambda c, cls, w: _scaling_flags(c, cls, args, model, w * prof.batch_size,
                                                 out, device_profile),
                _measure)
    atomic_write_json(out / "advise.json", report)
    print(f"advise: {out / 'advise.json'}, {png}")
    return 0
