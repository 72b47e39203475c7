"""`psring profile` and `psring advise`: a profile from a traced run, a ranking from a
tiny profile, and bad input refused in one paragraph with exit 2."""

import json
import re

import pytest

from psring.config import RunConfig
from psring.predict.calibration import Calibration
from psring.records.profile import Profile
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
                 "--mtbf", 100, "--job-hours", 50, "--out", out, timeout=120)
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
    # --mtbf: every strategy priced with failures, async-ps (going on without a lost
    # worker) beside the ranking's, and whether they change the answer, said
    fails = {r["strategy"]: r for r in report["failures"]["ranking"]}
    assert set(fails) == set(rows) | {"async-ps"}
    assert all(r["with_failures_s"] > r["step_s"] for r in fails.values())
    assert "goes on without a lost worker" in fails["async-ps"]["why"]
    assert "restarts a day" in fails["allreduce"]["why"]
    assert any(line.startswith("Failures") for line in report["failures"]["summary"])
    assert all(line in text for line in report["failures"]["summary"])


@pytest.mark.parametrize("args,words", [
    (["--model", "nosuchnet", "--hosts", "2", "--link", "1gbit"], "nosuchnet"),
    (["--hosts", "2", "--workers-per-host", "2", "--workers", "5", "--link", "1gbit"],
     "do not fit"),
    (["--hosts", "2", "--link", "fast"], "not a rate"),
    (["--hosts", "2"], "--link"),
    (["--hosts", "2", "--link", "1gbit", "--batch-size", "33"], "multiple"),
    (["--hosts", "1", "--workers-per-host", "2", "--delay", "1ms"], "--link"),
    (["--hosts", "24", "--batch-size", "48", "--link", "1gbit", "--verify"], "do not fit"),
    (["--hosts", "2", "--link", "1gbit", "--mtbf", "-1"], "--mtbf"),
    (["--max-workers", "0"], "--max-workers 0"),
    (["--max-workers", "70000", "--link", "1gbit"], "65536"),
    (["--max-workers", "8", "--link", "1gbit", "--target-efficiency", "0"],
     "--target-efficiency"),
    (["--max-workers", "8", "--link", "1gbit", "--target-efficiency", "1.5"], "(0, 1]"),
    (["--max-workers", "16", "--workers-per-host", "3", "--link", "1gbit",
      "--batch-size", "48"], "--workers-per-host 3"),
    (["--max-workers", "8"], "--link"),
    (["--target-efficiency", "0.9"], "--max-workers"),
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


@pytest.fixture
def big(tmp_path):
    """A profile on paper of a model whose gradients the links feel (400 MB, 300 ms a
    step at batch 64), and the tiny test's calibration (loopback gloo: 1.7 GB/s)."""
    prof = Profile.on_paper([100_000_000, 4 * KB] * 4, forward_s=0.1, backward_s=0.2,
                            batch_size=64, source={"model": "big"})
    cal = Calibration(zmq_alpha=1e-4, zmq_beta=6e-10, dist_alpha=1.5e-4, dist_beta=6e-10,
                      gamma=1e-10)
    return prof.save(tmp_path / "big"), cal.save(tmp_path / "cal.json")


def test_device_link_prices_the_traffic_inside_a_host(big, tmp_path):
    prof, cal = big
    common = ["--profile", prof, "--calibration", cal, "--hosts", 2, "--workers-per-host", 2,
              "--link", "20gbit"]
    reports = {}
    for name, extra in (("loopback", []), ("nvlink", ["--device-link", "nvlink"])):
        out = tmp_path / name
        res = psring("advise", *common, *extra, "--out", out, timeout=120)
        reports[name] = json.loads((out / "advise.json").read_text())
        printed = " ".join(res.stdout.split())  # (the table's title wraps)
        assert ("device link nvlink inside each host (150 GB/s; to host memory 15.75 GB/s)"
                in printed) == bool(extra)
    step = {k: {r["strategy"]: float(r["step ms"]) for r in rep["ranking"]}
            for k, rep in reports.items()}
    # byteps's and hallreduce's reduce-scatter and all-gather run at NVLink's 150 GB/s
    for name in ("byteps", "hallreduce"):
        assert step["nvlink"][name] < step["loopback"][name], (name, step)
    # a flat ring's hops inside a host take the link too, and its sums run on the
    # devices (no host γ), but its slowest edge is still the host link: it gains less
    for name in ("allreduce", "ddp"):
        assert step["nvlink"]["byteps"] < step["nvlink"][name] <= step["loopback"][name], \
            (name, step)
    # the parameter server sends nothing among a host's workers, but its workers copy
    # their gradients to host memory and the parameters back, at the host's PCIe: their
    # copy engines are busy (its step, a mean of draws of the flows, moves either way)
    for name, rep in reports.items():
        ps = next(p for p in rep["predictions"] if p["strategy"] == "ps")
        copies = [v for k, v in ps["utilization"].items() if k.endswith(("d2h", "h2d"))]
        assert (len(copies) == 2 and min(copies) > 0.01) == (name == "nvlink"), (name, ps)
    link = reports["nvlink"]["cluster"]["device_link"]
    assert link == {"name": "nvlink", "alpha_s": 10e-6, "bytes_per_s": 150e9,
                    "host_copy_bytes_per_s": 15.75e9}
    assert "device link nvlink inside each host" in reports["nvlink"]["title"]
    assert "device_link" not in reports["loopback"]["cluster"]
    assert "device link" not in reports["loopback"]["title"]
    # the winner's bucket sizes, each once (byteps: at its own update site only)
    for rep in reports.values():
        line = next(r for r in rep["recommendations"] if r.startswith("Bucket size:"))
        sizes = re.findall(r"[(,] ([\d.]+) MB", line)
        assert sizes and len(sizes) == len(set(sizes)), line


@pytest.mark.parametrize("args,words", [
    (["--workers-per-host", "4", "--device-link", "nvlinq"], "--device-link nvlink"),
    (["--workers-per-host", "4", "--device-link", "12x"], "is not a rate"),
    (["--workers-per-host", "4", "--device-link", "0gbit"], "--device-link nvlink"),
    (["--device-link", "nvlink"], "Put several workers on a host (--workers-per-host)"),
    (["--workers", "2", "--device-link", "1200gbit"], "or drop --device-link"),
])
def test_a_device_link_that_cannot_apply_is_refused(big, tmp_path, args, words):
    prof, cal = big
    out = tmp_path / "adv"
    res = cli_here("advise", "--profile", prof, "--calibration", cal, "--hosts", "2",
                   "--link", "20gbit", *args, "--out", out)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert err.startswith("psring: error:") and words in err, err
    assert "\n\n" not in err and "Traceback" not in err
    assert not out.exists()  # nothing started, nothing written


def test_verify_runs_take_the_device_link_where_their_strategy_accepts_it(tmp_path):
    """--verify's runs: --device-link for the strategies with collectives inside a host
    (byteps, hallreduce), none for the others; psring.config accepts every one."""
    import argparse

    from psring.cluster.spec import Cluster
    from psring.commands.advise import strategy_classes, verify_flags
    from psring.config import RunConfig, validate
    from psring.predict.advise import candidates, rank
    from psring.train.models import ModelSettings, build_model

    model, _ = build_model("mlp", ModelSettings(), 0)
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    prof = Profile.on_paper(sizes, forward_s=0.01, backward_s=0.02, batch_size=8,
                            source={"model": "mlp"})
    path = prof.save(tmp_path / "prof")
    cal = Calibration(zmq_alpha=1e-4, zmq_beta=6e-10, dist_alpha=1.5e-4, dist_beta=6e-10,
                      gamma=1e-10)
    # (one host too: a one-host Cluster keeps workers_per_host 0, its workers counted)
    for hosts in (2, 1):
        classes = strategy_classes(4, hosts)
        cluster = Cluster.of(hosts=hosts, workers_per_host=4 // hosts, link_bits=1e9)
        ranking = rank(candidates(prof, cluster, cal, classes, inside=(10e-6, 1 / 150e9)))
        assert {"byteps", "hallreduce", "allreduce", "ps"} <= {c.strategy for c in ranking}
        for device_link in ("nvlink", ""):
            args = argparse.Namespace(hosts=hosts, link="1gbit", delay="", verify_steps=5,
                                      device_link=device_link)
            for c in ranking:
                cls = classes[c.strategy]
                if not cls.caps.emulates_device:
                    continue  # (hogwild on one host: --verify never runs it)
                flags = verify_flags(c, cls, args, {"model": "mlp"}, 32, 4, tmp_path, path)
                assert flags.get("device_link", "") == \
                    (device_link if cls.caps.inside_host else ""), (hosts, c.strategy, flags)
                validate(RunConfig(**flags))  # psring run would take it


def test_verify_runs_at_least_the_floor_and_the_rule_above_it(tmp_path):
    """A verifying run's --time-scale: the device rule's where it asks for more than
    VERIFY_MIN_TIME_SCALE, the floor where the rule would leave the cores busy."""
    from psring.commands.advise import VERIFY_MIN_TIME_SCALE, verify_time_scale
    from psring.train.device import required_time_scale

    sizes = [4 * 1024 * 1024, 4096]
    flags = dict(model="mlp", strategy="ps", workers=2, servers=2, compute="device")
    for step_s, above in ((1e-2, False), (1e-5, True)):
        path = Profile.on_paper(sizes, step_s / 3, 2 * step_s / 3, batch_size=8).save(
            tmp_path / f"p{step_s:g}")
        run = {**flags, "device_profile": str(path)}
        rule = required_time_scale(RunConfig(**run))
        assert (rule > VERIFY_MIN_TIME_SCALE) == above, rule
        assert verify_time_scale(run) == max(rule, VERIFY_MIN_TIME_SCALE)


def test_a_described_link_faster_than_loopback_is_not_floored_at_it(big, tmp_path):
    """advise prices a cluster on the clock of the run that would verify it (this
    machine's software costs at 1/S): a 100 Gbit/s host link is the link's own, not
    floored at this machine's loopback gloo (1.7 GB/s in this calibration)."""
    from psring.cluster.spec import Cluster
    from psring.predict.sim.simulate import simulate

    prof, cal_path = big
    out = tmp_path / "adv"
    psring("advise", "--profile", prof, "--calibration", cal_path, "--hosts", 2,
           "--workers-per-host", 1, "--link", "100gbit", "--batch-size", 128,
           "--out", out, timeout=120)
    ranked = json.loads((out / "advise.json").read_text())["ranking"]
    got = min(float(r["step ms"]) for r in ranked if r["strategy"] == "allreduce") / 1e3
    p, cal = Profile.load(prof), Calibration.load(cal_path)
    cluster = Cluster.of(hosts=2, link_bits=100e9)
    floored = min(simulate(p, cluster, "ring", cal, bucket_mb=mb).step_s
                  for mb in (1, 5, 25, 100))
    ideal = min(simulate(p, cluster, "ring", cal.faster(1e9), bucket_mb=mb).step_s
                for mb in (1, 5, 25, 100))
    assert ideal <= got < floored
    assert got < 1.1 * ideal  # the 100 Gbit/s link, not 1.7 GB/s


def test_max_workers_answers_the_scaling_question(tiny, tmp_path):
    """--max-workers: every strategy's curve from 1 to N in advise.json, the largest
    count that keeps the target, the servers and the batch, and scaling.png."""
    prof, cal = tiny
    out = tmp_path / "adv"
    res = psring("advise", "--profile", prof, "--calibration", cal, "--hosts", 1,
                 "--workers-per-host", 2, "--max-workers", 64, "--link", "1gbit",
                 "--target-efficiency", 0.7, "--out", out, timeout=120)
    report = json.loads((out / "advise.json").read_text())
    sc = report["scaling"]
    assert sc["max_workers"] == 64 and sc["workers_per_host"] == 2
    ring = sc["strategies"]["allreduce"]
    assert [p["workers"] for p in ring] == [1, 2, 4, 8, 16, 32, 64]
    assert {"workers", "hosts", "servers", "step_s", "samples_per_s", "efficiency",
            "epoch_s"} <= set(ring[0])
    assert [p["hosts"] for p in ring] == [1, 1, 2, 4, 8, 16, 32]
    for name, n in sc["recommended_workers"].items():
        points = {p["workers"]: p for p in sc["strategies"][name]}
        assert n == 1 or points[n]["efficiency"] >= 0.7
        assert all(p["efficiency"] < 0.7 for w, p in points.items() if w > n)
    assert sc["servers"]["ps"]["servers"] >= 1
    assert set(sc["batch"]) >= {"allreduce", "ps"}
    assert all(line in res.stdout for line in sc["summary"])
    assert "stops hiding under backward" in res.stdout
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_no_processes(out)
