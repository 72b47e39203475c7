"""``psring calibrate``: the command over psring.predict.measure's measurements.

    psring calibrate [--quick] [--out FILE]
    psring calibrate --hosts 2 --link 1gbit [--quick] [--out FILE]   # across a link
    python -m psring.commands.calibrate [--quick] [--out FILE]   # without the psring CLI
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from psring.cluster.spec import link_key
from psring.errors import ConfigError, run_guarded
from psring.predict.calibration import Calibration, default_path
from psring.units import parse_delay, parse_rate


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to save the calibration (default: $PSRING_CALIBRATION, "
                        "else ~/.cache/psring/calibration.json)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats: a few seconds instead of ~15, noisier")
    p.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                   help="2: measure α and β between two emulated hosts joined by --link "
                        "(kept beside the loopback figures, which are measured first if "
                        "the file has none); 1 (default): this machine's loopback")
    p.add_argument("--link", default="", metavar="RATE",
                   help="with --hosts 2: the links' rate in tc's syntax, e.g. 1gbit")
    p.add_argument("--delay", default="", metavar="TIME",
                   help="with --hosts 2: a one-way delay per link direction (needs netem)")


def command(args: argparse.Namespace) -> int:
    # the measuring module imports torch (~1-2 s): only when the command runs, so that
    # `psring --help` and every other command's start-up do not pay for it
    from psring.predict.measure import calibrate, calibrate_link, describe

    out = Path(args.out).expanduser() if args.out else default_path()
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name, e.g. "
                          f"{out / 'calibration.json'}.")
    if args.hosts == 2 and not args.link:
        raise ConfigError("--hosts 2 measures across an emulated link: give its rate, e.g. "
                          "--link 1gbit.")
    if args.hosts == 1 and (args.link or args.delay):
        raise ConfigError("--link and --delay describe the link between emulated hosts: "
                          "add --hosts 2.")
    t0 = time.monotonic()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cal = None
    if args.hosts == 2:
        key = link_key(parse_rate(args.link), parse_delay(args.delay) if args.delay else 0.0)
        if out.is_file():
            cal = Calibration.load(out)
    if cal is None:
        cal = calibrate(quick=args.quick, log=say)
    if args.hosts == 2:
        cal.links[key] = calibrate_link(args.link, args.delay, quick=args.quick, log=say)
    path = cal.save(out)
    print(describe(cal))
    print(f"saved to {path} ({time.monotonic() - t0:.0f} s"
          f"{', quick' if args.quick else ''})")
    return 0


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``calibrate`` to the psring CLI's subparsers; its func returns 0."""
    p = subparsers.add_parser("calibrate", help="measure α, β, γ of this machine for the "
                              "cost model (docs/cost-model.md)")
    add_flags(p)
    p.set_defaults(func=command)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="psring calibrate",
                                     description=__doc__.splitlines()[0])
    add_flags(parser)
    args = parser.parse_args(argv)
    return run_guarded(command, args)


if __name__ == "__main__":
    sys.exit(main())
