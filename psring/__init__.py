"""psring: which data-parallel strategy trains fastest on my model and hardware, and why.

    psring run --strategy allreduce --workers 2
    psring compare
    psring report runs/*

Inside your own training script (docs/your-script.md), started by
``psring launch --strategy ps --workers 2 -- python train.py``::

    dist = psring.init()
    model, optimizer = dist.wrap(model, optimizer)

From Python (a notebook)::

    import psring
    cfg = psring.RunConfig(strategy="ps", workers=2, steps=20)
    run_dir = psring.launch(cfg)        # validates cfg first (psring.validate)

The packages, each with one job (its ``__init__`` says which):

- ``strategies``: the strategy seam and one module per strategy;
- ``comm``: the wire protocol, partitions, compression, Adasum, a host's interconnect;
- ``cluster``: a run's cluster and the emulated one built for it;
- ``runtime``: the processes of a run: supervising, forking, the rendezvous;
- ``train``: models, data, the update, evaluation, checkpoints, device mode;
- ``zoo``: the built-in models;
- ``records``: run logs, traces, merges, profiles;
- ``report``: tables, plots, report.md; ``predict``: cost model, simulator, advise;
- ``library``: the strategies inside a user's own training script;
- ``runs``: one run launched, sweeps, ``psring compare``, ``psring profile``;
- ``commands``: ``psring advise`` and ``psring calibrate``.

Names used here are imported on first use, so ``import psring`` imports no torch.
"""

from psring._lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, {
    "RunConfig": "config", "validate": "config", "ConfigError": "errors",
    "PsringError": "errors", "launch": "runs.launch", "Cluster": "cluster.spec",
    "Strategy": "strategies", "STRATEGIES": "strategies", "StepStats": "strategies",
    "WorkerContext": "strategies", "Capabilities": "strategies",
    "COST_MODELS": "predict.sim.simulate", "CostModel": "predict.sim.cost_models",
    "MODELS": "train.models", "build_model": "train.models",
    "summarize_all": "report", "write_report": "report",
    "init": "library", "launched": "library", "Distributed": "library",
})
