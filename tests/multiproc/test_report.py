"""`psring report` and `psring compare` as a user runs them."""

import json
import statistics

import pytest

from psring.predict.sim.simulate import is_costed
from psring.records.runlog import warmup_steps
from psring.report.runs import percentile
from tests.helpers import assert_no_processes, psring, read_steps


def test_percentile_and_warmup():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(101))), 95) == 95.0
    assert warmup_steps(3) == 0 and warmup_steps(12) == 1 and warmup_steps(50) == 5


@pytest.mark.timeout(120)
def test_report_reads_values_from_the_logs(small_runs):
    proc = psring("report", *small_runs.values(), "--json")
    rows = {r["strategy"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"single", "allreduce", "ddp"}
    for name, row in rows.items():
        records = read_steps(small_runs[name])
        kept = [r for r in records if r["step"] >= warmup_steps(12)]
        comm = sum(r["comm_s"] for r in kept) / sum(r["step_s"] for r in kept)
        assert row["comm_share"] == pytest.approx(comm)
        assert row["compute_share"] == pytest.approx(1 - comm)
        # the job's step: from its last worker's start to its last worker's end
        by_step = {}
        for r in kept:
            by_step.setdefault(r["step"], []).append(r)
        job = [max(r["time"] for r in rs) - max(r["time"] - r["step_s"] for r in rs)
               for rs in by_step.values()]
        assert row["step_p50_s"] == pytest.approx(statistics.median(job))
        assert row["samples_per_s"] > 0 and row["loss_final"] < row["loss_first"]
    assert rows["single"]["speedup_vs_single"] == pytest.approx(1.0)
    assert rows["allreduce"]["speedup_vs_single"] == pytest.approx(
        rows["allreduce"]["samples_per_s"] / rows["single"]["samples_per_s"])
    # single waits for nothing: its comm_s laps are clock reads. A sum over SMALL's
    # sub-millisecond steps would catch the one step a busy machine preempted inside
    # that lap, so the typical step is asserted.
    single = [r for r in read_steps(small_runs["single"]) if r["step"] >= warmup_steps(12)]
    assert percentile([r["comm_s"] / r["step_s"] for r in single], 50) < 0.05
    table = psring("report", *small_runs.values()).stdout
    for name in rows:
        assert name in table


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_compare_runs_every_strategy_and_reports(compare_run):
    out, proc = compare_run
    from psring.strategies import STRATEGIES

    report = (out / "report.md").read_text()
    rows = {r["strategy"]: r for r in json.loads((out / "report.json").read_text())}
    for name in STRATEGIES:
        workers = 1 if name == "single" else 2
        assert (out / f"strategy={name}_workers={workers}_r0" / "model.pt").exists()
        assert f"│ {name} (workers={workers})" in proc.stdout
        assert f"| {name} (workers={workers})" in report
        assert rows[name]["samples_per_s"]["median"] > 0
    # a quick calibration was measured, so the communicating strategies have predictions
    assert (out / "calibration.json").exists()
    for name in ("allreduce", "ddp", "ps"):
        assert rows[name]["predicted_comm_ms"] > 0
        assert rows[name]["comm_error"] is not None
    assert rows["hogwild"]["predicted_comm_ms"] is None
    # the simulator replays every run: a step time beside each measured one, whose
    # error is what the report says it is; hogwild's prediction is its compute alone
    for name in STRATEGIES:
        r = rows[name]
        if not is_costed(STRATEGIES.get(name).caps.cost_model):  # (no prediction shown)
            assert r["predicted_step_ms"] is None, name
            continue
        assert r["predicted_step_ms"] > 0, name
        assert r["step_error"] == pytest.approx(
            r["predicted_step_ms"] / r["step_ms"]["median"] - 1)
    assert rows["ps"]["predicted_bound"] is not None
    assert "## Step-time prediction" in report
    # time to accuracy: compare.toml's 90% target, which single reaches at step 24 and
    # every synchronous strategy at the same step (the same SGD)
    assert "## Time to accuracy" in report and (out / "accuracy.png").exists()
    for name in ("single", "allreduce", "ddp", "ps"):
        assert rows[name]["tta_steps"]["median"] == rows["single"]["tta_steps"]["median"] <= 30
        assert rows[name]["accuracy_final"]["median"] >= 0.9
    assert f"report: {out / 'report.md'}" in proc.stdout
    assert_no_processes(out)
