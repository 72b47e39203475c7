"""A sweep's points grouped into settings: medians and ranges over repeats, the cost
model's and the simulator's predictions, speedups, scaling efficiency, time to
accuracy, and where two strategies' throughputs cross.

Definitions (also in docs/cost-model.md):
- *intensity* = FLOPs a worker computes per step / bytes of gradients M. It is the
  same for every strategy on one workload, so curves of different strategies share x.
- *time to accuracy* (MLPerf Training's) = the training time (rank 0's clock,
  evaluations excluded; psring.train.evaluate) of the first held-out evaluation whose
  accuracy reaches the target: ``[report] target_accuracy`` of the definition, else
  the runs' own ``--target-accuracy``. A run that never reaches it is "not reached".
"""

from __future__ import annotations

import json
import math
import statistics as st
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from psring.config import cluster_of
from psring.predict.analytic import crossover_bytes
from psring.predict.calibration import Calibration
from psring.predict.replay import replay
from psring.predict.sim.simulate import comm_seconds, is_costed
from psring.records.runlog import PHASES
from psring.report.cluster import CLUSTER_KEYS, cluster_text, network_text
from psring.report.faults import tta_with_losses
from psring.report.runs import WORKLOAD_KEYS
from psring.strategies import STRATEGIES
from psring.train.evaluate import time_to_accuracy

#: keys that define the model and data (not the batch): the scaling baseline's match
MODEL_KEYS = ("model", "width", "depth", "data", "samples", "features", "classes",
              "accumulate", "seed")


@dataclass(frozen=True)
class Spread:
    """A value over a setting's repeats: the median and the range."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        """Over the finite values given; None when there are none."""
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return None
        return cls(st.median(vals), min(vals), max(vals), len(vals))


#: fields report.json names otherwise, by the names its readers have always used
_JSON_KEYS = {"id": "setting", "cost_model": "comm_model"}


@dataclass
class Setting:
    """A sweep's point aggregated over its repeats (the points whose ids differ only in
    the repeat number): what the tables and plots read, and report.json holds
    (:meth:`to_dict`). Times are in milliseconds."""

    #: the point id without its repeat number (report.json's "setting")
    id: str
    strategy: str
    workers: int
    servers: int
    #: the settings the sweep varies, as this point's definition gave them
    varied: dict[str, Any]
    #: the first repeat's config, as its manifest stores it
    config: dict[str, Any]
    #: where it ran, in words (psring.report.cluster)
    cluster: str
    repeats: int
    #: M: the gradients' bytes per step as sent (compressed with --compress)
    gradient_bytes: int
    #: FLOPs a worker computes per step / gradient bytes; None when not measured
    intensity: float | None
    #: the strategy's closed form (psring.predict.analytic), if any
    cost_model: str | None
    samples_per_s: Spread | None
    step_ms: Spread | None
    #: communication time per step (psring.report.points.comm_time)
    comm_ms: Spread | None
    #: median of each phase (runlog.PHASES) over the repeats' step medians
    phase_ms: dict[str, float]
    loss_final: Spread | None
    accuracy_final: Spread | None
    #: the repeats' own rows (psring.report.points.load_point)
    rows: list[dict] = field(default_factory=list, repr=False)
    #: the cost model's communication time; None without a calibration
    predicted_comm_ms: float | None = None
    #: the simulator's step time (psring.predict.replay), the median over repeats, and
    #: what bounds that median replay
    predicted_step_ms: float | None = None
    predicted_bound: str | None = None
    #: (predicted - measured) / measured
    step_error: float | None = None
    comm_error: float | None = None
    #: throughput over single's on the same workload
    speedup: float | None = None
    #: throughput / (workers x single's at the same per-worker batch)
    efficiency: float | None = None
    #: time and steps to the target accuracy, over the repeats that reached it
    tta_s: Spread | None = None
    tta_steps: Spread | None = None
    tta_reached: int = 0
    has_evals: bool = False
    #: every step's staleness, over the repeats (asynchronous strategies)
    staleness: list[int] = field(default_factory=list, repr=False)
    #: how the report names it (make_label); "" until the report sets it
    label: str = ""

    #: the fields that are a Spread (in report.json: {median, min, max, n})
    SPREADS = ("samples_per_s", "step_ms", "comm_ms", "loss_final", "accuracy_final",
               "tta_s", "tta_steps")

    def to_dict(self) -> dict[str, Any]:
        """This setting in report.json: every field in order but the rows, staleness
        and has_evals; the id as "setting" and the cost model as "comm_model"
        (:data:`_JSON_KEYS`), a Spread as {median, min, max, n}."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("rows", "staleness", "has_evals"):
                continue
            value = getattr(self, f.name)
            out[_JSON_KEYS.get(f.name, f.name)] = \
                asdict(value) if isinstance(value, Spread) else value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Setting:
        """A setting as report.json holds it (:meth:`to_dict`), without its rows."""
        known = {f.name for f in fields(cls)}
        field_of = {key: name for name, key in _JSON_KEYS.items()}
        kwargs = {field_of.get(k, k): v for k, v in d.items()}
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        for name in cls.SPREADS:
            if kwargs.get(name) is not None:
                kwargs[name] = Spread(**kwargs[name])
        return cls(**kwargs)


def aggregate(rows: list[dict], cal: Calibration | None = None) -> list[Setting]:
    """One Setting per setting: medians and ranges over repeats, predictions, speedups."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["setting"]].append(r)
    out = []
    for setting, rs in groups.items():
        r0 = rs[0]
        cls = STRATEGIES.get(r0["strategy"]) if r0["strategy"] in STRATEGIES else None
        # (a strategy without a formula yet is not priced: docs/cost-model.md)
        model = cls.caps.cost_model if cls and is_costed(cls.caps.cost_model) else None
        s = Setting(
            id=setting, strategy=r0["strategy"], workers=r0["workers"],
            servers=r0["servers"], varied=r0["varied"], config=r0["config"],
            cluster=cluster_text(r0["config"]),
            repeats=len(rs), gradient_bytes=r0["gradient_bytes"],
            intensity=r0["intensity"], cost_model=model,
            samples_per_s=Spread.of(r["samples_per_s"] for r in rs),
            step_ms=Spread.of(r["step_p50_s"] * 1e3 for r in rs),
            comm_ms=Spread.of(r["comm_time_s"] * 1e3 for r in rs),
            phase_ms={p: st.median(r["phase_ms"][p] for r in rs) for p in PHASES},
            loss_final=Spread.of(r["loss_final"] for r in rs),
            accuracy_final=Spread.of(r["accuracy_final"] for r in rs),
            rows=rs, staleness=[x for r in rs for x in r["staleness"]],
        )
        pred = None
        if cal is not None and model is not None:
            pred = comm_seconds(model, s.workers, s.servers, s.gradient_bytes, cal,
                                cluster_of(r0["config"]))
        s.predicted_comm_ms = pred * 1e3 if pred is not None else None
        _predict_step(s, cal)
        if pred and s.comm_ms:  # (one worker: nothing to predict but 0)
            s.comm_error = (pred * 1e3 - s.comm_ms.median) / s.comm_ms.median
        out.append(s)
    _speedups(out)
    _efficiency(out)
    order = {name: i for i, name in enumerate(STRATEGIES)}
    out.sort(key=lambda s: (order.get(s.strategy, len(order)), s.workers, s.servers,
                            s.intensity or 0, s.gradient_bytes, s.id))
    return out


def _predict_step(s: Setting, cal: Calibration | None) -> None:
    """The simulator's step time (psring.predict.replay: each run's own compute, its
    cluster's communication played out) beside the measured one, and what bounds it."""
    preds = [replay(Path(r["run"]), cal) for r in s.rows] if cal is not None else []
    preds = [p for p in preds if p is not None]
    preds.sort(key=lambda p: p.step_s)
    s.predicted_step_ms = st.median(p.step_s * 1e3 for p in preds) if preds else None
    s.predicted_bound = preds[len(preds) // 2].bound if preds else None  # the median's
    s.step_error = ((s.predicted_step_ms - s.step_ms.median) / s.step_ms.median
                    if preds and s.step_ms else None)


def prediction_check(settings: list[Setting]) -> dict[str, Any]:
    """How well the simulator did over a sweep: the median and largest absolute error of
    the predicted step time, and, per group of settings that differ only in strategy
    (and the servers' number and placement), whether the predicted fastest is the
    measured fastest."""
    errs = [abs(s.step_error) for s in settings
            if s.step_error is not None and s.strategy != "single"]
    groups: dict[str, list[Setting]] = defaultdict(list)
    for s in settings:
        if s.step_error is None or s.strategy == "single":
            continue
        # the sweep's varied settings (its base is shared), less what is compared
        key = {k: v for k, v in s.varied.items()
               if k not in ("strategy", "servers", "server_placement")}
        groups[json.dumps(key, sort_keys=True, default=str)].append(s)
    winners = []
    for g in groups.values():
        if len(g) < 2:
            continue
        measured = min(g, key=lambda s: s.step_ms.median)
        predicted = min(g, key=lambda s: s.predicted_step_ms)
        # a tie within 5% measured counts either way: noise decides it
        close = predicted.step_ms.median <= 1.05 * measured.step_ms.median
        winners.append({"measured": setting_label(measured),
                        "predicted": setting_label(predicted),
                        "right": predicted is measured or close})
    return {"n": len(errs), "median_abs_error": st.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "winners": winners}


def _workload(cfg: dict, keys=WORKLOAD_KEYS) -> str:
    return json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True)


def _speedups(settings: list[Setting]) -> None:
    base = {_workload(s.config): s for s in settings if s.strategy == "single"}
    for s in settings:
        b = base.get(_workload(s.config))
        s.speedup = s.samples_per_s.median / b.samples_per_s.median if b else None


def _efficiency(settings: list[Setting]) -> None:
    """Scaling efficiency = throughput / (workers x single's throughput at the same
    per-worker batch and model): 1.0 is perfect linear scaling."""
    single = {}
    for s in settings:
        if s.strategy == "single":
            single[(_workload(s.config, MODEL_KEYS), s.config["batch_size"])] = s
    for s in settings:
        c = s.config
        # (uneven shares have no single run "at the same per-worker batch")
        b = None if c.get("worker_batch") else \
            single.get((_workload(c, MODEL_KEYS), c["batch_size"] // c["workers"]))
        s.efficiency = (s.samples_per_s.median / (s.workers * b.samples_per_s.median)
                        if b else None)


def target_accuracy(rows: list[dict], spec: dict) -> float | None:
    """``[report] target_accuracy`` of the definition, else the runs' own
    ``--target-accuracy`` (the highest, if they differ); None when neither is set."""
    t = (spec.get("report") or {}).get("target_accuracy")
    if t is not None:
        return float(t)
    own = [r["config"].get("target_accuracy") or 0 for r in rows]
    return max(own) if any(own) else None


def add_time_to_accuracy(settings: list[Setting], target: float | None) -> None:
    """Per setting, over its repeats: time to target, steps to target, and how many
    runs reached it."""
    for s in settings:
        got = [time_to_accuracy(r["evals"], target) if target is not None and r["evals"]
               else (None, None) for r in s.rows]
        s.tta_s = Spread.of(t for t, _ in got if t is not None)
        s.tta_steps = Spread.of(n for _, n in got if n is not None)
        s.tta_reached = sum(t is not None for t, _ in got)
        s.has_evals = any(r["evals"] for r in s.rows)


#: what a crossover is sought along: the x value, and the settings a group shares
#: (everything but what moves x; the cluster included, so each link speed is its own)
_ALONG = {
    "intensity": ("intensity", ("model", "width", "depth", "features", "workers", "hosts",
                                "link", "delay")),
    "size": ("gradient_bytes", ("model", "features", "batch_size", "accumulate", "workers",
                                "hosts", "link", "delay")),
}


def line_name(s: Setting) -> str:
    """A strategy as a contender: with its servers and their placement when it has any."""
    c = s.config
    name = s.strategy
    if s.servers > 1:
        name += f" K={s.servers}"
    if c.get("server_placement", "colocated") != "colocated":
        name += f" ({c['server_placement']})"
    return name


def crossovers(settings: list[Setting], along: str = "intensity") -> list[dict]:
    """Where the throughput curves of two contenders cross along intensity (what the
    batch sets) or along gradient size (what the model's width and depth set), within a
    group of settings that differ only in that."""
    attr, shared = _ALONG[along]
    groups: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for s in settings:
        if not getattr(s, attr) or s.strategy == "single":
            continue
        c = s.config
        key = json.dumps({k: c.get(k) for k in shared}, sort_keys=True)
        groups[key][line_name(s)].append((getattr(s, attr), s.samples_per_s.median))
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


def predicted_crossovers(settings: list[Setting], cal: Calibration | None) -> list[dict]:
    """The cost model's crossovers: per (model, workers), the gradient size at which two
    strategies' predicted communication times are equal. (Along intensity at a fixed
    size the model predicts no crossover: compute is the same for both, so the one
    with the cheaper communication is faster at every intensity, by less and less.)"""
    if cal is None:
        return []
    out = []
    pairs: dict[tuple, dict[str, list[Setting]]] = defaultdict(lambda: defaultdict(list))
    for s in settings:
        if s.predicted_comm_ms is None or s.intensity is None:
            continue
        c = s.config
        # contenders on the same network, wherever their servers are; the crossover is a
        # size, the same whatever size each point's model has
        pairs[(c["model"], s.workers, network_text(c))][line_name(s)].append(s)
    for (model, n, cluster), by in pairs.items():
        names = sorted(by)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ma, mb = by[a][0].cost_model, by[b][0].cost_model
                k = max(by[a][0].servers, by[b][0].servers)
                m_star = crossover_bytes(ma, mb, n, k, cal, cluster_of(by[a][0].config),
                                         cluster_of(by[b][0].config), price=comm_seconds)
                sizes = sorted({x.gradient_bytes for x in by[a] + by[b]})
                big_a = max(by[a], key=lambda x: x.gradient_bytes)
                big_b = max(by[b], key=lambda x: x.gradient_bytes)
                out.append({"a": a, "b": b, "model": model, "cluster": cluster,
                            "workers": n, "bytes": sizes, "crossover_bytes": m_star,
                            "faster_comm": a if big_a.predicted_comm_ms <
                            big_b.predicted_comm_ms else b})
    return out


def setting_label(s: Setting) -> str:
    """How the report names a setting: its label, else its varied settings."""
    return s.label or make_label(s, with_cluster=False)


def make_label(s: Setting, with_cluster: bool, varied: dict[str, Any] | None = None) -> str:
    """The varied settings as this point ran them (single's workers are normalized to
    1); ``with_cluster``: where it ran instead of the cluster flags (when points of one
    sweep ran on different clusters); ``varied``: these instead of the setting's own."""
    c = s.config
    # settings a strategy has no use for were normalized away: not worth naming
    unused = set() if s.strategy not in STRATEGIES or \
        STRATEGIES.get(s.strategy).caps.uses_servers else {"servers", "server_placement"}
    shown = {("batch_size" if k == "batch_per_worker" else k): c.get(k, v)
             for k, v in (s.varied if varied is None else varied).items()
             if k != "strategy" and k not in unused
             and not (with_cluster and k in CLUSTER_KEYS) and c.get(k, v) != ""}
    extra = ", ".join(f"{k}={v}" for k, v in shown.items())
    if with_cluster:
        extra += ("; " if extra else "") + s.cluster
    return f"{s.strategy}" + (f" ({extra})" if extra else "")


#: the sweep's grid key whose cases the report's Faults section compares
#: (psring.runs.sweep: a key that is no flag names cases); its first case is the
#: fault-free run the others are set against
FAULT_AXIS = "fault"


def fault_rows(settings: list, grid: dict[str, list], target: float | None) -> list[dict]:
    """For every setting of a fault case (grid key ``fault``) other than the first: what
    its faults cost, over its repeats, beside the first case's setting that differs only
    in the fault (psring.report.aggregate.Setting's). Empty without such a key."""
    cases = [c[FAULT_AXIS] if isinstance(c, dict) else c for c in grid.get(FAULT_AXIS, [])]
    if len(cases) < 2:
        return []
    clean = {_others(s): s for s in settings if s.varied.get(FAULT_AXIS) == cases[0]}
    out = []
    for s in settings:
        if s.varied.get(FAULT_AXIS) in (None, cases[0]):
            continue
        got = [r.get("fault_effects") or {} for r in s.rows]

        def over(key: str, got=got) -> Any:
            return Spread.of(g.get(key) for g in got)
        out.append({
            "setting": s, "fault": s.varied[FAULT_AXIS], "clean": clean.get(_others(s)),
            "recovery_s": over("recovery_s"), "steps_redone": over("steps_redone"),
            "lost_s": over("lost_s"), "before": over("samples_per_s_before"),
            "after": over("samples_per_s_after"),
            "lost_workers": sorted({w for g in got for w in g.get("lost", [])}),
            "tta_s": Spread.of(tta_with_losses(r["evals"], target,
                                               [tuple(x) for x in g.get("losses", [])])
                               for r, g in zip(s.rows, got)),
        })
    return out


def _others(s: Any) -> str:
    """A setting's varied values but the fault: what its fault-free partner shares."""
    return json.dumps({k: v for k, v in s.varied.items() if k != FAULT_AXIS},
                      sort_keys=True, default=str)
