"""Communication: what moves between processes, and how it is sized and summed.

- ``protocol``: the parameter-server wire protocol (a versioned msgpack header and raw
  tensor frames; docs/protocol.md);
- ``partition``: how a model's parameters are split among servers and buckets;
- ``compress``: the wire dtype of gradients (``--compress``);
- ``adasum``: the adaptive sum ``allreduce --reduce adasum`` uses;
- ``interconnect``: a host's device interconnect timed in device mode (``--device-link``);
- ``psclient``: the parameter-server client a worker uses (ps, async-ps, byteps).
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Message": "protocol", "ProtocolError": "protocol", "encode": "protocol",
    "decode": "protocol", "Partitioner": "partition", "wire_dtype": "compress",
    "host_comm": "interconnect", "PSClient": "psclient", "Replies": "psclient",
})
