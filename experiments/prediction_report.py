"""The simulator's step-time error over several sweeps, split by where they ran.

    psring sweep experiments/models.toml --out runs/models
    psring sweep experiments/emulated_costmodel.toml --out runs/emulated_costmodel
    python experiments/prediction_report.py runs/models runs/emulated_costmodel

Reads each sweep's report.json (``psring report DIR`` writes it, with the simulator's
replay of every run: psring.predict.replay) and prints, for the runs on
emulated links and for those on this machine's loopback separately: the median and
largest absolute error of the predicted step time, and how often the predicted fastest
strategy of a setting was the measured fastest (or within 5% of it); each strategy's
median error; per cluster, the measured and the predicted fastest, and over the clusters
whose measured fastest leads every other strategy by more than 10%, how often the
predicted fastest is it. Then a grid of the clusters and strategies (the table of
docs/results/2026-11-26-host-model-prediction.md), and every point as a Markdown table
for docs/benchmarks.md.

    python experiments/prediction_report.py --seeds 6 runs/host_model runs/host_model_flat

``--seeds K`` adds the parameter servers' settings replayed with K draws of TCP's
uneven shares (psring.predict.sim.engine.Flows, seeds 0..K-1): each one's spread, and the
errors of the mean of the K draws against the measured step.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(dirs: list[str]) -> int:
    from psring.report.aggregate import Setting, prediction_check

    rows, checks = [], {"emulated links": [], "loopback": []}
    for d in dirs:
        settings = [Setting.from_dict(s)
                    for s in json.loads((Path(d) / "report.json").read_text())]
        for where in checks:
            part = [s for s in settings
                    if (s.cluster != "this machine") == (where == "emulated links")]
            checks[where].append(prediction_check(part))
        for s in settings:
            if s.step_error is None or s.strategy == "single":
                continue
            rows.append((Path(d).name, s.label or s.strategy, s.cluster, s.step_ms.median,
                         s.predicted_step_ms, s.step_error, s.predicted_bound or "-"))
    for where, cs in checks.items():
        errs = [abs(r[5]) for r in rows if (r[2] != "this machine") == (where == "emulated links")]
        wins = [w for c in cs for w in c["winners"]]
        if not errs:
            continue
        print(f"{where}: {len(errs)} settings, median |error| {statistics.median(errs):.1%}, "
              f"largest {max(errs):.1%}, within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}; "
              f"winner right {sum(w['right'] for w in wins)}/{len(wins)}")
        for w in wins:
            if not w["right"]:
                print(f"  wrong winner: measured {w['measured']}, predicted {w['predicted']}")
    _by_strategy(rows)
    _winners_with_a_gap(dirs)
    print()
    _grid(dirs)
    print()
    print("| sweep | setting | cluster | measured ms | predicted ms | error | bound |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:+.0%} | {r[6]} |")
    return 0


def _by_strategy(rows: list[tuple]) -> None:
    """Each strategy's median and largest |error| (rows: as main builds them)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r[1].split(" ")[0].split(",")[0], []).append(abs(r[5]))
    print("per strategy: " + "; ".join(
        f"{k} median {statistics.median(v):.1%}, largest {max(v):.1%} ({len(v)})"
        for k, v in sorted(by.items())))


def _winners_with_a_gap(dirs: list[str], gap: float = 0.10) -> None:
    """Per cluster (the settings that differ only in strategy and servers): the measured
    fastest, the predicted fastest and what picking it costs (its measured step over the
    fastest's); a pick counts as right where it is the fastest or within ``gap`` of it.
    And how many clusters a parameter-server strategy won."""
    from psring.strategies import STRATEGIES

    groups: dict[str, list] = {}
    for d, s in _replayed(dirs):
        key = {k: v for k, v in s.varied.items()
               if k not in ("strategy", "servers", "server_placement")}
        groups.setdefault(d + json.dumps(key, sort_keys=True, default=str), []).append(s)
    right = ps_wins = clear = clear_right = 0
    for g in groups.values():
        ranked = sorted(g, key=lambda s: s.step_ms.median)
        best = ranked[0]
        pick = min(g, key=lambda s: s.predicted_step_ms)
        cost = pick.step_ms.median / best.step_ms.median - 1
        # the measured fastest ahead of every other strategy by more than the gap
        others = [s for s in ranked if s.strategy != best.strategy]
        lead = others[0].step_ms.median / best.step_ms.median - 1 if others else 0.0
        ps_wins += STRATEGIES.get(best.strategy).caps.uses_servers
        right += cost <= gap
        if lead > gap:
            clear += 1
            clear_right += pick.strategy == best.strategy  # (its placement may differ)
        print(f"  {best.config.get('model')}, {best.cluster}: measured fastest "
              f"{_name(best)} {best.step_ms.median:.0f} ms (ahead of the next strategy "
              f"by {lead:.0%}), predicted {_name(pick)} (measured "
              f"{pick.step_ms.median:.0f} ms, {cost:+.0%})")
    print(f"clusters: {len(groups)}; the predicted fastest is the measured fastest or "
          f"within {gap:.0%} of it in {right}; where the measured fastest leads the next "
          f"strategy by more than {gap:.0%} ({clear}), the predicted fastest is it in "
          f"{clear_right}; a parameter-server strategy measured fastest in {ps_wins}")


def _replayed(dirs: list[str]):
    """(sweep directory, Setting) of every setting with a replay, ``single`` left out."""
    from psring.report.aggregate import Setting

    for d in dirs:
        for x in json.loads((Path(d) / "report.json").read_text()):
            s = Setting.from_dict(x)
            if s.step_error is not None and s.strategy != "single":
                yield d, s


#: the grid's columns: (strategy, server placement or None), in this order
COLUMNS = [("allreduce", None), ("ddp", None), ("hallreduce", None),
           ("byteps", "colocated"), ("byteps", "own-hosts"), ("ps", "colocated"),
           ("ps", "own-hosts"), ("async-ps", "colocated"), ("async-ps", "own-hosts")]


def _grid(dirs: list[str]) -> None:
    """Every cluster a row, every strategy a column: the measured step (ms) and the
    replay's error; **bold** the measured fastest, ◀ the predicted fastest."""
    rows: dict[str, dict] = {}
    for d, s in _replayed(dirs):
        c = s.config
        hosts = max(1, c["workers"] // max(1, c.get("workers_per_host") or 1))
        # (a sweep drops --device-link where a strategy has nothing it times: ps)
        label = (f"{c['model']}, {hosts}×{c['workers'] // hosts}, {c['link']}, "
                 f"S={c.get('time_scale', 1):g}")
        place = c.get("server_placement") if s.strategy in ("byteps", "ps", "async-ps") \
            else None
        row = rows.setdefault(d + label, {"label": label, "link": "-"})
        row[(s.strategy, place)] = s
        row["link"] = c.get("device_link") or row["link"]
    names = [f"{n} {'c' if p == 'colocated' else 'o'}" if p else n for n, p in COLUMNS]
    print("| cluster | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for row in rows.values():
        cells = {k: v for k, v in row.items() if k not in ("label", "link")}
        best = min(cells.values(), key=lambda s: s.step_ms.median)
        pick = min(cells.values(), key=lambda s: s.predicted_step_ms)
        out = []
        for key in COLUMNS:
            s = cells.get(key)
            if s is None:
                out.append("–")
                continue
            ms = f"{s.step_ms.median:.0f}"
            ms = f"**{ms}**" if s is best else ms
            out.append(f"{ms} ({s.step_error:+.0%})" + (" ◀" if s is pick else ""))
        print(f"| {row['label']}, {row['link']} | " + " | ".join(out) + " |")


def _name(s) -> str:
    from psring.strategies import STRATEGIES

    placement = s.config.get("server_placement")
    uses = STRATEGIES.get(s.strategy).caps.uses_servers
    return s.strategy + (f" ({placement})" if uses else "")


def seed_means(dirs: list[str], k: int) -> None:
    """The servers' settings (their replays draw TCP's shares) replayed with k seeds:
    each one's mean and spread, the errors of the means, the largest ones."""
    from psring.predict.calibration import Calibration, find_calibration
    from psring.predict.replay import replay
    from psring.report.aggregate import Setting
    from psring.strategies import STRATEGIES

    rows = []
    for d in dirs:
        cal = Calibration.load(find_calibration(d))
        for x in json.loads((Path(d) / "report.json").read_text()):
            s = Setting.from_dict(x)
            if s.step_error is None or not STRATEGIES.get(s.strategy).caps.uses_servers:
                continue
            draws = [replay(Path(d) / f"{s.id}_r0", cal, flow_seed=seed, draws=1)
                     for seed in range(k)]
            steps = [p.step_s * 1e3 for p in draws if p is not None]
            if len(steps) == k:
                mean = statistics.mean(steps)
                rows.append((s.label or s.strategy, s.strategy, s.step_ms.median, mean,
                             statistics.stdev(steps) / mean if k > 1 else 0.0))
    errs = [abs(m / meas - 1) for _, _, meas, m, _ in rows]
    print(f"\nthe servers' {len(rows)} settings, the mean of {k} draws: median |error| "
          f"{statistics.median(errs):.1%}, largest {max(errs):.1%}, above 20%: "
          f"{sum(e > 0.2 for e in errs)}; spread (sd/mean) up to "
          f"{max(r[4] for r in rows):.0%}")
    for name in sorted({r[1] for r in rows}):
        e = [abs(r[3] / r[2] - 1) for r in rows if r[1] == name]
        print(f"  {name}: median {statistics.median(e):.1%}, largest {max(e):.1%} ({len(e)})")
    for label, _, meas, mean, sd in sorted(rows, key=lambda r: -abs(r[3] / r[2] - 1))[:5]:
        print(f"  {label}: measured {meas:.0f} ms, mean of draws {mean:.0f} "
              f"({mean / meas - 1:+.0%}, sd {sd:.0%})")


if __name__ == "__main__":
    args = sys.argv[1:]
    seeds = 0
    if args[:1] == ["--seeds"] and len(args) > 1:
        seeds, args = int(args[1]), args[2:]
    if not args:
        print(__doc__)
        sys.exit(2)
    code = main(args)
    if seeds:
        seed_means(args, seeds)
    sys.exit(code)
