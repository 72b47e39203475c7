"""A process the kernel's OOM killer ended: the run's error says the machine ran out of
memory (a rise of /proc/vmstat's oom_kill while it ran), not only "killed by SIGKILL"."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from psring.errors import RunFailed
from psring.runtime import process
from psring.runtime.process import ProcessSpec, Supervisor, oom_kills
from tests.helpers import pid_alive


def test_oom_kills_reads_the_kernels_count(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 10\noom_kill 7\npgfault 3\n")
    assert oom_kills(str(vmstat)) == 7
    assert oom_kills(str(tmp_path / "absent")) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("oom", [True, False])
def test_a_sigkill_while_the_oom_count_rose_names_the_oom_killer(tmp_path, monkeypatch, oom):
    counts = iter([3, 4 if oom else 3])
    monkeypatch.setattr(process, "oom_kills", lambda: next(counts))
    sup = Supervisor(tmp_path / "logs")
    child = sup.start(ProcessSpec("worker-0", [sys.executable, "-c",
                                               "import time; time.sleep(60)"]))
    os.kill(child.proc.pid, signal.SIGKILL)
    with pytest.raises(RunFailed) as e:
        sup.wait()
    assert "worker-0 failed (killed by SIGKILL)" in str(e.value)
    assert ("OOM killer" in str(e.value)) == oom
    assert not pid_alive(child.proc.pid)
