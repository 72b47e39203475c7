"""Sweeps: many runs from one small definition, resumable, one directory per point.

    psring sweep experiments/intensity.toml [--out runs/intensity] [--repeats N]
    psring report runs/intensity           # report.md, plots, the key table

A sweep definition is a TOML file (see experiments/README.md):

    description = "PS vs ring across arithmetic intensity"
    repeats = 2                  # each point is run this many times
    [base]                       # RunConfig fields shared by every point
    steps = 20
    [grid]                       # lists; every combination is a point
    strategy = ["allreduce", "ps"]
    width = [64, 256, 1024]
    [report]                     # optional: what the report plots against what
    target_accuracy = 0.9        # time to accuracy (else the runs' --target-accuracy)

A grid value may be a table that brings settings of its own, for workloads that need
different ones; the key's own value names the point:

    model = [{model = "resnet18", lr = 0.01}, {model = "mlstm", width = 64, lr = 0.05}]

A grid key that is no `psring run` flag names *cases*: every value is a table, whose
own key is only the case's name (in the point's id), the rest its flags:

    fault = [{fault = "none"}, {fault = "worker", kill_worker = "1:10"},
             {fault = "server", kill_server = "0:10"}]

A case that cannot apply to a point's strategy is not run there: ``kill_server`` where
the strategy has no servers, ``backup_workers`` where it takes none.

Device-mode sweeps (``compute = "device"``, docs/emulation.md) can describe their
profiles on paper in the definition, so the published figures they rest on sit beside
the grid, sources cited; the sweep builds each once (``psring profile --on-paper``) in
``OUT/profiles/NAME/`` before the first point, and a ``device_profile`` that names one
uses it:

    [profiles.resnet101]         # psring profile --on-paper flags, with _ for -
    model = "resnet101"
    batch_size = 64              # per device
    step_ms = 536
    source = "Horovod README, October 2017: 119.4 images/s on one Pascal GPU"
    [grid]
    model = [{model = "resnet101", device_profile = "resnet101"}]

A ``device_profile`` that is a relative path is read from the definition's folder when
the file is there (``experiments/seeds_horovod_h100.toml`` names
``profiles/h100/resnet101.json``), else from the current folder.

``batch_per_worker`` (in base or grid) sets ``batch_size = batch_per_worker * workers``
(weak scaling); otherwise ``batch_size`` is the global batch (strong scaling).
Settings that do not apply to a strategy are normalized, and points that become the
same run are run once: ``single`` runs 1 worker, ``servers`` is 1 for strategies
without servers, ``max_staleness`` is -1 where it does not apply, ``device_link`` is dropped for
strategies without traffic inside a host it can time, and a
``slow_worker`` that names no worker of the point (``1:3`` for ``single``) is dropped.

Each point runs in ``OUT/<point id>/`` and is done when its ``point.json`` says so
(written atomically, last). Running the sweep again skips done points and reruns the
others, so an interrupted sweep resumes where it stopped; a point that fails is
recorded with its error in ``point.json`` and the sweep goes on. Points run one after
another: on a small machine concurrent runs would measure each other.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from psring.cluster.spec import derived_hosts
from psring.comm import interconnect
from psring.config import RunConfig, validate
from psring.errors import ConfigError, PsringError, RunFailed
from psring.records.runlog import atomic_write_json
from psring.runs.launch import launch as launch_run
from psring.runs.profiling import PAPER_FLAGS, paper_profile_from
from psring.strategies import STRATEGIES

SWEEP_FILE = "sweep.json"
POINT_FILE = "point.json"
#: keys of a definition's [report] table
REPORT_KEYS = {"target_accuracy", "title"}
#: grid keys that are not RunConfig fields
EXTRA_KEYS = {"batch_per_worker"}
#: where a sweep builds its [profiles] (under its --out)
PROFILES_DIR = "profiles"


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read sweep definition {path}: {e.strerror}; pass a file "
                          f"such as experiments/intensity.toml.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"sweep definition {path} is not valid TOML: {e}") from None


@dataclass
class Point:
    id: str
    repeat: int
    config: RunConfig
    varied: dict[str, Any]


@dataclass
class Sweep:
    name: str
    description: str = ""
    look_at: str = ""
    repeats: int = 1
    base: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the definition's folder (set by :meth:`load`): a relative device_profile path is
    #: read from there when the file is there, so a shipped sweep runs from any folder
    home: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        valid = {f.name for f in fields(RunConfig)} | EXTRA_KEYS
        self._check_profiles()
        for where, table in (("base", self.base), ("grid", self.grid)):
            unknown = sorted(set(table) - valid - (self.cases if where == "grid" else set()))
            if unknown:
                raise ConfigError(f"sweep {self.name!r}: unknown key(s) {', '.join(unknown)} "
                                  f"in [{where}]; valid keys are the `psring run` flags with "
                                  f"_ for -: {', '.join(sorted(valid))} (in [grid], a key "
                                  f"that is no flag names cases when every value is a table "
                                  f"such as {{{unknown[0]} = \"none\"}}).")
        for k in ("out", "master_port", "server_addrs"):
            if k in self.base or k in self.grid:
                raise ConfigError(f"sweep {self.name!r}: {k!r} is chosen per point by the "
                                  f"sweep; remove it from the definition.")
        for k, v in self.grid.items():
            if not isinstance(v, list) or not v:
                raise ConfigError(f"sweep {self.name!r}: grid.{k} must be a non-empty list "
                                  f"(got {v!r}); put single values in [base].")
            tables = [e for e in v if isinstance(e, dict)]
            for e in tables:  # a value that brings settings of its own (see the docstring)
                if k not in e or set(e) - valid - {k}:
                    raise ConfigError(
                        f"sweep {self.name!r}: a table in grid.{k} must set {k} (it names "
                        f"the point) and only `psring run` flags; got {e!r}.")
            names = [e[k] if isinstance(e, dict) else e for e in v]
            if tables and len(set(map(str, names))) != len(names):
                raise ConfigError(f"sweep {self.name!r}: grid.{k} names a value twice "
                                  f"({names}); each table's {k} must differ.")
        unknown = sorted(set(self.report) - REPORT_KEYS)
        if unknown:
            raise ConfigError(f"sweep {self.name!r}: unknown [report] key(s) "
                              f"{', '.join(unknown)}; valid: {', '.join(sorted(REPORT_KEYS))}.")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"sweep {self.name!r}: repeats must be an integer >= 1 "
                              f"(got {self.repeats!r}).")

    @property
    def cases(self) -> set[str]:
        """The grid keys that are no `psring run` flag: each names cases (a table per
        value, its own key the case's name only)."""
        flags = {f.name for f in fields(RunConfig)} | EXTRA_KEYS
        return {k for k, v in self.grid.items() if k not in flags and isinstance(v, list)
                and v and all(isinstance(e, dict) for e in v)}

    def _check_profiles(self) -> None:

        valid = {f.name for f in fields(RunConfig)} | set(PAPER_FLAGS) | {"host_copy"}
        for name, spec in self.profiles.items():
            where = f"sweep {self.name!r}: [profiles.{name}]"
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"{where}: a profile's name must be letters, digits, '.', "
                                  f"'_' or '-' (it names a directory).")
            if not isinstance(spec, dict) or "model" not in spec:
                raise ConfigError(f"{where} must be a table that sets at least model (the "
                                  f"`psring profile --on-paper` flags, with _ for -).")
            unknown = sorted(set(spec) - valid)
            if unknown:
                raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: the "
                                  f"`psring profile --on-paper` flags with _ for - "
                                  f"({', '.join(PAPER_FLAGS)}, model, batch_size, ...).")

    def changed(self, **changes: Any) -> "Sweep":
        """This sweep with some of its definition changed (--repeats, compare's grid),
        still read from its folder."""
        return dataclasses.replace(self, **changes)

    def _profile_path(self, given: Any, out: Path) -> Any:
        """A point's device_profile: a [profiles] name (in the point's id, not its path)
        as the folder the sweep builds it in; a relative path, from the definition's
        folder where the file is there (else as given: from the current folder)."""
        if given in self.profiles:
            return str(out / PROFILES_DIR / given)
        if isinstance(given, str) and given and not os.path.isabs(given) and self.home \
                and os.path.exists(os.path.join(self.home, given)):
            return os.path.join(self.home, given)
        return given

    def build_profiles(self, out: Path) -> None:
        """Build each [profiles] entry once, in OUT/profiles/NAME (kept on a rerun)."""

        for name, spec in self.profiles.items():
            dest = Path(out) / PROFILES_DIR / name
            if not (dest / "profile.json").exists():  # written atomically, last
                try:
                    paper_profile_from(spec, dest)
                except ConfigError as e:
                    raise ConfigError(f"sweep {self.name!r}: [profiles.{name}]: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Sweep":
        path = Path(path)
        raw = _load_toml(path)
        known = {"description", "look_at", "repeats", "base", "grid", "report", "profiles"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"sweep definition {path}: unknown top-level key(s) "
                              f"{', '.join(unknown)}; valid: {', '.join(sorted(known))}.")
        return cls(name=path.stem, home=str(path.resolve().parent), **raw)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "look_at": self.look_at,
                "repeats": self.repeats, "base": self.base, "grid": self.grid,
                "report": self.report, "profiles": self.profiles}

    def points(self, out: Path) -> list[Point]:
        """Every distinct run of the sweep, in a stable order (strategies together). The
        sweep's [profiles] are built first (once, in OUT/profiles): points are validated
        runs, and a run's --device-profile must exist."""

        self.build_profiles(out)

        keys = list(self.grid)
        seen: dict[str, Point] = {}
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            values = dict(self.base)
            for k, v in zip(keys, combo):
                values.update(v if isinstance(v, dict) else {k: v})
            varied = {k: v[k] if isinstance(v, dict) else v for k, v in zip(keys, combo)}
            for k in self.cases:
                values.pop(k, None)  # (a case's name, not a flag)
            strategy = STRATEGIES.get(values.get("strategy", "single"))
            from_cases = {f for k, v in zip(keys, combo) if k in self.cases for f in v}
            if not _applies(values, strategy, from_cases):
                continue
            if strategy.caps.max_workers is not None:
                values["workers"] = min(values.get("workers", 1), strategy.caps.max_workers)
            if not strategy.caps.uses_servers:
                values["servers"] = 1
            if not strategy.caps.supports_staleness_bound:
                values["max_staleness"] = -1
            if interconnect.not_timed(strategy.caps, values.get("reduce", "sum")):
                values["device_link"] = ""  # nothing runs inside a host to time
            slow = str(values.get("slow_worker") or "")
            if slow and int(slow.split(":")[0] or 0) >= values.get("workers", 1):
                values["slow_worker"] = ""  # no such worker (single): nobody is slowed
            _normalize_cluster(values, strategy)
            per_worker = values.pop("batch_per_worker", None)
            if per_worker is not None:
                values["batch_size"] = int(per_worker) * values.get("workers", 1)
            # the point's identity: the settings the grid varies, after normalization
            shown = {k: varied[k] if k in self.cases else
                     values.get(k, getattr(RunConfig, k, None))
                     for k in keys if k != "batch_per_worker"}
            if "batch_per_worker" in keys:
                shown["batch_size"] = values["batch_size"]
            base_id = "_".join(f"{k}={_slug(v)}" for k, v in shown.items()) or "point"
            if values.get("device_profile"):
                values["device_profile"] = self._profile_path(values["device_profile"], out)
            for r in range(self.repeats):
                pid = f"{base_id}_r{r}"
                if pid in seen:
                    continue  # normalized into a point already listed
                try:
                    cfg = validate(RunConfig(**{**values, "out": str(out / pid)}))
                except ConfigError as e:
                    raise ConfigError(f"sweep {self.name!r}: point {pid} is not a valid "
                                      f"run: {e}") from None
                seen[pid] = Point(pid, r, cfg, varied)
        return list(seen.values())


def _applies(values: dict[str, Any], strategy: Any, from_cases: set[str]) -> bool:
    """Whether a case's faults can happen under the point's strategy (a fault case
    crossed with every strategy): a server killed needs servers, backup workers a
    strategy that takes them. Only flags a case set (``from_cases``) drop a point; the
    same flags in [base] or a plain grid key are the run's own, and validated as such."""
    if "kill_server" in from_cases and values.get("kill_server") \
            and not strategy.caps.uses_servers:
        return False
    return not ("backup_workers" in from_cases and values.get("backup_workers")
                and not strategy.caps.supports_backups)


def _normalize_cluster(values: dict[str, Any], strategy: Any) -> None:
    """Emulation settings that cannot apply to a point are dropped (psring.cluster.spec): a
    strategy of one host runs on one; no more hosts than workers; servers are placed
    only where there are servers; links, their delay, loss and queues only where traffic
    crosses hosts."""
    workers = values.get("workers", 1)
    per_host = values.get("workers_per_host", 0)
    hosts = derived_hosts(workers, values.get("hosts", 1), per_host)
    if strategy.caps.max_hosts is not None and hosts > strategy.caps.max_hosts:
        hosts, per_host = strategy.caps.max_hosts, 0
    hosts = min(hosts, workers)
    if per_host:  # as many hosts as G per host takes, whatever else was given
        hosts = -(-workers // per_host)
    values["hosts"] = hosts
    values["workers_per_host"] = 0 if per_host >= workers or hosts == 1 else per_host
    if not strategy.caps.uses_servers:
        values["server_placement"] = "colocated"
        values["transport"] = "auto"
    # hosts beyond one, or servers on hosts of their own: Cluster.emulated's rule
    own = strategy.caps.uses_servers and values.get("server_placement") == "own-hosts"
    if values["hosts"] == 1 and not own:
        values.update(link="", delay="", loss=0.0, loss_burst=1.0, link_buffer="",
                      switch="fifo", loss_in="forwarder", tcp_rto_min="")
    elif values.get("transport") == "ipc":  # hosts talk over their links
        values["transport"] = "auto"


def _slug(v: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "-", str(v))


def point_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / POINT_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


@dataclass
class SweepResult:
    out: Path
    ran: int
    skipped: int
    failed: list[str]


def run_sweep(sweep: Sweep, out: Path,
              on_point: Callable[[Point, str, float], None] | None = None,
              launch: Callable | None = None,
              on_start: Callable[[int], None] | None = None) -> SweepResult:
    """Run every point not already done; record failures and go on. ``on_start(total)``
    is called once the points are known, ``on_point(point, status, seconds)`` after each
    point (for progress displays)."""
    if launch is None:
        launch = launch_run
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = sweep.points(out)
    if on_start is not None:
        on_start(len(points))
    atomic_write_json(out / SWEEP_FILE, {**sweep.to_dict(),
                                         "points": [p.id for p in points]})
    ran, skipped, failed = 0, 0, []
    for p in points:
        run_dir = Path(p.config.out)
        status = point_status(run_dir)
        if status is not None and status.get("status") == "ok":
            skipped += 1
            if on_point:
                on_point(p, "skipped", 0.0)
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a partial or failed attempt: start clean
        t0 = time.monotonic()
        record: dict[str, Any] = {"id": p.id, "repeat": p.repeat, "varied": p.varied,
                                  "config": p.config.to_dict(), "started": time.time()}
        try:
            launch(p.config)
            record["status"] = "ok"
        except RunFailed as e:
            if e.exit_code in (130, 143):
                raise  # the user stopped the sweep: leave this point undone
            record.update(status="failed", error=str(e))
        except PsringError as e:
            record.update(status="failed", error=str(e))
        record["seconds"] = round(time.monotonic() - t0, 3)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / POINT_FILE, record)
        ran += 1
        if record["status"] != "ok":
            failed.append(p.id)
        if on_point:
            on_point(p, record["status"], record["seconds"])
    return SweepResult(out, ran, skipped, failed)


def run_sweep_with_progress(sweep: Sweep, out: Path) -> SweepResult:
    """run_sweep with a progress bar and ETA on stderr (plain lines when not a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("points"), TimeElapsedColumn(), TextColumn("ETA"),
                  TimeRemainingColumn(), console=console,
                  # redrawn on each point, not by a thread: a thread would keep the
                  # runs' workers from being forked (psring.runtime.forking)
                  auto_refresh=False) as bar:
        task = bar.add_task(f"sweep {sweep.name}", total=None)

        def on_point(p: Point, status: str, seconds: float) -> None:
            if status == "failed":
                bar.console.print(f"[red]point {p.id} failed[/red]; recorded in "
                                  f"{Path(p.config.out) / POINT_FILE}")
            elif not console.is_terminal:
                bar.console.print(f"point {p.id}: {status} ({seconds:.1f} s)")
            bar.advance(task)
            bar.refresh()

        def on_start(total: int) -> None:
            bar.update(task, total=total)
            bar.refresh()

        return run_sweep(sweep, Path(out), on_point, on_start=on_start)


def default_out(sweep: Sweep) -> Path:
    return Path("runs") / f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def format_summary(res: SweepResult) -> str:
    msg = (f"sweep {res.out}: {res.ran} point(s) run, {res.skipped} already done")
    if res.failed:
        msg += (f", {len(res.failed)} failed ({', '.join(res.failed[:5])}"
                f"{', ...' if len(res.failed) > 5 else ''}; errors in each point.json)")
    return msg
