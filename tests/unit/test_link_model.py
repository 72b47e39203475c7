"""The emulated links' loss model and the refusals of bad link settings, without building
a cluster (tests/emulation/test_links.py builds them).

What is checked: the loss model's long-run rate and bursts, bursts as spells of the
link, and that a seed fixes its decisions; the refusals of bad --loss, --delay,
--loss-burst, --link-buffer and --loss-tolerance (exit 2, one paragraph, nothing
started)."""

from __future__ import annotations

import re
import statistics as st

import pytest

from psring.cluster import link
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from tests.emulation.test_emulate import assert_paragraph
from tests.helpers import cli_here


def decisions(rate: float, burst: float, seed: str, n: int) -> list[bool]:
    d = link.LossModel(rate, burst).dropper(seed)
    return [d.drop() for _ in range(n)]


def test_independent_losses_have_the_rate_and_no_memory():
    got = decisions(0.05, 1, "a", 100_000)
    assert abs(sum(got) / len(got) - 0.05) < 0.004
    # P(drop | previous dropped) is the rate itself
    after = [b for a, b in zip(got, got[1:]) if a]
    assert abs(sum(after) / len(after) - 0.05) < 0.02


def test_bursty_losses_have_the_rate_and_the_mean_burst():
    got = decisions(0.02, 4, "b", 200_000)
    assert abs(sum(got) / len(got) - 0.02) < 0.004
    runs, n = [], 0
    for x in got:
        if x:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert 3.4 < st.mean(runs) < 4.6


def test_a_burst_is_a_spell_of_the_link_not_of_one_senders_packets():
    # a sender in backoff: one packet a second on a link whose frame takes 0.1 ms; its
    # packets meet the long-run rate, not bursts that outlast its timeouts
    d = link.LossModel(0.01, 4, slot_s=1e-4).dropper("c")
    sparse = [d.drop(float(t)) for t in range(20_000)]
    assert abs(sum(sparse) / len(sparse) - 0.01) < 0.004
    runs = "".join("x" if x else "." for x in sparse).split(".")
    assert max(map(len, runs)) <= 3  # independent: no run of four at 1%
    # back to back (the link busy), the bursts are there
    d = link.LossModel(0.01, 4, slot_s=1e-4).dropper("c")
    dense = [d.drop(i * 1e-4) for i in range(200_000)]
    lost = "".join("x" if x else "." for x in dense).split(".")
    assert 3.4 < st.mean(len(r) for r in lost if r) < 4.6


def test_a_seed_fixes_each_directions_decisions():
    s = link.link_seed(3, "host-0", "up")
    assert decisions(0.1, 1, s, 500) == decisions(0.1, 1, s, 500)
    assert decisions(0.1, 1, s, 500) != decisions(0.1, 1, link.link_seed(3, "host-0",
                                                                          "down"), 500)
    assert decisions(0.1, 1, s, 500) != decisions(0.1, 1, link.link_seed(4, "host-0",
                                                                          "up"), 500)
    assert not any(decisions(0.0, 1, s, 500))


@pytest.mark.parametrize("kw, needle", [
    (dict(loss=1.0), "in [0, 1)"),
    (dict(loss=-0.1), "in [0, 1)"),
    (dict(loss=0.01, loss_burst=0.5), ">= 1"),
    (dict(loss_burst=3.0), "give --loss too"),
    (dict(delay="fast"), "is not a time"),
    (dict(link_buffer="64kb"), "give --link RATE too"),
    (dict(link="1gbit", link_buffer="lots"), "is not a size"),
    (dict(link="1gbit", link_buffer="1kb"), "at least two full-size frames"),
    (dict(strategy="ps", loss_tolerance=1.0), "in [0, 1)"),
    (dict(strategy="ps", loss_tolerance=-0.5), "in [0, 1)"),
    (dict(strategy="ddp", loss_tolerance=0.01), "'ddp' has none"),
    (dict(loss_tolerance=0.01, reduce="adasum"), "transpose all-reduce"),
    (dict(strategy="ps", hosts=1, transport="ipc", loss_tolerance=0.01), "UDP datagrams"),
])
def test_bad_link_settings_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate(RunConfig(**{"strategy": "allreduce", "workers": 2, "hosts": 2, **kw}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["--loss", "0.01"], "nothing crosses one"),
    (["--delay", "2ms"], "nothing crosses one"),
    (["--hosts", "2", "--loss", "1.5"], "drops, in [0, 1)"),
    (["--hosts", "2", "--delay", "2 parsecs"], "is not a time"),
    (["--loss-tolerance", "0.01", "--strategy", "hallreduce"], "'hallreduce' has none"),
])
def test_bad_link_flags_exit_2_in_one_paragraph(tmp_path, args, needle):
    proc = cli_here("run", "--strategy", "allreduce", "--workers", "2", *args,
                    "--out", tmp_path / "r")
    assert_paragraph(proc, needle)
    assert not (tmp_path / "r").exists()


def test_bursts_that_cannot_hold_the_loss_are_refused():
    with pytest.raises(ConfigError, match="bursts of B packets lose at most"):
        validate(RunConfig(strategy="allreduce", workers=2, hosts=2, loss=0.6,
                           loss_burst=1.2))
    validate(RunConfig(strategy="allreduce", workers=2, hosts=2, loss=0.5, loss_burst=1.2))
