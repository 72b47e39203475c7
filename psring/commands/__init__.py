"""What each ``psring`` command does, one module per concern, each imported by psring.cli
when its command runs (the parsers are built without them, so ``psring --help``
imports no torch): ``run`` (``psring run``, ``psring launch``), ``sweep`` (``psring
sweep``, ``psring compare``), ``records`` (``psring report``, ``merge``, ``trace``),
``models`` (``psring models``, ``strategies``), ``profile``, ``advise`` and
``calibrate`` (whose flags psring.cli adds; it imports the measuring module only when it
runs)."""
