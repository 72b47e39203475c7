"""Diagnostic (in-process, not a figure of what users run): the CPU the bounded-loss
transport (--loss-tolerance) spends per Gbit/s of gradients, sending and receiving,
on loopback in one process: a worker's LossySender cutting a 40 MB gradient into
datagrams (segmented sends, UDP GSO) and a server's drain and Ingress keeping them
(coalesced receives, UDP GRO) and assembling the push. Issue 48's goal is under a
tenth of a core for 1 Gbit/s, sending and receiving together.

    .venv/bin/python benchmarks/diag_datagrams.py [--rounds 6]

Prints the median over the rounds (the first, which warms up, left out) of the
process's CPU time for each side, as the share of a core 1 Gbit/s would take.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time

import torch

from psring.comm import ingress, lossy, receiving
from psring.comm.protocol import VERSION, Message


def one(rx, sender: lossy.LossySender, done: queue.SimpleQueue,
        arriving: ingress.Ingress, grad: torch.Tensor, transfer: int) -> tuple[float, float]:
    """(sending, receiving) CPU seconds of one push of ``grad`` from ``sender`` (whose
    ``on_sent`` puts on ``done``) into ``arriving``: one of each for every push, as a
    worker keeps a sender for its server and a server keeps its ingress."""
    c0 = time.process_time()
    sender.send(transfer, 0, grad, token=transfer)
    done.get(timeout=60)
    c1 = time.process_time()
    c2 = time.process_time()
    n = receiving.drain(rx, arriving)
    push = arriving.complete(Message({
        "v": VERSION, "op": "lossy_push", "run": "diag", "worker": 0, "seq": transfer,
        "shard": 0, "step": 0, "offset": 0, "numel": grad.numel(), "packets": n,
        "dtype": "float32", "tolerance": 0.0, "transfer": transfer, "tensors": []}))
    c3 = time.process_time()
    if not isinstance(push, Message) or not torch.equal(push.tensors[0], grad):
        raise SystemExit("the push did not arrive whole (the receive buffer too small?)")
    return c1 - c0, c3 - c2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rx = receiving.receiving_socket("127.0.0.1", 0, 200 << 20)
    grad = torch.randn(10_000_000)
    done: queue.SimpleQueue = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "diag", 0,
                               on_sent=done.put)
    arriving = ingress.Ingress()
    costs = [one(rx, sender, done, arriving, grad, i)
             for i in range(max(2, args.rounds))][1:]
    sender.close()
    per_gbit = 1e9 / (grad.numel() * 32)
    send = statistics.median(c[0] for c in costs) * per_gbit
    recv = statistics.median(c[1] for c in costs) * per_gbit
    print(f"1 Gbit/s of gradients costs {send:.3f} of a core sending, {recv:.3f} "
          f"receiving, {send + recv:.3f} together (goal: under 0.1)")
    rx.close()


if __name__ == "__main__":
    main()
