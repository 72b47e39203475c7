"""psring.comm.hostring: a flat ring all-reduce from point-to-point sends. Untimed it
sums as dist.all_reduce does; with a device link its hops inside a host send a token
and take the link's time, and only the hops between hosts carry the chunks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from psring.runtime.process import free_port

WORLD, PER_HOST = 4, 2


def _rank(rank: int, port: int, out: str, link: list[float] | None) -> None:
    import torch.distributed as dist

    from psring.comm.hostring import HostRing

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timedelta(seconds=50))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    sent: list[int] = []

    def send(t, dst):
        sent.append(t.numel())
        return dist.isend(t, dst)

    ring = HostRing(None, rank, WORLD, PER_HOST, tuple(link) if link else None, send=send,
                    recv=lambda t, src: dist.irecv(t, src))
    # 1001 random elements (chunks of 251 and 250), then 3 (fewer than the ranks: one
    # chunk is empty)
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(1001, generator=gen), torch.randn(3, generator=gen)]
    if link:
        tensors = [torch.zeros(10_000)]  # 40 kB: chunks of 10 kB
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    ring.all_reduce(tensors[0]).wait()
    end = time.perf_counter()
    first = list(sent)  # (the first ring's messages)
    for t in tensors[1:]:
        ring.all_reduce(t).wait()
    ring.close()
    dist.destroy_process_group()
    # the same sum, up to the order of the additions (rounding)
    equal = all(torch.allclose(t, e, rtol=1e-5, atol=1e-5) for t, e in zip(tensors, expected))
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"equal": equal, "sent": first, "t0": t0, "end": end}))


def _run_world(tmp_path: Path, link: list[float] | None) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), link))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert not any(os.path.exists(f"/proc/{p.pid}") for p in procs)  # reaped, all
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(120)
def test_an_untimed_ring_sums_as_torch_does(tmp_path):
    ranks = _run_world(tmp_path, None)
    assert all(r["equal"] for r in ranks)
    # 2 (N - 1) steps, each a real chunk to the next rank
    assert all(len(r["sent"]) == 6 and min(r["sent"]) >= 250 for r in ranks)


@pytest.mark.timeout(120)
def test_a_device_link_times_the_hops_inside_a_host_and_only_those(tmp_path):
    # α 0, 1 MB/s, chunks of 10 kB: each hop inside a host takes 10 ms, and a link
    # carries the ring's 6 chunks one after another: 60 ms for the ranks at the end of
    # one, 50 ms for those a step behind (their last chunk left at 50 ms, across hosts)
    ranks = _run_world(tmp_path, [0.0, 1e6])
    # (perf_counter is the machine's monotonic clock, one for all processes: each rank's
    # time counts from the first rank's start, however far apart the barrier let them go)
    first = min(r["t0"] for r in ranks)
    for rank, r in enumerate(ranks):
        inside = (rank + 1) % WORLD // PER_HOST == rank // PER_HOST
        # the hop to a worker of its own host carries a token; across hosts, the chunk
        assert r["sent"] == ([1] * 6 if inside else [2500] * 6), (rank, r["sent"])
        timed_in = not inside  # (hosts of 2: the rank sending across receives inside)
        least = 0.060 if timed_in else 0.050
        assert least - 0.001 <= r["end"] - first, (rank, r["end"] - first)
        assert r["end"] - r["t0"] < least + 2.0, (rank, r["end"] - r["t0"])
