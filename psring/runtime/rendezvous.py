"""One launch across hosts: what the workers of a torchrun launch learn from the
rendezvous they share, and the deadline that holds on every host.

Under ``psring run`` the launcher supervises every process and hands each the run's id
(PSRING_RUN_ID). Workers started by ``torchrun`` on several hosts have no such launcher:
what they share is torchrun's key-value store (at MASTER_ADDR:MASTER_PORT, kept by node
0's torchrun agent). Through it :func:`join`

- agrees on **one run id**: rank 0 draws a fresh one and writes it; every rank reads it,
  whatever its host's ``--out`` (parameter servers name runs by it; a second launch has
  a new store, so a new id);
- **registers every rank** (host, address, interface, pid, run directory) and waits up
  to ``--timeout`` for all of them, naming those that never arrive;
- keeps each rank's **stage** ("creating the gloo process group", "step 812") in the
  store, so a worker that times out says how far each other one got, and publishes the
  **first failure**, so the workers on other hosts stop within a second or two instead
  of waiting out their own timeouts;
- runs a **watchdog**: a worker with no progress for ``--timeout`` + :data:`GRACE_S`
  exits with status 1 saying what it waited for, whatever call it is stuck in (gloo's
  connection set-up, for one, waits up to 5 times its timeout).

torchrun's own rendezvous, before any psring code runs, is bounded by torchrun's
``--rdzv-conf timeout=SECONDS`` (default 600), not by ``--timeout``: docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

from psring.errors import PsringError
from psring.records.runlog import host_name

RUN_ENV = "PSRING_RUN_ID"
#: the run's flags a script's worker reads in psring.init() (psring.library): a JSON list
#: psring launch writes, or a shell string a user gives under torchrun
RUN_ARGS_ENV = "PSRING_RUN_ARGS"
#: seconds past --timeout before the watchdog ends a worker that made no progress; and
#: the time a failing worker has to shut down. torch's own timeouts (the process
#: group's, the store's) are set to --timeout, so they fire first when they work.
GRACE_S = 10.0
#: how often a worker's stage goes to the store and the store is asked for failures
BEAT_S = 1.0
#: a store operation of the watchdog or of a failing worker waits at most this long
STORE_OP_S = 2.0
#: the store's key with the newest attempt of the launch any rank began
NEWEST = "psring/newest"


def under_torchrun(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Started with a peer's rendezvous (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR set by
    hand) rather than by ``psring run``, which sets PSRING_RUN_ID."""
    return not env.get(RUN_ENV) and bool(env.get("MASTER_ADDR")) \
        and bool(env.get("MASTER_PORT")) and bool(env.get("WORLD_SIZE"))


class Launch:
    """A worker's view of its launch under ``psring run``: the launcher supervises, so
    nothing to agree on and nothing to watch. The torchrun case is :class:`Rendezvous`."""

    kind = "psring run"

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.run_id = os.environ.get(RUN_ENV, "")
        self.peers: list[dict] = []

    def stage(self, what: str, step: int | None = None, waiting: bool = True) -> None:
        """This worker got as far as ``what`` (progress, for the watchdog). ``waiting``:
        it now waits on the other workers (the watchdog's deadline runs), or False: it
        works on its own (building the model, a download), which no deadline bounds."""

    def done(self) -> None:
        """Past the last wait on the others: a later failure elsewhere is not this
        worker's."""

    def fail(self, message: str) -> None:
        """This worker failed with ``message``: tell the others."""

    def explain(self) -> str:
        """What the other workers last reported ('' when nothing is known)."""
        return ""

    def describe(self) -> dict[str, Any]:
        """For the manifest."""
        return {"launcher": self.kind, "run_id": self.run_id}

    @property
    def attempt(self) -> int:
        """Which start of the launch this is: 1, or 1 + the restarts before it (torchrun's
        --max-restarts; psring run's restarts are new launches)."""
        return 1

    def mark(self, name: str) -> None:
        """Tell the others that ``name`` is done (:meth:`wait_mark`)."""

    def wait_mark(self, name: str, what: str) -> None:
        """Wait up to --timeout for another rank's :meth:`mark` of ``name``."""

    def close(self) -> None:
        pass


def _store(host: str, port: int, rank: int, world: int, timeout: float):
    """The rendezvous store as torch's env:// rendezvous opens it: a client of the
    agent's store under torchrun (TORCHELASTIC_USE_AGENT_STORE), else rank 0 serves."""
    from torch.distributed import TCPStore

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return TCPStore(host, port, world, is_master=rank == 0 and not agent,
                    timeout=timedelta(seconds=timeout), multi_tenant=not agent,
                    wait_for_workers=False)


class Rendezvous(Launch):
    kind = "torchrun"

    def __init__(self, rank: int, world: int, timeout: float, record: dict[str, Any],
                 log: logging.Logger, prefix: str):
        super().__init__(rank, world)
        self.timeout = timeout
        self.log = log
        self.prefix = prefix  # "[worker R/W]", for the watchdog's last words
        self.host = os.environ["MASTER_ADDR"]
        self.port = int(os.environ["MASTER_PORT"])
        self.where = f"{self.host}:{self.port}"
        self.ns = ""  # psring/<attempt>/, once the store is reached (_attempt)
        self.record = {**record, "rank": rank}
        self._stage = {"stage": "joining the run", "step": None, "time": time.time()}
        self._waiting = True
        self._progress = time.monotonic()
        self._finished = False
        self._shutdown_by: float | None = None
        self._seen: dict[int, dict] = {}  # each rank's stage as last read from the store
        self._contact = time.monotonic()  # the watchdog's last answer from the store
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            self.store = _store(self.host, self.port, rank, world, timeout)
            self.ns = _attempt(self.store, rank)
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise PsringError(
                f"worker {rank}: could not reach the rendezvous store at {self.where} "
                f"(MASTER_ADDR:MASTER_PORT, kept by node 0's torchrun) within --timeout "
                f"{timeout:g} s: {_first_line(e)}. Check that node 0's torchrun runs and "
                f"that this host reaches {self.host}.") from None
        self._peer_failure: str | None = None
        self._progress = time.monotonic()  # the join's --timeout starts now
        self._threads = [threading.Thread(target=target, name=f"psring-{name}", daemon=True)
                         for name, target in (("watchdog", self._watchdog),
                                              ("heartbeat", self._heartbeat))]
        for t in self._threads:
            t.start()

    def key(self, name: str) -> str:
        return self.ns + name

    # -- joining ------------------------------------------------------------------------
    def join(self) -> None:
        """Agree on the run id and wait for every rank (up to --timeout)."""
        try:
            self._join()
        except PsringError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's errors (its host went away)
            raise PsringError(
                f"worker {self.rank}: the rendezvous store at {self.where} failed while the "
                f"workers joined: {_first_line(e)}. Node 0's torchrun may have ended: see "
                f"its output.") from None

    def _join(self) -> None:
        s = self.store
        if self.rank == 0:
            s.set(self.key("run"), uuid.uuid4().hex)  # before rank 0 counts as arrived
        s.set(self.key(f"stage/{self.rank}"), json.dumps(self._stage))
        s.set(self.key(f"rank/{self.rank}"), json.dumps(self.record))
        keys = [self.key(f"rank/{r}") for r in range(self.world)]
        self._wait_for(keys, lambda: self._missing(keys))
        self.run_id = s.get(self.key("run")).decode()
        self.peers = [json.loads(v) for v in s.multi_get(keys)]
        os.environ[RUN_ENV] = self.run_id  # psring.records.runlog.run_id: servers, shared memory
        self.stage("joined")

    @property
    def attempt(self) -> int:
        return int(self.ns.split("/")[1]) if self.ns else 1

    def mark(self, name: str) -> None:
        self.store.set(self.key(f"mark/{name}"), "1")

    def wait_mark(self, name: str, what: str) -> None:
        self._wait_for([self.key(f"mark/{name}")],
                       lambda: f"worker {self.rank}: waited --timeout {self.timeout:g} s for "
                               f"{what}. {self.explain()}")

    def _wait_for(self, keys: list[str], missing: Callable[[], str]) -> None:
        """Until every key is in the store: at most --timeout (then a PsringError saying
        ``missing()``), stopping at once when another rank publishes its failure."""
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise PsringError(missing())
            time.sleep(0.05)

    def _missing(self, keys: list[str]) -> str:
        here = [r for r, k in enumerate(keys) if self.store.check([k])]
        gone = [r for r in range(self.world) if r not in here]
        known = "; ".join(f"rank {p['rank']} on {p['host']}" for p in
                          (json.loads(self.store.get(keys[r])) for r in here))
        return (f"worker {self.rank}: waited --timeout {self.timeout:g} s for every worker "
                f"to join the run through the rendezvous store at {self.where}; "
                f"{_ranks(gone)} never arrived (arrived: {known or 'none'}). A host's "
                f"torchrun may have started late or not at all, or its worker failed before "
                f"joining: see that host's output. Every host runs the same command, with "
                f"its own --node-rank.")

    def _raise_if_failed(self) -> None:
        failure = self._failure(self.store)
        if failure is not None:
            raise PsringError(failure)

    def _failure(self, store) -> str | None:
        """The first failure another rank published, as a sentence (None: none)."""
        if not store.check([self.key("failed")]):
            return None
        f = json.loads(store.get(self.key("failed")))
        if f.get("rank") == self.rank:
            return None
        return (f"worker {self.rank}: stopping, because worker {f.get('rank')} on "
                f"{f.get('host')} failed: {f.get('error')}")

    def _superseded(self, store) -> str | None:
        """A newer attempt of the launch began: torchrun restarted a worker elsewhere
        (one that died without a word, killed), and this attempt can never finish."""
        if not store.check([NEWEST]):
            return None
        newest = int(store.get(NEWEST))
        if newest <= self.attempt:
            return None
        return (f"worker {self.rank}: stopping, because torchrun restarted the workers of "
                f"another host (attempt {newest} of the launch began): a worker of this "
                f"attempt died (see the other hosts' output).")

    # -- progress and failure -----------------------------------------------------------
    def stage(self, what: str, step: int | None = None, waiting: bool = True) -> None:
        with self._lock:
            self._stage = {"stage": what, "step": step, "time": time.time()}
            self._waiting = waiting
            self._progress = time.monotonic()

    def done(self) -> None:
        self._finished = True
        self.stage("finished")

    def fail(self, message: str) -> None:
        """Publish the failure (the first one in the run wins) and allow GRACE_S for the
        shutdown: the watchdog ends the process if it takes longer."""
        self._shutdown_by = time.monotonic() + GRACE_S
        value = _failure_value(self.rank, self.record.get("host"), message)
        _bounded(lambda: self._client().compare_set(self.key("failed"), "", value))
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # rank 0 serves the store itself here: stay until the others have read it
            time.sleep(2 * BEAT_S + 0.5)

    # -- the watchdog ---------------------------------------------------------------------
    # Two threads: the watchdog only keeps time (no I/O, so nothing can stall it), and a
    # heartbeat talks to the store. A TCPStore call whose peer vanished with a cut link
    # can block past its own timeout: only the heartbeat may be stuck in one.
    def _watchdog(self) -> None:
        while not self._stop.wait(BEAT_S / 4):
            now = time.monotonic()
            if self._shutdown_by is not None and now > self._shutdown_by:
                self._die(f"worker {self.rank}: shutting down after the error above took "
                          f"more than {GRACE_S:g} s; exiting now.")
            with self._lock:
                stage, idle, waiting = dict(self._stage), now - self._progress, self._waiting
            if waiting and idle > self.timeout + GRACE_S:
                self._die(f"worker {self.rank}: no progress for {idle:.0f} s (--timeout "
                          f"{self.timeout:g} s + {GRACE_S:g} s grace) at: "
                          f"{_stage_text(stage)}. {self.explain()}")
            failure = self._peer_failure
            if failure is not None and not self._finished and self._shutdown_by is None:
                self._die(failure)

    def _heartbeat(self) -> None:
        client = None
        last_sent: dict | None = None
        while not self._stop.wait(BEAT_S):
            try:
                if client is None:
                    client = self._client()
                with self._lock:
                    stage = dict(self._stage)
                if stage != last_sent:
                    client.set(self.key(f"stage/{self.rank}"), json.dumps(stage))
                    last_sent = stage
                self._peer_failure = self._failure(client) or self._superseded(client)
                if self.peers:
                    keys = [self.key(f"stage/{r}") for r in range(self.world)]
                    seen = {r: json.loads(v) for r, v in enumerate(client.multi_get(keys))}
                    with self._lock:
                        self._seen = seen
                self._contact = time.monotonic()
            except Exception:  # noqa: BLE001 - an unreachable store is itself a finding
                client = None  # a timed-out connection may be out of step: a new one
                continue

    def _client(self):
        from torch.distributed import TCPStore

        # its own connection: the main thread's may be blocked in a long wait
        return TCPStore(self.host, self.port, self.world, is_master=False,
                        timeout=timedelta(seconds=STORE_OP_S), wait_for_workers=False)

    def _die(self, message: str) -> None:
        sys.stderr.write(f"{self.prefix} error: {message}\n")
        sys.stderr.flush()
        os._exit(1)

    def explain(self) -> str:
        silent = time.monotonic() - self._contact
        if silent > 3 * BEAT_S + STORE_OP_S:
            return (f"The rendezvous store at {self.where} (on node 0's host) has not "
                    f"answered this worker for {silent:.0f} s either: this host has lost its "
                    f"connection to node 0's host (a cut link, or that host is down).")
        with self._lock:
            seen = dict(self._seen)
        if not seen:
            return ""
        now = time.time()
        parts = []
        for p in self.peers:
            r = p["rank"]
            if r == self.rank or r not in seen:
                continue
            s = seen[r]
            parts.append(f"rank {r} ({p.get('host')}, {p.get('address') or '?'}): "
                         f"{_stage_text(s)}, "
                         f"{now - s['time']:.0f} s ago")
        return ("What the other workers last reported to the rendezvous store: "
                + "; ".join(parts) + ".") if parts else ""

    def describe(self) -> dict[str, Any]:
        return {"launcher": self.kind, "run_id": self.run_id, "rendezvous": self.where,
                "nodes": len({p.get("node") for p in self.peers}),
                "hosts": count_hosts(self.peers), "workers": self.peers}

    def close(self) -> None:
        """Stop the watchdog and the heartbeat, waiting for a store operation the
        heartbeat is in: a script's interpreter that exits while a daemon thread is in
        a TCPStore call ends that thread in C++ when it takes the GIL back, and the
        process aborts ("terminate called without an active exception", SIGABRT) after
        the run succeeded. A store that no longer answers is waited for at most
        STORE_OP_S + BEAT_S."""
        self._stop.set()
        deadline = time.monotonic() + STORE_OP_S + BEAT_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


_current: Launch = Launch(0, 1)


def current() -> Launch:
    """The launch this process joined (a no-op Launch before :func:`join`)."""
    return _current


def join(rank: int, world: int, timeout: float, record: dict[str, Any],
         log: logging.Logger, prefix: str) -> Launch:
    """The launch this worker belongs to (see the module's docstring); under torchrun,
    joined: the run id agreed and every rank arrived, or a PsringError naming who did
    not."""
    global _current
    if not under_torchrun():
        _current = Launch(rank, world)
        return _current
    _current = rdzv = Rendezvous(rank, world, timeout, record, log, prefix)
    rdzv.join()
    hosts = count_hosts(rdzv.peers)
    log.info("run %s: %d worker%s on %d host%s joined through %s", rdzv.run_id, world,
             "s" * (world > 1), hosts, "s" * (hosts > 1), rdzv.where)
    return rdzv


def report_failure(rank: int, message: str) -> None:
    """Tell the other workers of a torchrun launch that this one failed, so they stop
    now rather than at their timeout; also before :func:`join` (a bad flag on one host),
    through a short-lived connection to the store. Best effort: the store may be gone."""
    if isinstance(_current, Rendezvous):
        _current.fail(message)
        return
    if not under_torchrun():
        return
    value = _failure_value(rank, host_name(), message)

    def publish() -> None:
        store = _store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), -1,
                       int(os.environ["WORLD_SIZE"]), STORE_OP_S)
        store.compare_set(_attempt(store, rank) + "failed", "", value)

    _bounded(publish)


def _bounded(call: Callable[[], object], seconds: float = STORE_OP_S) -> None:
    """``call()`` (a store operation), given at most ``seconds``: past that, or on an
    error, the caller goes on without it (the thread is a daemon)."""
    def run() -> None:
        try:
            call()
        except Exception:  # noqa: BLE001 - best effort: the store may be gone
            pass

    t = threading.Thread(target=run, name="psring-store-op", daemon=True)
    t.start()
    t.join(seconds)


def _stage_text(stage: dict) -> str:
    return stage["stage"] if stage.get("step") is None else \
        f"{stage['stage']}, after step {stage['step']}"


def count_hosts(peers: list[dict]) -> int:
    """Hosts among the workers' records: a host is its name and its address toward
    MASTER_ADDR (machines cloned from one image may share a host name)."""
    return len({(p.get("host"), p.get("address")) for p in peers})


def _attempt(store: Any, rank: int) -> str:
    """psring's keys in the store for this attempt of the launch. A restarted torchrun
    worker group may share the store with the attempts before (the c10d backend keeps
    it across rounds), and TORCHELASTIC_RESTART_COUNT is each agent's own count (a
    membership change does not raise it). Every rank of a new round starts once, so
    counting this rank's starts in the store gives all ranks the same number."""
    attempt = store.add(f"psring/starts/{rank}", 1)
    # (ranks of older attempts watch it: _superseded); it only grows, whoever is late
    seen = ""
    while not seen or int(seen) < attempt:
        now = store.compare_set(NEWEST, seen, str(attempt)).decode()
        if now in (seen, str(attempt)) or int(now) >= attempt:
            break
        seen = now
    return f"psring/{attempt}/"


def _failure_value(rank: int, host: str | None, message: str) -> str:
    return json.dumps({"rank": rank, "host": host, "error": message[:2000],
                       "time": time.time()})


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
