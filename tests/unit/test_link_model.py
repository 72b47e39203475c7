"""The emulated links' loss model and the refusals of bad link settings, without building
a cluster (tests/emulation/test_links.py builds them).

What is checked: the loss model's long-run rate and bursts, bursts as spells of the
link, and that a seed fixes its decisions; the refusals of bad --loss, --delay,
--loss-burst, --link-buffer and --loss-tolerance (exit 2, one paragraph, nothing
started)."""

from __future__ import annotations

import json
import re
import statistics as st

import pytest

from psring.cluster import link
from psring.cluster.emulate import EmulatedCluster
from psring.cluster.shaping import in_kernel, user_space
from psring.cluster.spec import Cluster
from psring.comm import lossy
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
    # --switch priority: a switch that drops, and a transport with priorities
    (dict(switch="priority", loss=0.01), "without --loss-tolerance every byte goes over"),
    (dict(switch="priority", loss_tolerance=0.01), "whose links drop, with --loss F"),
    (dict(switch="lifo"), "'lifo'"),
    # --credit-window: a window of at least a datagram, into servers that grant
    (dict(strategy="ps", loss_tolerance=0.01, credit_window="0kb"), "at least one datagram"),
    (dict(strategy="ps", loss_tolerance=0.01, credit_window="lots"), "is not a size"),
    (dict(strategy="ps", credit_window="64kb"), "give --loss-tolerance F"),
    (dict(credit_window="64kb"), "give --loss-tolerance F"),
    # --loss-in kernel: independent losses, nothing the forwarder alone does
    (dict(loss_in="switch"), "'switch'"),
    (dict(loss=0.01, loss_burst=2, loss_in="kernel"), "--loss-burst needs the user-space"),
    (dict(loss=0.01, delay="1ms", loss_in="kernel"), "--delay needs the user-space"),
    (dict(loss=0.01, switch="priority", loss_tolerance=0.01, loss_in="kernel"),
     "--switch priority needs the user-space"),
    # --tcp-rto-min: a time, above 0, between emulated hosts
    (dict(tcp_rto_min="0ms"), "above 0 and at most 120 s"),
    (dict(tcp_rto_min="soon"), "is not a time"),
    (dict(hosts=1, tcp_rto_min="5ms"), "nothing crosses one"),
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
    (["--hosts", "2", "--link", "1gbit", "--switch", "priority"], "TCP, which has no"),
    (["--hosts", "2", "--strategy", "ps", "--loss-tolerance", "0.01", "--credit-window", "0"],
     "a credit window lets at least one datagram"),
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


# -- DLCP's priority-aware switch (--switch priority): the forwarder's part --------------

def _frame(tos: int) -> bytes:
    """An Ethernet frame of an IPv4 packet with this TOS byte."""
    return bytes(12) + b"\x08\x00" + bytes([0x45, tos]) + bytes(40)


class _Scripted:
    """A dropper that loses exactly the packets it is told."""

    def __init__(self, lose: set[int]):
        self.lose, self.n = lose, -1

    def drop(self, now=None) -> bool:
        self.n += 1
        return self.n in self.lose


def _carry(tmp_path, tos: list[int], lose: set[int], priority: bool,
           times: list[float] | None = None) -> tuple[list[int], link.Direction]:
    """The packet numbers a direction drops of frames with these TOS bytes."""
    d = link.Direction("up", -1, -1, _Scripted(lose), 0.0, tmp_path / "t.drops", priority)
    sent = []
    d._send = sent.append  # (no device: what would be written)
    waiting: list[bytes] = []

    def read(fd, n):  # (one frame a take(), at its time)
        if not waiting:
            raise BlockingIOError
        return waiting.pop()

    real = link.os.read
    link.os.read = read
    try:
        for i, t in enumerate(tos):
            waiting.append(_frame(t))
            d.take((times or [0.0] * len(tos))[i])
    finally:
        link.os.read = real
    return d.pending, d


def test_a_priority_switch_moves_a_loss_onto_a_lower_level(tmp_path):
    hi, lo, tcp = 0x80, 0x20, 0x00
    # with low datagrams passing, packet 1 (TCP) is dealt a loss: it goes through, and
    # the next low datagram (3) takes the loss; a high one (2) in between does not
    lost, d = _carry(tmp_path, [lo, tcp, hi, lo, lo], {1}, priority=True)
    assert lost == [3] and d.moved == 1 and not d.debts
    # fifo: the packet dealt the loss is the one lost
    lost, _ = _carry(tmp_path, [lo, tcp, hi, lo, lo], {1}, priority=False)
    assert lost == [1]
    # a high datagram's loss goes to the lowest level passing, not to TCP
    lost, d = _carry(tmp_path, [lo, hi, tcp, tcp, lo], {1}, priority=True)
    assert lost == [4]
    # the lowest level keeps its own losses; the link's count of losses is unchanged
    lost, d = _carry(tmp_path, [lo, hi, lo, hi, lo], {0, 1, 3}, priority=True)
    assert lost == [0, 2, 4] and d.moved == 2
    # TCP alone: nothing lower passes, so TCP's losses stay its own
    lost, d = _carry(tmp_path, [tcp, tcp, tcp], {1}, priority=True)
    assert lost == [1] and d.moved == 0
    # a debt no lower frame takes within DEBT_S is taken by the next frame
    t = [0.0, 0.001, link.DEBT_S + 0.003]
    lost, d = _carry(tmp_path, [lo, hi, hi], {1}, priority=True, times=t)
    assert lost == [2] and not d.debts


def test_a_frames_level_is_its_tos_mark_and_tcp_ranks_above():
    assert [link.level(_frame(t)) for t in (0x20, 0x40, 0x60, 0x80, 0x00, 0x10)] == \
        [0, 1, 2, 3, link.UNMARKED, link.UNMARKED]
    # the switch reads the marks the senders write (two layers that import neither)
    assert link.LEVELS == {tos: lv for lv, tos in enumerate(lossy.PRIORITY_TOS)}


# -- --loss-in kernel: the classifier's program and its counters -----------------------

def run_cbpf(program: list[tuple[int, int, int, int]], random: int) -> int:
    """What the classic-BPF program kernel_loss writes returns for one packet, the
    kernel's random number being ``random`` (its three opcodes, interpreted)."""
    a, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]: k is the random ancillary load
            assert k == (-0x1000 + 56) & 0xFFFFFFFF
            a, pc = random, pc + 1
        elif code == 0x35:  # jge #k
            pc += 1 + (jt if a >= k else jf)
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_the_kernels_classifier_drops_the_top_rate_of_its_random_numbers():
    lines = link.kernel_loss("psr-h0", 0.02)
    assert lines[0] == "qdisc add dev psr-h0 handle ffff: ingress"
    # IPv4 only (ARP is never dropped, as the forwarder's), verdicts in direct action
    assert "protocol ip bpf da bytecode" in lines[1]
    text = re.search(r"bytecode '(\d+),(.*)'", lines[1])
    program = [tuple(map(int, op.split())) for op in text[2].split(",")]
    assert int(text[1]) == len(program)
    verdicts = [run_cbpf(program, r) for r in range(0, 2**32, 2**32 // 10000)]
    assert verdicts.count(2) == pytest.approx(200, abs=2)  # TC_ACT_SHOT: 2% of them
    assert set(verdicts) == {0, 2}
    with pytest.raises(ValueError):
        link.kernel_loss("psr-h0", 0.0)


def test_the_kernels_drops_are_read_from_the_ingress_qdiscs_counters():
    stats = ("qdisc noqueue 0: root refcnt 2 \n Sent 9 bytes 9 pkt (dropped 9, overlimits 0)"
             "\nqdisc ingress ffff: parent ffff:fff1 ---------------- \n Sent 20655072 bytes "
             "20101 pkt (dropped 2038, overlimits 0 requeues 0) \n backlog 0b 0p\n")
    assert link.kernel_loss_counts(stats) == {"packets": 20101, "bytes": 20655072,
                                              "dropped": 2038}
    assert link.kernel_loss_counts("")["packets"] == 0


def test_loss_in_kernel_reaches_the_agents_plan(tmp_path):
    cfg = RunConfig(strategy="allreduce", workers=2, hosts=2, link="1gbit", loss=0.01,
                    loss_in="kernel")
    cluster = Cluster.from_config(cfg, uses_servers=False)
    assert cluster.loss_in == "kernel" and "loss in the kernel" in cluster.text()
    plan = json.loads(EmulatedCluster(cluster, tmp_path).agent_spec().argv[-2])
    assert plan["loss_in"] == "kernel"
    assert in_kernel(plan) and not user_space(plan)  # no TAPs, no forwarders
    assert not in_kernel({**plan, "loss_in": "forwarder"})


def test_tcp_rto_min_reaches_the_plan_slowed_by_the_time_scale(tmp_path):
    cfg = RunConfig(strategy="allreduce", workers=2, hosts=2, link="1gbit",
                    tcp_rto_min="5ms", time_scale=3)
    cluster = Cluster.from_config(cfg, uses_servers=False)
    assert "TCP's floor 5ms" in cluster.text()
    plan = json.loads(EmulatedCluster(cluster, tmp_path).agent_spec().argv[-2])
    assert plan["tcp_rto_min_us"] == 15000  # 5 ms of the cluster described, 3x slower
    cfg = RunConfig(strategy="allreduce", workers=2, hosts=2, link="1gbit")
    plan = json.loads(EmulatedCluster(Cluster.from_config(cfg, uses_servers=False),
                                      tmp_path).agent_spec().argv[-2])
    assert plan["tcp_rto_min_us"] == 0  # the kernel's own
