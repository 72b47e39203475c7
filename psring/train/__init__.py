"""What a worker trains, and how: models, data, the update and its bookkeeping.

- ``models``: building a model from the zoo (psring.zoo) or a user's factory, its loss;
- ``data``: the data set with its held-out split, and each worker's share of a batch
  (``shares``: how the global batch is split among workers);
- ``workload``: what a run trains (model and data together);
- ``optim``: SGD without ``torch.optim``; ``evaluate``: held-out accuracy and time to
  accuracy; ``checkpoint``: saving and resuming;
- ``device``: device mode, compute taken as time from a profile.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "build_model": "models", "Dataset": "data", "Workload": "workload",
    "build_workload": "workload", "SGD": "optim", "Checkpoint": "checkpoint",
})
