"""Replaying a measured run: the simulator's step time for the cluster a run ran on,
given the run's own compute (``psring report`` shows it beside the measured step).

    from psring.predict.replay import replay
    p = replay("runs/ps", cal)      # a psring.predict.sim.simulate.Prediction, or None

As dPRO replays a profiled trace (Hu et al., MLSys 2022): the run's own phase times and
bucket launches (psring.records.profile.Profile.from_run) are kept, and its cluster's
communication is played out by psring.predict.sim.simulate. Unlike the simulator, this
module needs the strategy registry (which strategy sends what), and with it torch.
"""

from __future__ import annotations

from typing import Any

from psring.comm.interconnect import alpha_beta, on_host, parse
from psring.config import cluster_of
from psring.errors import PsringError
from psring.predict.calibration import Calibration
from psring.predict.sim.simulate import FLOW_DRAWS, Prediction, is_costed, simulate
from psring.records.profile import Profile
from psring.records.runlog import read_manifest
from psring.strategies import STRATEGIES


def shared_cores(manifest: dict[str, Any]) -> int | None:
    """The cores a run's processes shared, where its compute and communication competed
    for them: every process started by ``psring run`` on this machine (emulated hosts
    included) computing for real. None where each worker had its own device, or its
    compute was device mode's (a wait, not CPU work), or the machine is unknown."""
    cores = (manifest.get("host") or {}).get("cores")
    launcher = (manifest.get("launch") or {}).get("launcher")
    mode = (manifest.get("compute") or {}).get("mode")
    if launcher != "psring run" or mode != "real" or manifest.get("device", "cpu") != "cpu":
        return None
    return int(cores) if isinstance(cores, int) and cores > 0 else None


def _with_host_copies(prof: Profile, manifest: dict[str, Any]) -> Profile:
    """The run's profile with the host copies its device workers made (a device-mode
    run's manifest records them; before it did, its --device-link's host describes them)."""
    from dataclasses import replace


    compute = manifest.get("compute") or {}
    if compute.get("mode") != "device":
        return prof
    if "host_copy" not in compute:
        return on_host(prof, manifest["config"].get("device_link") or "")
    # (Profile checks it: a ValueError, and the run is not replayed)
    return replace(prof, host_copy=compute["host_copy"])


def replay(run_dir: Any, cal: Calibration, inside: tuple[float, float] | None = None,
           flow_seed: int = 0, draws: int = FLOW_DRAWS) -> Prediction | None:
    """The simulator's step time for a measured run, from the run's own profile (its
    compute phases and when its buckets were launched; Profile.from_run): what the run's
    communication should have cost on its cluster, given its compute. None for a run
    the simulator cannot read. ``inside``: (α, β) of each host's own interconnect, for
    what the run would take with, say, NVLink inside its hosts (simulate's); by default
    the run's own --device-link where it had one (psring.comm.interconnect);
    ``flow_seed``, ``draws``: the first draw of TCP's uneven shares and how many to
    average (simulate's; a parameter server's step is a random process)."""
    try:
        manifest = read_manifest(run_dir)
        cfg = manifest["config"]
        cls = STRATEGIES.get(cfg["strategy"])
        # each step's slowest worker: the one a synchronous step waits for, and the one
        # whose step a report measures (the slowest worker's step, async runs included)
        prof = Profile.from_run(run_dir, worker=None)
        prof = _with_host_copies(prof, manifest)
    except (PsringError, KeyError, OSError, ValueError):
        return None
    if not is_costed(cls.caps.cost_model) or cfg.get("loss_tolerance"):
        # (bounded-loss pushes: their datagrams' CPU and resend rounds are not priced)
        return None
    # a time-scaled run: this machine's software costs are 1/S on the described clock
    cal = cal.faster(float(cfg.get("time_scale") or 1.0))
    if inside is None and cfg.get("device_link"):

        try:
            inside = alpha_beta(parse(cfg["device_link"]))
        except PsringError:
            return None
    compress = cfg.get("compress", "none") if cls.caps.supports_compression else "none"
    try:
        # the run's own compute already carries its share of the cores: no stretch
        return simulate(prof, cluster_of(cfg), cls.caps.cost_model, cal, compress=compress,
                        bucket_mb=float(cfg.get("bucket_mb", 25.0)),
                        update_on=cfg.get("update_on") or "server",
                        reduce=cfg.get("reduce") or "sum", inside=inside,
                        cores=shared_cores(manifest), stretch=False, flow_seed=flow_seed,
                        draws=draws)
    except (ValueError, RuntimeError):
        return None
