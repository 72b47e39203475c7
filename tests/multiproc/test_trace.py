"""`psring run --trace`: a valid Chrome trace with one track per worker and per server,
spans that add up to the logged step times, and a rendered PNG."""

import json

import pytest

from tests.helpers import SMALL, assert_no_processes, cli_here, psring, read_steps

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_traced_ps_run_has_worker_and_server_tracks(tmp_path):
    out = tmp_path / "ps"
    psring("run", "--strategy", "ps", "--workers", 2, *SMALL, "--steps", 6, "--trace",
           "--out", out)
    assert_no_processes(out)
    trace = json.loads((out / "trace.json").read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["server-0", "worker 0", "worker 1"]
    spans = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= -1 for e in spans)
    # every worker's phase spans of a step add up to the step time it logged
    for r in read_steps(out):
        pid = next(p for p, n in names.items() if n == f"worker {r['worker']}")
        total = sum(e["dur"] for e in spans if e["pid"] == pid and e["cat"] == "phase"
                    and e["args"]["step"] == r["step"]) / 1e6
        assert total == pytest.approx(r["step_s"], rel=0.02, abs=2e-4)
    phases = {e["name"] for e in spans if e["cat"] == "phase"}
    assert {"forward", "backward", "comm"} <= phases
    assert any(e["cat"] == "bucket" for e in spans)
    server = next(p for p, n in names.items() if n == "server-0")
    applies = [e for e in spans if e["pid"] == server and e["cat"] == "apply"]
    # 6 steps x 2 workers x at least one bucket each
    assert len(applies) >= 12

    png = tmp_path / "t.png"
    proc = psring("trace", out, "--png", png)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert "perfetto" in proc.stdout


def test_trace_of_an_untraced_run_says_how_to_trace(tmp_path, small_runs):
    proc = cli_here("trace", small_runs["single"])
    assert proc.returncode == 2
    assert "--trace" in proc.stderr
