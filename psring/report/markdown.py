"""The report of a sweep: ``psring report SWEEP_DIR`` writes report.md, report.json and
PNG plots into the sweep directory and prints the key table.

    psring sweep experiments/intensity.toml --out runs/intensity
    psring report runs/intensity            # -> runs/intensity/report.md, *.png

Every figure is read back from the points' logs (psring.report.points); points
repeated R times are aggregated per *setting* (the point without its repeat number)
as the median with the min–max range (psring.report.aggregate). What is in it:

- the key table: throughput, step time, communication time measured beside the cost
  model's prediction (psring.predict.costmodel, from ``psring calibrate``) and its
  relative error, speedup over ``single``, time to the target accuracy;
- the step-time breakdown per setting (data / forward / backward / comm / update);
- throughput and scaling efficiency vs workers (when the sweep varies workers);
- throughput vs arithmetic intensity per strategy with the measured crossovers, and
  the crossover the cost model predicts (when the sweep varies intensity);
- held-out accuracy vs training time and vs step, and time to accuracy: time to the
  target, steps to it (statistical efficiency) and time per step (hardware efficiency);
- training loss vs time and vs step (an EMA, the raw points faint);
- the staleness distribution of asynchronous runs.
"""

from __future__ import annotations

import json
import statistics as st
from pathlib import Path

from psring.errors import ConfigError
from psring.predict.costmodel import Calibration, find_calibration
from psring.runs.runlog import PHASES, atomic_write_bytes, read_manifest
from psring.report.aggregate import (
    Setting,
    Spread,
    add_time_to_accuracy,
    aggregate,
    crossovers,
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


def write_report(sweep_dir: Path) -> tuple[Path, str]:
    """Write report.md and the plots into the sweep directory; return (path, key table)."""
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
    # points that ran on different clusters say where in their labels
    mixed = len({s.cluster for s in settings}) > 1
    for s in settings:
        s.label = make_label(s, with_cluster=mixed)
    found = crossovers(settings)
    found_size = crossovers(settings, "size")
    predicted = predicted_crossovers(settings, cal)

    plots: dict[str, Path] = {}
    plots["breakdown"] = plot_breakdown(settings, sweep_dir / "breakdown.png")
    if len({s.workers for s in settings}) > 1:
        plots["scaling"] = plot_scaling(settings, sweep_dir / "scaling.png")
    if len({round(s.intensity or 0, 6) for s in settings}) > 1:
        plots["intensity"] = plot_along(settings, found, sweep_dir / "intensity.png")
    distributed = [s for s in settings if s.strategy != "single"]
    if len({s.gradient_bytes for s in distributed}) > 1:
        plots["size"] = plot_along(settings, found_size, sweep_dir / "size.png", "size")
    plots["loss"] = plot_loss(settings, sweep_dir / "loss.png")
    evaluated = [s for s in settings if s.has_evals]
    if evaluated:
        plots["accuracy"] = plot_accuracy(settings, target, sweep_dir / "accuracy.png")
    if any(s.staleness for s in settings):
        plots["staleness"] = plot_staleness(settings, sweep_dir / "staleness.png")
    if any(s.predicted_comm_ms is not None for s in settings):
        plots["costmodel"] = plot_costmodel(settings, sweep_dir / "costmodel.png")

    emulated = any(s.cluster != "this machine" for s in settings)
    key_header = ["setting", *(["cluster"] if emulated else []), "samples/s", "step ms",
                  "comm ms", "predicted step ms", "error", "speedup vs single",
                  "final acc", "time to target s"]
    key_rows = []
    for s in settings:
        key_rows.append([
            make_label(s, with_cluster=False), *([s.cluster] if emulated else []),
            _fmt(s.samples_per_s), _fmt(s.step_ms, digits=1),
            _fmt(s.comm_ms, digits=1),
            f"{s.predicted_step_ms:.1f}" if s.predicted_step_ms is not None else "-",
            f"{s.step_error:+.0%}" if s.step_error is not None else "-",
            f"{s.speedup:.2f}x" if s.speedup is not None else "-",
            "timing only" if _timing_only(s) else _fmt(s.accuracy_final, digits=3),
            _tta_text(s) if target is not None else "-",
        ])
    md = [f"# Sweep report: {spec.get('name', sweep_dir.name)}", ""]
    if spec.get("description"):
        md += [spec["description"].strip(), ""]
    if spec.get("look_at"):
        md += ["**What to look at:** " + spec["look_at"].strip(), ""]
    host = read_manifest(Path(rows[0]["run"])).get("host", {})
    if emulated:
        clusters = sorted({s.cluster for s in settings})
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
                     [[setting_label(s), *[f"{s.phase_ms[p]:.2f}" for p in PHASES],
                       _fmt(s.step_ms, digits=1)] for s in settings]), ""]
    if "scaling" in plots:
        md += ["## Scaling with workers", "", f"![scaling]({plots['scaling'].name})", "",
               _md_table(["setting", "workers", "samples/s", "efficiency"],
                         [[setting_label(s), str(s.workers), _fmt(s.samples_per_s),
                           f"{s.efficiency:.2f}" if s.efficiency is not None else "-"]
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
                         [[setting_label(s), _fmt(s.step_ms, digits=1),
                           f"{s.predicted_step_ms:.1f}", f"{s.step_error:+.0%}",
                           s.predicted_bound or "-"]
                          for s in settings if s.step_error is not None]), ""]
        if check["winners"]:
            md += [_md_table(["measured fastest", "predicted fastest", "right"],
                             [[w["measured"], w["predicted"], "yes" if w["right"] else "no"]
                              for w in check["winners"]]), ""]
    if "costmodel" in plots:
        errs = [s for s in settings if s.comm_error is not None]
        md += ["## Cost model vs measurement", "", f"![costmodel]({plots['costmodel'].name})",
               "", _md_table(["setting", "gradient MB", "measured comm ms", "predicted ms",
                              "relative error"],
                             [[setting_label(s), f"{s.gradient_bytes / 1e6:.2f}",
                               _fmt(s.comm_ms, digits=2), f"{s.predicted_comm_ms:.2f}",
                               f"{s.comm_error:+.0%}"] for s in errs]), ""]
    if "accuracy" in plots:
        md += ["## Time to accuracy", "", f"![accuracy]({plots['accuracy'].name})", "",
               "Time to target = steps to target (statistical efficiency) x time per step "
               "(hardware efficiency), roughly: an asynchronous or compressed strategy wins "
               "only if its faster steps outweigh any extra steps it needs.", "",
               _md_table(["setting", "time to target s", "steps to target", "step ms",
                          "final accuracy", "runs reaching it"],
                         [[setting_label(s), _tta_text(s) if target is not None else "-",
                           _fmt(s.tta_steps) if s.tta_steps else "-",
                           _fmt(s.step_ms, digits=1), _fmt(s.accuracy_final, digits=3),
                           f"{s.tta_reached}/{s.repeats}" if target is not None else "-"]
                          for s in evaluated]), ""]
    md += ["## Training loss", "", f"![loss]({plots['loss'].name})", "",
           _md_table(["setting", "final loss"],
                     [[setting_label(s), "timing only" if _timing_only(s) else
                       _fmt(s.loss_final, digits=3, style="g")] for s in settings]), ""]
    if "staleness" in plots:
        md += ["## Staleness", "", f"![staleness]({plots['staleness'].name})", "",
               _md_table(["setting", "steps", "mean", "p50", "max"],
                         [[setting_label(s), str(len(s.staleness)),
                           f"{st.fmean(s.staleness):.2f}",
                           f"{st.median(s.staleness):.0f}", str(max(s.staleness))]
                          for s in settings if s.staleness]), ""]
    md += ["## Points", "", _md_table(["point", "run directory"],
                                      [[r["id"], f"`{r['run']}`"] for r in rows]), ""]
    path = sweep_dir / REPORT
    atomic_write_bytes(path, "\n".join(md).encode())
    atomic_write_bytes(sweep_dir / "report.json", json.dumps(
        [s.to_dict() for s in settings], indent=2, default=str).encode())
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
