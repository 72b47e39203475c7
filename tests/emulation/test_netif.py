"""psring.cluster.netif: the interface a worker's collectives use across hosts. A user's
setting wins; else the interface routed to MASTER_ADDR; else an error naming the
variable to set. (On emulated hosts, where it matters:
tests/emulation/test_multihost.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from psring.cluster import netif
from psring.errors import ConfigError
from tests.helpers import needs_emulation


def test_one_host_needs_no_choice():
    for master in ("127.0.0.1", "localhost", ""):
        c = netif.choose({"MASTER_ADDR": master}, cuda=False)
        assert (c.interface, c.how, c.env) == (None, "loopback", {})


def test_the_users_setting_wins_and_must_exist():
    c = netif.choose({"MASTER_ADDR": "127.0.0.1", netif.GLOO: "lo"}, cuda=False)
    assert (c.interface, c.how, c.env) == ("lo", "user", {})
    with pytest.raises(ConfigError, match=r"GLOO_SOCKET_IFNAME=nosuch0 names an interface "
                                          r"this host does not have.*lo"):
        netif.choose({"MASTER_ADDR": "127.0.0.1", netif.GLOO: "nosuch0"}, cuda=False)
    # NCCL's own setting counts only with CUDA, and is checked too
    with pytest.raises(ConfigError, match="NCCL_SOCKET_IFNAME=nosuch1"):
        netif.choose({"MASTER_ADDR": "127.0.0.1", netif.NCCL: "nosuch1"}, cuda=True)
    assert netif.choose({"MASTER_ADDR": "127.0.0.1", netif.NCCL: "nosuch1"},
                        cuda=False).how == "loopback"


def test_an_address_maps_to_its_interface():
    assert netif.interface_of("127.0.0.1") == "lo"
    assert netif.source_address("127.0.0.1") == "127.0.0.1"


def test_a_master_addr_that_does_not_resolve_is_named():
    with pytest.raises(ConfigError, match="MASTER_ADDR 'no-such-host.invalid' does not resolve"):
        netif.choose({"MASTER_ADDR": "no-such-host.invalid"}, cuda=False)


_PROBE = """
import json, sys
from psring.cluster import netif
from psring.errors import ConfigError
try:
    c = netif.choose({"MASTER_ADDR": sys.argv[1]}, cuda=sys.argv[2] == "cuda")
    print(json.dumps([c.interface, c.address, c.how, c.env]))
except ConfigError as e:
    print("error:", e)
"""


@needs_emulation
@pytest.mark.timeout(60)
def test_the_route_to_master_addr_picks_the_interface_or_its_absence_is_explained(tmp_path):
    """In a namespace of our own: an interface (one end of a veth pair) with
    198.18.7.2/24 routes to .1; a network with no route fails with the variable to set."""
    script = (f"ip link add psr-t0 type veth peer name psr-t1 && "
              f"ip addr add 198.18.7.2/24 dev psr-t0 && "
              f"ip link set psr-t0 up && {sys.executable} -c '{_PROBE}' 198.18.7.1 cpu && "
              f"{sys.executable} -c '{_PROBE}' 198.19.9.9 cuda")
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--net"]
    out = subprocess.run([*unshare, "--", "sh", "-c", script], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == '["psr-t0", "198.18.7.2", "route", {"GLOO_SOCKET_IFNAME": "psr-t0"}]'
    assert second.startswith("error: this host has no route to MASTER_ADDR 198.19.9.9")
    assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" in second


def test_node_0_with_a_loopback_master_addr_takes_the_route_to_its_peers():
    """Node 0's MASTER_ADDR may be its own host name, mapped to 127.0.1.1: the choice
    waits for the peers' addresses (here one at 127.0.0.1, the only route a test has)."""
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    first = netif.choose(env, cuda=False)
    assert first.how == "loopback"
    peers = [{"rank": 0, "host": "a", "address": None},
             {"rank": 1, "host": "b", "address": "127.0.0.1"}]
    c = netif.after_join(first, peers, "a", cuda=True)
    assert (c.interface, c.address, c.how) == ("lo", "127.0.0.1", "route")
    assert c.env == {netif.GLOO: "lo", netif.NCCL: "lo"}
    # every worker on this machine: loopback it stays
    same = [{"rank": 0, "host": "a", "address": None}, {"rank": 1, "host": "a", "address": None}]
    assert netif.after_join(first, same, "a", cuda=False) is first


def test_nccl_names_are_prefixes_and_gloos_setting_carries_over_on_cuda():
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert netif.choose({**env, netif.NCCL: "l"}, cuda=True).how == "loopback"  # l* = lo
    with pytest.raises(ConfigError, match="NCCL_SOCKET_IFNAME==l names"):
        netif.choose({**env, netif.NCCL: "=l"}, cuda=True)  # '=': the exact name
    c = netif.choose({**env, netif.GLOO: "lo"}, cuda=True)
    assert c.env == {netif.NCCL: "lo"}
    assert netif.resolve("localhost")[0] in ("127.0.0.1", "::1")
    assert all(":" not in a for a in netif.resolve("127.0.0.1"))
