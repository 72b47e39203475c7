"""Adasum (psring.comm.adasum): the pairwise rule, and recursive vector halving over 2, 4
and 8 ranks (threads here, with queues for the point-to-point swaps) equal to the
rule applied as a tree to whole tensors in one process."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from psring.comm import adasum
from tests.helpers import (
    SMALL,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    psring,
    read_steps,
    trained_by_the_tree,
)


class ThreadComm:
    """adasum.Comm between threads of one process: a queue per (sender, receiver) and
    a barrier per block for the sums."""

    def __init__(self, rank: int, size: int, shared: dict):
        self.rank, self.size, self.shared = rank, size, shared

    def sendrecv(self, peer, send, recv):
        self.shared["q"][(self.rank, peer)].put(send.clone())
        got = self.shared["q"][(peer, self.rank)].get(timeout=10)
        assert got.numel() == recv.numel(), (self.rank, peer, got.numel(), recv.numel())
        recv.copy_(got)

    def sum_in_block(self, level, t):
        block = self.rank // (2 * level)
        slots, barrier = self.shared["blocks"][(level, block)]
        slots[self.rank % (2 * level)] = t.clone()
        barrier.wait(timeout=10)
        total = sum(slots)
        barrier.wait(timeout=10)  # everyone has read the slots before they are reused
        t.copy_(total)


def run_ranks(bufs: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    size = len(bufs)
    shared = {"q": {(a, b): queue.Queue() for a in range(size) for b in range(size)},
              "blocks": {}}
    level = 1
    while level < size:
        for block in range(size // (2 * level)):
            shared["blocks"][(level, block)] = ([None] * (2 * level),
                                                threading.Barrier(2 * level))
        level *= 2
    out = [b.clone() for b in bufs]
    errors = []

    def work(r):
        try:
            adasum.reduce(out[r], counts, ThreadComm(r, size, shared))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return out


def split(flat: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(flat.split(counts))


def test_orthogonal_gradients_add_and_equal_ones_average():
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    assert torch.allclose(adasum.reference([[a], [b]])[0], a + b)
    assert torch.allclose(adasum.reference([[a], [a.clone()]])[0], a)
    # opposite gradients cancel out less than a sum does... they cancel exactly here
    assert torch.allclose(adasum.reference([[a], [-a]])[0], torch.zeros(3))
    # and a zero gradient leaves the other as it is
    assert torch.allclose(adasum.reference([[a], [torch.zeros(3)]])[0], a)
    # over 4 ranks: four equal gradients average, four orthogonal ones add
    e = torch.eye(4)
    assert torch.allclose(adasum.reference([[e[0]]] * 4)[0], e[0])
    assert torch.allclose(adasum.reference([[e[i]] for i in range(4)])[0], torch.ones(4))


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("counts", [[37, 5, 1, 64], [3], [1000, 7, 250]],
                         ids=["four-tensors", "tiny", "uneven"])
def test_vector_halving_equals_the_tree_on_whole_tensors(size, counts):
    g = torch.Generator().manual_seed(size * 100 + len(counts))
    n = sum(counts)
    bufs = [torch.randn(n, generator=g) for _ in range(size)]
    # some tensors of some ranks nearly parallel, so the coefficients matter
    bufs[-1][:counts[0]] = bufs[0][:counts[0]] * 0.5 + 0.01 * bufs[-1][:counts[0]]
    got = run_ranks(bufs, counts)
    want = torch.cat(adasum.reference([split(b, counts) for b in bufs]))
    for r in range(size):  # every rank ends with the same result, the tree's
        assert torch.allclose(got[r], want, rtol=1e-5, atol=1e-6), (r, (got[r] - want).abs().max())
    # and it is neither the sum nor the mean
    assert not torch.allclose(want, sum(bufs), rtol=1e-3)


class HostThreadComm(ThreadComm):
    """hallreduce's Adasum across hosts (adasum.TorchComm with per_host G): the ranks are
    the hosts; local rank l swaps with local rank l of the peer host, and a level's sums
    run over every worker of the block's hosts."""

    def __init__(self, host, hosts, local, g, shared):
        super().__init__(host, hosts, shared)
        self.local, self.g = local, g

    def sendrecv(self, peer, send, recv):
        me, them = (self.rank, self.local), (peer, self.local)
        self.shared["q"][(me, them)].put(send.clone())
        got = self.shared["q"][(them, me)].get(timeout=10)
        recv.copy_(got)

    def sum_in_block(self, level, t):
        block = self.rank // (2 * level)
        slots, barrier = self.shared["blocks"][(level, block)]
        slots[(self.rank % (2 * level)) * self.g + self.local] = t.clone()
        barrier.wait(timeout=10)
        total = sum(slots)
        barrier.wait(timeout=10)
        t.copy_(total)


@pytest.mark.parametrize("hosts, g", [(2, 2), (4, 2), (2, 3)])
def test_adasum_across_hosts_of_host_averages_equals_the_tree(hosts, g):
    """Each host's workers average (the reduce-scatter: worker l keeps slice l), the
    slices go through Adasum across the hosts with sums over whole hosts, then the host
    gathers: the tree over the hosts' averages, per tensor, though the slices cut the
    tensors (each tensor's dot products and norms are summed over the host's slices)."""
    counts = [37, 5, 1, 64]
    n = sum(counts)
    c = -(-n // g)
    gen = torch.Generator().manual_seed(hosts * 10 + g)
    grads = [[torch.randn(n, generator=gen) for _ in range(g)] for _ in range(hosts)]
    grads[1][0][:37] = grads[0][0][:37] * 0.7  # nearly parallel somewhere: coefficients matter
    means = [sum(w) / g for w in grads]
    shared = {"q": {((a, lr), (b, lr)): queue.Queue() for a in range(hosts)
                    for b in range(hosts) for lr in range(g)}, "blocks": {}}
    level = 1
    while level < hosts:
        for block in range(hosts // (2 * level)):
            shared["blocks"][(level, block)] = ([None] * (2 * level * g),
                                                threading.Barrier(2 * level * g))
        level *= 2
    slices = {}
    errors = []

    def work(h, lr):
        try:
            padded = torch.zeros(c * g)
            padded[:n] = means[h]
            mine = padded[lr * c:(lr + 1) * c].clone()
            adasum.reduce(mine, adasum.slice_counts(counts, lr * c, (lr + 1) * c, c * g),
                          HostThreadComm(h, hosts, lr, g, shared))
            slices[(h, lr)] = mine
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(h, lr)) for h in range(hosts)
               for lr in range(g)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    want = torch.cat(adasum.reference([split(m, counts) for m in means]))
    for h in range(hosts):
        got = torch.cat([slices[(h, lr)] for lr in range(g)])[:n]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (h, (got - want).abs().max())
    assert not torch.allclose(want, sum(means) / hosts, rtol=1e-3)


def test_slice_counts():
    # tensors of 3, 5, 2 elements padded to 12, cut into slices of 4: the padding last
    assert adasum.slice_counts([3, 5, 2], 0, 4, 12) == [3, 1, 0, 0]
    assert adasum.slice_counts([3, 5, 2], 4, 8, 12) == [0, 4, 0, 0]
    assert adasum.slice_counts([3, 5, 2], 8, 12, 12) == [0, 0, 2, 2]


def test_per_tensor_not_per_buffer():
    """Two tensors in one buffer combine on their own: orthogonal in one, equal in the
    other, the first adds and the second averages."""
    a = torch.tensor([1.0, 0.0, 3.0, 4.0])
    b = torch.tensor([0.0, 1.0, 3.0, 4.0])
    got = run_ranks([a, b], [2, 2])
    assert torch.allclose(got[0], torch.tensor([1.0, 1.0, 3.0, 4.0]))


def test_a_world_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        adasum.reference([[torch.ones(2)]] * 3)
    with pytest.raises(ValueError, match="power-of-two"):
        adasum.reduce(torch.ones(4), [4], ThreadComm(0, 6, {}))


@pytest.mark.timeout(200)
def test_allreduce_reduce_adasum_trains_what_the_tree_computes(tmp_path, small_runs):
    """4 workers, several buckets (SMALL's --bucket-mb): the run ends with the parameters
    of SGD on the tree's Adasum of the 4 workers' gradients, computed here in one
    process; not with single's (the sum's) parameters."""
    out = tmp_path / "adasum"
    psring("run", "--strategy", "allreduce", "--workers", 4, "--reduce", "adasum", *SMALL,
           "--out", out, timeout=180)
    assert_no_processes(out)
    got = load_model(out)
    assert max_rel_diff(got, trained_by_the_tree(out)) < 1e-4
    assert max_rel_diff(got, load_model(small_runs["single"])) > 1e-3
    records = read_steps(out)
    assert {r["worker"] for r in records} == set(range(4)) and len(records) == 4 * 12
    # several buckets, the first handed to the communication thread while backward ran
    assert all(len(r["bucket_launch_s"]) > 1 and r["bucket_launch_s"][0] < r["backward_end_s"]
               for r in records)


@pytest.mark.parametrize("args, needle", [
    (["--strategy", "allreduce", "--workers", "3", "--batch-size", "48"],
     "--workers must be a power of two (got 3); use --workers 2 or 4"),
    (["--strategy", "allreduce", "--workers", "2", "--compress", "fp16"], "drop --compress"),
    (["--strategy", "ps", "--workers", "2"], "--reduce adasum is for allreduce"),
    (["--strategy", "hallreduce", "--workers", "6", "--hosts", "3", "--batch-size", "48"],
     "--hosts must be a power of two (got 3); use --hosts 2 or 4"),
])
def test_bad_adasum_input_is_one_paragraph_and_exit_2(tmp_path, args, needle):
    proc = cli_here("run", *args, "--reduce", "adasum", "--out", tmp_path / "r")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert proc.stderr.count("psring: error:") == 1 and not (tmp_path / "r").exists()
