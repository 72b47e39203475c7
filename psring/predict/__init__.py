"""Prediction: what a step of each strategy should cost, worked out without training.

- ``analytic``: the α-β-γ closed forms, a strategy's communication time per step and
  the gradient size where two strategies trade places (docs/cost-model.md);
- ``calibration``: the measured numbers they take (:class:`Calibration`), found and
  validated; ``measure`` measures them on this machine (``psring calibrate``), with the
  ping-pong processes of ``pingpong``;
- ``sim``: the step-time simulator, pure Python: a profile and a cluster in, a predicted
  step out (docs/prediction.md); its cost models by name (``sim.cost_models``'s
  ``COST_MODELS``: what a strategy's ``caps.cost_model`` names; a plugin registers its
  own), the ring's in ``sim.ring``, the parameter servers' in ``sim.psround``, on the
  event engine ``sim.engine``;
- ``replay``: the simulator on a measured run, its own compute and its cluster
  (what ``psring report`` puts beside each measured step);
- ``advise``: ranks the strategies on a cluster by their simulated steps (the command
  is psring.commands.advise); ``failures`` prices a failure rate into each strategy's
  step (``psring advise --mtbf``).

A prediction needs no worker processes: only the inputs are measured, once, by
processes of their own (``measure``; a profile's short ``single`` run,
psring.records.profile), and ``psring advise --verify`` runs the top candidates to
check. ``analytic``, ``calibration``, ``sim``, ``advise`` and ``failures`` import no
torch; ``measure`` (it measures torch.distributed) and ``replay`` (the strategy
registry) do.
"""
