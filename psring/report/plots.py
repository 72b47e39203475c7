"""The sweep report's PNG plots, one function per figure; each takes the settings
(psring.report.aggregate) and the path to write, and returns the path.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from psring.records.runlog import PHASES
from psring.records.trace import PHASE_COLORS
from psring.report.aggregate import Setting, make_label, setting_label
from psring.report.cluster import CLUSTER_KEYS


def _plt():
    """matplotlib's pyplot on the Agg backend (files, no display)."""
    # imported here, not at the top: matplotlib costs ~0.5 s to import and only writing
    # a report's pictures needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _where(settings: list[Setting]) -> str:
    """The cluster every setting shares, for a figure's footnote ('' when they differ:
    then each label says it, or when all ran on this machine's own network)."""
    clusters = {s.cluster for s in settings}
    return f"cluster: {clusters.pop()}" if len(clusters) == 1 and \
        settings[0].cluster != "this machine" else ""


def _save(fig, path: Path, settings: list[Setting] | None = None, bottom: float = 0.0) -> Path:
    """Lay out and write a figure; ``bottom``: the share of its height kept free below
    the axes (for a legend there)."""
    where = _where(settings) if settings else ""
    if where:
        fig.text(0.995, 0.005, where, ha="right", va="bottom", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, max(bottom, 0.03 if where else 0.0), 1, 1))
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_breakdown(settings: list[Setting], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(settings) + 1.6))
    left = [0.0] * len(settings)
    for p in PHASES:
        name = p[:-2]
        vals = [s.phase_ms[p] for s in settings]
        ax.barh(range(len(settings)), vals, left=left, color=PHASE_COLORS[name], label=name)
        left = [a + b for a, b in zip(left, vals)]
    for i, s in enumerate(settings):
        lo, hi = s.step_ms.min, s.step_ms.max
        if s.repeats > 1:
            ax.plot([lo, hi], [i, i], color="k", lw=1)  # min–max of the step time
    ax.set_yticks(range(len(settings)))
    ax.set_yticklabels([setting_label(s) for s in settings], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median over steps and repeats; black: min–max step p50)")
    ax.legend(ncol=5, fontsize=8, loc="lower right")
    ax.set_title("Where a step's time goes")
    return _save(fig, path, settings)


def _series(s: Setting, x_keys: tuple[str, ...]) -> str:
    """A line's name: the strategy and the varied settings but those along the x axis."""
    return make_label(s, with_cluster=False,
                      varied={k: v for k, v in s.varied.items() if k not in x_keys})


def _by_strategy(settings: list[Setting]) -> dict[str, list[Setting]]:
    out: dict[str, list[Setting]] = defaultdict(list)
    for s in settings:
        out[s.strategy].append(s)
    return out


def _scaling_series(settings: list[Setting]) -> dict[str, list[Setting]]:
    """Lines of the scaling plot: a setting but for its workers (and their hosts). A
    strategy's one-worker point, which runs on one host with no link to shape, starts
    every line of that strategy that differs from it only in cluster settings."""
    x_keys = ("workers", "hosts", "batch_per_worker")
    series: dict[str, list[Setting]] = defaultdict(list)
    for s in settings:
        series[_series(s, x_keys)].append(s)

    def rest(s: Setting) -> dict:
        return {k: s.config.get(k) for k in s.varied
                if k not in (*x_keys, *CLUSTER_KEYS)}

    for name, ss in list(series.items()):
        if len(ss) != 1 or ss[0].workers != 1 or ss[0].strategy == "single":
            continue
        lone = ss[0]
        joined = [n for n, other in series.items() if n != name and
                  other[0].strategy == lone.strategy and rest(other[0]) == rest(lone)
                  and all(o.workers > 1 for o in other)]
        for n in joined:
            series[n].append(lone)
        if joined:
            del series[name]
    return series


def plot_scaling(settings: list[Setting], path: Path) -> Path:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    series = _scaling_series(settings)
    colors = _colors(plt, len(settings))
    strategies = list(dict.fromkeys(s.strategy for s in settings))
    links = sorted({s.config.get("link", "") for s in settings} - {""})
    styles = dict(zip(links, ("--", "-", ":", "-.")))
    for name, ss in series.items():
        ss = sorted(ss, key=lambda s: s.workers)
        # a colour per strategy, a line style per link speed, squares: servers of their own
        link = next((s.config.get("link") for s in ss if s.config.get("link")), "")
        own = any(s.config.get("server_placement") == "own-hosts" for s in ss)
        kw = {"color": colors[strategies.index(ss[0].strategy) % len(colors)],
              "ls": styles.get(link, "-"), "marker": "s" if own else "o"}
        xs = [s.workers for s in ss]
        med = [s.samples_per_s.median for s in ss]
        err = [[m - s.samples_per_s.min for m, s in zip(med, ss)],
               [s.samples_per_s.max - m for m, s in zip(med, ss)]]
        a1.errorbar(xs, med, yerr=err, capsize=3, label=name, **kw)
        eff = [(s.workers, s.efficiency) for s in ss if s.efficiency is not None]
        if eff:
            a2.plot(*zip(*eff), **kw)
    tops = [s.samples_per_s.median for s in settings]
    if max(tops) > 20 * max(min(tops), 1e-9):
        a1.set_yscale("log")
    for a in (a1, a2):
        a.set_xlabel("workers")
        a.set_xticks(sorted({s.workers for s in settings}))
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


def plot_along(settings: list[Setting], found: list[dict], path: Path,
               along: str = "intensity") -> Path:
    """Throughput against intensity or gradient size, a line per everything else, with
    the measured crossovers dotted."""
    attr, moves, xlabel, fmt = _X_AXES[along]
    varied = {k for s in settings for k in s.varied}
    # a sweep over models (experiments/models.toml) moves along x by changing the model:
    # one line per strategy through every model, each point named
    by_model = "model" in varied and not varied & set(moves)
    if by_model:
        moves = (*moves, "model")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    series: dict[str, list[Setting]] = defaultdict(list)
    for s in settings:
        if getattr(s, attr):
            series[_series(s, moves)].append(s)
    for label, ss in sorted(series.items()):
        ss = sorted(ss, key=lambda s: getattr(s, attr))
        xs = [getattr(s, attr) for s in ss]
        med = [s.samples_per_s.median for s in ss]
        err = [[m - s.samples_per_s.min for m, s in zip(med, ss)],
               [s.samples_per_s.max - m for m, s in zip(med, ss)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
        if by_model:
            for x, y, s in zip(xs, med, ss):
                ax.annotate(s.varied["model"], (x, y), fontsize=6, alpha=0.7,
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


def plot_loss(settings: list[Setting], path: Path) -> Path:
    """Training loss (mean over workers) vs time and vs step: an EMA over a tenth of
    the steps, the raw points faint behind it."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(plt, len(settings))
    for i, s in enumerate(settings):
        c = colors[i % len(colors)]
        for j, r in enumerate(s.rows):
            if not r["curve"]:
                continue  # a timing-only run (--compute device) has no loss to show
            steps, ts, losses = zip(*r["curve"])
            smooth = _ema(list(losses), max(2, len(losses) // 10))
            for a, x in ((a1, ts), (a2, steps)):
                a.plot(x, losses, color=c, lw=0.6, alpha=0.2)
                a.plot(x, smooth, color=c, lw=1.4, label=setting_label(s) if j == 0 else None)
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


def plot_accuracy(settings: list[Setting], target: float | None, path: Path) -> Path:
    """Held-out accuracy vs training time and vs step, one line per run."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(plt, len(settings))
    for i, s in enumerate(settings):
        for j, r in enumerate(s.rows):
            if not r["evals"]:
                continue
            kw = {"color": colors[i % len(colors)], "lw": 1.2, "alpha": 0.85, "marker": ".",
                  "ms": 3, "label": setting_label(s) if j == 0 else None}
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


def plot_staleness(settings: list[Setting], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    stale = [(s, [x for r in s.rows for x in r["staleness"]]) for s in settings]
    stale = [(s, v) for s, v in stale if v]
    top = max(max(v) for _, v in stale)
    bins = [b - 0.5 for b in range(top + 2)]
    for s, v in stale:
        ax.hist(v, bins=bins, alpha=0.5, label=setting_label(s), density=True)
    ax.set_xlabel("staleness (updates applied between a worker's pull and its push)")
    ax.set_ylabel("share of steps")
    ax.set_title("Staleness of asynchronous updates")
    ax.legend(fontsize=8)
    return _save(fig, path, settings)


def plot_costmodel(settings: list[Setting], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    pts = [s for s in settings if s.predicted_comm_ms is not None and s.comm_ms]
    for name, ss in _by_strategy(pts).items():
        ax.scatter([s.predicted_comm_ms for s in ss], [s.comm_ms.median for s in ss],
                   label=name)
    values = [s.predicted_comm_ms for s in pts] + [s.comm_ms.median for s in pts]
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
