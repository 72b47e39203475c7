"""Communication: what moves between processes, and how it is sized and summed.

- ``protocol``: the parameter-server wire protocol (a versioned msgpack header and raw
  tensor frames; docs/protocol.md);
- ``partition``: how a model's parameters are split among servers and buckets;
- ``compress``: the wire dtype of gradients (``--compress``);
- ``adasum``: the adaptive sum ``allreduce --reduce adasum`` uses;
- ``interconnect``: a host's device interconnect timed in device mode (``--device-link``);
- ``psclient``: the parameter-server client a worker uses (ps, async-ps, byteps);
- ``datagrams``, ``lossy``, ``ingress``, ``buffers``, ``credits``: bounded-loss pushes
  as datagrams (``--loss-tolerance``), their wire format, sending and receiving sides,
  memory and receiver-driven pacing; ``egress``, ``pulls``: a sync run's pulls as
  datagrams, the server's and the worker's sides; ``transpose``: the transpose
  all-reduce built on them.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Message": "protocol", "ProtocolError": "protocol", "encode": "protocol",
    "decode": "protocol", "Partitioner": "partition", "wire_dtype": "compress",
    "host_comm": "interconnect", "PSClient": "psclient", "Replies": "psclient",
})
