"""Timelines of a run: Chrome-trace / Perfetto JSON built from the run's logs, and a PNG.

    psring run --strategy ps --workers 2 --trace --out runs/ps   # writes runs/ps/trace.json
    psring trace runs/ps [--png runs/ps/trace.png] [--steps 3]   # (re)builds it, renders it

Open trace.json in https://ui.perfetto.dev or chrome://tracing. Tracks:

- one process per worker ("worker R"): thread "step" holds the phases in the order
  they happened (data, forward, backward, comm = blocked waiting, update); thread
  "bucket K" holds bucket K's communication from launch (in a gradient hook) to
  completion, so overlap with backward shows as buckets running under "backward";
- one process per parameter server ("server-K"): each push's apply (sum into the
  update, SGD) and each pull's hold (waiting for the version it asked for).

Nothing is measured here: workers record spans when run with ``--trace`` (see
psring.workers.loop) and servers always log their requests (servers.jsonl). All
processes of a host read the same wall clock (``time.time``), so the tracks line up;
across hosts they line up as well as the hosts' clocks agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from psring.errors import ConfigError
from psring.records.runlog import atomic_write_json, read_steps

TRACE = "trace.json"
SERVERS = "servers.jsonl"
PHASE_COLORS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868",
                "comm": "#c44e52", "update": "#dd8452", "bucket": "#8172b2",
                "apply": "#937860", "held": "#da8bc3"}


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash: skip it, keep the rest
    return out


def build_trace(run_dir: Path) -> dict[str, Any]:
    """The trace of a run traced with ``--trace``, as a Chrome-trace JSON object."""
    run_dir = Path(run_dir)
    records = [r for r in read_steps(run_dir) if "spans" in r]
    if not records:
        raise ConfigError(f"{run_dir}: no traced steps in steps.jsonl; run with "
                          f"`psring run ... --trace` to record spans.")
    t_base = min(r["start"] for r in records)
    clock = _Clock(t_base)
    workers = sorted({r["worker"] for r in records})
    events = [e for w in workers for e in _process(w, f"worker {w}", ["step"])]
    named: set[tuple[int, int]] = set()
    for r in records:
        events += _step_events(r, clock, named)
    t_end = max(r["start"] + r["step_s"] for r in records)
    server_log = [s for s in _read_jsonl(run_dir / SERVERS) if isinstance(s, dict)]
    servers = sorted({s["server"] for s in server_log if "server" in s})
    pid_of = {name: max(workers) + 1 + i for i, name in enumerate(servers)}
    for name, pid in pid_of.items():
        events += _process(pid, name, ["apply", "held pulls"])
    for s in server_log:
        pid = pid_of.get(s.get("server"))
        end = s.get("time")
        if pid is None or not isinstance(end, (int, float)) or not t_base <= end <= t_end + 1:
            continue
        events += _server_events(s, pid, end, clock)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "time.time() in µs since the first traced step began",
                          "t0_unix_s": t_base, "run_dir": str(run_dir)}}


class _Clock:
    """A trace's time stamps: µs since the first traced step began (the shared clock)."""

    def __init__(self, t_base: float):
        self.t_base = t_base

    def us(self, t: float) -> float:
        return round((t - self.t_base) * 1e6, 1)


def _process(pid: int, name: str, threads: list[str]) -> list[dict]:
    """The metadata events naming a process (a worker or a server) and its threads."""
    return [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid,
             "args": {"sort_index": pid}},
            *({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
               "args": {"name": thread}} for tid, thread in enumerate(threads))]


def _step_events(r: dict, clock: _Clock, named: set[tuple[int, int]]) -> list[dict]:
    """A step's phases on its worker's thread 0, and each completed bucket on a thread
    of its own (named the first time it appears: ``named``)."""
    w, s0, events = r["worker"], r["start"], []
    for name, a, b in r["spans"]:
        events.append({"ph": "X", "name": name, "cat": "phase", "pid": w, "tid": 0,
                       "ts": clock.us(s0 + a), "dur": round((b - a) * 1e6, 1),
                       "args": {"step": r["step"]}})
    spans = zip(r.get("bucket_launch_s", []), r.get("bucket_done_s", []))
    for k, (a, b) in enumerate(spans):
        if b <= 0 or b < a:  # not completed in this step (e.g. no_sync)
            continue
        if (w, k) not in named:
            named.add((w, k))
            events.append({"ph": "M", "name": "thread_name", "pid": w, "tid": 1 + k,
                           "args": {"name": f"bucket {k}"}})
        events.append({"ph": "X", "name": f"bucket {k}", "cat": "bucket", "pid": w,
                       "tid": 1 + k, "ts": clock.us(s0 + a), "dur": round((b - a) * 1e6, 1),
                       "args": {"step": r["step"]}})
    return events


def _server_events(s: dict, pid: int, end: float, clock: _Clock) -> list[dict]:
    """A server's log line: a push applied (thread 0), or a pull held (thread 1)."""
    apply_s, wait_s = float(s.get("apply_s", 0)), float(s.get("wait_s", 0))
    if s.get("op") == "push":
        return [{"ph": "X", "name": f"apply w{s.get('worker')}", "cat": "apply",
                 "pid": pid, "tid": 0, "ts": clock.us(end - apply_s),
                 "dur": round(apply_s * 1e6, 1),
                 "args": {"worker": s.get("worker"), "step": s.get("step"),
                          "bytes": s.get("bytes_in")}}]
    if s.get("op") == "pull" and wait_s > 0 and end - apply_s > clock.t_base:
        # A pull may have been held since before the first traced step (the
        # parameters a worker evaluates at step 0): show the part inside the trace.
        held_from = max(end - apply_s - wait_s, clock.t_base)
        return [{"ph": "X", "name": f"held w{s.get('worker')}", "cat": "held",
                 "pid": pid, "tid": 1, "ts": clock.us(held_from),
                 "dur": round((end - apply_s - held_from) * 1e6, 1),
                 "args": {"worker": s.get("worker"), "version": s.get("version")}}]
    return []


def write_trace(run_dir: Path) -> Path:
    path = Path(run_dir) / TRACE
    atomic_write_json(path, build_trace(run_dir))
    return path


def load_trace(path: Path) -> dict[str, Any]:
    try:
        trace = json.loads(Path(path).read_text())
        events = trace["traceEvents"]
        assert isinstance(events, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise ConfigError(f"{path} is not a psring trace ({e}); rebuild it with "
                          f"`psring trace RUN_DIR`.") from None
    return trace


def render_png(trace: dict[str, Any], path: Path, steps: int = 3) -> Path:
    """Draw ``steps`` consecutive steps from the middle of the run (warm-up excluded), one
    row per track, as a PNG (what the docs show when no browser is at hand)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in ev if e["ph"] == "X"]
    step_ids = sorted({e["args"]["step"] for e in spans if e["cat"] == "phase"})
    if not step_ids:
        raise ConfigError("the trace has no worker steps to draw")
    mid = step_ids[len(step_ids) // 2]
    pick = set(step_ids[max(0, mid - steps // 2):][:steps])
    window = [e for e in spans if e["cat"] != "phase" or e["args"]["step"] in pick]
    shown = [e for e in window if e["cat"] == "phase"]
    lo = min(e["ts"] for e in shown)
    hi = max(e["ts"] + e["dur"] for e in shown)
    window = [e for e in window if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    # rows: per worker "step" then "buckets" (all buckets on one row, translucent), then
    # per server "apply" and "held pulls"
    rows: list[tuple[int, str]] = []
    for pid in sorted(names):
        if names[pid].startswith("worker"):
            rows += [(pid, "step"), (pid, "buckets")]
        else:
            rows += [(pid, "apply"), (pid, "held")]
    row_of = {key: i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.4))
    for e in window:
        if e["cat"] == "phase":
            key, color, alpha = (e["pid"], "step"), PHASE_COLORS.get(e["name"], "k"), 1.0
        elif e["cat"] == "bucket":
            key, color, alpha = (e["pid"], "buckets"), PHASE_COLORS["bucket"], 0.5
        else:
            key, color, alpha = (e["pid"], e["cat"]), PHASE_COLORS[e["cat"]], 0.8
        if key not in row_of:
            continue
        ax.barh(row_of[key], e["dur"] / 1e3, left=(e["ts"] - lo) / 1e3, height=0.8,
                color=color, alpha=alpha, edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names[pid]} · {what}" for pid, what in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel(f"ms (steps {min(pick)}–{max(pick)})")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()],
              ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.2 / len(rows)),
              fontsize=8, frameon=False)
    ax.set_title(Path(str(trace.get("otherData", {}).get("run_dir", ""))).name or "trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
