"""Parameter-server processes (installed as ``psring.servers``).

A server is a request handler (``handler.py``: the sync/async SGD rules) plus a store
(``store.py``: a shard of the flat parameters and its SGD state), behind a ZeroMQ
ROUTER socket (``server.py``). How parameters are split across servers is decided by
the workers' partitioner (``psring.comm.partition``); a server only sees its range.

    python -m psring.servers --bind tcp://127.0.0.1:5555      # = psring server ...
"""
