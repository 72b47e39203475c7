"""psring.report.faults: what a fault cost a run, read from its logs."""

import json
from pathlib import Path

import pytest

from psring.records.runlog import FAULTS, RESTARTS
from psring.report.faults import effects, restart_losses, tta_with_losses


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def steps(workers: int, times: dict[int, float], step_s: float = 1.0) -> list[dict]:
    return [{"worker": w, "step": s, "time": t, "step_s": step_s}
            for s, t in times.items() for w in range(workers)]


def test_a_restart_costs_the_redone_steps_and_its_start(tmp_path):
    # 2 workers, a step a second; killed at 5.5 s during step 5, restarted from the
    # checkpoint at step 3: steps 3..5 again from 10 s on
    before = steps(2, {s: s + 1.0 for s in range(5)})
    after = steps(2, {3: 11.0, 4: 12.0, 5: 13.0, 6: 14.0, 7: 15.0})
    records = before + after
    write(tmp_path / FAULTS, [{"time": 5.5, "fault": "--kill-worker 1:5", "step": 5}])
    write(tmp_path / RESTARTS, [{"time": 9.0, "reached": 5, "reached_at": 5.0,
                                 "steps_redone": 2}])
    got = effects(tmp_path, records, {"batch_size": 8, "workers": 2})
    assert got["fault_step"] == 5 and got["restarts"] == 1 and got["steps_redone"] == 2
    assert got["lost_s"] == pytest.approx(12.0 - 5.0)  # step 4 logged at 5 s, again at 12
    assert got["recovery_s"] == pytest.approx(13.0 - 5.5)  # step 5 done at last
    # before: steps 1..4 after step 0's end (1 s): 4 steps x 8 samples in 4 s
    assert got["samples_per_s_before"] == pytest.approx(8.0)
    assert got["samples_per_s_after"] == pytest.approx(8.0)  # the same pace again
    evals = [{"step": 4, "accuracy": 0.5, "train_s": 4.0, "time": 5.0},
             {"step": 6, "accuracy": 0.95, "train_s": 6.0, "time": 14.1}]
    # the clock at the target, plus the 7 s the restart lost before it
    assert tta_with_losses(evals, 0.9, got["losses"]) == pytest.approx(13.0)
    assert tta_with_losses(evals, 0.99, got["losses"]) is None


def test_a_run_that_goes_on_without_a_worker_is_timed_by_its_survivors(tmp_path):
    records = steps(3, {s: s + 1.0 for s in range(4)}) + \
        [{"worker": w, "step": s, "time": 6.0 + s, "step_s": 1.0}
         for s in range(4, 8) for w in (0, 2)]
    write(tmp_path / FAULTS, [{"time": 4.2, "fault": "--kill-worker 1:4", "step": 4},
                              {"time": 4.3, "lost": "worker 1", "exit": "SIGKILL"}])
    got = effects(tmp_path, records, {"batch_size": 9, "workers": 3})
    assert got["lost"] == ["worker 1"] and got["restarts"] == 0
    assert got["recovery_s"] == pytest.approx(10.0 - 4.2) and got["lost_s"] == 0
    assert got["samples_per_s_before"] == pytest.approx(3 * 3 * 3 / 3.0)
    assert got["samples_per_s_after"] == pytest.approx(2 * 3 * 3 / 3.0)  # two left


def test_no_fault_and_no_restart_is_none(tmp_path):
    assert effects(tmp_path, steps(2, {0: 1.0}), {"batch_size": 2, "workers": 2}) is None
    assert restart_losses([], []) == []


def test_each_fault_case_is_set_beside_its_fault_free_setting():
    from types import SimpleNamespace

    from psring.report.aggregate import fault_rows

    grid = {"setup": [{"setup": "a"}, {"setup": "b"}],
            "fault": [{"fault": "none"}, {"fault": "worker", "kill_worker": "1:5"}]}
    evals = [{"step": 6, "accuracy": 0.95, "train_s": 2.0, "time": 20.0}]
    run = {"fault_effects": {"recovery_s": 1.5, "steps_redone": 2, "lost_s": 3.0,
                             "losses": [[10.0, 3.0]], "lost": []}, "evals": evals}

    def setting(setup, fault, rows):
        return SimpleNamespace(varied={"setup": setup, "fault": fault}, rows=rows)
    settings = [setting("a", "none", [{"evals": evals}]), setting("a", "worker", [run]),
                setting("b", "worker", [run])]
    rows = fault_rows(settings, grid, target=0.9)
    assert [r["setting"] for r in rows] == settings[1:]
    assert rows[0]["clean"] is settings[0] and rows[1]["clean"] is None  # b has no "none"
    assert rows[0]["recovery_s"].median == 1.5 and rows[0]["steps_redone"].median == 2
    assert rows[0]["tta_s"].median == pytest.approx(5.0)  # 2 s of training + 3 s lost
    assert fault_rows(settings, {"setup": grid["setup"]}, 0.9) == []
