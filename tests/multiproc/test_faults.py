"""Faults from the command line (--kill-worker, --kill-server) and restarts from the last
checkpoint (--max-restarts): bad flags refused before anything starts; a killed worker
fails the run naming the fault; a run killed twice and restarted ends with exactly the
parameters of one never killed; nothing is left running."""

from __future__ import annotations

import json

import pytest

from psring.config import RunConfig
from psring.runtime import faults
from psring.train import checkpoint
from tests.helpers import (
    SMALL,
    Node,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    psring,
    psring_together,
    read_steps,
    start_server_process,
    user_env,
    wait_all,
)


@pytest.mark.parametrize("args, words", [
    (["--workers", 2, "--kill-worker", "2:3"], "the worker is 0..1 and the step 1..11"),
    (["--workers", 2, "--kill-worker", "1:0"], "a fault at step STEP lets step STEP - 1"),
    (["--workers", 2, "--kill-worker", "1:12"], "the run has 12 steps"),
    (["--workers", 2, "--kill-worker", "one"], "must be I:STEP"),
    (["--workers", 2, "--max-restarts", 1], "add --checkpoint-every N"),
    (["--workers", 2, "--max-restarts", -1], "--max-restarts must be >= 0"),
    (["--workers", 2, "--backup-workers", 2], "B is 0..1"),
    (["--workers", 2, "--kill-worker", "1:3,1:5"], "names worker 1 more than once"),
    (["--workers", 2, "--strategy", "ps", "--backup-workers", 1, "--worker-batch", "24,8"],
     "Drop one of them"),
    (["--workers", 2, "--backup-workers", 1], "use --strategy ps"),
    (["--workers", 2, "--kill-server", "0:3"], "'allreduce' uses none"),
    (["--workers", 2, "--strategy", "ps", "--server-addrs", "tcp://127.0.0.1:5999",
      "--kill-server", "0:3"], "drop one of the two"),
])
def test_a_fault_that_cannot_apply_is_refused_before_anything_starts(tmp_path, args, words):
    out = tmp_path / "run"
    res = cli_here("run", "--strategy", "allreduce", *SMALL, *args, "--out", out)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert words in err and "\n\n" not in err and "Traceback" not in err, err
    assert not out.exists()


def test_fault_flags_repeat_and_travel_to_the_workers():
    from psring.cli import build_parser

    args = build_parser().parse_args(["run", "--workers", "4", "--strategy", "ps",
                                      "--servers", "2", "--kill-worker", "1:5",
                                      "--kill-worker", "2:7,3:8", "--kill-server", "1:6"])
    from psring.config.flags import config_from_args

    cfg = config_from_args(args)
    assert cfg.faults == (("worker", 1, 5), ("worker", 2, 7), ("worker", 3, 8),
                          ("server", 1, 6))
    assert faults.stops_at(cfg, 2) == {7} and faults.stops_at(cfg, 0) == {6}  # (server's)
    # what a worker process parses back (RunConfig.to_argv)
    again = config_from_args(build_parser().parse_args(["run", *cfg.to_argv()]))
    assert again.faults == cfg.faults
    left = faults.without(cfg, {faults.Fault("worker", 2, 7)})
    assert left.faults == (("worker", 1, 5), ("worker", 3, 8), ("server", 1, 6))
    assert RunConfig().faults == ()


@pytest.mark.timeout(120)
def test_a_killed_worker_fails_the_run_naming_the_fault(tmp_path):
    out = tmp_path / "run"
    res = psring("run", "--strategy", "allreduce", "--workers", 2, *SMALL,
                 "--kill-worker", "1:4", "--out", out, check=False, timeout=100)
    assert res.returncode != 0
    assert "worker-1 failed (killed by SIGKILL)" in res.stderr, res.stderr
    assert "--kill-worker 1:4 placed it" in res.stderr and "--max-restarts" in res.stderr
    # it never finished step 4, and began nothing after it
    assert max(r["step"] for r in read_steps(out) if r["worker"] == 1) == 3
    fired = [json.loads(x) for x in (out / faults.FAULTS).read_text().splitlines()]
    assert [(f["fault"], f["process"]) for f in fired] == [("--kill-worker 1:4", "worker-1")]
    assert not (out / faults.RESTARTS).exists()
    assert_no_processes(out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, extra, kills", [
    ("allreduce", [], ["--kill-worker", "1:5", "--kill-worker", "0:10"]),
    ("ps", ["--servers", 2], ["--kill-worker", "1:5", "--kill-server", "1:10"]),
])
def test_a_run_killed_twice_restarts_to_the_uninterrupted_parameters(tmp_path, strategy,
                                                                      extra, kills):
    args = ["run", "--strategy", strategy, "--workers", 2, *SMALL, *extra,
            "--checkpoint-every", 3]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    _, res = psring_together([*args, "--out", ref],
                             [*args, *kills, "--max-restarts", 2, "--out", out],
                             timeout=200)
    assert res.stderr.count("psring: restart ") == 2, res.stderr
    restarts = [json.loads(x) for x in (out / faults.RESTARTS).read_text().splitlines()]
    assert [r["attempt"] for r in restarts] == [1, 2]
    # killed at step 5: back to the checkpoint of step 3; at step 10: to step 9
    assert [r["resumed_from"] for r in restarts] == [3, 9]
    assert all(r["steps_redone"] >= 1 for r in restarts), restarts
    assert len((out / faults.FAULTS).read_text().splitlines()) == 2  # each fired once
    # every step exactly once per worker, and exactly the uninterrupted parameters
    assert sorted((r["step"], r["worker"]) for r in read_steps(out)) == \
        [(s, w) for s in range(12) for w in range(2)]
    assert max_rel_diff(load_model(out), load_model(ref)) == 0.0
    assert_no_processes(out)
    report = cli_here("report", out).stdout
    assert " ".join(kills[:2]) in report and " ".join(kills[2:]) in report, report
    assert "2 restart(s) from checkpoints" in report, report


@pytest.mark.timeout(120)
def test_without_a_checkpoint_yet_a_restart_starts_over(tmp_path):
    out = tmp_path / "run"
    psring("run", "--strategy", "allreduce", "--workers", 2, *SMALL, "--checkpoint-every",
           10, "--kill-worker", "0:2", "--max-restarts", 1, "--out", out, timeout=100)
    (restart,) = [json.loads(x) for x in (out / faults.RESTARTS).read_text().splitlines()]
    assert restart["resumed_from"] == 0 and restart["steps_redone"] == 2
    assert sorted((r["step"], r["worker"]) for r in read_steps(out)) == \
        [(s, w) for s in range(12) for w in range(2)]
    assert_no_processes(out)


@pytest.mark.timeout(120)
def test_async_ps_goes_on_past_a_killed_worker(tmp_path):
    """async-ps never waits for a worker's update: worker 1 killed at step 4, the
    survivors finish every step and worker 0 writes the model; with --max-staleness
    (whose bound would wait for the lost worker) the same loss fails the run."""
    out = tmp_path / "run"
    res = psring("run", "--strategy", "async-ps", "--workers", 3, *SMALL, "--batch-size", 48,
                 "--kill-worker", "1:4", "--out", out, timeout=100)
    assert "worker-1 lost (killed by SIGKILL); the run goes on without it" in res.stderr
    steps = read_steps(out)
    assert max(r["step"] for r in steps if r["worker"] == 1) == 3
    for w in (0, 2):
        assert sorted(r["step"] for r in steps if r["worker"] == w) == list(range(12))
    assert (out / "model.pt").exists()
    assert "faults --kill-worker 1:4; went on without worker-1" in cli_here("report", out).stdout
    assert_no_processes(out)
    from psring.strategies import STRATEGIES

    caps = STRATEGIES.get("async-ps").caps
    cfg = RunConfig(strategy="async-ps", workers=3, batch_size=48)
    assert caps.may_lose(cfg, "worker-2") and not caps.may_lose(cfg, "worker-0")
    assert not caps.may_lose(cfg, "server-0")
    assert not caps.may_lose(cfg.replace(max_staleness=2), "worker-2")
    assert not STRATEGIES.get("ps").caps.may_lose(cfg, "worker-2")


def test_without_psring_runs_launcher_a_worker_kills_itself_and_records_it(tmp_path):
    """Under torchrun no launcher would act on a stopped worker: it records its fault
    and dies at once (SIGKILL), and a restart of it does not meet the fault again."""
    import os
    import subprocess
    import sys

    code = ("from psring.config import RunConfig; from psring.runtime import faults; "
            f"cfg = RunConfig(workers=2, strategy='allreduce', steps=5, kill_worker='1:3', "
            f"out={str(tmp_path)!r}); faults.stop_here(cfg, 1, 3); print('alive')")
    env = {k: v for k, v in os.environ.items() if k != "PSRING_PARENT_PID"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == -9 and "alive" not in res.stdout, res
    (fired,) = [json.loads(x) for x in (tmp_path / faults.FAULTS).read_text().splitlines()]
    assert fired["fault"] == "--kill-worker 1:3" and fired["process"] == "worker-1"
    cfg = RunConfig(workers=2, strategy="allreduce", steps=5, kill_worker="1:3",
                    out=str(tmp_path))
    assert faults.stops_at(cfg, 1) == set()


@pytest.mark.timeout(120)
def test_backup_workers_drop_the_last_worker_and_go_on_past_a_lost_one(tmp_path):
    """ps, 3 workers, --backup-workers 1: every step takes two workers' gradients and
    logs the third as dropped; with worker 2 killed at step 4 the other two finish the
    run. --backup-workers 0 is the plain synchronous PS, parameter for parameter."""
    args = ["run", "--strategy", "ps", "--workers", 3, *SMALL, "--batch-size", 48,
            "--servers", 2]
    plain, zero, backed = tmp_path / "plain", tmp_path / "zero", tmp_path / "backed"
    psring_together([*args, "--out", plain], [*args, "--backup-workers", 0, "--out", zero])
    assert max_rel_diff(load_model(zero), load_model(plain)) == 0.0
    res = psring(*args, "--backup-workers", 1, "--kill-worker", "2:4", "--out", backed,
                 timeout=100)
    assert "worker-2 lost (killed by SIGKILL); the run goes on without it" in res.stderr
    steps = read_steps(backed)
    # each of the servers' steps took two workers' gradients (a worker dropped late may
    # compute its next step on a newer version: records name the version, "version")
    for v in range(12):
        assert sum(not r["dropped"] for r in steps if r["version"] == v) == 2, v
    assert any(r["dropped"] for r in steps if r["version"] < 4)  # while all three pushed
    for w in (0, 1):
        assert sorted(r["step"] for r in steps if r["worker"] == w) == list(range(12))
    assert max(r["step"] for r in steps if r["worker"] == 2) == 3
    assert (backed / "model.pt").exists()
    # the servers log whom each step took: two workers, the same on both shards
    took = [json.loads(x) for x in (backed / "servers.jsonl").read_text().splitlines()]
    chosen = {(r["server"], r["step"]): r["chosen"] for r in took if "chosen" in r}
    assert all(len(c) == 2 for c in chosen.values()) and len(chosen) >= 2 * 12
    assert_no_processes(backed)


@pytest.mark.timeout(120)
def test_backup_workers_take_checkpoints_and_restart_after_a_lost_server(tmp_path):
    """ps, 3 workers, --backup-workers 1, worker 0 twice as slow (the servers go on
    without it, so its loop trails their version): checkpoints are of the servers'
    version, server 1 killed as worker 0 begins its step 6 restarts the run from the
    newest one; each of the servers' steps took two workers once, and no worker logs a
    step twice (the trailing one skips those of its steps the servers had passed).
    (Killed early: were the servers done by then, there would be nothing to restart;
    60 steps, so that they are not even when a loaded machine starves worker 0: with
    30, CI once saw them done first.)"""
    out, n = tmp_path / "run", 60
    res = psring("run", "--strategy", "ps", "--workers", 3, *SMALL, "--batch-size", 48,
                 "--steps", n, "--servers", 2, "--backup-workers", 1, "--slow-worker", "0:2",
                 "--checkpoint-every", 2, "--kill-server", "1:6", "--max-restarts", 1,
                 "--out", out, timeout=100)
    (restart,) = [json.loads(x) for x in (out / faults.RESTARTS).read_text().splitlines()]
    assert restart["resumed_from"] % 2 == 0 and 6 <= restart["resumed_from"] < n, restart
    steps = read_steps(out)
    for v in range(n):
        assert sum(not r["dropped"] for r in steps if r["version"] == v) == 2, v
    for w in range(3):
        mine = [r["step"] for r in steps if r["worker"] == w]
        assert len(mine) == len(set(mine)) and mine[-1] == n - 1, (w, mine)
    assert checkpoint.usable_steps(out)[0] == n
    assert "1 restart(s) from checkpoints" in res.stdout
    assert_no_processes(out)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_torchrun_restarts_resume_every_host_from_its_own_checkpoint(tmp_path, small_runs,
                                                                     strategy):
    """Two torchrun nodes (each its own --out, as hosts have), torchrun's and psring's
    --max-restarts: worker 1 is killed at step 5; torchrun restarts both workers (node
    0's sees the newer attempt begin: a ps worker waits on its servers, not on worker
    1), every host resumes from step 3, and the run ends as the uninterrupted one.
    allreduce: each host from its own checkpoint; ps (a standalone server, as
    docs/multihost.md runs it): rank 0 re-initializes the server from node 0's."""
    server, extra = None, []
    if strategy == "ps":
        server, addr = start_server_process()
        extra = ["--server-addrs", addr]
    try:
        dirs = _torchrun_two_nodes(tmp_path, ["--strategy", strategy, *extra, *SMALL,
                                              "--checkpoint-every", "3", "--max-restarts",
                                              "1", "--kill-worker", "1:5"])
    finally:
        if server is not None:
            server.kill()
            server.wait()
    for out in dirs:
        (restart,) = [json.loads(x) for x in (out / faults.RESTARTS).read_text().splitlines()]
        assert restart["resumed_from"] == 3 and restart["steps_redone"] >= 2, restart
        assert sorted(r["step"] for r in read_steps(out)) == list(range(12))
    assert "worker-1 killed by --kill-worker 1:5" in (dirs[1] / faults.RESTARTS).read_text()
    # each host wrote its own checkpoints where its state is its own (ps: in the server)
    assert checkpoint.usable_steps(dirs[0]) == [12, 9]
    assert checkpoint.usable_steps(dirs[1]) == ([12, 9] if strategy == "allreduce" else [])
    diff = max_rel_diff(load_model(dirs[0]), load_model(small_runs["allreduce"]))
    # (allreduce is psring run's allreduce bit for bit; ps sums in another order)
    assert diff == 0.0 if strategy == "allreduce" else diff < 1e-5, diff
    merged = tmp_path / "merged"
    psring("merge", *dirs, "--out", merged)
    assert "1 restart(s) from checkpoints" in cli_here("report", merged).stdout
    assert_no_processes(tmp_path)


def _torchrun_two_nodes(tmp_path, worker_args: list[str]) -> list:
    """docs/multihost.md's command on two torchrun nodes of this machine (one thread a
    worker, as psring run gives 2 workers on 2 cores), torchrun restarting once; both
    must succeed. Their run directories."""
    import subprocess
    import sys
    from pathlib import Path

    from psring.runtime.process import free_port

    # --timeout 60: a restarted worker's start (a torch import) has taken 30 s beside the
    # examples test's seventeen runs on the 2 cores, and its peer gave up at 30
    port, dirs, nodes = free_port("127.0.0.1"), [tmp_path / "host0", tmp_path / "host1"], []
    for i, out in enumerate(dirs):
        log = tmp_path / f"node{i}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--node-rank",
                 str(i), "--nproc-per-node", "1", "--max-restarts", "1", "--master-addr",
                 "127.0.0.1", "--master-port", str(port), "--rdzv-conf", "timeout=60",
                 "-m", "psring.workers", *worker_args, "--threads", "1", "--timeout", "60",
                 "--out", str(out)],
                env=user_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        nodes.append(Node(proc, log))
    wait_all(nodes, nodes[0].started + 120)
    assert [n.proc.returncode for n in nodes] == [0, 0], [n.output[-3000:] for n in nodes]
    return dirs
