"""psring: which data-parallel strategy trains fastest on my model and hardware, and why.

    psring run --strategy allreduce --workers 2
    psring compare
    psring report runs/*
"""

__version__ = "0.1.0"
