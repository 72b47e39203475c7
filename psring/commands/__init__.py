"""The commands of ``psring`` too large for psring.cli: ``advise`` (``psring advise``:
profile, cluster and calibration in, the ranked strategies and why out) and
``calibrate`` (``psring calibrate``, which imports the measuring module only when it
runs, so ``psring --help`` needs no torch)."""
