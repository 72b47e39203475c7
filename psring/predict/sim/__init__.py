"""The step-time simulator: one training step of a strategy on a cluster, played out as
events without running anything (docs/prediction.md).

- ``simulate``: the entry, :func:`simulate` (a profile, a cluster, a cost model's name
  and a calibration in; a :class:`Prediction` out);
- ``cost_models``: the vocabulary every cost model shares (:class:`Sim`,
  :class:`Prediction`, :func:`finish`) and the registry by name, :data:`COST_MODELS`, that
  a strategy's ``caps.cost_model`` names (a plugin registers its own);
- ``ring``, ``psround``: the built-in cost models (ring and hierarchical ring; the
  parameter servers and BytePS);
- ``engine``: the event queue, the resources and the links shared as a fluid.

Pure Python, no torch. The cost models' vocabulary is re-exported here, imported on
first use (what a plugin's cost model needs; COST_MODELS with the built-in ones
registered)::

    from psring.predict.sim import COST_MODELS, CostModel, Prediction, Sim, finish
    from psring.predict.sim.simulate import simulate
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "COST_MODELS": "simulate", "CostModel": "cost_models", "Prediction": "cost_models",
    "Sim": "cost_models", "finish": "cost_models",
})
