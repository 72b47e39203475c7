"""The ``psring`` command.

    psring run --strategy allreduce --workers 2 --steps 50 --out runs/ar
    psring run --resume runs/ar               (after --checkpoint-every N; continues it)
    psring launch --strategy ps --workers 2 -- python train.py   (your own script)
    psring report runs/ar runs/single [--json]
    psring sweep experiments/intensity.toml --out runs/intensity   (resumable)
    psring report runs/intensity              (a sweep: report.md and plots)
    psring calibrate                          (α, β, γ for the cost model)
    psring compare [--out DIR]
    psring trace runs/ps                      (after psring run ... --trace)
    psring server --bind tcp://127.0.0.1:5555
    psring strategies
    psring models [--classes 1000 --image-size 224]   (sizes, FLOPs, intensity)
    psring profile --model resnet18 --batch-size 32   (for the simulator)
    psring advise --model resnet18 --hosts 4 --link 10gbit [--verify]

Errors meant for the user (bad flags, a failed worker) print one paragraph and exit
non-zero; see psring.errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from psring.commands.calibrate import add_calibrate_parser
from psring.config import add_config_flags
from psring.errors import run_guarded
from psring.runtime import forking
from psring.servers.entry import add_server_flags


# Each command's module is imported when the command runs, not when its parser is
# built: `psring --help` imports no torch, and a command that launches runs calls
# forking.allow() before torch is imported at all (its processes are forked from it;
# psring.runtime.forking). These are the command's only imports inside functions.
def _cmd_run(args: argparse.Namespace) -> int:
    forking.allow()
    from psring.commands import run

    return run.run(args)


def _cmd_launch(args: argparse.Namespace) -> int:
    forking.allow()  # (a script's workers are forked from here, as psring run's)
    from psring.commands import run

    return run.launch_script(args)


def _cmd_sweep(args: argparse.Namespace) -> int:
    forking.allow()
    from psring.commands import sweep

    return sweep.sweep(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    forking.allow()
    from psring.commands import sweep

    return sweep.compare(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from psring.commands import records

    return records.report(args)


def _cmd_merge(args: argparse.Namespace) -> int:
    from psring.commands import records

    return records.merge(args)


def _cmd_trace(args: argparse.Namespace) -> int:
    from psring.commands import records

    return records.trace(args)


def _cmd_server(args: argparse.Namespace) -> int:
    from psring.servers.entry import run_server

    return run_server(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from psring.commands import models

    return models.models(args)


def _cmd_strategies(args: argparse.Namespace) -> int:
    from psring.commands import models

    return models.strategies(args)


def _cmd_profile(args: argparse.Namespace) -> int:
    from psring.commands import profile

    return profile.profile(args)


def _cmd_advise(args: argparse.Namespace) -> int:
    from psring.commands import advise

    return advise.advise_command(args)


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="train with one strategy; logs to a run directory")
    add_config_flags(run)
    run.set_defaults(func=_cmd_run)


def _add_launch(sub) -> None:
    la = sub.add_parser(
        "launch", help="run your own training script as each worker (psring.init() "
        "in it): psring launch --strategy ps --workers 2 -- python train.py ARGS",
        description="Start the run's servers, emulated hosts and workers as psring run "
        "does, each worker running COMMAND (a script that calls psring.init(); "
        "docs/your-script.md), supervised (fail-stop, nothing left behind), into the "
        "same run directory. psring run's flags set the run; the model's and data's "
        "are the script's business.")
    add_config_flags(la)
    la.add_argument("--stream", choices=("rank0", "all", "none"), default="rank0",
                    help="the workers' output on this terminal as they print it: worker "
                    "0's (default), every worker's with a [rank r] prefix, or none; all of "
                    "it is in DIR/logs/worker-N.log")
    la.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="what each worker runs, e.g. python train.py --epochs 2")
    la.set_defaults(func=_cmd_launch)


def _add_report(sub) -> None:
    rep = sub.add_parser("report", help="summarize run directories")
    rep.add_argument("dirs", nargs="+", metavar="DIR",
                     help="run directories, or directories containing them; a sweep "
                     "directory gets report.md and plots")
    rep.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rep.set_defaults(func=_cmd_report)


def _add_merge(sub) -> None:
    mg = sub.add_parser("merge", help="join the run directories of one torchrun launch "
                        "from several hosts into one run directory")
    mg.add_argument("dirs", nargs="+", metavar="DIR", help="each host's --out, copied "
                    "to this machine (node 0's holds the manifest)")
    mg.add_argument("--out", required=True, help="the merged run directory (new)")
    mg.set_defaults(func=_cmd_merge)


def _add_sweep(sub) -> None:
    sw = sub.add_parser("sweep", help="run a sweep definition (experiments/*.toml), "
                        "resumably, then report on it")
    sw.add_argument("spec", metavar="SPEC", help="a sweep definition, e.g. "
                    "experiments/intensity.toml")
    sw.add_argument("--out", default=None, help="sweep directory (default "
                    "runs/<name>-<time>); run again with the same --out to resume")
    sw.add_argument("--repeats", type=int, default=None, help="override the definition's "
                    "repeats")
    sw.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                    help="write the report when the sweep is done (default: yes)")
    sw.set_defaults(func=_cmd_sweep)


def _add_calibrate(sub) -> None:
    add_calibrate_parser(sub)


def _add_compare(sub) -> None:
    cmp_ = sub.add_parser("compare", help="every strategy on a small default workload: "
                          "a sweep (psring/runs/compare.toml) and its report")
    cmp_.add_argument("--out", default=None, help="sweep directory (default "
                      "runs/compare-<time>); the same --out again resumes")
    cmp_.add_argument("--workers", type=int, default=2, help="workers per distributed run")
    cmp_.add_argument("--repeats", type=int, default=None, help="runs per strategy "
                      "(default: compare.toml's)")
    cmp_.set_defaults(func=_cmd_compare)


def _add_trace(sub) -> None:
    tr = sub.add_parser("trace", help="build a traced run's trace.json and render it as a PNG")
    tr.add_argument("dir", metavar="DIR", help="a run directory of `psring run --trace`")
    tr.add_argument("--png", default=None, help="where to write the picture (default "
                    "DIR/trace.png)")
    tr.add_argument("--steps", type=int, default=3, help="steps to draw (from the middle "
                    "of the run)")
    tr.add_argument("--rebuild", action="store_true", help="rebuild trace.json from the logs")
    tr.set_defaults(func=_cmd_trace)


def _add_server(sub) -> None:
    srv = sub.add_parser("server", help="run one parameter server (for --server-addrs)")
    add_server_flags(srv)
    srv.set_defaults(func=_cmd_server)


def _add_models(sub) -> None:
    md = sub.add_parser("models", help="list the models with their parameters, "
                        "gradient MB, FLOPs per sample and arithmetic intensity")
    md.add_argument("model", nargs="*", help="models to describe (default: every "
                    "built-in one); package.module:factory for your own")
    for flag, default, what in (("--classes", 10, "classes (the vocabulary, for token "
                                 "models)"), ("--image-size", 32, "image side"),
                                ("--seq-len", 32, "tokens per sequence"),
                                ("--features", 256, "input features (mlp, cnn)"),
                                ("--width", 0, "width (0 = each model's default)"),
                                ("--depth", 0, "depth (0 = each model's default)"),
                                ("--batch-size", 64, "batch for the arithmetic intensity")):
        md.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    md.set_defaults(func=_cmd_models)


def _add_profile(sub) -> None:
    pr = sub.add_parser("profile", help="profile a model for the simulator: one short "
                        "traced single run -> DIR/profile.json (psring.records.profile)")
    add_config_flags(pr, only=("model", "width", "depth", "classes", "image_size", "seq_len",
                               "features", "batch_size", "threads", "seed", "data",
                               "device"))
    pr.add_argument("--steps", type=int, default=8, help="steps to time (the first are "
                    "warm-up; default 8)")
    pr.add_argument("--out", default="", help="run directory (default runs/profile-<time>)")
    pr.add_argument("--on-paper", action="store_true", help="build the profile from "
                    "published figures instead of running: the model's parameters, and "
                    "--forward-ms/--backward-ms or --step-ms at --batch-size (per device)")
    for name, what in (("forward", "forward pass"), ("backward", "backward pass"),
                       ("step", "forward and backward together (split 1:2)")):
        pr.add_argument(f"--{name}-ms", type=float, default=None,
                        help=f"--on-paper: the device's {what}, milliseconds")
    pr.add_argument("--update-ms", type=float, default=0.0, help="--on-paper: the device's "
                    "optimizer step, milliseconds (default 0)")
    pr.add_argument("--source", default="", help="--on-paper: where the figures come from "
                    "(kept in the profile)")
    pr.add_argument("--host-copy", default="", metavar="FILE", help="a GPU's pinned copy "
                    "rates between device and host (benchmarks/gpu_copy.py's JSON), kept in "
                    "the profile: the simulator and device mode charge a parameter "
                    "server's worker for copying each gradient out and parameter back")
    pr.add_argument("script", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="profile your own training script instead (one that calls "
                    "psring.init(); docs/your-script.md): psring profile --steps 8 -- "
                    "python train.py")
    pr.set_defaults(func=_cmd_profile)


def _add_advise(sub) -> None:
    p = sub.add_parser("advise", help="predict which strategy, bucket size and servers "
                       "train fastest on a cluster, and why (psring.predict.sim.simulate)")
    add_config_flags(p, only=("model", "width", "depth", "classes", "image_size", "seq_len",
                              "features", "batch_size", "hosts", "workers_per_host",
                              "link", "delay", "loss", "seed"))
    # the cluster flags mean the cluster to predict (emulated only with --verify)
    for flag, text in (("--hosts", "hosts in the cluster"),
                       ("--workers-per-host", "workers on each host (default 1)"),
                       ("--link", "each host's link rate, e.g. 1gbit, 25gbit, 100gbit"),
                       ("--delay", "one-way delay of each link, e.g. 50us"),
                       ("--loss", "fraction of packets each link direction drops, e.g. "
                                  "0.001: TCP's recovery is priced (a fitted share of a "
                                  "round trip per lost segment; docs/prediction.md)")):
        p._option_string_actions[flag].help = text
    p.add_argument("--workers", type=int, default=0, help="workers in all (default: "
                   "hosts x workers-per-host)")
    p.add_argument("--profile", default="", help="a profile (psring profile, or any run "
                   "directory) instead of profiling the model now")
    p.add_argument("--calibration", default="", help="α-β-γ calibration file (default: "
                   "$PSRING_CALIBRATION or ~/.cache/psring/calibration.json; measured "
                   "quickly when there is none)")
    p.add_argument("--device-speed", type=float, default=1.0, help="the workers' devices are "
                   "this many times as fast as the profile's (ask about a GPU cluster from "
                   "a laptop's profile; or give a GPU's profile with --profile)")
    p.add_argument("--device-link", default="", help="each host's own interconnect among "
                   "its workers: nvlink (150 GB/s, V100's NVLink 2.0), nvlink3, nvlink4, "
                   "pcie, pcie4, pcie5, or a rate such as 1200gbit. byteps's and "
                   "hallreduce's collectives inside a host are "
                   "priced at its time (and --verify runs them with it) instead of this "
                   "machine's loopback gloo; needs several workers per host. Default: "
                   "loopback")
    p.add_argument("--mtbf", type=float, default=0.0, metavar="HOURS",
                   help="mean time between failures of one worker or server, in hours: "
                   "each strategy's step is also priced with failures (restarts from "
                   "checkpoints, or going on without a lost worker; "
                   "psring.predict.failures). Default 0: no failures")
    p.add_argument("--checkpoint-minutes", type=float, default=30.0,
                   help="with --mtbf: the checkpoint interval (default 30)")
    p.add_argument("--restart-s", type=float, default=120.0,
                   help="with --mtbf: what a restart itself costs, in seconds (default "
                   "120)")
    p.add_argument("--job-hours", type=float, default=24.0,
                   help="with --mtbf: the job's length (default 24)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="also answer the scaling question: every strategy's best setting "
                   "at 1, 2, 4, ... N workers (--workers-per-host a host), the largest "
                   "count that keeps --target-efficiency, the servers and the batch; "
                   "writes scaling.png and advise.json's \"scaling\" (1 to 65536)")
    p.add_argument("--target-efficiency", type=float, default=0.8, metavar="E",
                   help="with --max-workers: the scaling efficiency to keep, in (0, 1] "
                   "(default 0.8)")
    p.add_argument("--epoch-samples", type=int, default=1281167,
                   help="with --max-workers: samples in one epoch, for the time per epoch "
                   "(default 1281167, ImageNet-1k's training set)")
    p.add_argument("--verify", action="store_true", help="run the top candidates on this "
                   "machine's emulation of the cluster and print predicted vs measured")
    p.add_argument("--verify-steps", type=int, default=20, help="steps per verifying run")
    p.add_argument("--out", default="", help="directory for the profile, advise.json, "
                   "advise.png and verifying runs (default runs/advise-<time>)")
    p.set_defaults(func=_cmd_advise)



def _add_strategies(sub) -> None:
    st = sub.add_parser("strategies", help="list the registered strategies")
    st.set_defaults(func=_cmd_strategies)


#: the subcommands, in the order --help lists them
SUBCOMMANDS = (_add_run, _add_launch, _add_report, _add_merge, _add_sweep, _add_calibrate,
               _add_compare, _add_trace, _add_server, _add_models, _add_profile, _add_advise,
               _add_strategies)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psring", description="Compare data-parallel training strategies: parameter "
        "server vs ring all-reduce, step by step.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # which flags were given (psring run --resume keeps the others)
    return run_guarded(args.func, args)


def entry() -> None:
    """The ``psring`` command (and ``python -m psring``): :func:`main`, then leave
    without the interpreter's finalization. With torch imported, finalization alone
    takes ~0.3 s here (tearing down torch's modules), a fifth of a 1-step run; by now
    every file a command writes was written atomically and closed, and its processes
    were stopped, so there is nothing left for it to do. (Tests call :func:`main`.)"""
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 1  # e.g. stdout closed early: what was printed is lost
    os._exit(code)
