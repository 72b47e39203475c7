"""Uneven workers (HetSeq): --worker-batch gives each worker its own share of the
global batch, gradients weighed by samples, so every synchronous strategy still trains
what single trains on the global batch."""

from __future__ import annotations

import statistics

import pytest
import torch

from psring.train.data import Dataset, worker_batch
from tests.helpers import (
    SMALL,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    psring_together,
    read_steps,
)


def test_uneven_shares_cover_single_batch_rows_once():
    ds = Dataset(torch.arange(100.0).reshape(100, 1), torch.zeros(100, dtype=torch.int64), 2)
    sizes = (5, 2, 1)
    for index in (0, 1, 12):  # (12 wraps around the data set's end)
        rows = torch.cat([worker_batch(ds, 8, index, r, 3, sizes)[0] for r in range(3)])
        assert rows.flatten().tolist() == [(index * 8 + i) % 100 for i in range(8)]
        assert [len(worker_batch(ds, 8, index, r, 3, sizes)[0]) for r in range(3)] == [5, 2, 1]


@pytest.mark.timeout(240)
def test_every_synchronous_strategy_with_uneven_batches_trains_singles_model(tmp_path,
                                                                              small_runs):
    """SMALL's global batch of 32 split 24 + 8: allreduce, ddp and ps (2 servers) end
    with the parameters single reaches on the batch of 32."""
    runs = {"allreduce": [], "ddp": [], "ps": ["--servers", 2]}
    psring_together(*(["run", "--strategy", s, "--workers", 2, *SMALL, *extra,
                       "--worker-batch", "24,8", "--out", tmp_path / s]
                      for s, extra in runs.items()), timeout=200)
    ref = load_model(small_runs["single"])
    for strategy in runs:
        out = tmp_path / strategy
        assert max_rel_diff(load_model(out), ref) < 1e-4, strategy
        records = read_steps(out)
        assert {r["worker"] for r in records} == {0, 1} and len(records) == 24
    # readers of the run count each worker's own share: a profile of the run is of
    # the larger share's batch, the report's samples/s adds 24 and 8 a step
    from psring.records.profile import Profile
    from psring.report.runs import summarize

    assert Profile.from_run(tmp_path / "allreduce", worker=None).batch_size == 24
    records = read_steps(tmp_path / "allreduce")
    want = sum(n / statistics.median(r["step_s"] for r in records if r["worker"] == w and
                                     r["step"] >= 1)
               for w, n in ((0, 24), (1, 8)))
    assert summarize(tmp_path / "allreduce")["samples_per_s"] == pytest.approx(want)
    assert_no_processes(tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--worker-batch", "24,4"], "adds up to 28, not --batch-size 32"),
    (["--worker-batch", "32,0"], "at least one sample"),
    (["--worker-batch", "16,8,8"], "names 3 batch(es) for --workers 2"),
    (["--worker-batch", "big,small"], "comma-separated in rank order"),
    (["--worker-batch", "24,8", "--strategy", "async-ps"], "Use allreduce, hallreduce, ddp or ps"),
    (["--worker-batch", "24,8", "--reduce", "adasum"], "Use one of the two"),
])
def test_bad_worker_batches_are_one_paragraph_and_exit_2(tmp_path, args, needle):
    proc = cli_here("run", "--strategy", "allreduce", "--workers", 2, *SMALL, *args,
                    "--out", tmp_path / "r")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert proc.stderr.count("psring: error:") == 1 and not (tmp_path / "r").exists()


def test_proportional_shares_follow_the_measured_speeds(tmp_path):
    """proportional:RUN_DIR reads an earlier run's step records: worker 1 computed 3x as
    long a step, so it gets a quarter of the batch; the resolved shares are what the
    config (and so the manifest) holds."""
    import json

    from psring.config import RunConfig, validate
    from psring.train.shares import proportional_shares

    run = tmp_path / "even"
    run.mkdir()
    with open(run / "steps.jsonl", "w") as f:
        for step in range(10):
            for w, compute in ((0, 0.010), (1, 0.030)):
                f.write(json.dumps({"step": step, "worker": w, "forward_s": compute / 3,
                                    "backward_s": 2 * compute / 3}) + "\n")
    assert proportional_shares(str(run), 64, 2) == [48, 16]
    assert proportional_shares(str(run), 7, 2) == [5, 2]  # 5.25 and 1.75: by remainder
    assert proportional_shares(str(run), 2, 2) == [1, 1]  # at least one each
    cfg = validate(RunConfig(strategy="allreduce", workers=2, batch_size=64,
                             worker_batch=f"proportional:{run}"))
    assert cfg.worker_batch == "48,16" and cfg.worker_batches == (48, 16)
    proc = cli_here("run", "--strategy", "allreduce", "--workers", 3, "--batch-size", 63,
                    "--worker-batch", f"proportional:{run}", "--out", tmp_path / "r")
    assert proc.returncode == 2 and "that run had 2 worker(s), this one 3" in proc.stderr
