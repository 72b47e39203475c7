"""The emulated links in tc's and ip's syntax: the token bucket that shapes a link
(tbf), its queue, the veths' frames, and where --loss drops (a forwarder, or the
kernel). The cluster's agent (psring.cluster.agent) runs these lines when it builds the
links; psring.cluster.link has the user-space side and the priority queue's lines."""

from __future__ import annotations

from psring.cluster.link import kernel_loss, priority_queue

#: bytes: one of veth's largest GSO packets (64 KiB) and room to spare (tbf_params)
GSO_BURST = 72 * 1024
#: bytes: the burst of a shallow port's bucket (tbf_params): ten full frames
FRAMES_BURST = 10 * 1514


def tbf_params(bits: float, limit: int | None = None) -> tuple[int, int]:
    """(burst, limit) bytes of the token bucket that shapes a link of ``bits``/s.

    burst: 1 ms of the rate, and never less than 72 KiB, one of veth's largest GSO
    packets (64 KiB) with room to spare. A packet larger than the burst is split by tbf
    into frames; where only some of a flow's packets are (a burst just under 64 KiB,
    about 300-600 Mbit/s), gloo's ring over the link carried 74% of 500 Mbit/s and 86%
    of 400 against 95% with the larger burst
    (docs/results/2026-11-23-emulation-runs-and-prediction.md, "Link fidelity").
    A full bucket lets a burst through at once, so a transfer can beat the rate by
    burst/rate: 1 ms, or 6 ms at 100 Mbit/s, small against the gradients of a step.
    limit, the queue: 100 ms of the rate, at least 4 MiB. Deep on purpose: a switch port
    that drops packets sends TCP into 200 ms retransmission timeouts, which would measure
    TCP's loss recovery instead of the link; with a deep queue, a link shared by several
    flows (a parameter server's) is a work-conserving pipe of RATE, as the cost model
    assumes. The price is queueing delay under load, which a real shallow-buffered
    switch would not add (docs/emulation.md). ``limit`` (--link-buffer) replaces it: a
    shallow port that drops when full, for incast. Its burst is then FRAMES_BURST (or
    the port, if smaller), so that tbf splits a GSO packet (UDP's segmented sends, which
    a veth's ``gso_max_segs 1`` does not stop) into frames before they queue: the port
    holds frames, and a 64 KiB send no longer exceeds a 64 KB port as one packet."""
    bytes_per_s = bits / 8
    if limit:
        return min(FRAMES_BURST, limit), limit
    burst = max(GSO_BURST, int(bytes_per_s * 1e-3))
    return burst, max(4 * 2**20, int(bytes_per_s * 0.1))


def shaping(dev: str, plan: dict) -> list[str]:
    """tc batch lines shaping ``dev``'s egress with tbf to the link's rate (with
    ``--switch priority`` a strict-priority queue: link.priority_queue); with
    ``--loss-in kernel`` what arrives on ``dev`` loses --loss (link.kernel_loss)."""
    lines = kernel_loss(dev, plan["loss"]) if in_kernel(plan) else []
    if not plan["link_bits"]:
        return lines
    burst, limit = tbf_params(plan["link_bits"], plan.get("buffer_bytes"))
    lines += [f"qdisc add dev {dev} root handle 1: tbf rate {int(plan['link_bits'])}bit "
              f"burst {burst} limit {limit}"]
    if plan.get("switch") == "priority":
        lines += priority_queue(dev, limit)
    return lines


#: frames a TAP device queues for its forwarder (the kernel's default is 1000): room
#: for the forwarder's pauses, so that only tbf's queue and the loss model drop
TAP_QUEUE = 20000


def frames(dev: str, plan: dict) -> list[str]:
    """ip batch lines that make a veth hand on Ethernet frames, not 64 KiB GSO packets,
    where the queue is shallow (--link-buffer) or the kernel drops (--loss-in kernel):
    a drop loses one frame, not 44. (A TAP link never offers GSO; its own queue is made
    long instead.)"""
    if user_space(plan):
        return [f"link set dev {dev} txqueuelen {TAP_QUEUE}"]
    by_frame = plan.get("buffer_bytes") or in_kernel(plan)
    return [f"link set dev {dev} gso_max_segs 1"] if by_frame else []


def in_kernel(plan: dict) -> bool:
    """Does the kernel drop --loss (``--loss-in kernel``)?"""
    return bool(plan.get("loss")) and plan.get("loss_in") == "kernel"


def user_space(plan: dict) -> bool:
    """Do the links need the forwarder (psring.cluster.link): loss it drops, or delay?"""
    return bool((plan.get("loss") and not in_kernel(plan)) or plan.get("delay_us"))
