"""The report of a sweep: ``psring report SWEEP_DIR`` writes report.md, report.json and
PNG plots into the sweep directory and prints the key table.

    psring sweep experiments/intensity.toml --out runs/intensity
    psring report runs/intensity            # -> runs/intensity/report.md, *.png

Every figure is read back from the points' logs (psring.report.points); points
repeated R times are aggregated per *setting* (the point without its repeat number)
as the median with the min–max range (psring.report.aggregate). What is in it:

- the key table: throughput, step time, communication time measured beside the cost
  model's prediction (psring.predict.analytic, from ``psring calibrate``) and its
  relative error, speedup over ``single``, time to the target accuracy;
- the step-time breakdown per setting (data / forward / backward / comm / update);
- throughput and scaling efficiency vs workers (when the sweep varies workers);
- throughput vs arithmetic intensity per strategy with the measured crossovers, and
  the crossover the cost model predicts (when the sweep varies intensity);
- held-out accuracy vs training time and vs step, and time to accuracy: time to the
  target, steps to it (statistical efficiency) and time per step (hardware efficiency);
- training loss vs time and vs step (an EMA, the raw points faint);
- the staleness distribution of asynchronous runs;
- with a grid key ``fault`` (cases: psring.runs.sweep), each fault case beside the
  same setting without it: recovery time, steps redone, time lost, throughput before
  and after, time to accuracy and final accuracy (psring.report.faults).
"""

from __future__ import annotations

import json
import statistics as st
from dataclasses import dataclass
from pathlib import Path

from psring.errors import ConfigError
from psring.predict.calibration import Calibration, find_calibration
from psring.records.runlog import PHASES, atomic_write_bytes, read_manifest
from psring.report.aggregate import (
    FAULT_AXIS,
    Setting,
    Spread,
    add_time_to_accuracy,
    aggregate,
    crossovers,
    fault_rows,
    make_label,
    predicted_crossovers,
    prediction_check,
    setting_label,
    target_accuracy,
)
from psring.report.plots import (
    plot_accuracy,
    plot_along,
    plot_breakdown,
    plot_costmodel,
    plot_loss,
    plot_scaling,
    plot_staleness,
)
from psring.report.points import collect

REPORT = "report.md"


def _timing_only(s: Setting) -> bool:
    """A setting run with --compute device (psring.train.device): nothing learnt to show."""
    return any(r.get("timing_only") for r in s.rows)


def _fmt(a: Spread | None, scale: float = 1.0, digits: int = 0, style: str = "f") -> str:
    """Median (min–max); ``style`` "g" counts significant digits, for values such as
    a final loss that can fall to 1e-4 and would print as 0.000."""
    if a is None:
        return "-"
    spec = f".{digits}{style}"
    m = f"{a.median * scale:{spec}}"
    if a.n > 1:
        m += f" ({a.min * scale:{spec}}–{a.max * scale:{spec}})"
    return m


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _tta_text(s: Setting) -> str:
    if not s.has_evals:
        return "-"
    if not s.tta_s:
        return "not reached"
    return _fmt(s.tta_s, digits=2) + ("" if s.tta_reached == s.repeats else
                                      f" [{s.tta_reached}/{s.repeats} reached]")


def _crossover_section(along: str, plot: Path | None, found: list[dict]) -> list[str]:
    """report.md's section for a plot of throughput along intensity or model size."""
    if plot is None:
        return []
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


@dataclass
class _Sweep:
    """A sweep read back from its logs and aggregated per setting: what every plot and
    section of the report draws on."""

    dir: Path
    #: the sweep's definition (sweep.json)
    spec: dict
    #: the finished points, one row each (psring.report.points.load_point)
    rows: list[dict]
    #: the points that failed or did not run
    problems: list[dict]
    cal_path: Path | None
    cal: Calibration | None
    settings: list[Setting]
    target: float | None
    #: measured crossovers along intensity and along model size, and the cost model's
    found: list[dict]
    found_size: list[dict]
    predicted: list[dict]

    @property
    def emulated(self) -> bool:
        return any(s.cluster != "this machine" for s in self.settings)

    @property
    def evaluated(self) -> list[Setting]:
        return [s for s in self.settings if s.has_evals]


def _read_sweep(sweep_dir: Path) -> _Sweep:
    """The sweep's finished points aggregated per setting, labelled, with time to the
    target accuracy and the crossovers; a ConfigError when nothing finished."""
    spec, rows, problems = collect(sweep_dir)
    if not rows:
        raise ConfigError(f"{sweep_dir}: no finished points to report on "
                          f"({len(problems)} not run or failed); run the sweep first.")
    cal_path = find_calibration(sweep_dir)
    cal = Calibration.load(cal_path) if cal_path else None
    if cal is not None and rows:  # (against the machine the runs were on, not this one)
        ran_on = rows[0].get("machine") or {}
        cal.warn_if_elsewhere(cal_path, ran_on.get("hostname") or "", ran_on.get("cores") or 0,
                              where="the machine these runs were on")
    settings = aggregate(rows, cal)
    target = target_accuracy(rows, spec)
    add_time_to_accuracy(settings, target)
    # points that ran on different clusters say where in their labels
    mixed = len({s.cluster for s in settings}) > 1
    for s in settings:
        s.label = make_label(s, with_cluster=mixed)
    return _Sweep(sweep_dir, spec, rows, problems, cal_path, cal, settings, target,
                  found=crossovers(settings), found_size=crossovers(settings, "size"),
                  predicted=predicted_crossovers(settings, cal))


def _draw_plots(sw: _Sweep) -> dict[str, Path]:
    """The PNG plots the sweep has data for, by name; breakdown and loss always."""
    settings, d = sw.settings, sw.dir
    plots: dict[str, Path] = {}
    plots["breakdown"] = plot_breakdown(settings, d / "breakdown.png")
    if len({s.workers for s in settings}) > 1:
        plots["scaling"] = plot_scaling(settings, d / "scaling.png")
    if len({round(s.intensity or 0, 6) for s in settings}) > 1:
        plots["intensity"] = plot_along(settings, sw.found, d / "intensity.png")
    distributed = [s for s in settings if s.strategy != "single"]
    if len({s.gradient_bytes for s in distributed}) > 1:
        plots["size"] = plot_along(settings, sw.found_size, d / "size.png", "size")
    plots["loss"] = plot_loss(settings, d / "loss.png")
    if sw.evaluated:
        plots["accuracy"] = plot_accuracy(settings, sw.target, d / "accuracy.png")
    if any(s.staleness for s in settings):
        plots["staleness"] = plot_staleness(settings, d / "staleness.png")
    if any(s.predicted_comm_ms is not None for s in settings):
        plots["costmodel"] = plot_costmodel(settings, d / "costmodel.png")
    return plots


def _key_table(sw: _Sweep) -> tuple[list[str], list[list[str]]]:
    """The key table's header and rows: report.md's and the terminal's."""
    emulated = sw.emulated
    header = ["setting", *(["cluster"] if emulated else []), "samples/s", "step ms",
              "comm ms", "predicted step ms", "error", "speedup vs single",
              "final acc", "time to target s"]
    rows = [[
        make_label(s, with_cluster=False), *([s.cluster] if emulated else []),
        _fmt(s.samples_per_s), _fmt(s.step_ms, digits=1),
        _fmt(s.comm_ms, digits=1),
        f"{s.predicted_step_ms:.1f}" if s.predicted_step_ms is not None else "-",
        f"{s.step_error:+.0%}" if s.step_error is not None else "-",
        f"{s.speedup:.2f}x" if s.speedup is not None else "-",
        "timing only" if _timing_only(s) else _fmt(s.accuracy_final, digits=3),
        _tta_text(s) if sw.target is not None else "-",
    ] for s in sw.settings]
    return header, rows


def _intro(sw: _Sweep) -> list[str]:
    """The title, what the sweep is and what to look at, and where and how it ran."""
    spec = sw.spec
    md = [f"# Sweep report: {spec.get('name', sw.dir.name)}", ""]
    if spec.get("description"):
        md += [spec["description"].strip(), ""]
    if spec.get("look_at"):
        md += ["**What to look at:** " + spec["look_at"].strip(), ""]
    host = read_manifest(Path(sw.rows[0]["run"])).get("host", {})
    if sw.emulated:
        clusters = sorted({s.cluster for s in sw.settings})
        md += ["**Where the points ran:** " + "; ".join(clusters) + " (emulated hosts: "
               "network namespaces joined by tbf-shaped links on this one machine, "
               "sharing its cores; see docs/emulation.md).", ""]
    md += [f"Directory `{sw.dir}`; {len(sw.rows)} finished point(s) in {len(sw.settings)} "
           f"setting(s), {spec.get('repeats', 1)} repeat(s) each; host "
           f"{host.get('hostname', '?')} ({host.get('cores', '?')} cores). Values are "
           f"medians over repeats with the min–max range in brackets; steps exclude warm-up.",
           ""]
    return md


def _unfinished_section(problems: list[dict]) -> list[str]:
    if not problems:
        return []
    return ["## Points that did not finish", "",
            _md_table(["point", "status", "error"],
                      [[p["id"], p["status"], p["error"].replace("\n", " ")[:300]]
                       for p in problems]), ""]


def _key_section(sw: _Sweep, header: list[str], rows: list[list[str]]) -> list[str]:
    """The key table, what its columns mean, and where its predictions come from."""
    if sw.target is None:
        # without a target the note on communication time is left out too, as report.md
        # has always read
        note = ("No target accuracy set (`--target-accuracy`, or `[report] target_accuracy` "
                "in the definition): no time to target.")
    else:
        note = (f"Communication time = blocked + hidden under backward, less waiting for a "
                f"slower peer (see docs/cost-model.md). "
                f"Time to target: training seconds until the first held-out evaluation at "
                f"accuracy {sw.target:g} or above (evaluation time excluded).")
    md = ["## Key table", "", _md_table(header, rows), "", note, ""]
    if sw.cal is None:
        return md + ["No calibration found, so no predictions: run `psring calibrate` (or "
                     "put a calibration.json in the sweep directory) and report again.", ""]
    return md + [f"Cost model calibration: `{sw.cal_path}`.", ""]


def _breakdown_section(settings: list[Setting], plot: Path) -> list[str]:
    return ["## Step-time breakdown", "", f"![breakdown]({plot.name})", "",
            _md_table(["setting", *[p[:-2] + " ms" for p in PHASES], "step ms"],
                      [[setting_label(s), *[f"{s.phase_ms[p]:.2f}" for p in PHASES],
                        _fmt(s.step_ms, digits=1)] for s in settings]), ""]


def _scaling_section(settings: list[Setting], plot: Path | None) -> list[str]:
    if plot is None:
        return []
    return ["## Scaling with workers", "", f"![scaling]({plot.name})", "",
            _md_table(["setting", "workers", "samples/s", "efficiency"],
                      [[setting_label(s), str(s.workers), _fmt(s.samples_per_s),
                        f"{s.efficiency:.2f}" if s.efficiency is not None else "-"]
                       for s in settings]), ""]


def _predicted_crossovers_section(predicted: list[dict]) -> list[str]:
    """Where the cost model puts each pair's crossover along gradient size."""
    if not predicted:
        return []
    return ["## Cost model: predicted crossovers", "",
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


def _prediction_section(settings: list[Setting]) -> list[str]:
    """The simulator's step time beside the measured one, and whether it picks the
    fastest strategy."""
    check = prediction_check(settings)
    if not check["n"]:
        return []
    winners = check["winners"]
    md = ["## Step-time prediction", "",
          "The simulator (psring.predict.sim.simulate, docs/prediction.md) replays each run: its "
          "own forward, backward and update times and when its buckets were "
          "launched, with its cluster's communication played out on the calibrated "
          f"α-β-γ costs. Over {check['n']} distributed setting(s): median absolute "
          f"error {check['median_abs_error']:.0%}, largest "
          f"{check['max_abs_error']:.0%}."
          + (f" Predicted fastest = measured fastest (or within 5% of it) in "
             f"{sum(w['right'] for w in winners)} of "
             f"{len(winners)} comparison(s)." if winners else ""), "",
          _md_table(["setting", "measured step ms", "predicted step ms", "error",
                     "predicted bound"],
                    [[setting_label(s), _fmt(s.step_ms, digits=1),
                      f"{s.predicted_step_ms:.1f}", f"{s.step_error:+.0%}",
                      s.predicted_bound or "-"]
                     for s in settings if s.step_error is not None]), ""]
    if winners:
        md += [_md_table(["measured fastest", "predicted fastest", "right"],
                         [[w["measured"], w["predicted"], "yes" if w["right"] else "no"]
                          for w in winners]), ""]
    return md


def _costmodel_section(settings: list[Setting], plot: Path | None) -> list[str]:
    if plot is None:
        return []
    errs = [s for s in settings if s.comm_error is not None]
    return ["## Cost model vs measurement", "", f"![costmodel]({plot.name})",
            "", _md_table(["setting", "gradient MB", "measured comm ms", "predicted ms",
                           "relative error"],
                          [[setting_label(s), f"{s.gradient_bytes / 1e6:.2f}",
                            _fmt(s.comm_ms, digits=2), f"{s.predicted_comm_ms:.2f}",
                            f"{s.comm_error:+.0%}"] for s in errs]), ""]


def _accuracy_section(sw: _Sweep, plot: Path | None) -> list[str]:
    """Time to accuracy, split into steps to it and time per step."""
    if plot is None:
        return []
    targeted = sw.target is not None
    return ["## Time to accuracy", "", f"![accuracy]({plot.name})", "",
            "Time to target = steps to target (statistical efficiency) x time per step "
            "(hardware efficiency), roughly: an asynchronous or compressed strategy wins "
            "only if its faster steps outweigh any extra steps it needs.", "",
            _md_table(["setting", "time to target s", "steps to target", "step ms",
                       "final accuracy", "runs reaching it"],
                      [[setting_label(s), _tta_text(s) if targeted else "-",
                        _fmt(s.tta_steps) if s.tta_steps else "-",
                        _fmt(s.step_ms, digits=1), _fmt(s.accuracy_final, digits=3),
                        f"{s.tta_reached}/{s.repeats}" if targeted else "-"]
                       for s in sw.evaluated]), ""]


def _faults_section(sw: _Sweep) -> list[str]:
    """Each fault case against the same setting without it (grid key ``fault``)."""
    rows = fault_rows(sw.settings, sw.spec.get("grid") or {}, sw.target)
    if not rows:
        return []

    def vs(a: Spread | None, b: Spread | None, digits: int) -> str:
        return f"{_fmt(a, digits=digits)} vs {_fmt(b, digits=digits)}"
    table = []
    for r in rows:
        s, clean = r["setting"], r["clean"]
        table.append([
            make_label(s, False, {k: v for k, v in s.varied.items() if k != FAULT_AXIS}),
            str(r["fault"]) + (f" (went on without {', '.join(r['lost_workers'])})"
                          if r["lost_workers"] else ""),
            _fmt(r["recovery_s"], digits=2), _fmt(r["steps_redone"]),
            _fmt(r["lost_s"], digits=2),
            f"{_fmt(r['before'])} → {_fmt(r['after'])}",
            vs(s.samples_per_s, clean.samples_per_s if clean else None, 0),
            vs(r["tta_s"], clean.tta_s if clean else None, 2)
            if sw.target is not None else "-",
            vs(s.accuracy_final, clean.accuracy_final if clean else None, 3),
        ])
    return ["## Faults", "",
            "Each fault case beside the same setting without it (the grid's first `fault` "
            "case). Recovery: from the process killed to the first step at or past the one "
            "it stopped, completed by a worker (a restart's start and the steps it redoes "
            "included). Lost: each restart's time from the last step logged before the "
            "failure to the same step logged again. samples/s: every worker's steps before "
            "the fault → after the recovery, on the wall clock (evaluations included); "
            "samples/s (vs without): the key table's, the whole run. Time to target: the "
            "training clock at the first evaluation at the target plus the time lost in "
            "restarts before it (psring.report.faults).", "",
            _md_table(["setting", "fault", "recovery s", "steps redone", "lost s",
                       "samples/s before → after", "samples/s (vs without)",
                       "time to target s (vs without)",
                       "final acc (vs without)"], table), ""]


def _loss_section(settings: list[Setting], plot: Path) -> list[str]:
    return ["## Training loss", "", f"![loss]({plot.name})", "",
            _md_table(["setting", "final loss"],
                      [[setting_label(s), "timing only" if _timing_only(s) else
                        _fmt(s.loss_final, digits=3, style="g")] for s in settings]), ""]


def _staleness_section(settings: list[Setting], plot: Path | None) -> list[str]:
    if plot is None:
        return []
    return ["## Staleness", "", f"![staleness]({plot.name})", "",
            _md_table(["setting", "steps", "mean", "p50", "max"],
                      [[setting_label(s), str(len(s.staleness)),
                        f"{st.fmean(s.staleness):.2f}",
                        f"{st.median(s.staleness):.0f}", str(max(s.staleness))]
                       for s in settings if s.staleness]), ""]


def _points_section(rows: list[dict]) -> list[str]:
    return ["## Points", "", _md_table(["point", "run directory"],
                                       [[r["id"], f"`{r['run']}`"] for r in rows]), ""]


def _markdown(sw: _Sweep, plots: dict[str, Path], key_header: list[str],
              key_rows: list[list[str]]) -> str:
    """report.md, section by section; a section without data or plot is left out."""
    settings = sw.settings
    return "\n".join([
        *_intro(sw),
        *_unfinished_section(sw.problems),
        *_key_section(sw, key_header, key_rows),
        *_breakdown_section(settings, plots["breakdown"]),
        *_scaling_section(settings, plots.get("scaling")),
        *_crossover_section("arithmetic intensity", plots.get("intensity"), sw.found),
        *_crossover_section("model size", plots.get("size"), sw.found_size),
        *_predicted_crossovers_section(sw.predicted),
        *_prediction_section(settings),
        *_costmodel_section(settings, plots.get("costmodel")),
        *_accuracy_section(sw, plots.get("accuracy")),
        *_faults_section(sw),
        *_loss_section(settings, plots["loss"]),
        *_staleness_section(settings, plots.get("staleness")),
        *_points_section(sw.rows),
    ])


def write_report(sweep_dir: Path) -> tuple[Path, str]:
    """Write report.md and the plots into the sweep directory; return (path, key table)."""
    sw = _read_sweep(Path(sweep_dir))
    plots = _draw_plots(sw)
    key_header, key_rows = _key_table(sw)
    path = sw.dir / REPORT
    atomic_write_bytes(path, _markdown(sw, plots, key_header, key_rows).encode())
    atomic_write_bytes(sw.dir / "report.json", json.dumps(
        [s.to_dict() for s in sw.settings], indent=2, default=str).encode())
    return path, render_key_table(key_header, key_rows, sw.spec.get("name", ""))


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
