"""psring.report.runs: how a run's step time is read from its step records."""

from __future__ import annotations

import pytest


def test_a_jobs_step_is_from_its_last_workers_start_to_its_last_workers_end():
    from psring.report.runs import _job_steps

    # two PS workers whose steps end at different moments (each when its own pushes
    # are acknowledged), back to back: every 1.0 s the job completes a step, but each
    # worker's step_s swings 0.6 / 1.4 out of phase with the other's, and the largest
    # of them overstates the period; the job's own step does not
    ends = {0: [10.0, 10.4], 1: [11.4, 11.0], 2: [12.0, 12.4], 3: [13.4, 13.0]}
    by_step = {s: [{"worker": w, "time": t, "step_s": 1.4 if (s + w) % 2 else 0.6}
                   for w, t in enumerate(ts)] for s, ts in ends.items()}
    assert _job_steps({s: by_step[s] for s in (1, 2, 3)}, 2, {}) == pytest.approx([1.0] * 3)
    assert max(max(r["step_s"] for r in rs) for rs in by_step.values()) == 1.4
    # time between steps (an evaluation after step 1) is not in the next step
    late = {s: [{**r, "time": r["time"] + (5.0 if s >= 2 else 0.0)} for r in rs]
            for s, rs in by_step.items() if s >= 1}
    assert _job_steps(late, 2, {}) == pytest.approx([1.0] * 3)
    # on the described clock of a time-scaled run (step_s already is)
    scaled = {s: [{**r, "step_s": r["step_s"] / 4} for r in rs] for s, rs in late.items()}
    assert _job_steps(scaled, 2, {"time_scale": 4}) == pytest.approx([0.25] * 3)
    # a step without every worker's record: not this reading
    del late[2][1]
    assert _job_steps(late, 2, {}) == []


def test_a_worker_lost_mid_run_adds_samples_only_while_it_was_there():
    from psring.report.runs import _speed

    cfg = {"batch_size": 9, "workers": 3, "accumulate": 1, "worker_batch": ""}
    records = [{"worker": w, "step": s, "time": s + 1.0, "step_s": 1.0}
               for s in range(10) for w in range(3) if w != 1 or s < 4]
    _, rate = _speed(records, cfg)
    # workers 0 and 2 at 3 samples a second throughout; worker 1 for 4 steps of 10
    assert rate == pytest.approx(3.0 + 3.0 + 3.0 * 4 / 10)


def test_a_scripts_runs_with_other_arguments_have_their_own_baseline(tmp_path):
    """Speedups pair a run with the `single` run of the same workload: for a script's
    runs that includes its arguments (--clip 0 trains another model than --clip 1)."""
    import json

    from psring.report.runs import summarize_all

    def run(name: str, strategy: str, workers: int, args: list[str], step_s: float) -> None:
        d = tmp_path / name
        d.mkdir()
        cfg = {"strategy": strategy, "workers": workers, "model": "script train.py",
               "batch_size": 8, "steps": 4, "accumulate": 1, "worker_batch": ""}
        (d / "manifest.json").write_text(json.dumps({"config": cfg,
                                                     "script": ["train.py", *args]}))
        (d / "steps.jsonl").write_text("".join(json.dumps(
            {"worker": w, "step": s, "time": float(s), "step_s": step_s, "data_s": 0.0,
             "forward_s": step_s, "backward_s": 0.0, "comm_s": 0.0, "update_s": 0.0,
             "loss": None}) + "\n" for s in range(4) for w in range(workers)))

    run("single-a", "single", 1, ["--clip", "1"], 1.0)
    run("single-b", "single", 1, ["--clip", "0"], 0.5)
    run("ps-b", "ps", 2, ["--clip", "0"], 0.25)
    rows = {r["run"].rsplit("/", 1)[1]: r for r in summarize_all([str(tmp_path)])}
    # against single-b (16 samples/s); paired with single-a (8) it would be 4.0
    assert rows["ps-b"]["speedup_vs_single"] == pytest.approx(2.0)
    assert rows["single-a"]["speedup_vs_single"] == pytest.approx(1.0)
