"""``psring run`` and ``psring launch``: one run launched, then its summary.

    psring run --strategy allreduce --workers 2 --steps 50 --out runs/ar
    psring run --resume runs/ar               (after --checkpoint-every N; continues it)
    psring launch --strategy ps --workers 2 -- python train.py   (your own script)

Imported by psring.cli once ``forking.allow()`` has run: this process only launches,
and its children are forked from it (psring.runtime.forking).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from psring.config import config_from_args, given_fields
from psring.config.flags import flag_values
from psring.errors import ConfigError
from psring.library.start import script_refusals
from psring.report import render_table, summarize_all
from psring.runs.launch import launch, resume_config


def run(args: argparse.Namespace) -> int:
    """``psring run``: a new run, or ``--resume DIR`` continuing one."""
    if args.resume:
        given = _given(args) - {"resume"}
        cfg = resume_config(args.resume, flag_values(args, given))
        print(f"psring: resuming {cfg.resume}", file=sys.stderr)
    else:
        cfg = config_from_args(args)
    print(f"psring: running {cfg.strategy} with {cfg.workers} worker(s)", file=sys.stderr)
    run_dir = launch(cfg, progress=progress_printer(cfg.steps * cfg.workers))
    print(render_table(summarize_all([str(run_dir)])))
    print(f"run directory: {run_dir}")
    return 0


def launch_script(args: argparse.Namespace) -> int:
    """``psring launch -- COMMAND``: the run's workers each run a user's script."""
    command = script_command(args.command)
    if not command:
        raise ConfigError("psring launch needs the command each worker runs, after --: "
                          "psring launch --strategy ps --workers 2 -- python train.py")
    # without --steps the script decides how many (0: no cap)
    cfg = config_from_args(args, **({} if "steps" in _given(args) else {"steps": 0}))
    script_refusals(cfg)
    print(f"psring: launching {cfg.workers} worker(s) of {cfg.strategy}: "
          f"{' '.join(command)}", file=sys.stderr)
    run_dir = launch(cfg, command=command, stream=args.stream)
    print(render_table(summarize_all([str(run_dir)])))
    print(f"run directory: {run_dir}")
    return 0


def _given(args: argparse.Namespace) -> set[str]:
    """The config fields given on the command line (psring.cli keeps its argv)."""
    argv = getattr(args, "argv", None)
    return given_fields(argv if argv is not None else sys.argv[1:])


def script_command(words: list[str]) -> list[str]:
    """The command after ``--`` (none: []); a leading ``python`` is the interpreter
    psring runs in (its venv's), whatever PATH says first."""
    command = list(words[1:] if words[:1] == ["--"] else words)
    if command[:1] in (["python"], ["python3"]):
        command = [sys.executable, *command[1:]]
    return command


def progress_printer(total: int) -> Callable[[int, int], None] | None:
    """A plain one-line progress display on stderr (only when it is a terminal)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int = total) -> None:
        print(f"\r  {done}/{total} worker-steps", end="", file=sys.stderr, flush=True)
        if done >= total:
            print(file=sys.stderr)

    return lambda done, total: show(done, total)
