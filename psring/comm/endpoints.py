"""Where a parameter server listens and who may reach it: endpoints (abstract Unix
sockets on Linux; loopback), and the shared secret that a server reachable beyond this
host needs and that every worker then signs with (psring.comm.protocol signs and checks).
Pure: no torch.

    >>> is_local("tcp://127.0.0.1:5555"), is_local("tcp://10.0.0.5:5555")
    (True, False)
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from pathlib import Path
from urllib.parse import urlparse

from psring.errors import ConfigError

#: environment variable holding the shared secret itself (--secret-file names a file)
SECRET_ENV = "PSRING_SECRET"
MIN_SECRET_BYTES = 16

HOW_TO_SET_A_SECRET = (
    "give the server and every worker the same shared secret: --secret-file PATH on "
    "`psring server` and `psring run`/`python -m psring.workers` (a file holding at "
    f"least {MIN_SECRET_BYTES} random bytes, e.g. made with `python -c \"import secrets; "
    "print(secrets.token_hex(32))\" > PATH && chmod 600 PATH`), or the environment "
    f"variable {SECRET_ENV}")


def load_secret(path: str | os.PathLike | None = None) -> bytes | None:
    """The shared secret: the contents of ``path`` (surrounding whitespace stripped),
    else the environment variable PSRING_SECRET, else None (no signing)."""
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"--secret-file {path}: {e.strerror or e}; "
                              f"{HOW_TO_SET_A_SECRET}.") from None
        source = f"--secret-file {path}"
    else:
        env = os.environ.get(SECRET_ENV, "")
        if not env:
            return None
        data = env.encode().strip()
        source = f"the environment variable {SECRET_ENV}"
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source} holds {len(data)} bytes; a shared secret needs at "
                          f"least {MIN_SECRET_BYTES}: {HOW_TO_SET_A_SECRET}.")
    return data


#: abstract Unix sockets (``ipc://@name``: a name, not a file; nothing to clean up, freed
#: with the socket) exist on Linux only
ABSTRACT_IPC = sys.platform.startswith("linux")


def abstract_ipc_endpoint(prefix: str) -> str:
    """A fresh abstract Unix socket name (random, so concurrent users never meet);
    only where ABSTRACT_IPC."""
    return f"ipc://@{prefix}-{secrets.token_hex(8)}"


def is_local(endpoint: str) -> bool:
    """True for endpoints only this host can reach: loopback TCP and ipc://. Listening
    on anything else needs a shared secret."""
    u = urlparse(endpoint)
    if u.scheme == "ipc":
        return True
    host = u.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
