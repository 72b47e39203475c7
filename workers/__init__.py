"""Worker processes (installed as ``psring.workers``): the training loop and the
process entry point. ``python -m psring.workers --help`` lists the flags."""
