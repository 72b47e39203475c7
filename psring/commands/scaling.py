"""``psring advise --max-workers N``: the scaling question, asked of the profile advise
ranked — every strategy's best setting at 1, 2, 4, … N workers
(psring.predict.scaling), the largest count that keeps ``--target-efficiency``, the
servers a parameter server needs there, the per-worker batch that would keep the target
at N, and the sentence that says where communication stops hiding under backward.

    psring advise --model resnet50 --profile runs/prof-r50 --max-workers 1024 \\
        --workers-per-host 8 --link 25gbit --target-efficiency 0.8

It prints a table of efficiencies, writes ``scaling.png`` and returns advise.json's
``"scaling"``. With ``--verify`` it also runs one strategy of each cost model at every
size from 2 to 16 in device mode on this machine's emulation and prints predicted
against measured (:func:`check`; ``"scaling"["verify"]``). This module is the
command's part; the pricing is psring.predict.scaling's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from psring.errors import ConfigError
from psring.predict.advise import Candidate
from psring.predict.published import matching
from psring.predict.scaling import (
    EVENTS_UP_TO,
    Curve,
    batch_for,
    check_scaling,
    knee_sentence,
    plot,
    priced,
    scale,
)
from psring.predict.sim.simulate import is_costed
from psring.records.profile import Profile
from psring.strategies import STRATEGIES


def check_flags(args: argparse.Namespace, per_host: int) -> None:
    """--max-workers and its companions, or a ConfigError that names the fix (before
    anything is profiled)."""
    if args.max_workers is None:
        if args.target_efficiency != 0.8:
            raise ConfigError("--target-efficiency is the scaling question's: give "
                              "--max-workers N too.")
        return
    check_scaling(args.max_workers, args.target_efficiency, per_host)
    if args.max_workers > per_host and not args.link:
        raise ConfigError(f"--max-workers {args.max_workers} at {per_host} worker(s) a "
                          f"host spans several hosts: give the link between them, --link "
                          f"RATE (e.g. 10gbit, 25gbit, 100gbit).")
    if args.epoch_samples < 1:
        raise ConfigError(f"--epoch-samples {args.epoch_samples}: give the samples in one "
                          f"epoch of the dataset (default ImageNet-1k's 1281167).")


def scaling_classes() -> dict[str, Any]:
    """Every registered strategy the simulator can price, whatever the size."""
    return {name: STRATEGIES.get(name) for name in STRATEGIES
            if is_costed(STRATEGIES.get(name).caps.cost_model)}


def answer(args: argparse.Namespace, prof: Profile, cal: Any, per_host: int,
           link: float | None, delay: float, loss: float,
           inside: tuple[float, float] | None, out: Path
           ) -> tuple[dict[str, Any], dict[str, Curve]]:
    """Price, print, plot: advise.json's "scaling", and the curves."""
    classes = scaling_classes()
    began = time.perf_counter()
    curves = scale(prof, cal, classes, args.max_workers, per_host, link, delay, loss, inside)
    priced = time.perf_counter() - began
    target = args.target_efficiency
    _print_table(curves, target, per_host, link)
    lines = [knee_sentence(c, target) for c in curves.values() if len(c.points) > 1]
    servers = _servers(curves, classes, target)
    lines += [f"Servers: {name} at {s['workers']} workers needs {s['servers']} server(s) "
              f"{s['placement']} ({s['setting']})." for name, s in servers.items()
              if s["workers"] > 1]
    batches = {name: _batch(prof, cal, classes[name], c, target, inside)
               for name, c in curves.items() if len(c.points) > 1}
    lines += _batch_lines(batches, args.max_workers, target, prof.batch_size)
    lines.append(f"(Priced {sum(len(c.points) for c in curves.values())} sizes x "
                 f"strategies, every setting of each, in {priced:.1f} s; the parameter "
                 f"servers' best settings by the simulator's events on small clusters (up to "
                 f"{EVENTS_UP_TO} workers, the fluid's best of each placement), by its fluid "
                 f"beyond, psring.predict.sim.fluid.)")
    for line in lines:
        print(line)
    marks = matching(prof.source.get("model"), per_host, link)
    title = (f"psring advise: {prof.source.get('model', 'profiled model')}, batch "
             f"{prof.batch_size} a worker, {per_host} a host, "
             + (f"{link / 1e9:g} Gbit/s links" if link else "one host"))
    png = plot(curves, title, out / "scaling.png", target, marks)
    print(f"scaling: {png}")
    return {"max_workers": args.max_workers, "workers_per_host": per_host,
            "link_bits": link, "target_efficiency": target,
            "per_worker_batch": prof.batch_size, "epoch_samples": args.epoch_samples,
            "strategies": {name: [p.to_dict(args.epoch_samples) for p in c.points]
                           for name, c in curves.items()},
            "recommended_workers": {name: c.recommended(target)
                                    for name, c in curves.items()},
            "servers": servers, "batch": batches, "summary": lines, "priced_s": priced,
            "published": [{"source": m.source, "model": m.model, "workers": m.workers,
                           "strategy": m.strategy, "efficiency": m.efficiency}
                          for m in marks]}, curves


def _servers(curves: dict[str, Curve], classes: dict[str, Any],
             target: float) -> dict[str, dict[str, Any]]:
    """The servers each PS strategy uses at the largest count that keeps the target."""
    out = {}
    for name, c in curves.items():
        p = c.at(c.recommended(target))
        if classes[name].caps.uses_servers and p is not None:
            out[name] = {"workers": p.workers, "servers": p.servers,
                         "placement": p.placement, "setting": p.setting}
    return out


def _batch(prof: Profile, cal: Any, cls: Any, c: Curve, target: float,
           inside: tuple[float, float] | None) -> dict[str, Any] | None:
    """The guidelines' per-worker batch at the curve's largest size (None: the
    profile has no batch)."""
    if not prof.batch_size:
        return None
    last = c.points[-1]
    found = batch_for(prof, cal, cls, last, target, inside)
    return {"workers": last.workers, "per_worker_batch": found[0] if found else None,
            "efficiency": found[1] if found else None}


def _batch_lines(batches: dict[str, dict[str, Any] | None], n: int, target: float,
                 batch: int) -> list[str]:
    known = {k: v for k, v in batches.items() if v}
    if not known:
        return []
    parts = [f"{k} {v['per_worker_batch']}" if v["per_worker_batch"] else f"{k} none up "
             f"to {64 * batch}" for k, v in known.items()]
    return [f"Batch: the smallest per-worker batch that keeps {target:.0%} at the largest "
            f"size each strategy runs ({n} workers where it can; the profile's "
            f"{batch}, compute taken to grow with the batch): " + ", ".join(parts)
            + ". A larger global batch changes training: scale the learning rate and "
              "its warm-up with it, and check the accuracy it reaches."]


def _print_table(curves: dict[str, Curve], target: float, per_host: int,
                 link: float | None) -> None:
    sizes = sorted({p.workers for c in curves.values() for p in c.points})
    t = Table(title=f"scaling efficiency predicted ({per_host} worker(s) a host, "
                    + (f"{link / 1e9:g} Gbit/s links" if link else "one host")
                    + f"; target {target:.0%})")
    t.add_column("strategy")
    for n in sizes:
        t.add_column(str(n), justify="right")
    t.add_column(f"keeps {target:.0%} to", justify="right")
    for name, c in curves.items():
        cells = []
        for n in sizes:
            p = c.at(n)
            cells.append(f"{p.efficiency:.0%}" if p else "")
        t.add_row(name, *cells, str(c.recommended(target)))
    Console(width=200).print(t)


#: the largest size --verify runs (device-mode workers; psring.commands.advise's limit
#: of processes holds a server or two beside them)
VERIFY_MAX_WORKERS = 16
#: draws of TCP's uneven shares a checked setting is priced by: one draw's step moves by
#: tens of per cent on a parameter server's small cluster, so the table's few draws
#: leave their mean as far off as the check's target; more cost under a second a
#: setting, against the minutes of the run it is checked against
VERIFY_DRAWS = 16


def check(curves: dict[str, Curve], classes: dict[str, Any], prof: Profile, cal: Any,
          inside: tuple[float, float] | None,
          flags_of: Callable[[Candidate, Any, int], dict[str, Any]],
          measure: Callable[[dict[str, Any]], tuple[float, int]]) -> dict[str, Any]:
    """--verify with --max-workers: each cost model's strategy (the first registered of
    each) at every size from 2 to VERIFY_MAX_WORKERS, its scaling setting run on this
    machine's emulation (``flags_of``: the run's RunConfig fields; ``measure``: runs
    them, returns the measured step and the --time-scale it ran at) and priced again on
    that run's clock (``cal.faster(S)``, as advise's --verify prices its own), by the
    mean of VERIFY_DRAWS draws where its events price it.
    Returns advise.json's "scaling"["verify"]; prints each pair and the errors."""
    seen: set[str | None] = set()
    rows = []
    for name, curve in curves.items():
        caps = classes[name].caps
        if caps.cost_model in seen or caps.cost_model is None or not caps.emulates_device:
            continue
        seen.add(caps.cost_model)
        for p in curve.points:
            if not 2 <= p.workers <= VERIFY_MAX_WORKERS or p.candidate is None:
                continue
            flags = flags_of(p.candidate, classes[name], p.workers)
            measured, scale_s = measure(flags)
            c = p.candidate
            predicted = priced(prof, cal.faster(scale_s), caps.cost_model, c.cluster,
                               c.bucket_mb, update_on=p.update_on or "server",
                               inside=inside, draws=VERIFY_DRAWS).step_s
            rows.append({"strategy": name, "workers": p.workers, "setting": p.setting,
                         "predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3,
                         "error": predicted / measured - 1, "time_scale": scale_s})
            print(f"scaling check: {name} x {p.workers} ({p.setting}): predicted "
                  f"{predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
                  f"({predicted / measured - 1:+.0%})", flush=True)
    errors = [abs(r["error"]) for r in rows]
    out = {"runs": rows, "median_abs_error": statistics.median(errors) if errors else None,
           "max_abs_error": max(errors, default=None)}
    if errors:
        print(f"scaling check: median |error| {out['median_abs_error']:.1%}, largest "
              f"{out['max_abs_error']:.1%} over {len(rows)} device-mode runs")
    return out
