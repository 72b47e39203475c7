"""A run's settings: one frozen dataclass in sections, its command-line flags, and the
one validation step that needs torch and files.

Every field of :class:`RunConfig` is a flag of ``psring run`` (``batch_size`` is
``--batch-size``), so the CLI, the worker entry point (which ``torchrun`` can start
directly) and ``manifest.json`` can never disagree about what a run is.
``RunConfig(...)`` checks values only; :func:`validate` checks them against the
strategy, the model and the files they name, and fills in the derived values. A bad
value raises :class:`psring.errors.ConfigError` with a message that names the fix.

    >>> cfg = RunConfig(strategy="allreduce", workers=2, batch_size=64)  # no torch yet
    >>> cfg.per_worker_batch
    32
    >>> validate(cfg) == cfg  # builds the model on torch's meta device
    True

- ``sections``: the sections (model, data, optimization, servers, cluster, device, run, ...)
- ``run``: RunConfig, their composition, with the value checks and derived values
- ``validate``: the registries, the files, CUDA, the meta model
- ``flags``: the flags, in one ``--help`` group per section
"""

from psring.config.flags import add_config_flags, config_from_args, given_fields
from psring.config.run import RunConfig, cluster_of
from psring.config.validate import validate

__all__ = ["RunConfig", "add_config_flags", "cluster_of", "config_from_args", "given_fields",
           "validate"]
