"""Sweeps: definitions, normalization, running, resuming, failures, and the report read
back from the points' logs."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from psring.errors import ConfigError
from psring.report import summarize
from psring.runs.sweep import Sweep
from tests.helpers import (
    assert_no_processes,
    env_with_plugins,
    psring,
    zygote,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = {"model": "mlp", "width": 32, "depth": 1, "features": 16, "samples": 512,
        "steps": 6, "bucket_mb": 0.05}


def write_spec(path: Path, grid: dict, repeats: int = 1, base: dict | None = None,
               report: dict | None = None) -> Path:
    def val(v):
        return json.dumps(v)  # TOML and JSON agree on strings, numbers and lists

    lines = [f"description = {val('test sweep')}", f"repeats = {repeats}", "[base]"]
    lines += [f"{k} = {val(v)}" for k, v in {**TINY, **(base or {})}.items()]
    lines += ["[grid]"] + [f"{k} = {val(v)}" for k, v in grid.items()]
    if report:
        lines += ["[report]"] + [f"{k} = {val(v)}" for k, v in report.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_points_are_normalized_and_deduplicated(tmp_path):
    spec = Sweep.load(write_spec(tmp_path / "s.toml", {
        "strategy": ["single", "allreduce", "ps"], "workers": [1, 2], "servers": [1, 2],
        "batch_per_worker": [8]}))
    points = spec.points(tmp_path / "out")
    ids = [p.id for p in points]
    assert len(ids) == len(set(ids))
    by = {(p.config.strategy, p.config.workers, p.config.servers): p for p in points}
    # single runs once (1 worker, 1 server); allreduce ignores servers; ps keeps both
    assert sorted(by) == [("allreduce", 1, 1), ("allreduce", 2, 1), ("ps", 1, 1),
                          ("ps", 1, 2), ("ps", 2, 1), ("ps", 2, 2), ("single", 1, 1)]
    # weak scaling: batch_per_worker x workers
    assert by[("ps", 2, 2)].config.batch_size == 16 and by[("ps", 1, 1)].config.batch_size == 8
    assert all(Path(p.config.out).parent == tmp_path / "out" for p in points)


def test_transport_is_swept_only_where_there_are_servers(tmp_path):
    sweep = Sweep(name="t", base={"steps": 2, "workers": 2, "batch_size": 64},
                  grid={"strategy": ["allreduce", "ps"], "transport": ["tcp", "ipc"]})
    got = sorted((p.config.strategy, p.config.transport) for p in sweep.points(tmp_path))
    assert got == [("allreduce", "auto"), ("ps", "ipc"), ("ps", "tcp")]


def test_grid_tables_bring_their_own_settings_and_stragglers_need_a_worker(tmp_path):
    sweep = Sweep(name="t", base={"steps": 2, "batch_size": 8, "lr": 0.1, "workers": 2},
                  grid={"model": [{"model": "mlp", "width": 16},
                                  {"model": "gpt", "width": 32, "lr": 0.05}],
                        "strategy": ["single", "allreduce"], "slow_worker": ["", "1:3"]})
    points = sweep.points(tmp_path)
    got = sorted((p.config.model, p.config.width, p.config.lr, p.config.strategy,
                  p.config.slow_worker) for p in points)
    assert got == [("gpt", 32, 0.05, "allreduce", ""), ("gpt", 32, 0.05, "allreduce", "1:3"),
                   ("gpt", 32, 0.05, "single", ""), ("mlp", 16, 0.1, "allreduce", ""),
                   ("mlp", 16, 0.1, "allreduce", "1:3"), ("mlp", 16, 0.1, "single", "")]
    assert {p.id.split("_")[0] for p in points} == {"model=mlp", "model=gpt"}
    assert all(p.varied["model"] in ("mlp", "gpt") for p in points)


def test_a_key_that_is_no_flag_names_cases_that_apply_where_they_can(tmp_path):
    sweep = Sweep(name="t", base={"steps": 30, "batch_size": 9, "workers": 3,
                                  "checkpoint_every": 10, "max_restarts": 1},
                  grid={"setup": [{"setup": "ring", "strategy": "allreduce"},
                                  {"setup": "ps-b1", "strategy": "ps", "backup_workers": 1,
                                   "checkpoint_every": 0, "max_restarts": 0}],
                        "fault": [{"fault": "none"}, {"fault": "server", "kill_server": "0:5"},
                                  {"fault": "backup", "backup_workers": 1}]})
    got = {p.id: p.config for p in sweep.points(tmp_path)}
    # no server to kill and no backups under allreduce: those cases are not run there
    assert sorted(got) == ["setup=ps-b1_fault=backup_r0", "setup=ps-b1_fault=none_r0",
                           "setup=ps-b1_fault=server_r0", "setup=ring_fault=none_r0"]
    assert got["setup=ps-b1_fault=server_r0"].kill_server == "0:5"
    assert got["setup=ps-b1_fault=none_r0"].backup_workers == 1
    assert got["setup=ring_fault=none_r0"].checkpoint_every == 10
    assert not hasattr(got["setup=ring_fault=none_r0"], "fault")


def test_profiles_on_paper_are_built_once_and_named_by_the_points_that_use_them(tmp_path):
    from psring.records.profile import Profile

    sweep = Sweep(name="t", base={"steps": 2, "batch_size": 16, "workers": 2,
                                  "compute": "device", "model": "mlp", "width": 16},
                  profiles={"small": {"model": "mlp", "width": 16, "batch_size": 8,
                                      "step_ms": 30, "source": "a test"}},
                  grid={"strategy": ["allreduce", "ps"], "device_profile": ["small"]})
    out = tmp_path / "o"
    points = sweep.points(out)
    assert {p.config.device_profile for p in points} == {str(out / "profiles" / "small")}
    launched = []
    from psring.runs.sweep import run_sweep
    run_sweep(sweep, out, launch=lambda cfg: launched.append(
        Profile.load(cfg.device_profile)))
    assert len(launched) == 2
    prof = launched[0]
    assert prof.forward_s + prof.backward_s == pytest.approx(0.030)
    assert prof.batch_size == 8 and prof.source["cited"] == "a test"
    # a rerun keeps the profile it built (its points read it)
    stamp = (out / "profiles" / "small" / "profile.json").stat().st_mtime_ns
    sweep.build_profiles(out)
    assert (out / "profiles" / "small" / "profile.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("profiles, needle", [
    ({"a": {"width": 8}}, "must be a table that sets at least model"),
    ({"a/b": {"model": "mlp"}}, "names a directory"),
    ({"a": {"model": "mlp", "step_sm": 3}}, "unknown key(s) step_sm"),
])
def test_bad_profiles_name_the_fix(profiles, needle):
    with pytest.raises(ConfigError) as e:
        Sweep(name="t", grid={"strategy": ["single"]}, profiles=profiles)
    assert needle in str(e.value)


def test_a_profile_that_cannot_be_built_names_the_table(tmp_path):
    sweep = Sweep(name="t", grid={"strategy": ["single"]},
                  profiles={"p": {"model": "mlp", "batch_size": 8}})  # no times
    with pytest.raises(ConfigError, match=r"\[profiles.p\]: --on-paper needs"):
        sweep.build_profiles(tmp_path)


@pytest.mark.parametrize("models, needle", [
    ([{"width": 8}], "must set model"),
    ([{"model": "mlp", "colour": 1}], "must set model"),
    ([{"model": "mlp"}, {"model": "mlp", "width": 2}], "names a value twice"),
])
def test_bad_grid_tables_name_the_fix(models, needle):
    with pytest.raises(ConfigError, match=needle):
        Sweep(name="t", grid={"model": models})


@pytest.mark.parametrize("cases, needle", [
    ([{"case": "a"}, "b"], "names cases when every value"),
    ([{"case": "a", "colour": 1}], "must set case"),
    ([{"case": "a"}, {"case": "a", "steps": 2}], "names a value twice"),
])
def test_bad_cases_name_the_fix(cases, needle):
    with pytest.raises(ConfigError, match=needle):
        Sweep(name="t", grid={"case": cases})


@pytest.mark.parametrize("grid, needle", [
    ({"strategy": ["single"], "colour": [1]}, "unknown key(s) colour"),
    ({"strategy": "single"}, "must be a non-empty list"),
    ({"strategy": ["nope"]}, "valid strategy names are"),
    ({"strategy": ["allreduce"], "workers": [3], "batch_size": [64]}, "not a valid run"),
    ({"strategy": ["single"], "out": ["x"]}, "chosen per point"),
])
def test_bad_definitions_name_the_fix(tmp_path, grid, needle):
    with pytest.raises(ConfigError, match=None) as e:
        Sweep.load(write_spec(tmp_path / "s.toml", grid)).points(tmp_path / "o")
    assert needle in str(e.value)


def test_bad_toml_is_a_config_error(tmp_path):
    (tmp_path / "bad.toml").write_text("repeats = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Sweep.load(tmp_path / "bad.toml")


@pytest.mark.timeout(300)
def test_sweep_records_a_failure_goes_on_resumes_and_reports(tmp_path):
    spec = write_spec(tmp_path / "tiny.toml", {"strategy": ["single", "allreduce", "ps",
                                                            "async-ps", "faulty"],
                                               "workers": [2]}, base={"batch_size": 16})
    out = tmp_path / "sweep"
    env = env_with_plugins()
    proc = psring("sweep", spec, "--out", out, env=env, check=False, timeout=240)
    assert proc.returncode == 1, proc.stderr  # one point failed, the others ran
    assert "1 failed" in proc.stderr
    status = {p.name: json.loads((p / "point.json").read_text())
              for p in out.iterdir() if (p / "point.json").exists()}
    assert len(status) == 5
    failed = [s for s in status.values() if s["status"] != "ok"]
    assert [s["config"]["strategy"] for s in failed] == ["faulty"]
    assert "injected failure in worker 1" in failed[0]["error"]
    assert_no_processes(out)

    # the report: one row per finished strategy, values read back from the logs
    report = (out / "report.md").read_text()
    assert "## Points that did not finish" in report and "faulty" in report
    rows = {r["strategy"]: r for r in json.loads((out / "report.json").read_text())}
    assert sorted(rows) == ["allreduce", "async-ps", "ps", "single"]
    for name, row in rows.items():
        run = next(out / pid for pid, s in status.items() if s["config"]["strategy"] == name)
        assert row["samples_per_s"]["median"] == pytest.approx(summarize(run)["samples_per_s"])
        assert f"| {name} (workers=" in report
    assert rows["single"]["speedup"] == pytest.approx(1.0)
    assert rows["allreduce"]["speedup"] > 0
    assert rows["async-ps"]["comm_ms"]["median"] > 0
    for png in ("breakdown.png", "loss.png", "staleness.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, png
    assert "## Staleness" in report

    # resume: finished points are not run again, the failed one is retried
    mtimes = {pid: (out / pid / "steps.jsonl").stat().st_mtime_ns
              for pid, s in status.items() if s["status"] == "ok"}
    proc = psring("sweep", spec, "--out", out, "--no-report", env=env, check=False,
                  timeout=120)
    assert proc.returncode == 1
    assert "1 point(s) run, 4 already done" in proc.stderr
    assert mtimes == {pid: (out / pid / "steps.jsonl").stat().st_mtime_ns for pid in mtimes}
    assert_no_processes(out)


@pytest.mark.timeout(240)
def test_interrupted_sweep_stops_cleanly_and_resumes(tmp_path):
    # the second point would run for minutes: it is surely running when interrupted
    spec = write_spec(tmp_path / "two.toml", {"strategy": ["ps"], "workers": [2],
                                              "steps": [20, 1000000]},
                      base={"batch_size": 16})
    out = tmp_path / "sweep"
    p = zygote.start(["sweep", spec, "--out", out], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    try:
        # wait until the first point is done and the second has started stepping
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [d for d in out.glob("*/point.json")]
            running = [d for d in out.glob("*/steps.jsonl")
                       if not (d.parent / "point.json").exists()]
            if done and running:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sweep did not get to its second point")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert_no_processes(out)
    first = done[0].parent
    assert json.loads(done[0].read_text())["status"] == "ok"
    interrupted = running[0].parent
    assert not (interrupted / "point.json").exists()  # not marked done

    # resume with the long point shortened (a new point id): the finished one is skipped
    stamp = (first / "steps.jsonl").stat().st_mtime_ns
    write_spec(spec, {"strategy": ["ps"], "workers": [2], "steps": [20, 30]},
               base={"batch_size": 16})
    proc = psring("sweep", spec, "--out", out, "--no-report", timeout=180)
    assert "1 point(s) run, 1 already done" in proc.stderr
    assert (first / "steps.jsonl").stat().st_mtime_ns == stamp
    assert json.loads((out / "strategy=ps_workers=2_steps=30_r0" / "point.json").read_text()
                      )["status"] == "ok"
    assert_no_processes(out)


def test_every_shipped_experiment_is_a_valid_sweep(tmp_path):
    from psring.runs.compare import SPEC, default_sweep

    root = Path(__file__).resolve().parents[2] / "experiments"
    specs = sorted(root.glob("*.toml")) + [SPEC]
    assert len(specs) >= 6
    # psring compare runs its own definition (once, a moved path made it run another)
    mine, theirs = default_sweep(workers=4), Sweep.load(SPEC)
    assert (mine.description, mine.look_at, mine.base) == \
        (theirs.description, theirs.look_at, theirs.base) and mine.description.strip()
    for spec in specs:
        sweep = Sweep.load(spec)
        assert sweep.description.strip() and sweep.look_at.strip(), spec
        assert sweep.points(tmp_path / spec.stem), spec
    assert os.path.exists(root / "README.md")


def test_a_relative_device_profile_is_read_beside_the_definition(tmp_path, monkeypatch):
    from psring.records.profile import Profile
    from psring.train.models import ModelSettings, build_model

    home = tmp_path / "defs"
    model = build_model("mlp", ModelSettings(features=16, width=32, depth=1), seed=0)[0]
    sizes = [p.numel() * 4 for p in model.parameters()]
    Profile.on_paper(sizes, 0.01, 0.02, batch_size=8).save(home / "profs" / "p.json")
    spec = write_spec(home / "dev.toml", {"strategy": ["allreduce"]},
                      base={"compute": "device", "device_profile": "profs/p.json",
                            "workers": 2, "batch_size": 16})
    monkeypatch.chdir(tmp_path)  # not the definition's folder
    (point,) = Sweep.load(spec).points(tmp_path / "out")
    assert point.config.device_profile == str(home / "profs" / "p.json")


def test_a_changed_sweep_still_reads_its_profiles_beside_the_definition(tmp_path,
                                                                        monkeypatch):
    """--repeats (and compare's grid) change a loaded sweep; its relative profile paths
    are still read from the definition's folder, whatever the current one."""
    root = Path(__file__).resolve().parents[2] / "experiments"
    monkeypatch.chdir(tmp_path)
    sweep = Sweep.load(root / "seeds_horovod_h100.toml").changed(repeats=2)
    points = sweep.points(tmp_path / "out")
    assert len(points) == 2 * 9
    assert all(p.config.device_profile.startswith(str(root / "profiles" / "h100"))
               for p in points if p.config.device_profile)
