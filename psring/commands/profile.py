"""``psring profile``: a model's profile for the simulator and device mode.

    psring profile --model resnet18 --batch-size 32          (a short traced single run)
    psring profile --steps 8 -- python train.py              (your own script)
    psring profile --model vgg16 --on-paper --step-ms 120    (from published figures)
"""

from __future__ import annotations

import argparse
import sys

from psring.commands.run import script_command
from psring.config import validate
from psring.errors import ConfigError
from psring.records.profile import load_host_copy
from psring.runs.profiling import PAPER_FLAGS, paper_profile, profile_config, take_profile


def profile(args: argparse.Namespace) -> int:
    """Take the profile (or write it from the figures given, --on-paper) into --out."""
    paper = {k: getattr(args, k) for k in PAPER_FLAGS}
    flags = {k: v for k, v in vars(args).items()
             if k not in ("func", "argv", "command", "out", "on_paper", "host_copy", "script",
                          *PAPER_FLAGS) and v is not None}
    script = script_command(args.script)
    host_copy = load_host_copy(args.host_copy) if args.host_copy else None
    if args.out:
        flags["out"] = args.out
    cfg = validate(profile_config(**flags))
    if args.on_paper:
        prof = paper_profile(cfg, **paper)
        prof.host_copy = host_copy
        path = prof.save(cfg.out)
        print(prof.describe())
        print(f"rule: {prof.source['rule']}")
        print(f"profile: {path}")
        return 0
    if any(paper[k] is not None for k in ("forward_ms", "backward_ms", "step_ms")) \
            or paper["source"] or paper["update_ms"]:
        raise ConfigError("--forward-ms, --backward-ms, --step-ms, --update-ms and --source "
                          "describe a device on paper: add --on-paper.")
    what = " ".join(script) if script else f"{cfg.model} at batch {cfg.batch_size}"
    print(f"psring: profiling {what}, {cfg.steps} steps", file=sys.stderr)
    prof = take_profile(cfg, command=script)
    if host_copy is not None:
        prof.host_copy = host_copy
        prof.save(cfg.out)
    print(prof.describe())
    print(f"profile: {cfg.out}/profile.json")
    return 0
