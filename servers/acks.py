"""Exactly once: a push is identified by ``(worker, seq)``. A second push with the same
pair (a retry after a timeout) is not applied again: it gets the very ack the first one
got. The acks of each worker's current and previous step are remembered (at most
MAX_ACKS per worker); a push reusing a seq for different data, or a retry older than
what is remembered, is refused. With a shared secret every request must also carry a
seq above the highest seen from its (run, worker) (:class:`Replays`) — else it is a
replay, dropped unanswered — except such a retry, which is answered as above.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from psring.servers.replies import RequestError

#: acks remembered per worker for answering retried pushes (its current and previous
#: step's; this caps them when a step has more pushes than that)
MAX_ACKS = 8192
#: runs whose highest seq per worker is remembered (replay protection with a secret):
#: a replayed message of a run older than these is still refused by the run check,
#: unless it is an init
MAX_RUNS_SEEN = 1024


@dataclass
class _Ack:
    """What a push was answered with, to answer its retry with the same."""
    step: int
    offset: int
    numel: int
    frames: list


class AckLedger(dict):
    """One run's acknowledged pushes: worker -> seq -> the ack its push got (its current
    and previous step's); :attr:`acked_seq`: worker -> its highest acknowledged seq."""

    def __init__(self) -> None:
        super().__init__()
        self.acked_seq: dict[int, int] = {}

    def retried(self, h: dict, numel: int) -> list | None:
        """The first ack's frames when push header ``h`` (of ``numel`` elements)
        repeats an acknowledged push; None when it is new; RequestError when it reuses
        a seq for another push."""
        ack = self.get(h["worker"], {}).get(h["seq"])
        if ack is None:
            return None
        if (ack.step, ack.offset, ack.numel) != (h["step"], h["offset"], numel):
            raise RequestError(
                f"worker {h['worker']} reused seq {h['seq']} for a different push (step "
                f"{h['step']}, offset {h['offset']}, {numel} elements; the first was step "
                f"{ack.step}, offset {ack.offset}, {ack.numel} elements)")
        return ack.frames

    def check_new(self, h: dict) -> None:
        """A push that is no retry must carry a seq above its worker's last acked one."""
        w = h["worker"]
        if h["seq"] <= self.acked_seq.get(w, h["seq"] - 1):
            raise RequestError(
                f"push seq {h['seq']} of worker {w} is not above its last acknowledged "
                f"push (seq {self.acked_seq[w]}): a retry older than the acks the server "
                f"keeps (this step's and the last), or a client reusing sequence numbers")

    def remember(self, h: dict, numel: int, frames: list) -> None:
        """Push header ``h``'s ack, for its retries."""
        w, step = h["worker"], h["step"]
        acks = self.setdefault(w, OrderedDict())
        acks[h["seq"]] = _Ack(step, h["offset"], numel, frames)
        self.acked_seq[w] = max(self.acked_seq.get(w, h["seq"]), h["seq"])
        # keep this worker's current and previous step (seqs, hence steps, only grow)
        while acks and (next(iter(acks.values())).step < step - 1 or len(acks) > MAX_ACKS):
            acks.popitem(last=False)


class Replays:
    """run -> worker -> the highest seq seen, for the MAX_RUNS_SEEN latest runs."""

    def __init__(self) -> None:
        self.seen: OrderedDict[str, dict[int, int]] = OrderedDict()

    def fresh(self, h: dict) -> bool:
        """Is this request's seq above every seq seen from its (run, worker)? Records it."""
        seen = self.seen.get(h["run"])
        if seen is None:
            seen = self.seen[h["run"]] = {}
            while len(self.seen) > MAX_RUNS_SEEN:
                self.seen.popitem(last=False)
        else:
            self.seen.move_to_end(h["run"])
        last = seen.get(h["worker"])
        if last is not None and h["seq"] <= last:
            return False
        seen[h["worker"]] = h["seq"]
        return True
