"""A plugin strategy brings its own cost model: `psring strategies` lists it, it runs,
the simulator replays its run with that model, and `psring advise` ranks it."""

import json
import subprocess
import sys

import pytest

from psring.predict.calibration import Calibration
from tests.helpers import SMALL, assert_no_processes, env_with_plugins, psring

NAP_S = 0.05  # tests/plugins/sleepy.py's


def plugin_env() -> dict[str, str]:
    env = env_with_plugins()
    env["PSRING_PLUGINS"] = "sleepy"
    return env


def test_the_plugin_is_listed_and_unknown_without_it():
    assert "sleepy-ring" in psring("strategies", env=plugin_env()).stdout
    assert "sleepy-ring" not in psring("strategies").stdout


@pytest.mark.slow
def test_a_plugin_run_is_replayed_with_its_own_cost_model(tmp_path):
    out = tmp_path / "sleepy"
    psring("run", "--strategy", "sleepy-ring", "--workers", 2, *SMALL, "--out", out,
           "--timeout", 60, env=plugin_env(), timeout=120)
    assert_no_processes(out)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert min(s["step_s"] for s in steps) >= NAP_S  # the plugin's own step ran
    cal = Calibration(zmq_alpha=1e-4, zmq_beta=6e-10, dist_alpha=1.5e-4,
                      dist_beta=6e-10, gamma=1e-10).save(tmp_path / "cal.json")
    # the replay and, for the same profile, the built-in ring's prediction
    code = (
        "import json, sys\n"
        "from psring.config import cluster_of\n"
        "from psring.predict.calibration import Calibration\n"
        "from psring.records.profile import Profile\n"
        "from psring.predict.replay import replay\n"
        "from psring.predict.sim.simulate import simulate\n"
        "from psring.records.runlog import read_manifest\n"
        "run, cal = sys.argv[1], Calibration.load(sys.argv[2])\n"
        "p = replay(run, cal)\n"
        "cfg = read_manifest(run)['config']\n"
        "ring = simulate(Profile.from_run(run, worker=None), cluster_of(cfg), 'ring', cal,\n"
        "                bucket_mb=cfg['bucket_mb'])\n"
        "print(json.dumps([p.cost_model, p.step_s, ring.step_s]))\n")
    res = subprocess.run([sys.executable, "-c", code, str(out), str(cal)], env=plugin_env(),
                         capture_output=True, text=True, timeout=120, check=True)
    model, step, ring = json.loads(res.stdout)
    assert model == "sleepy-ring"
    assert step == pytest.approx(ring + NAP_S, rel=1e-9)


def test_advise_ranks_the_plugin_by_its_cost_model(tmp_path):
    from psring.records.profile import Profile

    KB = 1024
    prof = Profile(param_bytes=[400 * KB, 4 * KB, 900 * KB, 4 * KB],
                   ready_s=[0.009, 0.008, 0.004, 0.0005], forward_s=0.004, backward_s=0.009,
                   update_s=0.001, batch_size=16, threads=1, source={"model": "tiny"})
    p = prof.save(tmp_path / "prof")
    cal = Calibration(zmq_alpha=1e-4, zmq_beta=6e-10, dist_alpha=1.5e-4, dist_beta=6e-10,
                      gamma=1e-10).save(tmp_path / "cal.json")
    out = tmp_path / "adv"
    psring("advise", "--profile", p, "--calibration", cal, "--hosts", 2,
           "--workers-per-host", 1, "--link", "1gbit", "--batch-size", 32, "--out", out,
           env=plugin_env())
    rows = {r["strategy"]: r for r in json.loads((out / "advise.json").read_text())["ranking"]}
    assert "sleepy-ring" in rows
    assert "cost model sleepy-ring" in rows["sleepy-ring"]["why"]
    assert float(rows["sleepy-ring"]["step ms"]) == \
        pytest.approx(float(rows["allreduce"]["step ms"]) + NAP_S * 1e3, abs=0.15)
