"""Bucketing, in one process: grouping, scaling, order, and launch during backward."""

import torch
from torch import nn

from psring.strategies.base import DONE, StepStats
from psring.strategies.buckets import GradientBuckets, bucket_caps


def make(cap_bytes, first_cap_bytes, scale=0.5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    launched = []
    stats = StepStats()

    def launch(bucket):
        # Record which gradients exist at launch time: launched before backward ends
        # means the first layer's gradient (computed last) is not there yet.
        launched.append((bucket.index, model[0].weight.grad is None))
        return DONE

    b = GradientBuckets(list(model.parameters()), cap_bytes, first_cap_bytes, scale, launch,
                        lambda: stats)
    return model, b, launched, stats


def test_grouping_respects_caps_and_reverse_order():
    model, b, _, _ = make(cap_bytes=20_000, first_cap_bytes=300)
    params = list(model.parameters())
    flat = [p for bucket in b.buckets for p in bucket.params]
    assert flat == list(reversed(params))
    # as DDP: a bucket closes as soon as it reaches its cap, so without its last tensor
    # it was below the cap
    for bucket, cap in zip(b.buckets, [300] + [20_000] * len(b.buckets)):
        last = bucket.params[-1].numel() * 4
        assert bucket.nbytes - last < cap
        if bucket is not b.buckets[-1]:
            assert bucket.nbytes >= cap
    assert b.total_bytes == sum(p.numel() * 4 for p in params)


def test_buckets_launch_during_backward_in_order_with_scaled_grads():
    model, b, launched, stats = make(cap_bytes=20_000, first_cap_bytes=300)
    x = torch.randn(8, 32)
    model(x).sum().backward()
    handles = b.finish()
    for h in handles:
        h.wait()
    assert [i for i, _ in launched] == list(range(len(b.buckets)))
    # the first bucket (last layer) went out while the first layer's grad did not exist yet
    assert launched[0][1] is True
    assert len(stats.bucket_launch) == len(b.buckets)
    assert all(d >= s > 0 for s, d in zip(stats.bucket_launch, stats.bucket_done))
    # the same model without hooks gives the raw gradients
    ref, ref_buckets, _, _ = make(cap_bytes=20_000, first_cap_bytes=300)
    ref_buckets.remove_hooks()
    ref(x).sum().backward()
    # each gradient already is its bucket's slot, scaled (autograd's own copy is gone)
    slots = {p: v for bucket in b.buckets for p, v in zip(bucket.params, bucket.views)}
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.data_ptr() == slots[p].data_ptr()
        torch.testing.assert_close(p.grad, r.grad * 0.5)
    b.assign_grads()  # (a no-op for parameters that got a gradient)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad * 0.5)


def test_disabled_buckets_do_not_launch_and_unused_params_count_as_zero():
    model, b, launched, _ = make(cap_bytes=20_000, first_cap_bytes=300)
    b.enabled = False
    model(torch.randn(2, 32)).sum().backward()
    assert launched == []
    b.enabled = True
    model.zero_grad(set_to_none=True)
    # a graph that touches only the last layer: the others never produce gradients
    model[4](torch.randn(2, 64)).sum().backward()
    handles = b.finish()
    assert len(handles) == len(b.buckets)
    b.assign_grads()
    assert model[0].weight.grad.abs().sum() == 0


def test_bucket_caps_follow_ddp_defaults():
    assert bucket_caps(25) == (25 * 2**20, 2**20)  # the default: small first bucket
    assert bucket_caps(0.5) == (2**19, 2**19)
    assert bucket_caps(50) == (50 * 2**20, 50 * 2**20)  # explicit cap: every bucket
