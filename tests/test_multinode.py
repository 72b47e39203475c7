"""Two "nodes" on loopback under torch's own launcher (torchrun), one worker each:
the multi-host path of docs/architecture.md, run on one machine."""

import subprocess
import sys

import pytest

from conftest import SMALL, assert_no_processes, load_model, max_rel_diff, read_steps
from psring.process import free_port


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "ddp"])
def test_two_torchrun_nodes_match_single(small_runs, tmp_path, strategy):
    port = free_port()
    out = tmp_path / "two-nodes"
    nodes = []
    try:
        for node_rank in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node_rank), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "psring.workers", "--strategy", strategy, *SMALL,
                   "--threads", "1", "--out", str(out)]
            nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outputs = [n.communicate(timeout=180)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
    for n, text in zip(nodes, outputs):
        assert n.returncode == 0, text
    records = read_steps(out)
    assert {r["worker"] for r in records} == {0, 1}
    assert max_rel_diff(load_model(out), load_model(small_runs["single"])) < 1e-4
    assert_no_processes(out)
