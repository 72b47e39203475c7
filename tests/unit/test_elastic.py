"""A torchrun launch restarted by torchrun (psring.runtime.elastic): the checkpoint every
host resumes from, who writes a directory's checkpoints, a directory cut back and its
restart recorded; and checkpoints written by several writers of one directory."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from psring.config import RunConfig
from psring.errors import ConfigError, PsringError
from psring.records.runlog import EVALS, RESTARTS, STEPS, append_record, read_steps
from psring.runtime import elastic
from psring.train import checkpoint


def _peer(rank: int, host: str, out: str, steps: list[int] | None = None) -> dict:
    return {"rank": rank, "host": host, "out": out,
            **({elastic.OFFER: steps} if steps is not None else {})}


def test_every_host_resumes_from_the_newest_step_they_all_hold():
    def agreed(a, b, servers=False):
        return elastic.agreed_step([_peer(0, "a", "/r", a), _peer(1, "b", "/r", b),
                                    _peer(2, "b", "/r")], servers)  # (rank 2 offers nothing)

    assert agreed([9, 6], [9, 6]) == 9
    # host b crashed while writing step 9: both go back to 6
    assert agreed([9, 6], [6, 3]) == 6
    # a parameter server's state is rank 0's alone: the other hosts hold none
    assert agreed([9, 6], [], servers=True) == 9
    # a replicated state: host b died writing its first checkpoint: start over
    assert agreed([3], []) is None
    # no checkpoint where rank 0 is: the run starts over
    assert agreed([], [3]) is None
    with pytest.raises(PsringError, match="no checkpoint of one step in common"):
        agreed([12, 9], [6, 3])


def test_the_lowest_rank_of_each_run_directory_writes_it():
    peers = [_peer(0, "a", "/r"), _peer(1, "a", "/r"), _peer(2, "b", "/r"), _peer(3, "b", "/r")]
    assert [elastic.writer_of(r, peers, p["host"], p["out"])
            for r, p in enumerate(peers)] == [0, 0, 2, 2]
    assert elastic.writer_of(3, [], None, None) == 0  # psring run: one directory, rank 0


def test_torchrun_must_restart_for_psring_to_resume(monkeypatch):
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
                 "TORCHELASTIC_MAX_RESTARTS": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PSRING_RUN_ID", raising=False)
    cfg = RunConfig(workers=2, checkpoint_every=3, max_restarts=2)
    with pytest.raises(ConfigError, match="Pass torchrun --max-restarts 2 as well"):
        elastic.check(cfg)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    elastic.check(cfg)
    elastic.check(RunConfig(workers=2))


class _Launch:
    """A restarted torchrun launch as a worker sees it after joining."""

    def __init__(self, attempt: int, peers: list[dict]):
        self.attempt, self.peers, self.marks = attempt, peers, []

    def mark(self, name: str) -> None:
        self.marks.append(name)

    def wait_mark(self, name: str, what: str) -> None:
        assert name in self.marks, what


def _ctx(rank: int, run_dir, **cfg) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, run_dir=run_dir, log=logging.getLogger("test"),
                           cfg=RunConfig(workers=2, checkpoint_every=3, **cfg),
                           resume=None, writes_checkpoints=False)


def test_a_restart_cuts_the_records_back_and_resumes_from_the_agreed_checkpoint(tmp_path):
    for step in (3, 6):
        checkpoint.save(tmp_path, step, {"model/w": torch.full((4,), float(step))},
                        {"train_s": 1.0})
    for step in range(8):
        append_record(tmp_path / STEPS, {"worker": 0, "step": step, "time": 100.0 + step})
    for step in (0, 3, 6):
        append_record(tmp_path / EVALS, {"step": step})
    peers = [_peer(0, "a", str(tmp_path), [6, 3]), _peer(1, "b", "/elsewhere", [3])]
    ctx, launch = _ctx(0, tmp_path, max_restarts=2), _Launch(2, peers)
    elastic.after_join(ctx, launch, uses_servers=False)
    assert ctx.writes_checkpoints and launch.marks == ["prepared/0"]
    assert ctx.resume.step == 3 and ctx.resume.tensors["model/w"][0] == 3.0
    assert [r["step"] for r in read_steps(tmp_path)] == [0, 1, 2]
    assert [r["step"] for r in read_steps(tmp_path, EVALS)] == [0, 3]
    (restart,) = read_steps(tmp_path, RESTARTS)
    assert (restart["attempt"], restart["resumed_from"], restart["reached"],
            restart["steps_redone"]) == (1, 3, 8, 5)
    assert restart["cause"].startswith("torchrun restarted the launch (restart 1)")


def test_the_other_ranks_of_a_directory_wait_for_its_writer_and_resume_too(tmp_path):
    """Two workers of one host (one --out): rank 2 waits for rank 1's mark, then loads
    the same checkpoint; under torchrun --resume takes the same path, without a restart
    in restarts.jsonl."""
    checkpoint.save(tmp_path, 4, {"model/w": torch.ones(2)})
    append_record(tmp_path / STEPS, {"worker": 1, "step": 5, "time": 1.0})
    peers = [_peer(0, "a", "/host-a", [4]), _peer(1, "b", str(tmp_path), [4]),
             _peer(2, "b", str(tmp_path))]
    launch = _Launch(1, peers)
    waiting = _ctx(2, tmp_path, resume=str(tmp_path))
    with pytest.raises(AssertionError, match="rank 1 to prepare"):
        elastic.after_join(waiting, launch, uses_servers=False)  # (not marked yet)
    writer = _ctx(1, tmp_path, resume=str(tmp_path))
    elastic.after_join(writer, launch, uses_servers=False)
    elastic.after_join(waiting, launch, uses_servers=False)
    assert launch.marks == ["prepared/1"] and not waiting.writes_checkpoints
    assert writer.resume.step == waiting.resume.step == 4
    assert read_steps(tmp_path) == [] and read_steps(tmp_path, RESTARTS) == []


def test_a_restart_without_psrings_flag_or_past_it_is_refused(tmp_path):
    peers = [_peer(0, "a", str(tmp_path), [])]
    with pytest.raises(ConfigError, match="not given --max-restarts"):
        elastic.after_join(_ctx(0, tmp_path), _Launch(2, peers), uses_servers=False)
    with pytest.raises(PsringError, match="more than the workers' --max-restarts 1"):
        elastic.after_join(_ctx(0, tmp_path, max_restarts=1), _Launch(3, peers), False)
    ctx = _ctx(0, tmp_path, max_restarts=1)
    elastic.after_join(ctx, _Launch(1, peers), uses_servers=False)  # the first start
    assert ctx.resume is None and ctx.writes_checkpoints


def test_a_host_without_the_servers_state_resumes_at_the_agreed_step(tmp_path):
    peers = [_peer(0, "a", "/host-a", [6, 3]), _peer(1, "b", str(tmp_path), [])]
    launch = _Launch(2, peers)
    ctx = _ctx(1, tmp_path, max_restarts=1)
    elastic.after_join(ctx, launch, uses_servers=True)
    assert ctx.resume.step == 6 and ctx.resume.tensors == {}
    # where the state is every worker's, a host without it makes the run start over
    ctx = _ctx(1, tmp_path, max_restarts=1)
    elastic.after_join(ctx, launch, uses_servers=False)
    assert ctx.resume is None


def test_writers_sharing_a_directory_and_a_step_written_again(tmp_path):
    root = tmp_path / checkpoint.CHECKPOINTS
    # another host's writer, mid-write of step 6, and a crashed writer's leftover of 1
    (root / ".step-00000006.other.1.tmp").mkdir(parents=True)
    (root / ".step-00000001.other.2.tmp").mkdir()
    for step in (3, 6, 6):
        checkpoint.save(tmp_path, step, {"w": torch.full((2,), float(step))})
    assert checkpoint.usable_steps(tmp_path) == [6, 3]
    assert checkpoint.at(tmp_path, 6).tensors["w"][0] == 6.0
    assert sorted(p.name for p in root.iterdir()) == \
        [".step-00000006.other.1.tmp", "step-00000003", "step-00000006"]
    # a tampered checkpoint is not offered
    (root / "step-00000006" / checkpoint.STATE).write_bytes(b"torn")
    assert checkpoint.usable_steps(tmp_path) == [3]
    with pytest.raises(ConfigError, match="torn or tampered"):
        checkpoint.at(tmp_path, 6)
    assert json.loads((root / "step-00000003" / checkpoint.COMMIT).read_text())["step"] == 3
