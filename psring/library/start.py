"""Setting a script's worker up: the run it belongs to, then the worker itself.

    dist = psring.init()                      # under psring launch: the launch's run
    dist = psring.init(strategy="single")     # alone: one worker, psring run's settings

Where the run comes from: ``psring launch`` gives each process the run's flags in
``PSRING_RUN_ARGS`` (a JSON list; under torchrun a user writes them as a shell string);
without it, psring.init's arguments (psring run's settings by field name). What a
script's run cannot do is refused here by name (:func:`script_refusals`), and the
process gets what psring's own workers get (psring.workers.entry): to die with its
parent, a fault handler, failures told to the other hosts under torchrun.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shlex
import signal
import sys
from typing import Any

import torch

from psring.config import RunConfig, add_config_flags, config_from_args, given_fields, validate
from psring.errors import ConfigError
from psring.library.session import Distributed
from psring.records.runlog import default_out
from psring.runtime import rendezvous
from psring.runtime.allocator import keep_freed_memory
from psring.runtime.process import die_with_parent, free_port
from psring.runtime.rendezvous import RUN_ARGS_ENV
from psring.workers import entry

#: the run's flags that ``psring launch`` gives each process it starts (a JSON list)
ENV = RUN_ARGS_ENV


def init(strategy: str | None = None, **settings: Any) -> Distributed:
    """This process's worker of a run: under ``psring launch`` the run it started (any
    argument given must agree with it); under torchrun, or alone (one worker), the run
    the arguments describe (``strategy`` and any ``psring run`` setting by field name:
    ``out``, ``steps``, ``update_on``, ...)."""
    # the script's random numbers stay its own, whatever the set-up draws (a seeded
    # model build in validation once reseeded them; tests/unit/test_library.py)
    with torch.random.fork_rng(devices=[]):
        cfg = validate(_config(strategy, settings))
        script_refusals(cfg)
        _harden()
        return Distributed.start(cfg)


def _config(strategy: str | None, settings: dict[str, Any]) -> RunConfig:
    """The run's RunConfig (not yet validated): the launch's, or the arguments'."""
    if strategy is not None:
        settings = {"strategy": strategy, **settings}
    unknown = sorted(set(settings) - set(RunConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"psring.init() takes psring run's settings by field name; "
                          f"{', '.join(unknown)} is not one (psring run --help lists them, "
                          f"--batch-size as batch_size).")
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if launched():
        flags, given = _parse_flags(os.environ[ENV])
        cfg = config_from_args(flags, **({"workers": world} if rendezvous.under_torchrun()
                                         else {}),
                               # (no --steps: the script decides how many)
                               **({} if "steps" in given else {"steps": 0}))
        _agree(cfg, settings)
    elif settings or rendezvous.under_torchrun():
        cfg = _own_config(settings, world, rendezvous.under_torchrun())
    else:
        raise ConfigError(
            "psring.init() was called outside a launch and without arguments: start the "
            "script with `psring launch --strategy S --workers N -- python SCRIPT`, under "
            "torchrun with psring.init(strategy=..., out=DIR), or alone with "
            "psring.init(strategy='single').")
    entry.servers_named(cfg)
    if not cfg.out and world > 1:
        raise ConfigError(f"under torchrun each host writes its workers' records to a run "
                          f"directory: add --out DIR to {ENV} (or psring.init(out=DIR)).")
    return cfg if cfg.out else cfg.replace(out=default_out(cfg))


def _own_config(settings: dict[str, Any], world: int, torchrun: bool) -> RunConfig:
    """The run psring.init's arguments describe, in a process of ``world`` workers."""
    if settings.get("workers", world) != world:
        raise ConfigError(f"psring.init(workers={settings['workers']}) in a process of a "
                          f"launch of {world}; start N workers with `psring launch "
                          f"--workers N -- python SCRIPT` (or torchrun --nproc-per-node N).")
    if not torchrun and world == 1:
        # alone: the process group (allreduce of one) meets itself on loopback
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    return RunConfig(**{"steps": 0, **settings, "workers": world})  # (steps: the script's)


def launched() -> bool:
    """Whether this process was given a run's flags: by psring launch, or by the user
    under torchrun (``PSRING_RUN_ARGS="--strategy allreduce --out runs/x" torchrun ...``)."""
    return bool(os.environ.get(ENV))


def _parse_flags(text: str) -> tuple[argparse.Namespace, set[str]]:
    """The run's flags as psring launch writes them (a JSON list) or a user does (a
    shell-quoted string), parsed as psring run parses its own; and which were given."""
    argv = json.loads(text) if text.lstrip().startswith("[") else shlex.split(text)
    parser = argparse.ArgumentParser(prog=f"{ENV}", exit_on_error=False)
    add_config_flags(parser)
    try:
        return parser.parse_args(argv), given_fields(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError(f"{ENV} holds flags psring run does not take ({e}): "
                          f"{text[:200]}") from None


def _agree(cfg: RunConfig, settings: dict[str, Any]) -> None:
    """Under psring launch the launch's flags set the run; an argument of the script's
    that says otherwise is refused rather than silently overruled."""
    for name, value in settings.items():
        if getattr(cfg, name) != value:
            raise ConfigError(
                f"psring.init({name}={value!r}) disagrees with the launch's "
                f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: psring launch sets "
                f"the run; drop the argument, or pass the flag to psring launch.")


def script_refusals(cfg: RunConfig) -> None:
    """What psring's own loop does that a script's run cannot: refused by name (psring
    launch before anything starts, psring.init in each worker)."""
    if cfg.compute == "device":
        raise ConfigError("--compute device times psring's own models from their "
                          "profiles; a script's model has none: drop --compute device "
                          "(your script computes for real).")
    if cfg.checkpoint_every or cfg.resume or cfg.max_restarts:
        raise ConfigError("--checkpoint-every, --resume and --max-restarts restart "
                          "psring's own loop from its checkpoints; a script's run has "
                          "none yet: drop them.")
    loops = [flag for flag, on in (("--eval-every", cfg.eval_every),
                                   ("--eliminate-every", cfg.eliminate_every),
                                   ("--slow-worker", cfg.slow_worker),
                                   ("--kill-worker", cfg.kill_worker),
                                   ("--kill-server", cfg.kill_server)) if on]
    if loops:
        raise ConfigError(f"{', '.join(loops)} act inside psring's own loop, which a "
                          f"script's run does not have: drop them (evaluate with "
                          f"dist.evaluate in the script).")


def _harden() -> None:
    """What ``python -m psring.workers`` does first (psring.workers.entry.main): die with
    the launcher, no page faults on each step's tensors, a stack dump on ``kill -USR1``,
    and an uncaught error reported to the other ranks (under torchrun they stop at
    once rather than at --timeout)."""
    die_with_parent()
    keep_freed_memory()
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, previous = int(os.environ.get("RANK") or 0), sys.excepthook

    def report(kind, error, tb) -> None:
        try:
            rendezvous.report_failure(rank, f"{kind.__name__}: {error}")
        finally:
            previous(kind, error, tb)

    sys.excepthook = report
