"""psring.runtime.forking: when the launcher forks a run's processes, and that a forked child
behaves as a new ``python -m MODULE`` would (its own log, exit status, environment).
Each check runs in a fresh interpreter: forking from pytest's own process is what the
module refuses to do."""

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import assert_no_processes, zygote

SCRIPT = r"""
import os, sys, threading, time
from pathlib import Path
from psring.runtime import forking
from psring.runtime.process import ProcessSpec, Supervisor

w = [sys.executable, "-m", "psring.workers", "--help"]
print("before allow:", forking.target(w))
forking.allow()
print("after allow:", forking.target(w))
print("other module:", forking.target([sys.executable, "-m", "json.tool"]))
log = Path(sys.argv[1])
sup = Supervisor(log)
bad = sup.start(ProcessSpec("server-0", [sys.executable, "-m", "psring.servers", "--bind",
                                         "nonsense"], env={"PSRING_MARK": "x"}))
ok = sup.start(ProcessSpec("worker-0", w))
for c in (bad, ok):
    c.proc.wait(timeout=60)
print("forked:", type(bad.proc).__name__, "codes:", bad.proc.returncode, ok.proc.returncode)
print("log:", "not a ZeroMQ endpoint" in (log / "server-0.log").read_text(),
      "usage:" in (log / "worker-0.log").read_text())
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
print("with a thread:", forking.target(w))
stop.set(); t.join()
"""


#: a CUDA (or ROCm) build never forks: test_a_gpu_build_of_torch_never_forks
GPU_BUILD = subprocess.run(
    [sys.executable, "-c", "import torch; print(bool(torch.version.cuda or torch.version.hip))"],
    capture_output=True, text=True, timeout=60).stdout.strip() == "True"


@pytest.mark.timeout(120)
@pytest.mark.skipif(GPU_BUILD, reason="this torch is a GPU build, which starts every "
                    "process anew (test_a_gpu_build_of_torch_never_forks)")
def test_the_launcher_forks_only_when_it_is_safe_and_children_behave_as_started_anew(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "before allow: None" in out
    assert "after allow: ('psring.workers', ['--help'])" in out
    assert "other module: None" in out
    # a server refusing its --bind exits 2 (a ConfigError), --help exits 0
    assert "forked: ForkedProcess codes: 2 0" in out
    assert "log: True True" in out
    assert "with a thread: None" in out
    assert_no_processes(str(tmp_path))  # the forked children carry its command line


@pytest.mark.timeout(120)
def test_psring_fork_0_starts_every_process_anew(tmp_path):
    code = ("import sys; from psring.runtime import forking; forking.allow(); "
            "print(forking.target([sys.executable, '-m', 'psring.workers']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env={**os.environ, "PSRING_FORK": "0"})
    assert proc.stdout.strip() == "None", proc.stderr


@pytest.mark.timeout(120)
def test_no_fork_once_torch_came_first(tmp_path):
    """Whatever ran after torch was imported but before allow() may have started its
    thread pools (a model module computing at import): a fork could inherit a lock."""
    code = ("import sys, torch; torch.ones(10**6).mul_(2); from psring.runtime import forking; "
            "forking.allow(); print(forking.target([sys.executable, '-m', 'psring.workers']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100)
    assert proc.stdout.strip() == "None", proc.stderr


CLOSED = r"""
import os, signal, sys
from pathlib import Path
from psring.runtime import forking
from psring.runtime.process import ProcessSpec, Supervisor
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # as some parents leave it
forking.allow()
os.close(0)  # the launcher's stdin closed: its first log file opens as fd 0
sup = Supervisor(Path(sys.argv[1]))
c = sup.start(ProcessSpec("worker-0", [sys.executable, "-m", "psring.workers", "--help"]))
print(type(c.proc).__name__, c.proc.wait(timeout=60))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(GPU_BUILD, reason="this torch is a GPU build, which starts every "
                    "process anew (test_a_gpu_build_of_torch_never_forks)")
def test_a_forked_child_logs_and_reports_its_exit_whatever_the_launcher_inherited(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CLOSED, str(tmp_path)], capture_output=True,
                          text=True, timeout=100)
    assert proc.stdout.strip() == "ForkedProcess 0", proc.stderr
    assert "usage:" in (tmp_path / "worker-0.log").read_text()
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(120)
def test_a_gpu_build_of_torch_never_forks():
    """A CUDA build's runtime, initialized in the launcher, is unusable in a forked
    child: such a build starts every process anew (here: a CPU build told it is one)."""
    code = ("import sys, torch; torch.version.cuda = torch.version.cuda or '13.0'; "
            "from psring.runtime import forking; forking.allow(); "
            "print(forking.target([sys.executable, '-m', 'psring.workers']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100)
    assert proc.stdout.strip() == "None", proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(not zygote.serves(), reason="the tests' zygote forks only on Linux with a "
                    "CPU build of torch and setproctitle (a GPU runtime may not be forked): "
                    "here every test command starts anew")
def test_the_tests_forked_commands_behave_as_new_interpreters(tmp_path):
    """tests/helpers/zygote.py: a command forked for a test sees its own arguments,
    environment (a plugin on its PYTHONPATH), working directory and streams, exits
    with its own status, and carries its own command line, as `python -m psring` does."""
    from tests.helpers import env_with_plugins, processes_mentioning

    env = env_with_plugins()
    runs = [(["strategies"], env), (["run", "--strategy", "nonsense", "--out", "x"], None)]
    codes = []
    for args, with_env in runs:
        fresh = subprocess.run([*zygote.PSRING, *args], capture_output=True, text=True,
                               env=with_env, cwd=tmp_path, timeout=100)
        forked = zygote.start(args, env=with_env, cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert isinstance(forked, zygote.Forked)  # (this machine forks: a CPU build)
        out, err = forked.communicate(timeout=100)
        assert (out, err, forked.returncode) == (fresh.stdout, fresh.stderr,
                                                 fresh.returncode)
        codes.append(forked.returncode)
        if args == ["strategies"]:
            assert "faulty" in out  # (the plugin, from the command's PYTHONPATH)
    assert codes == [0, 2]
    long_run = zygote.start(["run", "--strategy", "allreduce", "--workers", "2",
                             "--steps", "100000", "--out", tmp_path / "long"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "long" / "steps.jsonl").exists():
        assert long_run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    # the launcher and its forked workers: three processes that name the run directory
    assert len(processes_mentioning(str(tmp_path / "long"))) >= 3
    long_run.terminate()
    assert long_run.wait(timeout=30) == 143
    assert_no_processes(str(tmp_path))
