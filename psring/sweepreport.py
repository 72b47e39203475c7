"""The report of a sweep: ``psring report SWEEP_DIR`` writes report.md and PNG plots.

    psring sweep experiments/intensity.toml --out runs/intensity
    psring report runs/intensity            # -> runs/intensity/report.md, *.png

Every figure is read back from the points' logs (steps.jsonl, manifest.json); points
repeated R times are aggregated per *setting* (the point without its repeat number)
as the median with the min–max range. What is in it:

- the key table: throughput, step time, communication time measured beside the cost
  model's prediction (psring.predict.costmodel, from ``psring calibrate``) and its relative
  error, speedup over ``single``, time to the target accuracy;
- the step-time breakdown per setting (data / forward / backward / comm / update);
- throughput and scaling efficiency vs workers (when the sweep varies workers);
- throughput vs arithmetic intensity per strategy with the measured crossovers, and
  the crossover the cost model predicts (when the sweep varies intensity);
- held-out accuracy vs training time and vs step, and time to accuracy: time to the
  target, steps to it (statistical efficiency) and time per step (hardware efficiency);
- training loss vs time and vs step (an EMA, the raw points faint);
- the staleness distribution of asynchronous runs.

Definitions (also in docs/cost-model.md):
- *intensity* = FLOPs a worker computes per step / bytes of gradients M. It is the
  same for every strategy on one workload, so curves of different strategies share x.
- *communication time* of a step = time blocked on communication (``comm_s``) plus
  the time communication ran hidden under backward (the union of the buckets'
  in-flight intervals before backward ended), less, in synchronous strategies, the
  time a worker was blocked only because a slower peer was still in backward (its
  *peer wait*). It is what the cost model predicts.
- *time to accuracy* (MLPerf Training's) = the training time (rank 0's clock,
  evaluations excluded; psring.evaluate) of the first held-out evaluation whose
  accuracy reaches the target: ``[report] target_accuracy`` of the definition, else
  the runs' own ``--target-accuracy``. A run that never reaches it is "not reached".
"""

from __future__ import annotations

import json
import math
import re
import statistics as st
from collections import defaultdict
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .report import WORKLOAD_KEYS, summarize
from .evaluate import time_to_accuracy
from .runlog import (PHASES, atomic_write_bytes, read_evals, read_manifest, read_steps,
                     warmup_steps)
from .sweep import POINT_FILE, SWEEP_FILE, point_status

REPORT = "report.md"
#: keys that define the model and data (not the batch): the scaling baseline's match
MODEL_KEYS = ("model", "width", "depth", "data", "samples", "features", "classes",
              "accumulate", "seed")


# ----------------------------------------------------------------------- reading
def _peer_waits(records: list[dict]) -> dict[tuple[int, int], float]:
    """(worker, step) -> seconds a worker of a synchronous step could not have been
    communicating because a slower peer had not finished its backward yet: the latest
    backward end among the step's workers minus its own (on the wall clock the
    processes of a host share; the step's start is its end ``time`` minus ``step_s``)."""
    ends: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        if "backward_end_s" in r:
            ends[r["step"]][r["worker"]] = r["time"] - r["step_s"] + r["backward_end_s"]
    return {(w, step): max(e.values()) - t for step, e in ends.items() for w, t in e.items()}


def _comm_time(r: dict, peer_wait: float = 0.0) -> float:
    """Blocked time plus the communication in flight before backward ended (the union
    of the buckets' [launch, done] intervals cut at the end of backward): what a
    strategy spent communicating, hidden or not, less ``peer_wait`` (time blocked only
    because a slower peer was still computing). Strategies that log no buckets (ddp
    syncs inside torch) count their blocked time only."""
    end = r.get("backward_end_s", 0.0)
    spans = sorted((a, min(b, end)) for a, b in zip(r.get("bucket_launch_s") or [],
                                                   r.get("bucket_done_s") or [])
                   if 0 < a < end and b > a)
    hidden, reach = 0.0, 0.0
    for a, b in spans:
        a = max(a, reach)
        if b > a:
            hidden += b - a
            reach = b
    return max(0.0, r["comm_s"] - max(0.0, peer_wait)) + hidden


def _round_comm(records: list[dict], waits: dict[tuple[int, int], float]) -> list[float]:
    """Per synchronous step, the communication time of its slowest worker: the round
    ends for everyone only when the last worker has the result. Workers differ when
    they sit differently in the network: a worker beside its parameter server gets the
    new parameters at once, one behind a link waits for them to cross it."""
    by_step: dict[int, float] = {}
    for r in records:
        c = _comm_time(r, waits.get((r["worker"], r["step"]), 0.0))
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), c)
    return list(by_step.values())


def load_point(run_dir: Path) -> dict[str, Any]:
    """One finished point: the run summary plus what the sweep report needs."""
    row = summarize(run_dir)
    manifest = read_manifest(run_dir)
    cfg = manifest["config"]
    records = read_steps(run_dir)
    skip = warmup_steps(cfg["steps"])
    kept = [r for r in records if r["step"] >= skip] or records
    row["config"] = cfg
    row["servers"] = cfg["servers"]
    row["phase_ms"] = {p: st.median(r[p] for r in kept) * 1e3 for p in PHASES}
    from .strategies import STRATEGIES

    # in a synchronous step a worker blocked on a slower peer is waiting, not
    # communicating; asynchronous workers' steps are not rounds, so nothing is subtracted
    synchronous = cfg["strategy"] in STRATEGIES and \
        getattr(STRATEGIES.get(cfg["strategy"]), "comm_model", None) in ("ring", "ps")
    waits = _peer_waits(records) if synchronous else {}
    row["comm_time_s"] = st.median(_round_comm(kept, waits) if synchronous else
                                   [_comm_time(r) for r in kept])
    row["peer_wait_ms"] = st.median(waits.get((r["worker"], r["step"]), 0.0)
                                    for r in kept) * 1e3
    pbytes = manifest.get("parameter_bytes") or 0
    # what the cost model's M is: the gradients as sent (compressed with --compress)
    row["gradient_bytes"] = manifest.get("wire_bytes") or pbytes
    fws = manifest.get("flops_per_worker_step")
    row["intensity"] = fws / pbytes if fws and pbytes else None
    # loss curve: per step, mean over workers; time since the end of the first step (whose
    # time is mostly connection set-up: gloo connects on the first collective)
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    steps = sorted(by_step)
    start = max(r["time"] for r in by_step[steps[0]])
    # a step's time: when its last worker finished it
    row["curve"] = [(s, max(r["time"] for r in by_step[s]) - start,
                     st.fmean(r["loss"] for r in by_step[s])) for s in steps]
    row["staleness"] = [r["staleness"] for r in records if "staleness" in r]
    row["evals"] = sorted(read_evals(run_dir), key=lambda e: e["step"])
    row["accuracy_final"] = row["evals"][-1]["accuracy"] if row["evals"] else None
    row["train_seconds"] = max(r["time"] for r in records) - start
    return row


def setting_of(point_id: str) -> str:
    return re.sub(r"_r\d+$", "", point_id)


def collect(sweep_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    """(the sweep's definition, finished points' rows, failed/missing points)."""
    sweep_dir = Path(sweep_dir)
    try:
        spec = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{sweep_dir} is not a sweep directory ({SWEEP_FILE}: {e}); run "
                          f"`psring sweep SPEC --out {sweep_dir}` first.") from None
    rows, problems = [], []
    for pid in spec["points"]:
        status = point_status(sweep_dir / pid)
        if status is None:
            problems.append({"id": pid, "status": "not run", "error": ""})
        elif status.get("status") != "ok":
            problems.append({"id": pid, "status": status.get("status", "?"),
                             "error": status.get("error", "")})
        else:
            row = load_point(sweep_dir / pid)
            row["id"], row["setting"] = pid, setting_of(pid)
            row["varied"] = status.get("varied", {})
            rows.append(row)
    return spec, rows, problems


# ----------------------------------------------------------------------- aggregation
def _agg(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {"median": st.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def aggregate(rows: list[dict], cal: Any = None) -> list[dict]:
    """One entry per setting: medians and ranges over repeats, predictions, speedups."""
    from .predict.costmodel import Topology, predict_comm
    from .strategies import STRATEGIES

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["setting"]].append(r)
    out = []
    for setting, rs in groups.items():
        r0 = rs[0]
        cls = STRATEGIES.get(r0["strategy"]) if r0["strategy"] in STRATEGIES else None
        model = getattr(cls, "comm_model", None)
        s = {
            "setting": setting, "strategy": r0["strategy"], "workers": r0["workers"],
            "servers": r0["servers"], "varied": r0["varied"], "config": r0["config"],
            "cluster": cluster_text(r0["config"]),
            "repeats": len(rs), "gradient_bytes": r0["gradient_bytes"],
            "intensity": r0["intensity"], "comm_model": model,
            "samples_per_s": _agg([r["samples_per_s"] for r in rs]),
            "step_ms": _agg([r["step_p50_s"] * 1e3 for r in rs]),
            "comm_ms": _agg([r["comm_time_s"] * 1e3 for r in rs]),
            "phase_ms": {p: st.median(r["phase_ms"][p] for r in rs) for p in PHASES},
            "loss_final": _agg([r["loss_final"] for r in rs]),
            "accuracy_final": _agg([r["accuracy_final"] for r in rs]),
            "rows": rs,
        }
        pred = None
        if cal is not None and model is not None:
            pred = predict_comm(model, s["workers"], s["servers"], s["gradient_bytes"], cal,
                                Topology.for_config(r0["config"]))
        s["predicted_comm_ms"] = pred * 1e3 if pred is not None else None
        _predict_step(s, rs, cal)
        if pred and s["comm_ms"]:  # (one worker: nothing to predict but 0)
            s["comm_error"] = (pred * 1e3 - s["comm_ms"]["median"]) / s["comm_ms"]["median"]
        else:
            s["comm_error"] = None
        out.append(s)
    _speedups(out)
    _efficiency(out)
    order = {name: i for i, name in enumerate(STRATEGIES)}
    out.sort(key=lambda s: (order.get(s["strategy"], len(order)), s["workers"],
                            s["servers"], s["intensity"] or 0, s["gradient_bytes"],
                            s["setting"]))
    return out


def _predict_step(s: dict, rs: list[dict], cal: Any) -> None:
    """The simulator's step time (psring.predict.replay: each run's own compute, its
    cluster's communication played out) beside the measured one, and what bounds it."""
    from .predict.replay import replay

    preds = [replay(Path(r["run"]), cal) for r in rs] if cal is not None else []
    preds = [p for p in preds if p is not None]
    preds.sort(key=lambda p: p.step_s)
    s["predicted_step_ms"] = st.median(p.step_s * 1e3 for p in preds) if preds else None
    s["predicted_bound"] = preds[len(preds) // 2].bound if preds else None  # the median's
    s["step_error"] = ((s["predicted_step_ms"] - s["step_ms"]["median"]) / s["step_ms"]["median"]
                       if preds and s["step_ms"] else None)


def prediction_check(settings: list[dict]) -> dict[str, Any]:
    """How well the simulator did over a sweep: the median and largest absolute error of
    the predicted step time, and, per group of settings that differ only in strategy
    (and the servers' number and placement), whether the predicted fastest is the
    measured fastest."""
    errs = [abs(s["step_error"]) for s in settings
            if s.get("step_error") is not None and s["strategy"] != "single"]
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in settings:
        if s.get("step_error") is None or s["strategy"] == "single":
            continue
        # the sweep's varied settings (its base is shared), less what is compared
        key = {k: v for k, v in s["varied"].items()
               if k not in ("strategy", "servers", "server_placement")}
        groups[json.dumps(key, sort_keys=True, default=str)].append(s)
    winners = []
    for g in groups.values():
        if len(g) < 2:
            continue
        measured = min(g, key=lambda s: s["step_ms"]["median"])
        predicted = min(g, key=lambda s: s["predicted_step_ms"])
        # a tie within 5% measured counts either way: noise decides it
        close = predicted["step_ms"]["median"] <= 1.05 * measured["step_ms"]["median"]
        winners.append({"measured": _label(measured), "predicted": _label(predicted),
                        "right": predicted is measured or close})
    return {"n": len(errs), "median_abs_error": st.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "winners": winners}


#: the settings that place a run on an emulated cluster (psring.emulate)
CLUSTER_KEYS = ("hosts", "workers_per_host", "link", "delay", "server_placement")


def cluster_text(cfg: dict) -> str:
    """Where a point ran, in a few words: 'this machine', or e.g. '2 hosts, 1gbit links'
    with the servers' placement when it matters."""
    from .emulate import ClusterPlan

    topo_cfg = {"hosts": 1, "workers_per_host": 0, "server_placement": "colocated",
                "link": "", "delay": "", "master_addr": "127.0.0.1", **cfg}
    from types import SimpleNamespace

    plan = ClusterPlan.for_config(SimpleNamespace(**topo_cfg))
    if not plan.emulated:
        return "this machine"
    hosts = len({*plan.worker_host})
    text = f"{hosts} host{'s' if hosts > 1 else ''}"
    if plan.placement == "own-hosts" and plan.server_host:
        k = len(plan.server_host)
        text += f" + {k} server host{'s' if k > 1 else ''}"
    text += f", {plan.link or 'unshaped'} links"
    if plan.delay:
        text += f", {plan.delay} delay"
    if plan.server_host:
        text += f", servers {plan.placement}"
    return text


def _workload(cfg: dict, keys=WORKLOAD_KEYS) -> str:
    return json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True)


def _speedups(settings: list[dict]) -> None:
    base = {_workload(s["config"]): s for s in settings if s["strategy"] == "single"}
    for s in settings:
        b = base.get(_workload(s["config"]))
        s["speedup"] = (s["samples_per_s"]["median"] / b["samples_per_s"]["median"]
                        if b else None)


def _efficiency(settings: list[dict]) -> None:
    """Scaling efficiency = throughput / (workers x single's throughput at the same
    per-worker batch and model): 1.0 is perfect linear scaling."""
    single = {}
    for s in settings:
        if s["strategy"] == "single":
            single[(_workload(s["config"], MODEL_KEYS), s["config"]["batch_size"])] = s
    for s in settings:
        c = s["config"]
        b = single.get((_workload(c, MODEL_KEYS), c["batch_size"] // c["workers"]))
        s["efficiency"] = (s["samples_per_s"]["median"] / (s["workers"] *
                                                          b["samples_per_s"]["median"])
                           if b else None)


def target_accuracy(rows: list[dict], spec: dict) -> float | None:
    """``[report] target_accuracy`` of the definition, else the runs' own
    ``--target-accuracy`` (the highest, if they differ); None when neither is set."""
    t = (spec.get("report") or {}).get("target_accuracy")
    if t is not None:
        return float(t)
    own = [r["config"].get("target_accuracy") or 0 for r in rows]
    return max(own) if any(own) else None


def add_time_to_accuracy(settings: list[dict], target: float | None) -> None:
    """Per setting, over its repeats: time to target, steps to target, and how many
    runs reached it."""
    for s in settings:
        got = [time_to_accuracy(r["evals"], target) if target is not None and r["evals"]
               else (None, None) for r in s["rows"]]
        s["tta_s"] = _agg([t for t, _ in got if t is not None])
        s["tta_steps"] = _agg([n for _, n in got if n is not None])
        s["tta_reached"] = sum(t is not None for t, _ in got)
        s["has_evals"] = any(r["evals"] for r in s["rows"])


def _tta_text(s: dict) -> str:
    if not s["has_evals"]:
        return "-"
    if not s["tta_s"]:
        return "not reached"
    return _fmt(s["tta_s"], digits=2) + ("" if s["tta_reached"] == s["repeats"] else
                                         f" [{s['tta_reached']}/{s['repeats']} reached]")


#: what a crossover is sought along: the x value, and the settings a group shares
#: (everything but what moves x; the cluster included, so each link speed is its own)
_ALONG = {
    "intensity": ("intensity", ("model", "width", "depth", "features", "workers", "hosts",
                                "link", "delay")),
    "size": ("gradient_bytes", ("model", "features", "batch_size", "accumulate", "workers",
                                "hosts", "link", "delay")),
}


def line_name(s: dict) -> str:
    """A strategy as a contender: with its servers and their placement when it has any."""
    c = s["config"]
    name = s["strategy"]
    if s["servers"] > 1:
        name += f" K={s['servers']}"
    if c.get("server_placement", "colocated") != "colocated":
        name += f" ({c['server_placement']})"
    return name


def crossovers(settings: list[dict], along: str = "intensity") -> list[dict]:
    """Where the throughput curves of two contenders cross along intensity (what the
    batch sets) or along gradient size (what the model's width and depth set), within a
    group of settings that differ only in that."""
    attr, shared = _ALONG[along]
    groups: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for s in settings:
        if not s[attr] or s["strategy"] == "single":
            continue
        c = s["config"]
        key = json.dumps({k: c.get(k) for k in shared}, sort_keys=True)
        groups[key][line_name(s)].append((s[attr], s["samples_per_s"]["median"]))
    found = []
    for key, by_line in groups.items():
        names = sorted(by_line)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                pa, pb = dict(by_line[a]), dict(by_line[b])
                xs = sorted(set(pa) & set(pb))
                for x0, x1 in zip(xs, xs[1:]):
                    d0, d1 = pa[x0] - pb[x0], pa[x1] - pb[x1]
                    if d0 == 0 or d0 * d1 < 0:
                        # interpolate in log(x)
                        f = d0 / (d0 - d1) if d0 != d1 else 0.0
                        x = math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
                        found.append({"group": json.loads(key), "a": a, "b": b,
                                      "along": along, "x": x, along: x,
                                      "below": a if d0 > 0 else b,
                                      "above": b if d0 > 0 else a})
    return found


# ----------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(s: dict) -> str:
    return s.get("label") or make_label(s, with_cluster=False)


def make_label(s: dict, with_cluster: bool) -> str:
    """The varied settings as this point ran them (single's workers are normalized to
    1); ``with_cluster``: where it ran instead of the cluster flags (when points of one
    sweep ran on different clusters)."""
    from .strategies import STRATEGIES

    c = s["config"]
    # settings a strategy has no use for were normalized away: not worth naming
    unused = set() if s["strategy"] not in STRATEGIES or \
        STRATEGIES.get(s["strategy"]).uses_servers else {"servers", "server_placement"}
    shown = {("batch_size" if k == "batch_per_worker" else k): c.get(k, v)
             for k, v in s["varied"].items() if k != "strategy" and k not in unused
             and not (with_cluster and k in CLUSTER_KEYS) and c.get(k, v) != ""}
    extra = ", ".join(f"{k}={v}" for k, v in shown.items())
    if with_cluster:
        extra += ("; " if extra else "") + s["cluster"]
    return f"{s['strategy']}" + (f" ({extra})" if extra else "")


def _where(settings: list[dict]) -> str:
    """The cluster every setting shares, for a figure's footnote ('' when they differ:
    then each label says it, or when all ran on this machine's own network)."""
    clusters = {s["cluster"] for s in settings}
    return f"cluster: {clusters.pop()}" if len(clusters) == 1 and \
        settings[0]["cluster"] != "this machine" else ""


def _save(fig, path: Path, settings: list[dict] | None = None, bottom: float = 0.0) -> Path:
    """Lay out and write a figure; ``bottom``: the share of its height kept free below
    the axes (for a legend there)."""
    where = _where(settings) if settings else ""
    if where:
        fig.text(0.995, 0.005, where, ha="right", va="bottom", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, max(bottom, 0.03 if where else 0.0), 1, 1))
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_breakdown(settings: list[dict], path: Path) -> Path:
    from .trace import PHASE_COLORS

    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(settings) + 1.6))
    left = [0.0] * len(settings)
    for p in PHASES:
        name = p[:-2]
        vals = [s["phase_ms"][p] for s in settings]
        ax.barh(range(len(settings)), vals, left=left, color=PHASE_COLORS[name], label=name)
        left = [a + b for a, b in zip(left, vals)]
    for i, s in enumerate(settings):
        lo, hi = s["step_ms"]["min"], s["step_ms"]["max"]
        if s["repeats"] > 1:
            ax.plot([lo, hi], [i, i], color="k", lw=1)  # min–max of the step time
    ax.set_yticks(range(len(settings)))
    ax.set_yticklabels([_label(s) for s in settings], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median over steps and repeats; black: min–max step p50)")
    ax.legend(ncol=5, fontsize=8, loc="lower right")
    ax.set_title("Where a step's time goes")
    return _save(fig, path, settings)


def _series(s: dict, x_keys: tuple[str, ...]) -> str:
    """A line's name: the strategy and the varied settings but those along the x axis."""
    return make_label({**s, "varied": {k: v for k, v in s["varied"].items()
                                       if k not in x_keys}}, with_cluster=False)


def _by_strategy(settings: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for s in settings:
        out[s["strategy"]].append(s)
    return out


def _scaling_series(settings: list[dict]) -> dict[str, list[dict]]:
    """Lines of the scaling plot: a setting but for its workers (and their hosts). A
    strategy's one-worker point, which runs on one host with no link to shape, starts
    every line of that strategy that differs from it only in cluster settings."""
    x_keys = ("workers", "hosts", "batch_per_worker")
    series: dict[str, list[dict]] = defaultdict(list)
    for s in settings:
        series[_series(s, x_keys)].append(s)

    def rest(s: dict) -> dict:
        return {k: s["config"].get(k) for k in s["varied"]
                if k not in (*x_keys, *CLUSTER_KEYS)}

    for name, ss in list(series.items()):
        if len(ss) != 1 or ss[0]["workers"] != 1 or ss[0]["strategy"] == "single":
            continue
        lone = ss[0]
        joined = [n for n, other in series.items() if n != name and
                  other[0]["strategy"] == lone["strategy"] and rest(other[0]) == rest(lone)
                  and all(o["workers"] > 1 for o in other)]
        for n in joined:
            series[n].append(lone)
        if joined:
            del series[name]
    return series


def plot_scaling(settings: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    series = _scaling_series(settings)
    colors = _colors(plt, len(settings))
    strategies = list(dict.fromkeys(s["strategy"] for s in settings))
    links = sorted({s["config"].get("link", "") for s in settings} - {""})
    styles = dict(zip(links, ("--", "-", ":", "-.")))
    for name, ss in series.items():
        ss = sorted(ss, key=lambda s: s["workers"])
        # a colour per strategy, a line style per link speed, squares: servers of their own
        link = next((s["config"].get("link") for s in ss if s["config"].get("link")), "")
        own = any(s["config"].get("server_placement") == "own-hosts" for s in ss)
        kw = {"color": colors[strategies.index(ss[0]["strategy"]) % len(colors)],
              "ls": styles.get(link, "-"), "marker": "s" if own else "o"}
        xs = [s["workers"] for s in ss]
        med = [s["samples_per_s"]["median"] for s in ss]
        err = [[m - s["samples_per_s"]["min"] for m, s in zip(med, ss)],
               [s["samples_per_s"]["max"] - m for m, s in zip(med, ss)]]
        a1.errorbar(xs, med, yerr=err, capsize=3, label=name, **kw)
        eff = [(s["workers"], s["efficiency"]) for s in ss if s["efficiency"] is not None]
        if eff:
            a2.plot(*zip(*eff), **kw)
    tops = [s["samples_per_s"]["median"] for s in settings]
    if max(tops) > 20 * max(min(tops), 1e-9):
        a1.set_yscale("log")
    for a in (a1, a2):
        a.set_xlabel("workers")
        a.set_xticks(sorted({s["workers"] for s in settings}))
    a1.set_ylabel("samples/s (median, min–max)")
    a1.set_title("Throughput")
    a2.axhline(1.0, color="gray", ls="--", lw=1)
    a2.set_ylabel("throughput / (workers x single)")
    a2.set_title("Scaling efficiency")
    fig.legend(*a1.get_legend_handles_labels(), loc="lower center", fontsize=7,
               ncol=min(3, len(series)), frameon=False)
    return _save(fig, path, settings, bottom=0.03 + 0.04 * ((len(series) + 2) // 3))


#: per x axis: the step attribute, what moves it (not a line of its own), the axis label
_X_AXES = {
    "intensity": ("intensity", ("batch_per_worker", "batch_size", "accumulate"),
                  "arithmetic intensity: FLOPs per worker step / gradient bytes", "{:.0f}"),
    "size": ("gradient_bytes", ("width", "depth"), "gradient bytes per step (model size)",
             "{:.3g} B"),
}


def plot_along(settings: list[dict], found: list[dict], path: Path,
               along: str = "intensity") -> Path:
    """Throughput against intensity or gradient size, a line per everything else, with
    the measured crossovers dotted."""
    attr, moves, xlabel, fmt = _X_AXES[along]
    varied = {k for s in settings for k in s["varied"]}
    # a sweep over models (experiments/models.toml) moves along x by changing the model:
    # one line per strategy through every model, each point named
    by_model = "model" in varied and not varied & set(moves)
    if by_model:
        moves = (*moves, "model")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    series: dict[str, list[dict]] = defaultdict(list)
    for s in settings:
        if s[attr]:
            series[_series(s, moves)].append(s)
    for label, ss in sorted(series.items()):
        ss = sorted(ss, key=lambda s: s[attr])
        xs = [s[attr] for s in ss]
        med = [s["samples_per_s"]["median"] for s in ss]
        err = [[m - s["samples_per_s"]["min"] for m, s in zip(med, ss)],
               [s["samples_per_s"]["max"] - m for m, s in zip(med, ss)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
        if by_model:
            for x, y, s in zip(xs, med, ss):
                ax.annotate(s["varied"]["model"], (x, y), fontsize=6, alpha=0.7,
                            xytext=(3, 3), textcoords="offset points")
    for c in found:
        ax.axvline(c["x"], color="k", ls=":", lw=1)
        at = f"{c['x'] / 1e3:.0f} kB" if along == "size" else fmt.format(c["x"])
        ax.annotate(f"{c['a']}={c['b']}\n@{at}", (c["x"], 0),
                    xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                    va="bottom", ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples/s (median, min–max)")
    ax.set_title(f"Throughput vs {'arithmetic intensity' if along == 'intensity' else 'model size'}"
                 f" (dotted: measured crossovers)", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path, settings)


def _colors(plt, n: int) -> list:
    """One distinct colour per setting: the default cycle has 10, tab20 has 20."""
    if n <= 10:
        return plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [plt.get_cmap("tab20")(i % 20) for i in range(20)]


def _ema(xs: list[float], span: int) -> list[float]:
    a, out, v = 2 / (span + 1), [], None
    for x in xs:
        v = x if v is None else a * x + (1 - a) * v
        out.append(v)
    return out


def plot_loss(settings: list[dict], path: Path) -> Path:
    """Training loss (mean over workers) vs time and vs step: an EMA over a tenth of
    the steps, the raw points faint behind it."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(plt, len(settings))
    for i, s in enumerate(settings):
        c = colors[i % len(colors)]
        for j, r in enumerate(s["rows"]):
            steps, ts, losses = zip(*r["curve"])
            smooth = _ema(list(losses), max(2, len(losses) // 10))
            for a, x in ((a1, ts), (a2, steps)):
                a.plot(x, losses, color=c, lw=0.6, alpha=0.2)
                a.plot(x, smooth, color=c, lw=1.4, label=_label(s) if j == 0 else None)
    _label_pair(a1, a2, "training loss (EMA; raw faint)",
                ("wall-clock seconds since the end of step 0", "Training loss vs time"),
                ("step", "Training loss vs step"))
    return _save(fig, path, settings)


def _label_pair(a1, a2, ylabel: str, left: tuple[str, str], right: tuple[str, str]) -> None:
    """The two panels of a vs-time / vs-step figure: (x label, title) each."""
    for a, (xlabel, title) in ((a1, left), (a2, right)):
        a.set_ylabel(ylabel)
        a.set_xlabel(xlabel)
        a.set_title(title)
    a2.legend(fontsize=7)


def plot_accuracy(settings: list[dict], target: float | None, path: Path) -> Path:
    """Held-out accuracy vs training time and vs step, one line per run."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(plt, len(settings))
    for i, s in enumerate(settings):
        for j, r in enumerate(s["rows"]):
            if not r["evals"]:
                continue
            kw = {"color": colors[i % len(colors)], "lw": 1.2, "alpha": 0.85, "marker": ".",
                  "ms": 3, "label": _label(s) if j == 0 else None}
            a1.plot([e["train_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
            a2.plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
    for a in (a1, a2):
        if target is not None:
            a.axhline(target, color="k", ls="--", lw=1)
        a.set_ylim(0, 1.02)
    _label_pair(a1, a2, "held-out accuracy",
                ("training seconds (evaluation excluded)",
                 "Accuracy vs time" + (" (dashed: target)" if target is not None else "")),
                ("optimizer step", "Accuracy vs step (statistical efficiency)"))
    return _save(fig, path, settings)


def plot_staleness(settings: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    stale = [(s, [x for r in s["rows"] for x in r["staleness"]]) for s in settings]
    stale = [(s, v) for s, v in stale if v]
    top = max(max(v) for _, v in stale)
    bins = [b - 0.5 for b in range(top + 2)]
    for s, v in stale:
        ax.hist(v, bins=bins, alpha=0.5, label=_label(s), density=True)
    ax.set_xlabel("staleness (updates applied between a worker's pull and its push)")
    ax.set_ylabel("share of steps")
    ax.set_title("Staleness of asynchronous updates")
    ax.legend(fontsize=8)
    return _save(fig, path, settings)


def plot_costmodel(settings: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    pts = [s for s in settings if s["predicted_comm_ms"] is not None and s["comm_ms"]]
    for name, ss in _by_strategy(pts).items():
        ax.scatter([s["predicted_comm_ms"] for s in ss], [s["comm_ms"]["median"] for s in ss],
                   label=name)
    values = [s["predicted_comm_ms"] for s in pts] + [s["comm_ms"]["median"] for s in pts]
    lo, lim = max(min(values), 1e-3), max(values)
    if lim / lo > 20:  # a wide range (emulated links): log axes, so small points show
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        lo = 0.0
    ax.plot([lo, lim], [lo, lim], color="gray", ls="--", lw=1)
    for f in (0.75, 1.25):  # measured = predicted / f: the prediction off by ±25%
        ax.plot([lo, lim], [lo / f, lim / f], color="gray", ls=":", lw=0.8)
    ax.set_xlabel("predicted communication ms per step (α-β-γ model)")
    ax.set_ylabel("measured communication ms per step")
    ax.set_title("Cost model vs measurement (dotted: ±25%)")
    ax.legend(fontsize=8)
    return _save(fig, path, settings)


# ----------------------------------------------------------------------- report
def _fmt(a: dict | None, scale: float = 1.0, digits: int = 0, style: str = "f") -> str:
    """Median (min–max); ``style`` "g" counts significant digits, for values such as
    a final loss that can fall to 1e-4 and would print as 0.000."""
    if a is None:
        return "-"
    spec = f".{digits}{style}"
    m = f"{a['median'] * scale:{spec}}"
    if a["n"] > 1:
        m += f" ({a['min'] * scale:{spec}}–{a['max'] * scale:{spec}})"
    return m


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _crossover_section(along: str, plot: Path, found: list[dict]) -> list[str]:
    """report.md's section for a plot of throughput along intensity or model size."""
    md = [f"## Throughput vs {along}", "", f"![{plot.stem}]({plot.name})", ""]
    if not found:
        return md + [f"No measured crossover along {along}: in each group the same "
                     f"strategy is faster at every point measured.", ""]
    size = found[0]["along"] == "size"
    # name only what tells the groups apart
    keys = [k for k in found[0]["group"] if len({json.dumps(c["group"][k]) for c in found}) > 1]
    return md + [_md_table(
        ["strategies", "where",
         "measured crossover (gradient MB)" if size else "measured crossover intensity",
         "faster below", "faster above"],
        [[f"{c['a']} / {c['b']}", ", ".join(f"{k}={c['group'][k]}" for k in keys) or "-",
          f"{c['x'] / 1e6:.3g}" if size else f"{c['x']:.0f}", c["below"], c["above"]]
         for c in found]), ""]


def predicted_crossovers(settings: list[dict], cal: Any) -> list[dict]:
    """The cost model's crossovers: per (model, workers), the gradient size at which two
    strategies' predicted communication times are equal. (Along intensity at a fixed
    size the model predicts no crossover: compute is the same for both, so the one
    with the cheaper communication is faster at every intensity, by less and less.)"""
    from .predict.costmodel import Topology, crossover_bytes

    if cal is None:
        return []
    out = []
    pairs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for s in settings:
        if s["predicted_comm_ms"] is None or s["intensity"] is None:
            continue
        c = s["config"]
        # contenders on the same network (hosts and links), wherever their servers are
        network = "this machine" if c.get("hosts", 1) == 1 and c.get("link", "") == "" \
            else f"{c.get('hosts', 1)} hosts, {c.get('link') or 'unshaped'} links"
        # the crossover is a size, the same whatever size each point's model has
        pairs[(c["model"], s["workers"], network)][line_name(s)].append(s)
    for (model, n, cluster), by in pairs.items():
        names = sorted(by)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ma, mb = by[a][0]["comm_model"], by[b][0]["comm_model"]
                k = max(by[a][0]["servers"], by[b][0]["servers"])
                m_star = crossover_bytes(ma, mb, n, k, cal,
                                         Topology.for_config(by[a][0]["config"]),
                                         Topology.for_config(by[b][0]["config"]))
                sizes = sorted({x["gradient_bytes"] for x in by[a] + by[b]})
                big_a = max(by[a], key=lambda x: x["gradient_bytes"])
                big_b = max(by[b], key=lambda x: x["gradient_bytes"])
                out.append({"a": a, "b": b, "model": model, "cluster": cluster,
                            "workers": n, "bytes": sizes, "crossover_bytes": m_star,
                            "faster_comm": a if big_a["predicted_comm_ms"] <
                            big_b["predicted_comm_ms"] else b})
    return out


def write_report(sweep_dir: Path) -> tuple[Path, str]:
    """Write report.md and the plots into the sweep directory; return (path, key table)."""
    from .predict.costmodel import Calibration, find_calibration

    sweep_dir = Path(sweep_dir)
    spec, rows, problems = collect(sweep_dir)
    if not rows:
        raise ConfigError(f"{sweep_dir}: no finished points to report on "
                          f"({len(problems)} not run or failed); run the sweep first.")
    cal_path = find_calibration(sweep_dir)
    cal = Calibration.load(cal_path) if cal_path else None
    settings = aggregate(rows, cal)
    target = target_accuracy(rows, spec)
    add_time_to_accuracy(settings, target)
    for s in settings:
        s["staleness"] = [x for r in s["rows"] for x in r["staleness"]]
    # points that ran on different clusters say where in their labels
    mixed = len({s["cluster"] for s in settings}) > 1
    for s in settings:
        s["label"] = make_label(s, with_cluster=mixed)
    found = crossovers(settings)
    found_size = crossovers(settings, "size")
    predicted = predicted_crossovers(settings, cal)

    plots: dict[str, Path] = {}
    plots["breakdown"] = plot_breakdown(settings, sweep_dir / "breakdown.png")
    if len({s["workers"] for s in settings}) > 1:
        plots["scaling"] = plot_scaling(settings, sweep_dir / "scaling.png")
    if len({round(s["intensity"] or 0, 6) for s in settings}) > 1:
        plots["intensity"] = plot_along(settings, found, sweep_dir / "intensity.png")
    distributed = [s for s in settings if s["strategy"] != "single"]
    if len({s["gradient_bytes"] for s in distributed}) > 1:
        plots["size"] = plot_along(settings, found_size, sweep_dir / "size.png", "size")
    plots["loss"] = plot_loss(settings, sweep_dir / "loss.png")
    evaluated = [s for s in settings if s["has_evals"]]
    if evaluated:
        plots["accuracy"] = plot_accuracy(settings, target, sweep_dir / "accuracy.png")
    if any(s["staleness"] for s in settings):
        plots["staleness"] = plot_staleness(settings, sweep_dir / "staleness.png")
    if any(s["predicted_comm_ms"] is not None for s in settings):
        plots["costmodel"] = plot_costmodel(settings, sweep_dir / "costmodel.png")

    emulated = any(s["cluster"] != "this machine" for s in settings)
    key_header = ["setting", *(["cluster"] if emulated else []), "samples/s", "step ms",
                  "comm ms", "predicted step ms", "error", "speedup vs single",
                  "final acc", "time to target s"]
    key_rows = []
    for s in settings:
        key_rows.append([
            make_label(s, with_cluster=False), *([s["cluster"]] if emulated else []),
            _fmt(s["samples_per_s"]), _fmt(s["step_ms"], digits=1),
            _fmt(s["comm_ms"], digits=1),
            f"{s['predicted_step_ms']:.1f}" if s["predicted_step_ms"] is not None else "-",
            f"{s['step_error']:+.0%}" if s["step_error"] is not None else "-",
            f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-",
            _fmt(s["accuracy_final"], digits=3), _tta_text(s) if target is not None else "-",
        ])
    md = [f"# Sweep report: {spec.get('name', sweep_dir.name)}", ""]
    if spec.get("description"):
        md += [spec["description"].strip(), ""]
    if spec.get("look_at"):
        md += ["**What to look at:** " + spec["look_at"].strip(), ""]
    host = read_manifest(Path(rows[0]["run"])).get("host", {})
    if emulated:
        clusters = sorted({s["cluster"] for s in settings})
        md += ["**Where the points ran:** " + "; ".join(clusters) + " (emulated hosts: "
               "network namespaces joined by tbf-shaped links on this one machine, "
               "sharing its cores; see docs/emulation.md).", ""]
    md += [f"Directory `{sweep_dir}`; {len(rows)} finished point(s) in {len(settings)} "
           f"setting(s), {spec.get('repeats', 1)} repeat(s) each; host "
           f"{host.get('hostname', '?')} ({host.get('cores', '?')} cores). Values are "
           f"medians over repeats with the min–max range in brackets; steps exclude warm-up.",
           ""]
    if problems:
        md += ["## Points that did not finish", "",
               _md_table(["point", "status", "error"],
                         [[p["id"], p["status"], p["error"].replace("\n", " ")[:300]]
                          for p in problems]), ""]
    md += ["## Key table", "", _md_table(key_header, key_rows), "",
           f"Communication time = blocked + hidden under backward, less waiting for a slower "
           f"peer (see docs/cost-model.md). "
           f"Time to target: training seconds until the first held-out evaluation at "
           f"accuracy {target:g} or above (evaluation time excluded)." if target is not None
           else "No target accuracy set (`--target-accuracy`, or `[report] target_accuracy` "
           "in the definition): no time to target.", ""]
    if cal is None:
        md += ["No calibration found, so no predictions: run `psring calibrate` (or put a "
               "calibration.json in the sweep directory) and report again.", ""]
    else:
        md += [f"Cost model calibration: `{cal_path}`.", ""]
    md += ["## Step-time breakdown", "", f"![breakdown]({plots['breakdown'].name})", "",
           _md_table(["setting", *[p[:-2] + " ms" for p in PHASES], "step ms"],
                     [[_label(s), *[f"{s['phase_ms'][p]:.2f}" for p in PHASES],
                       _fmt(s["step_ms"], digits=1)] for s in settings]), ""]
    if "scaling" in plots:
        md += ["## Scaling with workers", "", f"![scaling]({plots['scaling'].name})", "",
               _md_table(["setting", "workers", "samples/s", "efficiency"],
                         [[_label(s), str(s["workers"]), _fmt(s["samples_per_s"]),
                           f"{s['efficiency']:.2f}" if s["efficiency"] is not None else "-"]
                          for s in settings]), ""]
    if "intensity" in plots:
        md += _crossover_section("arithmetic intensity", plots["intensity"], found)
    if "size" in plots:
        md += _crossover_section("model size", plots["size"], found_size)
    if predicted:
        md += ["## Cost model: predicted crossovers", "",
               _md_table(["strategies", "model", "workers", "cluster", "gradient MB measured",
                          "comm-time crossover (gradient size)", "faster comm, largest size"],
                         [[f"{p['a']} / {p['b']}", p["model"], str(p["workers"]), p["cluster"],
                           "–".join(f"{b / 1e6:.3g}" for b in (p["bytes"][0], p["bytes"][-1])
                                    [:1 if len(p["bytes"]) == 1 else 2]),
                           f"{p['crossover_bytes'] / 1e6:.3g} MB" if p["crossover_bytes"]
                           else "never (one is faster at every size)", p["faster_comm"]]
                          for p in predicted]),
               "", "Below the crossover size the strategy with the smaller fixed cost (α) is "
               "predicted faster, above it the one with the smaller cost per byte. Along "
               "intensity at a fixed size the model predicts no crossover: the strategy "
               "with the cheaper communication stays ahead, by less as compute grows.", ""]
    check = prediction_check(settings)
    if check["n"]:
        md += ["## Step-time prediction", "",
               "The simulator (psring.predict.simulate, docs/prediction.md) replays each run: its "
               "own forward, backward and update times and when its buckets were "
               "launched, with its cluster's communication played out on the calibrated "
               f"α-β-γ costs. Over {check['n']} distributed setting(s): median absolute "
               f"error {check['median_abs_error']:.0%}, largest "
               f"{check['max_abs_error']:.0%}."
               + (f" Predicted fastest = measured fastest (or within 5% of it) in "
                  f"{sum(w['right'] for w in check['winners'])} of "
                  f"{len(check['winners'])} comparison(s)." if check["winners"] else ""), "",
               _md_table(["setting", "measured step ms", "predicted step ms", "error",
                          "predicted bound"],
                         [[_label(s), _fmt(s["step_ms"], digits=1),
                           f"{s['predicted_step_ms']:.1f}", f"{s['step_error']:+.0%}",
                           s["predicted_bound"] or "-"]
                          for s in settings if s.get("step_error") is not None]), ""]
        if check["winners"]:
            md += [_md_table(["measured fastest", "predicted fastest", "right"],
                             [[w["measured"], w["predicted"], "yes" if w["right"] else "no"]
                              for w in check["winners"]]), ""]
    if "costmodel" in plots:
        errs = [s for s in settings if s["comm_error"] is not None]
        md += ["## Cost model vs measurement", "", f"![costmodel]({plots['costmodel'].name})",
               "", _md_table(["setting", "gradient MB", "measured comm ms", "predicted ms",
                              "relative error"],
                             [[_label(s), f"{s['gradient_bytes'] / 1e6:.2f}",
                               _fmt(s["comm_ms"], digits=2), f"{s['predicted_comm_ms']:.2f}",
                               f"{s['comm_error']:+.0%}"] for s in errs]), ""]
    if "accuracy" in plots:
        md += ["## Time to accuracy", "", f"![accuracy]({plots['accuracy'].name})", "",
               "Time to target = steps to target (statistical efficiency) x time per step "
               "(hardware efficiency), roughly: an asynchronous or compressed strategy wins "
               "only if its faster steps outweigh any extra steps it needs.", "",
               _md_table(["setting", "time to target s", "steps to target", "step ms",
                          "final accuracy", "runs reaching it"],
                         [[_label(s), _tta_text(s) if target is not None else "-",
                           _fmt(s["tta_steps"]) if s["tta_steps"] else "-",
                           _fmt(s["step_ms"], digits=1), _fmt(s["accuracy_final"], digits=3),
                           f"{s['tta_reached']}/{s['repeats']}" if target is not None else "-"]
                          for s in evaluated]), ""]
    md += ["## Training loss", "", f"![loss]({plots['loss'].name})", "",
           _md_table(["setting", "final loss"],
                     [[_label(s), _fmt(s["loss_final"], digits=3, style="g")]
                      for s in settings]), ""]
    if "staleness" in plots:
        md += ["## Staleness", "", f"![staleness]({plots['staleness'].name})", "",
               _md_table(["setting", "steps", "mean", "p50", "max"],
                         [[_label(s), str(len(s["staleness"])),
                           f"{st.fmean(s['staleness']):.2f}",
                           f"{st.median(s['staleness']):.0f}", str(max(s["staleness"]))]
                          for s in settings if s["staleness"]]), ""]
    md += ["## Points", "", _md_table(["point", "run directory"],
                                      [[r["id"], f"`{r['run']}`"] for r in rows]), ""]
    path = sweep_dir / REPORT
    atomic_write_bytes(path, "\n".join(md).encode())
    atomic_write_bytes(sweep_dir / "report.json", json.dumps(
        [{k: v for k, v in s.items() if k not in ("rows", "staleness", "has_evals")}
         for s in settings], indent=2, default=str).encode())
    return path, render_key_table(key_header, key_rows, spec.get("name", ""))


def render_key_table(header: list[str], rows: list[list[str]], title: str) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"psring sweep {title}: key table (medians over repeats)")
    for col in header:
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in rows:
        table.add_row(*r)
    console = Console(width=170, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


__all__ = ["write_report", "collect", "aggregate", "crossovers", "POINT_FILE"]
