"""One picture for experiments/models.toml: throughput of every model under each
strategy, on one host and on the emulated 1 Gbit/s cluster, read from the sweep's
report.json (``psring report`` writes it).

    psring sweep experiments/models.toml --out runs/models
    python experiments/models_report.py runs/models      # -> runs/models/models.png

It prints, per cluster and model, which strategy was fastest and by how much over the
other of ps and allreduce: where the PS-vs-ring winner changes with the model.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(sweep_dir: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(sweep_dir)
    settings = json.loads((root / "report.json").read_text())
    by = defaultdict(dict)  # (cluster, model) -> strategy -> samples/s
    for s in settings:
        cluster = ("1 host" if s["varied"].get("hosts", 1) == 1
                   else s["cluster"].split(",")[0] + ", 1 Gbit/s")
        by[(cluster, s["varied"]["model"])][s["strategy"]] = s["samples_per_s"]["median"]
    clusters = list(dict.fromkeys(c for c, _ in by))
    models = list(dict.fromkeys(m for _, m in by))
    strategies = ["allreduce", "ps", "async-ps"]
    fig, axes = plt.subplots(1, len(clusters), figsize=(6 * len(clusters), 4), sharey=True)
    for ax, c in zip(axes if len(clusters) > 1 else [axes], clusters):
        for i, strategy in enumerate(strategies):
            ys = [by[(c, m)].get(strategy, 0) for m in models]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(models))], ys, 0.27, label=strategy)
        ax.set_xticks(range(len(models)), models)
        ax.set_yscale("log")
        ax.set_title(f"{c}: samples/s per model (2 workers)", fontsize=10)
        ax.legend(fontsize=8)
        for m in models:
            ps, ring = by[(c, m)].get("ps"), by[(c, m)].get("allreduce")
            if ps and ring:
                win = "ps" if ps > ring else "allreduce"
                print(f"{c:<22} {m:<9} ps/allreduce {ps / ring:5.2f}  -> {win}")
    fig.tight_layout()
    out = root / "models.png"
    fig.savefig(out, dpi=100)
    print(f"picture: {out}")
    print(f"picture: {plot_accuracy(root, models, strategies, plt)}")
    return 0


def plot_accuracy(root: Path, models: list[str], strategies: list[str], plt) -> Path:
    """Held-out accuracy vs step, one panel per model: a colour per strategy, solid on
    one host, dashed on the emulated cluster."""
    from psring.records.runlog import read_evals, read_manifest

    fig, axes = plt.subplots(2, (len(models) + 1) // 2, figsize=(4 * ((len(models) + 1) // 2), 6),
                             sharex=True, sharey=True)
    panel = dict(zip(models, axes.flat))
    colors = dict(zip(strategies, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for point in sorted(p for p in root.iterdir() if (p / "evals.jsonl").exists()):
        cfg = read_manifest(point)["config"]
        evals = read_evals(point)
        ax = panel.get(cfg["model"])
        if ax is None or cfg["strategy"] not in colors:
            continue
        two = cfg["hosts"] > 1
        ax.plot([e["step"] for e in evals], [e["accuracy"] for e in evals],
                color=colors[cfg["strategy"]], ls="--" if two else "-", lw=1.2,
                label=f"{cfg['strategy']}{', 2 hosts 1 Gbit/s' if two else ', 1 host'}")
        ax.set_title(cfg["model"], fontsize=10)
        if cfg.get("target_accuracy"):
            ax.axhline(cfg["target_accuracy"], color="k", lw=0.8, ls=":")
    for ax in axes.flat:
        ax.set_ylim(0, 1.02)
    axes.flat[0].legend(fontsize=6)
    fig.supxlabel("optimizer step (rank 0)")
    fig.supylabel("held-out accuracy")
    fig.tight_layout()
    out = root / "models-accuracy.png"
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/models"))
