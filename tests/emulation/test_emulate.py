"""Emulated clusters (psring.cluster.emulate): hosts as network namespaces, links shaped by tbf.

What is checked: the flags' syntax and placement rules; that a run's gradients really
cross the emulated links (communication at least bytes / RATE, and shorter at a tenfold
rate); that synchronous strategies still train exactly single's model; that nothing of
a cluster outlives its run however the run ends; that a cut link fails a run within
--timeout naming the host; and the refusals (exit 2, one paragraph)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics as st
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from psring import units
from psring.cluster import emulate, netns, shaping
from psring.cluster import spec as clusters
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from tests.helpers import (
    PSRING,
    SMALL,
    assert_cluster_gone,
    assert_no_processes,
    cli_here,
    cluster_state,
    cut_link,
    load_model,
    max_rel_diff,
    needs_emulation,
    process_named,
    psring,
    read_steps,
    zygote,
)

# -- the flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, bits", [
    ("100mbit", 1e8), ("1gbit", 1e9), ("1.5Gbit", 1.5e9), ("10gbit", 1e10),
    ("125mbps", 1e9), ("1mibit", 2**20), ("2.5GBIT", 2.5e9)])
def test_rates_take_tc_syntax(text, bits):
    assert units.parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["", "fast", "100", "1gigabit", "100mb", "-1gbit",
                                  "1 gbit extra", "500kbit"])
def test_a_rate_that_is_not_one_is_refused(text):
    with pytest.raises(ConfigError, match="--link"):
        units.parse_rate(text)


def test_delays_take_tc_syntax():
    assert units.parse_delay("100us") == pytest.approx(1e-4)
    assert units.parse_delay("2ms") == pytest.approx(2e-3)
    with pytest.raises(ConfigError, match="--delay"):
        units.parse_delay("2")


def test_token_bucket_is_a_millisecond_of_the_rate_and_the_queue_deep():
    for bits in (1e8, 5e8, 1e9, 1e10):
        burst, limit = shaping.tbf_params(bits)
        assert burst == max(int(bits / 8 / 1000), shaping.GSO_BURST)
        assert burst > 2**16  # tbf never splits a 64 KiB GSO packet (shaping.tbf_params)
        assert limit >= 4 * 2**20 and limit >= bits / 8 * 0.1


def test_a_shallow_ports_bucket_splits_gso_sends_into_frames():
    # a 64 KiB segmented UDP send (bounded loss) must queue as frames at a 64 KB port:
    # counted whole it exceeds the port and every such send is lost (a resend livelock)
    for bits in (1e8, 1e9):
        burst, limit = shaping.tbf_params(bits, 65536)
        assert limit == 65536 and 1514 <= burst < 2**16
    assert shaping.tbf_params(1e9, 3028) == (3028, 3028)


def plan(**kw) -> clusters.Cluster:
    return RunConfig(**kw).cluster


def test_workers_are_spread_evenly_and_servers_colocated_by_default():
    p = plan(strategy="ps", workers=5, hosts=2, servers=3, batch_size=60, link="1gbit")
    assert p.worker_host == (0, 0, 0, 1, 1)
    assert p.server_host == (0, 1, 0)
    assert [h.address for h in p.host_list] == ["198.18.0.1", "198.18.0.2"]
    assert p.host_list[0].processes == ["worker-0", "worker-1", "worker-2", "server-0",
                                        "server-2"]
    assert p.local_ranks(3) == (0, 2) and p.local_ranks(2) == (2, 3)
    assert p.master_addr == "198.18.0.1"
    assert p.text() == "2 hosts, 1gbit links, servers colocated"


def test_servers_on_own_hosts_get_hosts_of_their_own():
    p = plan(strategy="ps", workers=4, hosts=4, servers=2, server_placement="own-hosts",
             link="100mbit")
    assert len(p.host_list) == 6 and p.server_host == (4, 5)
    assert p.host_list[5].processes == ["server-1"]
    assert p.text() == "4 hosts + 2 server hosts, 100mbit links, servers own-hosts"
    # own hosts need an emulated network even for the workers' single host
    assert plan(strategy="ps", workers=2, server_placement="own-hosts").emulated


def test_workers_per_host_fills_hosts_in_rank_order_and_derives_their_number():
    cfg = validate(RunConfig(strategy="allreduce", workers=4, workers_per_host=1, link="1gbit"))
    assert cfg.hosts == 4
    p = plan(strategy="allreduce", workers=5, hosts=2, workers_per_host=3, batch_size=60)
    assert p.worker_host == (0, 0, 0, 1, 1)
    assert not plan(strategy="allreduce", workers=2).emulated
    assert plan(strategy="allreduce", workers=2).text() == "this machine"


@pytest.mark.parametrize("kw, needle", [
    (dict(strategy="allreduce", workers=2, hosts=3), "--hosts 3 is more than --workers 2"),
    (dict(strategy="hogwild", workers=2, hosts=2), "one host by definition"),
    (dict(strategy="allreduce", workers=2, hosts=2, link="1gigabit"), "not a rate"),
    (dict(strategy="allreduce", workers=2, link="1gbit"), "nothing crosses one"),
    (dict(strategy="allreduce", workers=4, hosts=2, workers_per_host=1),
     "does not fit --workers 4"),
    (dict(strategy="allreduce", workers=4, hosts=3, workers_per_host=2),
     "leave a host empty"),
    (dict(strategy="allreduce", workers=2, hosts=2, server_placement="own-hosts"),
     "applies to parameter-server strategies"),
    (dict(strategy="ps", workers=2, hosts=2, server_addrs="tcp://10.0.0.5:5555"),
     "emulated hosts reach only each other"),
    (dict(strategy="allreduce", workers=2, hosts=2, master_addr="10.0.0.1"),
     "--master-addr is chosen by the emulated cluster"),
])
def test_cluster_flags_are_validated(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(RunConfig(**kw))


def test_sweeps_drop_cluster_settings_that_cannot_apply(tmp_path):
    from psring.runs.sweep import Sweep

    sweep = Sweep(name="t", base={"steps": 2, "link": "1gbit", "hosts": 2,
                                  "server_placement": "own-hosts", "batch_size": 64},
                  grid={"strategy": ["single", "hogwild", "allreduce", "ps"], "workers": [2]})
    cfgs = {p.config.strategy: p.config for p in sweep.points(tmp_path)}
    assert (cfgs["single"].hosts, cfgs["single"].link) == (1, "")
    assert (cfgs["hogwild"].hosts, cfgs["hogwild"].link) == (1, "")
    assert (cfgs["allreduce"].hosts, cfgs["allreduce"].server_placement) == (2, "colocated")
    assert (cfgs["ps"].hosts, cfgs["ps"].server_placement, cfgs["ps"].link) == \
        (2, "own-hosts", "1gbit")
    # G per host decides the hosts: 3 workers, 2 per host -> 2 hosts (not 3 of 4 asked)
    sweep = Sweep(name="t", base={"steps": 2, "hosts": 4, "workers_per_host": 2,
                                  "link": "1gbit", "batch_size": 60},
                  grid={"strategy": ["allreduce"], "workers": [3]})
    assert [(p.config.hosts, p.config.workers_per_host)
            for p in sweep.points(tmp_path)] == [(2, 2)]


def test_port_bytes_reads_this_namespaces_counters():
    before = netns.port_bytes({"lo", "no-such-port"})
    assert set(before) == {"lo"} and all(isinstance(x, int) for x in before["lo"])
    import socket
    with socket.create_server(("127.0.0.1", 0)) as srv:
        c = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
        c.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(a.recv(65536))
        c.close()
        a.close()
    after = netns.port_bytes({"lo"})
    assert after["lo"][0] - before["lo"][0] >= 100_000  # (loopback: received = sent)


def test_link_events_are_read_from_rtnetlink_messages():
    def newlink(name: str, flags: int) -> bytes:
        attr = name.encode() + b"\0"
        rta = struct.pack("=HH", 4 + len(attr), 3) + attr
        rta += b"\0" * (-len(rta) % 4)
        body = struct.pack("=BxHiII", 0, 1, 7, flags, 0) + rta
        return struct.pack("=IHHII", 16 + len(body), 16, 0, 0, 0) + body

    up, lower_up = 0x1, 0x10000
    data = newlink("psr-h1", up | lower_up) + newlink("psr-h2", up) + newlink("eth0", 0)
    assert list(netns.link_events(data)) == [("psr-h1", True), ("psr-h2", False),
                                                ("eth0", False)]


def test_the_machines_own_namespace_is_not_inside_a_cluster(monkeypatch):
    # where a server may listen without a secret: only inside an emulated host; here
    # not even when the launcher's mark names this namespace
    assert not netns.namespace_is_isolated()
    monkeypatch.setenv(netns.NETNS_ENV, str(os.stat("/proc/self/ns/net").st_ino))
    assert not netns.inside_cluster()


@needs_emulation
@pytest.mark.timeout(60)
def test_only_a_placed_process_on_an_emulated_host_counts_as_inside_it():
    probe = [sys.executable, "-c", "from psring.cluster.netns import namespace_is_isolated, "
             "inside_cluster; print(namespace_is_isolated(), inside_cluster())"]
    with emulate.standalone(2, "1gbit") as cluster:
        def run(env: dict) -> str:
            base = {k: v for k, v in os.environ.items() if k != netns.NETNS_ENV}
            return subprocess.run(cluster.command("host-1", probe), env={**base, **env},
                                  capture_output=True, text=True, timeout=30).stdout.strip()

        assert run(cluster.environment("host-1")) == "True True"
        assert run({}) == "True False"  # not placed there by psring: a secret is needed
        assert run(cluster.environment("host-0")) == "True False"  # another host's mark


# -- refusals, as a user meets them --------------------------------------------------------

def assert_paragraph(proc, *needles):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psring: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["--strategy", "allreduce", "--workers", "2", "--hosts", "3"], "more than --workers 2"),
    (["--strategy", "allreduce", "--workers", "2", "--hosts", "2", "--link", "1gigabit"],
     "is not a rate"),
    (["--strategy", "hogwild", "--workers", "2", "--hosts", "2"], "one host by definition"),
    (["--strategy", "ps", "--workers", "2", "--hosts", "2", "--server-addrs",
      "tcp://198.18.0.9:5555"], "drop --server-addrs"),
    (["--strategy", "allreduce", "--workers", "2", "--hosts", "2", "--master-addr",
      "198.18.0.1"], "--master-addr is chosen by the emulated cluster"),
])
def test_bad_cluster_flags_are_one_paragraph_and_exit_2(tmp_path, args, needle):
    proc = cli_here("run", *args, "--out", tmp_path / "r")
    assert_paragraph(proc, needle)
    assert not (tmp_path / "r" / "steps.jsonl").exists()


def _blocked_dirs(paths: list[Path]) -> dict[Path, set[str]]:
    """Directories an ordinary user cannot enter (no o+x) on the way to ``paths``, each
    with the children the user must reach through it, outermost first."""
    blocked: dict[Path, set[str]] = {}
    for path in paths:
        for parent in reversed(path.parents):
            if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
                blocked.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
    return dict(sorted(blocked.items(), key=lambda kv: len(kv[0].parts)))


def _as_ordinary_user(argv: list[str], home: Path) -> list[str]:
    """argv run as uid 65534 without privileges. What it needs (the interpreter, the
    virtual environment, psring's source for an editable install) may live under
    directories only root can enter: root's home, or a checkout in a ``mktemp -d``
    directory (both mode 700). Then a private mount namespace, for this command only,
    mounts over each such directory (outermost first) a 755 directory holding bind
    mounts of just the children on those paths."""
    import psring
    import psring.workers

    needed = [Path(os.path.realpath(sys.executable)), Path(sys.prefix).resolve(),
              Path(psring.__file__).resolve().parent,
              Path(psring.workers.__file__).resolve().parent]
    run = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env",
           f"HOME={home}", *argv]
    blocked = _blocked_dirs(needed)
    if not blocked:
        return run
    script = ["set -e"]
    for directory, children in blocked.items():
        script.append('X=$(mktemp -d); chmod 755 "$X"')
        for child in sorted(children):
            make = "mkdir -p" if (directory / child).is_dir() else "touch"
            script.append(f'{make} "$X/{child}"; mount --bind "{directory / child}" "$X/{child}"')
        # recursively: what was bound above may itself be overlaid by a later line
        script.append(f'mount --rbind "$X" "{directory}"')
    script.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "; ".join(script),
            "sh", *run]


@pytest.mark.untimed  # (a refusal: nothing timed)
@needs_emulation
@pytest.mark.timeout(60)
def test_without_permission_the_refusal_names_what_is_missing(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("staging a kernel that refuses namespaces needs root")
    out = tmp_path / "r"
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c",
         'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --inh-caps=-all '
         '--bounding-set=-all "$@"', "sh",
         *PSRING, "run", "--strategy", "allreduce", "--workers", "2", "--hosts", "2",
         "--link", "1gbit", *SMALL, "--out", str(out)],
        capture_output=True, text=True, timeout=50)
    assert_paragraph(proc, "cannot create the emulated cluster's network namespaces",
                     "user namespace", "run as root", "max_user_namespaces")
    assert not (out / "steps.jsonl").exists()
    assert_no_processes(out)


@pytest.mark.untimed  # (ownership and hosts checked, nothing timed)
@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_ordinary_user_gets_the_cluster_inside_a_user_namespace(tmp_path, request):
    if os.geteuid() != 0:
        pytest.skip("becoming an ordinary user for the test needs root")
    probe = subprocess.run(_as_ordinary_user(["unshare", "--user", "--net",
                                              "--map-root-user", "true"], tmp_path),
                           capture_output=True, text=True, timeout=30, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"this kernel gives ordinary users no user namespaces "
                    f"({probe.stderr.strip()}); the refusal is tested above")
    # a directory the user may write (pytest's own lie under a root-only one)
    home = Path(tempfile.mkdtemp(prefix="psring-user-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    home.chmod(0o777)
    out = home / "r"
    proc = subprocess.run(_as_ordinary_user(
        [*PSRING, "run", "--strategy", "ps", "--workers", "2", "--hosts", "2", "--link",
         "1gbit", *SMALL, "--steps", "4", "--out", str(out)], home),
        capture_output=True, text=True, timeout=100, cwd=home)
    assert proc.returncode == 0, proc.stderr
    state = cluster_state(out)
    assert state["mode"] == "userns"
    assert os.stat(out / "steps.jsonl").st_uid == 65534
    assert {r["host"] for r in read_steps(out)} == {"host-0", "host-1"}
    assert_no_processes(out)
    assert_cluster_gone(out)


# -- runs across emulated links ------------------------------------------------------------

#: 301,066 parameters (1.2 MB): at 100 Mbit/s about 0.1 s of ring all-reduce per step
LINK_BOUND = ("--model", "mlp", "--width", "512", "--depth", "2", "--features", "64",
              "--batch-size", "32", "--steps", "6", "--bucket-mb", "0.25")


def comm_times(run_dir: Path, worker: int) -> list[float]:
    """A worker's communication time per step after the first two, as the report shows
    it (blocked time plus bucket time hidden under backward, less waiting for a slower
    peer)."""
    from psring.report.points import comm_time, peer_waits

    records = read_steps(run_dir)
    waits = peer_waits(records)
    return [comm_time(r, waits.get((r["worker"], r["step"]), 0.0))
            for r in records if r["step"] >= 2 and r["worker"] == worker]


@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_gradients_cross_the_link_at_its_rate(tmp_path, strategy):
    """2 workers on 2 hosts: what worker 1 sends and receives crosses host-1's link
    (allreduce: to and from worker 0; ps: to and from the server, colocated with worker
    0), so its communication takes at least those bytes / RATE each step, and much less
    at ten times the rate."""
    medians = {}
    for rate, bits in (("100mbit", 1e8), ("1gbit", 1e9)):
        out = tmp_path / rate
        psring("run", "--strategy", strategy, "--workers", "2", "--hosts", "2", "--link",
               rate, *LINK_BOUND, "--out", out, timeout=200)
        records = read_steps(out)
        crossing = [r for r in records if r["worker"] == 1 and r["step"] >= 2]
        # tbf lets a full token bucket through at once: a transfer can beat the rate by
        # burst / rate (6 ms at 100 Mbit/s; shaping.tbf_params), and 1 ms of clocks
        slack = shaping.tbf_params(bits)[0] * 8 / bits + 1e-3
        for r in crossing:
            # nothing crosses before the first bucket is launched, and the last one is
            # done only once its bytes have crossed: every step's communication spans at
            # least bytes / RATE, less the slack
            bound = r["bytes_sent"] * 8 / bits
            span = max(r["bucket_done_s"]) - min(r["bucket_launch_s"])
            assert span >= bound - slack, (rate, bound, r)
            # and a synchronous step ends only once they have
            assert r["step_s"] >= bound - slack
        comm = comm_times(out, worker=1)  # as the report shows it
        assert st.median(comm) >= bound - slack, (rate, bound, comm)
        if rate == "100mbit":  # link-bound: not much slower than the rate either (a PS
            # worker's push and then its pull each cross the link)
            crossings = 2 if strategy == "ps" else 1
            assert st.median(comm) <= 1.3 * crossings * bound, (rate, bound, comm)
        medians[rate] = st.median(comm)
        # where each process ran, named in every log
        assert {(r["worker"], r["host"]) for r in records} == {(0, "host-0"), (1, "host-1")}
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["cluster"]["link"] == rate
        assert [h["processes"] for h in manifest["cluster"]["hosts"]][1] == ["worker-1"]
        if strategy == "ps":
            lines = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()]
            assert {x["host"] for x in lines} == {"host-0"}  # colocated with worker 0
        assert_no_processes(out)
        assert_cluster_gone(out)
    assert medians["1gbit"] < 0.5 * medians["100mbit"], medians


@pytest.mark.untimed  # (parameters compared, nothing timed)
@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_synchronous_strategies_train_singles_model_under_emulation(tmp_path, small_runs):
    ref = load_model(small_runs["single"])
    for name, args in (
            ("allreduce", ["--strategy", "allreduce", "--workers", "2", "--hosts", "2"]),
            ("ddp", ["--strategy", "ddp", "--workers", "2", "--hosts", "2"]),
            ("ps-own", ["--strategy", "ps", "--workers", "2", "--hosts", "2", "--servers",
                        "2", "--server-placement", "own-hosts"])):
        out = tmp_path / name
        psring("run", *args, "--link", "1gbit", *SMALL, "--out", out, timeout=200)
        assert max_rel_diff(load_model(out), ref) < 1e-4, name
        assert_no_processes(out)
        assert_cluster_gone(out)


def _start(out: Path, strategy: str, timeout: float = 300) -> subprocess.Popen:
    proc = zygote.start(["run", "--strategy", strategy, "--workers", "2", "--hosts", "2",
                         "--link", "1gbit", *SMALL, "--steps", "100000", "--timeout",
                         timeout, "--out", out], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (out / "steps.jsonl").exists() or (out / "steps.jsonl").stat().st_size < 2000:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run never trained: {proc.communicate()}")
        time.sleep(0.05)
    return proc


def _pid(out: Path, name: str) -> int:
    pid = process_named(out, name)
    assert pid is not None, f"no process {name} of the run in {out}"
    return pid


@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("end, code", [
    ("worker killed", 1), ("server killed", 1), ("SIGINT", 130), ("SIGTERM", 143),
    ("SIGKILL of the launcher", -9)])
def test_nothing_of_the_cluster_outlives_its_run(tmp_path, end, code):
    """Every way a run can end but success, which every test of a successful emulated
    run above checks the same way (assert_cluster_gone)."""
    out = tmp_path / "r"
    proc = _start(out, "ps")
    try:
        if end == "worker killed":
            os.kill(_pid(out, "worker-1"), signal.SIGKILL)
        elif end == "server killed":
            os.kill(_pid(out, "server-0"), signal.SIGKILL)
        else:
            os.kill(proc.pid, {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM,
                               "SIGKILL of the launcher": signal.SIGKILL}[end])
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert_no_processes(out, within=15)
    assert_cluster_gone(out)


@needs_emulation
@pytest.mark.slow
@pytest.mark.untimed  # (a deadline with 15 s of slack for a loaded machine: no link timed)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, lost", [
    ("allreduce", "the other workers' gradients"), ("ps", "parameter server(s) tcp://198.18.0.1")])
def test_a_cut_link_fails_the_run_within_the_timeout_naming_the_host(tmp_path, strategy, lost):
    """A partition only emulation can stage: host-1's interface goes down mid-run."""
    out = tmp_path / "r"
    proc = _start(out, strategy, timeout=5)
    try:
        t0 = time.monotonic()
        cut_link(out, "host-1")
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert 4 < elapsed < 5 + 15, elapsed  # the deadline, then the stop
    assert lost in err, err
    assert "host-1's link (198.18.0.2) went down" in err and "cutting off worker-1" in err
    assert_no_processes(out)
    assert_cluster_gone(out)


@needs_emulation
@pytest.mark.slow
@pytest.mark.untimed  # (the restart's steps and records checked, nothing timed)
@pytest.mark.timeout(150)
def test_a_killed_worker_alone_on_its_host_is_a_host_crash_and_a_restart_recovers(tmp_path):
    """--kill-worker 1:4 on 2 emulated hosts of one worker each: host-1's link goes down,
    then worker-1 is killed; with --max-restarts 1 the run starts again (a fresh cluster)
    from its step-3 checkpoint and finishes; no process, namespace or link is left."""
    out = tmp_path / "r"
    res = psring("run", "--strategy", "allreduce", "--workers", 2, "--hosts", 2, "--link",
                 "1gbit", *SMALL, "--kill-worker", "1:4", "--checkpoint-every", 3,
                 "--max-restarts", 1, "--out", out, timeout=120)
    assert "host-1 crashed (link cut, then worker-1 killed)" in res.stderr, res.stderr
    (fault,) = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines()]
    assert fault["host_down"] == "host-1" and fault["step"] == 4
    (restart,) = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert restart["resumed_from"] == 3 and "worker-1 failed" in restart["cause"]
    assert sorted((r["step"], r["worker"]) for r in read_steps(out)) == \
        [(s, w) for s in range(12) for w in range(2)]
    assert_no_processes(out)
    assert_cluster_gone(out)


# -- calibration across a link, and where reports say points ran --------------------------

def test_reports_say_where_a_point_ran():
    from psring.report.cluster import cluster_text

    assert cluster_text({"strategy": "allreduce", "workers": 2}) == "this machine"
    assert cluster_text({"strategy": "allreduce", "workers": 2, "hosts": 2,
                         "link": "1gbit"}) == "2 hosts, 1gbit links"
    assert cluster_text({"strategy": "ps", "workers": 4, "hosts": 4, "servers": 2,
                         "link": "100mbit", "server_placement": "own-hosts"}) == \
        "4 hosts + 2 server hosts, 100mbit links, servers own-hosts"


@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_calibrate_measures_alpha_and_beta_across_an_emulated_link(tmp_path):
    out = tmp_path / "cal.json"
    # this machine's loopback figures, kept beside the link's (measuring them is
    # tests/multiproc/test_costmodel.py's business)
    loopback = dict(zmq_alpha=2e-5, zmq_beta=3e-10, dist_alpha=3e-5, dist_beta=3e-10,
                    gamma=1e-10)
    from psring.predict.calibration import Calibration

    Calibration(**loopback).save(out)
    proc = psring("calibrate", "--hosts", "2", "--link", "200mbit", "--quick", "--out", out,
                  timeout=170)
    assert "ZeroMQ (200mbit link)" in proc.stdout
    cal = json.loads(out.read_text())
    link = cal["links"]["200mbit"]
    beta = units.payload_beta(2e8)
    # the link, not the loopback, sets β: within 10% of the rate's payload β
    for transport in ("zmq", "dist"):
        assert abs(link[f"{transport}_beta"] / beta - 1) < 0.10, (transport, link)
        assert 0 < link[f"{transport}_alpha"] < 5e-3
    assert {k: cal[k] for k in loopback} == loopback  # the loopback figures are kept
    assert_no_processes("psring-cluster-")
    # and a link needs a rate
    refused = cli_here("calibrate", "--hosts", "2", "--out", out)
    assert_paragraph(refused, "--link 1gbit")


@pytest.mark.untimed  # (a refusal: nothing timed)
@pytest.mark.timeout(60)
def test_a_worker_started_outside_an_emulated_cluster_refuses_cluster_flags(tmp_path):
    """Under torchrun the hosts are real: --hosts there would only mislabel the logs."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    env.pop("PSRING_HOST", None)
    proc = subprocess.run([sys.executable, "-m", "psring.workers", "--strategy", "allreduce",
                           "--hosts", "2", "--link", "1gbit", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "which `psring run` builds" in proc.stderr and "Traceback" not in proc.stderr
