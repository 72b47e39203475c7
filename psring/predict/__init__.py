"""Prediction: what a step of each strategy should cost, worked out without training.

- ``costmodel``: the α-β-γ formulas, the measured :class:`Calibration` and the
  predicted communication time per step (docs/cost-model.md);
- ``calibrate``: measures α, β and γ on this machine (``psring calibrate``);
- ``simulate``: the step-time simulator, pure Python: a profile and a cluster in, a
  predicted step out (docs/prediction.md), on the event engine ``engine``; its cost
  models by name in ``costs`` (``COST_MODELS``: what a strategy's ``caps.cost_model``
  names; a plugin registers its own), the ring's in ``ring``, the parameter servers'
  in ``psround``;
- ``replay``: the simulator on a measured run, its own compute and its cluster
  (what ``psring report`` puts beside each measured step);
- ``advise``: ranks the strategies on a cluster by their simulated steps (the command
  is psring.commands.advise); ``failures`` prices a failure rate into each strategy's
  step (``psring advise --mtbf``).

A prediction needs no worker processes: only the inputs are measured, once, by
processes of their own (``calibrate``; a profile's short ``single`` run,
psring.records.profile), and ``psring advise --verify`` runs the top candidates to
check. ``costmodel``, ``simulate``, ``advise`` and ``failures`` import no torch;
``calibrate`` (it measures torch.distributed) and ``replay`` (the strategy registry) do.
"""
