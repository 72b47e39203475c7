"""`psring profile` and `psring advise`: a profile from a traced run, a ranking from a
tiny profile, and bad input refused in one paragraph with exit 2."""

import json

import pytest

from psring.predict.costmodel import Calibration
from psring.predict.profile import Profile
from psring.strategies.buckets import GradientBuckets, bucket_caps
from tests.helpers import assert_no_processes, cli_here, psring

KB = 1024


@pytest.fixture
def tiny(tmp_path):
    """A saved profile (4 parameters, 1.3 MB) and a calibration, written as a user would
    have them: no run needed."""
    prof = Profile(param_bytes=[400 * KB, 4 * KB, 900 * KB, 4 * KB],
                   ready_s=[0.009, 0.008, 0.004, 0.0005], forward_s=0.004, backward_s=0.009,
                   update_s=0.001, batch_size=16, threads=1, source={"model": "tiny"})
    p = prof.save(tmp_path / "prof")
    cal = Calibration(zmq_alpha=1e-4, zmq_beta=6e-10, dist_alpha=1.5e-4, dist_beta=6e-10,
                      gamma=1e-10)
    c = cal.save(tmp_path / "cal.json")
    return p, c


def test_advise_ranks_the_strategies_of_a_tiny_profile(tiny, tmp_path):
    prof, cal = tiny
    out = tmp_path / "adv"
    res = psring("advise", "--profile", prof, "--calibration", cal, "--hosts", 2,
                 "--workers-per-host", 2, "--link", "100mbit", "--batch-size", 64,
                 "--out", out, timeout=120)
    text = res.stdout
    for name in ("allreduce", "ddp", "ps", "async-ps"):
        assert name in text
    assert "hogwild" not in text  # its workers share one memory: not across hosts
    assert "Fastest:" in text and "Bucket size:" in text and "Parameter servers:" in text
    report = json.loads((out / "advise.json").read_text())
    steps = [float(r["step ms"]) for r in report["ranking"]]
    # best first (a server beyond the first costs a 0.5% handicap in the ranking)
    assert all(a <= b * 1.01 for a, b in zip(steps, steps[1:])) and steps[0] > 0
    assert report["workers"] == 4
    # the answer trains what one worker would: synchronous, uncompressed settings only
    assert {r["strategy"] for r in report["ranking"]} == \
        {"allreduce", "ddp", "ps", "byteps", "hallreduce"}
    rows = {r["strategy"]: r for r in report["ranking"]}
    # per-host aggregation: each host's link carries the gradients once, not per worker
    assert "update on the" in rows["byteps"]["best setting"]
    assert float(rows["byteps"]["step ms"]) < float(rows["ps"]["step ms"])
    # hierarchy: the links carry 2(H-1)/H M instead of the flat ring's 2(N-1)/N M
    assert float(rows["hallreduce"]["step ms"]) < float(rows["allreduce"]["step ms"])
    assert "2(H−1)/H·M" in rows["hallreduce"]["why"]
    assert "fp16" not in " ".join(r["best setting"] for r in report["ranking"])
    # asynchronous and compressed settings are options, saying what they change
    opts = report["options"]
    assert any(o.startswith("Option: async-ps") and "staleness" in o for o in opts), opts
    assert any("fp16" in o and "gradients travel in fp16" in o for o in opts), opts
    assert all(o in text for o in opts)
    # every ranked strategy says what bounds it
    assert all(r["why"] for r in report["ranking"])
    assert (out / "advise.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 1.3 MB over 100 Mbit/s links: the ring's 2(n-1)/n·M crosses them, not compute
    ring = next(p for p in report["predictions"] if p["comm_model"] == "ring")
    assert ring["phases"]["comm_s"] > 0.05


@pytest.mark.parametrize("args,words", [
    (["--model", "nosuchnet", "--hosts", "2", "--link", "1gbit"], "nosuchnet"),
    (["--hosts", "2", "--workers-per-host", "2", "--workers", "5", "--link", "1gbit"],
     "do not fit"),
    (["--hosts", "2", "--link", "fast"], "not a rate"),
    (["--hosts", "2"], "--link"),
    (["--hosts", "2", "--link", "1gbit", "--batch-size", "33"], "multiple"),
    (["--hosts", "1", "--workers-per-host", "2", "--delay", "1ms"], "--link"),
    (["--hosts", "24", "--batch-size", "48", "--link", "1gbit", "--verify"], "do not fit"),
])
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path, args, words):
    res = cli_here("advise", *args, "--out", tmp_path / "adv")
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert err.startswith("psring: error:") and words in err
    assert "\n\n" not in err and "Traceback" not in err


def test_verify_refuses_a_profile_that_names_no_model(tmp_path):
    paper = Profile.on_paper([4096, 64], forward_s=0.01, backward_s=0.02, batch_size=8)
    path = paper.save(tmp_path / "paper")
    res = cli_here("advise", "--profile", path, "--hosts", "2", "--link", "1gbit",
                   "--verify", "--out", tmp_path / "adv")
    assert res.returncode == 2
    assert "does not say which model" in res.stderr and "Traceback" not in res.stderr


def test_a_bad_profile_is_refused(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"format": 1, "param_bytes": [4], "ready_s": []}))
    res = cli_here("advise", "--profile", bad, "--hosts", "2", "--link", "1gbit",
                   "--out", tmp_path / "adv")
    assert res.returncode == 2 and "profile" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(180)
def test_profile_records_every_gradient_and_buckets_like_the_strategies(tmp_path):
    out = tmp_path / "prof"
    res = psring("profile", "--model", "cnn", "--batch-size", 16, "--steps", 6,
                 "--threads", 1, "--out", out, timeout=150)
    assert "profile:" in res.stdout
    assert_no_processes(out)
    prof = Profile.load(out)
    assert prof.source["traced"] and prof.batch_size == 16 and prof.threads == 1
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.update_s > 0
    # every gradient is ready inside backward; the first layer's (weight, bias) come last
    assert all(0 <= t <= prof.backward_s * 1.5 for t in prof.ready_s)
    assert max(prof.ready_s[:2]) == max(prof.ready_s) > prof.ready_s[-1]
    # the profile's buckets are the strategies' own, at any size
    import torch

    from psring.train.models import ModelSettings, build_model

    model, _ = build_model("cnn", ModelSettings(), 0)
    params = [p for p in model.parameters() if p.requires_grad]
    assert prof.param_bytes == [p.numel() * 4 for p in params]
    for mb in (0.01, 0.1, 25.0):
        cap, first = bucket_caps(mb)
        real = GradientBuckets(params, cap, first, 1.0, launch=lambda b: None,
                               stats_of=lambda: None)
        assert [b.nbytes for b in real.buckets] == [m for m, _ in prof.buckets(mb)]
        real.remove_hooks()
    del torch


def test_device_speed_asks_about_faster_devices(tiny, tmp_path):
    prof, cal = tiny
    common = ["--profile", prof, "--calibration", cal, "--hosts", 2, "--link", "10gbit",
              "--batch-size", 32]
    rows = {}
    for speed in ("1", "4"):
        out = tmp_path / f"x{speed}"
        psring("advise", *common, "--device-speed", speed, "--out", out, timeout=120)
        report = json.loads((out / "advise.json").read_text())
        rows[speed] = {r["strategy"]: float(r["compute ms"]) for r in report["ranking"]}
    for name, ms in rows["1"].items():
        assert rows["4"][name] == pytest.approx(ms / 4, rel=0.05, abs=0.05)
    bad = cli_here("advise", *common, "--device-speed", "0", "--out", tmp_path / "b")
    assert bad.returncode == 2 and "--device-speed must be a positive number" in bad.stderr
