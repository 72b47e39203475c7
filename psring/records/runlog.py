"""The run directory: what a run leaves behind, and the helpers that write and read it.

    DIR/manifest.json   config, versions, host, sizes, FLOPs, bytes per step (rank 0)
    DIR/steps.jsonl     one JSON object per worker per step (every worker appends)
    DIR/evals.jsonl     one JSON object per held-out evaluation (rank 0; psring.train.evaluate)
    DIR/workers.jsonl   one JSON object per worker per launch: its run id, rank, host,
                        address and interface (every worker appends)
    DIR/model.pt        final parameters, a plain state_dict (rank 0)
    DIR/faults.jsonl    each fault placed by --kill-worker/--kill-server, as it fired
    DIR/restarts.jsonl  each restart of the run from a checkpoint (--max-restarts)
    DIR/logs/*.log      each process's stdout and stderr (written by the launcher)

Files that must survive a crash (manifest, model) are written atomically: a temporary
file in the same directory, fsync, rename.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from psring import __version__

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

MANIFEST = "manifest.json"
STEPS = "steps.jsonl"
EVALS = "evals.jsonl"
WORKERS = "workers.jsonl"
MODEL = "model.pt"
FAULTS = "faults.jsonl"
RESTARTS = "restarts.jsonl"

#: fields every step record has (docs/architecture.md explains each)
STEP_FIELDS = ("strategy", "worker", "step", "time", "data_s", "forward_s", "backward_s",
               "comm_s", "update_s", "step_s", "bytes_sent", "bytes_recv", "loss")
PHASES = ("data_s", "forward_s", "backward_s", "comm_s", "update_s")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_state_dict(path: Path, state: dict) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_state_dict(path: Path) -> dict:
    import torch

    # weights_only: never unpickle arbitrary objects from a file.
    return torch.load(path, map_location="cpu", weights_only=True)


class StepLog:
    """Appends records to steps.jsonl (or another .jsonl), one write() per record.

    Several workers (processes) append to the same file: O_APPEND makes each write
    land whole at the end, so lines never interleave.
    """

    def __init__(self, run_dir: Path, name: str = STEPS):
        self.fd = os.open(Path(run_dir) / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def append_record(path: Path, record: dict) -> None:
    """One JSON line appended to ``path`` (whole, among other processes' lines)."""
    log = StepLog(Path(path).parent, Path(path).name)
    try:
        log.write(record)
    finally:
        log.close()


def truncate_records(path: Path, before: int) -> None:
    """Keep the records (steps.jsonl, evals.jsonl) whose ``step`` is before ``before``
    (the checkpoint a resumed run continues from): what came after is run again. A
    record that names the servers' version it was for (ps with backup workers, where a
    late worker trails them) is kept only if that version is before it too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
            if max(r["step"], r.get("version", -1)) < before:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by the crash
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode())


def read_steps(run_dir: Path, name: str = STEPS) -> list[dict]:
    path = Path(run_dir) / name
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed process
    return out


def warmup_steps(steps: int) -> int:
    """How many first steps of a ``steps``-step run readers leave out of its figures:
    warm-up (allocator, connection set-up). Reports and profiles read runs alike."""
    return 0 if steps < 5 else max(1, steps // 10)


def read_evals(run_dir: Path) -> list[dict]:
    """evals.jsonl by step, those with a held-out ``accuracy`` (a script's run may log
    other metrics: psring.library); a resumed run may have evaluated a step twice
    (before the crash and after the resume): the later record counts."""
    by_step = {e["step"]: e for e in read_steps(run_dir, EVALS) if "accuracy" in e}
    return [by_step[s] for s in sorted(by_step)]


def read_manifest(run_dir: Path) -> dict:
    with open(Path(run_dir) / MANIFEST) as f:
        return json.load(f)


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))
    except FileNotFoundError:
        return 0


def versions() -> dict[str, str]:
    import msgpack
    import numpy
    import torch
    import zmq


    return {"psring": __version__, "python": platform.python_version(),
            "torch": torch.__version__, "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "msgpack": ".".join(map(str, msgpack.version)),
            "numpy": numpy.__version__}


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def host_facts() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cores": usable_cores(),
            "machine_cores": os.cpu_count(), "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's
    cpuset), which ``os.cpu_count()`` ignores (it counts the machine's); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (not Linux)
        return os.cpu_count() or 1


def host_name() -> str:
    """The host a process runs on, for its log lines: the emulated host's name
    (PSRING_HOST, set by psring.cluster.emulate), else the machine's hostname."""
    return os.environ.get("PSRING_HOST") or socket.gethostname()


def run_id(cfg) -> str:
    """The same string in every process of one run, and a new one for every launch:
    names the run to parameter servers and names its shared-memory files.

    ``psring run`` sets PSRING_RUN_ID (random) for its processes; under torchrun rank 0
    draws it and every worker reads it from the rendezvous store (psring.runtime.rendezvous).
    Only a worker started by hand, alone, falls back to its --out path."""
    import hashlib

    given = os.environ.get("PSRING_RUN_ID")
    parts = [given] if given else ["", os.path.abspath(cfg.out)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]


def iter_run_dirs(paths: list[str]) -> Iterator[Path]:
    """Run directories among ``paths``: each path itself, or its subdirectories that hold
    a manifest (so a comparison or sweep directory can be passed as one argument)."""
    for p in map(Path, paths):
        if (p / MANIFEST).exists():
            yield p
        elif p.is_dir():
            yield from sorted(d for d in p.iterdir() if (d / MANIFEST).exists())


def default_out(cfg: RunConfig) -> str:
    """Where a run writes without --out: runs/STRATEGY-wN-TIME in the working directory."""
    return os.path.join("runs", f"{cfg.strategy}-w{cfg.workers}-{time.strftime('%Y%m%d-%H%M%S')}")


def shares_of(config: dict) -> list[int]:
    """Each worker's samples a micro-batch in a run's recorded config (its manifest's
    ``config``): its --worker-batch, else equal shares of --batch-size."""
    if config.get("worker_batch"):
        return [int(v) for v in str(config["worker_batch"]).split(",")]
    return [config["batch_size"] // config["workers"]] * config["workers"]
