"""psring merge: the run directories of one torchrun launch's hosts become one run; the
directories of different launches, or an incomplete set, are refused with the reason.
(The directories are written here as workers write them;
tests/emulation/test_multihost.py merges real ones.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psring.errors import ConfigError
from psring.records import merge as merge_mod
from psring.records.runlog import read_manifest, read_steps
from psring.report.runs import summarize


def _host_dir(d: Path, run: str, ranks: list[int], world: int = 2, steps: int = 3,
              head: bool = False) -> Path:
    d.mkdir(parents=True)
    with open(d / "workers.jsonl", "w") as f:
        for r in ranks:
            f.write(json.dumps({"run": run, "rank": r, "world": world, "host": f"host-{r}",
                                "address": f"198.18.0.{r + 1}", "out": str(d)}) + "\n")
    with open(d / "steps.jsonl", "w") as f:
        for s in range(steps):
            for r in ranks:
                f.write(json.dumps({"strategy": "allreduce", "worker": r, "step": s,
                                    "host": f"host-{r}", "step_s": 0.01, "loss": 1.0}) + "\n")
    if head:
        (d / "manifest.json").write_text(json.dumps({
            "config": {"strategy": "allreduce", "workers": world, "steps": steps},
            "launch": {"launcher": "torchrun", "run_id": run, "hosts": world,
                       "workers": [{"rank": r, "host": f"host-{r}"} for r in range(world)]}}))
        (d / "model.pt").write_bytes(b"model")
        (d / "evals.jsonl").write_text('{"step": 3, "accuracy": 0.5}\n')
    return d


def test_one_launchs_directories_become_one_run(tmp_path):
    a = _host_dir(tmp_path / "a", "r1", [0], head=True)
    b = _host_dir(tmp_path / "b", "r1", [1])
    m = merge_mod.merge([a, b, a], tmp_path / "m")  # a twice: its steps count once
    steps = read_steps(tmp_path / "m")
    assert [(r["step"], r["worker"]) for r in steps] == [(s, w) for s in range(3) for w in (0, 1)]
    assert (tmp_path / "m" / "model.pt").read_bytes() == b"model"
    assert (tmp_path / "m" / "evals.jsonl").exists()
    assert [p["ranks"] for p in m["merged_from"]] == [[0], [1]]
    assert read_manifest(tmp_path / "m")["launch"]["run_id"] == "r1"
    assert [w["rank"] for w in read_steps(tmp_path / "m", "workers.jsonl")] == [0, 1]


def test_directories_of_different_launches_are_refused(tmp_path):
    a = _host_dir(tmp_path / "a", "r1", [0], head=True)
    b = _host_dir(tmp_path / "b", "r2", [1])
    with pytest.raises(ConfigError, match=r"different launches .*a: run r1; .*b: run r2"):
        merge_mod.merge([a, b], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_missing_host_or_head_is_named(tmp_path):
    a = _host_dir(tmp_path / "a", "r1", [0], world=3, head=True)
    b = _host_dir(tmp_path / "b", "r1", [1], world=3)
    with pytest.raises(ConfigError, match=r"3 workers.*rank 2 \(host-2\)"):
        merge_mod.merge([a, b], tmp_path / "m")
    with pytest.raises(ConfigError, match="node 0's host"):
        merge_mod.merge([b], tmp_path / "m")
    with pytest.raises(ConfigError, match="not the run directory of a psring worker"):
        merge_mod.merge([a, tmp_path], tmp_path / "m")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("")
    with pytest.raises(ConfigError, match="not empty"):
        merge_mod.merge([a, b], tmp_path / "m")


def test_a_report_of_one_hosts_directory_says_to_merge(tmp_path):
    a = _host_dir(tmp_path / "a", "r1", [0], head=True)
    with pytest.raises(ConfigError, match="rank 1 of this torchrun launch.*psring merge"):
        summarize(a)
