"""psring.cluster.spec: one description of a run's cluster, pure (no torch, no processes)."""

import subprocess
import sys

import pytest

from psring.cluster.spec import DEFAULTS, Cluster
from psring.errors import ConfigError


def test_old_manifests_without_cluster_settings_ran_on_this_machine():
    c = Cluster.from_config({"strategy": "ps", "workers": 2}, uses_servers=True)
    assert not c.emulated and c.text() == "this machine"
    assert c.worker_host == (0, 0) and c.server_host == (0,)
    assert c.describe() == {"emulated": False, "hosts": [
        {"name": "local", "index": 0, "address": DEFAULTS["master_addr"],
         "processes": ["worker-0", "worker-1", "server-0"]}], "worker_hosts": 1,
        "link": None, "link_bits_per_s": None, "delay": None, "loss": 0.0,
        "loss_burst": 1.0, "link_buffer_bytes": None, "switch": "fifo", "loss_in": "forwarder",
        "tcp_rto_min": None,
        "server_placement": "colocated", "time_scale": 1.0, "emulated_link_bits_per_s": None}


def test_a_time_scale_slows_the_emulated_links_not_the_cluster_described():
    c = Cluster.from_config({"workers": 4, "hosts": 2, "link": "10gbit", "delay": "1ms",
                             "time_scale": 20}, uses_servers=False)
    assert c.link_bits == 10e9 and c.emulated_link_bits == 0.5e9
    assert c.delay_s == 0.001 and c.emulated_delay_s == 0.02
    assert c.text() == "2 hosts, 10gbit links, 1ms delay, time scale 20"
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="--time-scale must be a positive number"):
            Cluster(workers=2, hosts=2, time_scale=bad)


def test_a_strategy_without_servers_places_none():
    c = Cluster.from_config({"workers": 4, "hosts": 2, "servers": 3, "link": "1gbit",
                             "server_placement": "own-hosts"}, uses_servers=False)
    assert c.servers == 0 and c.server_host == () and c.placement == "colocated"
    assert c.text() == "2 hosts, 1gbit links"
    assert c.describe()["server_placement"] is None


def test_links_and_placement_are_derived():
    c = Cluster(workers=4, hosts=4, servers=2, placement="own-hosts", link="100mbit",
                delay="2ms")
    assert c.link_bits == 1e8 and c.delay_s == pytest.approx(2e-3)
    assert c.worker_host == (0, 1, 2, 3) and c.server_host == (4, 5) and c.multi_host
    assert c.server_address(1) == "198.18.0.6"
    assert c.text() == "4 hosts + 2 server hosts, 100mbit links, 2ms delay, servers own-hosts"
    assert not Cluster(workers=2, servers=1).multi_host


@pytest.mark.parametrize("kw, needle", [
    (dict(workers=2, hosts=3), "--hosts 3 is more than --workers 2"),
    (dict(workers=2, hosts=2, link="fast"), "not a rate"),
    (dict(workers=2, link="1gbit"), "nothing crosses one"),
    (dict(workers=2, servers=1, placement="elsewhere"), "--server-placement must be one of"),
    (dict(workers=4, hosts=3, workers_per_host=2), "leave a host empty"),
])
def test_a_cluster_that_cannot_be_is_refused_naming_the_flag(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        Cluster(**kw)


def test_the_cluster_module_needs_no_torch():
    code = "import sys, psring.cluster.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
