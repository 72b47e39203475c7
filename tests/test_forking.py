"""psring.forking: when the launcher forks a run's processes, and that a forked child
behaves as a new ``python -m MODULE`` would (its own log, exit status, environment).
Each check runs in a fresh interpreter: forking from pytest's own process is what the
module refuses to do."""

import subprocess
import sys

import pytest

from conftest import assert_no_processes

SCRIPT = r"""
import os, sys, threading, time
from pathlib import Path
from psring import forking
from psring.process import ProcessSpec, Supervisor

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


@pytest.mark.timeout(120)
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
    code = ("import sys; from psring import forking; forking.allow(); "
            "print(forking.target([sys.executable, '-m', 'psring.workers']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env={**__import__("os").environ, "PSRING_FORK": "0"})
    assert proc.stdout.strip() == "None", proc.stderr
