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
import json
import logging
import os
import sys

from psring.errors import ConfigError, run_guarded
from psring.runtime import forking


def _cmd_run(args: argparse.Namespace) -> int:
    # first, before torch and a user's model are imported: this process only launches,
    # and its children are forked from it (psring.runtime.forking)
    forking.allow()
    from psring.config import config_from_args
    from psring.report import render_table, summarize_all
    from psring.runs.launch import launch

    if args.resume:
        from psring.config import given_fields
        from psring.config.flags import flag_values
        from psring.runs.launch import resume_config

        argv = getattr(args, "argv", None)
        given = given_fields(argv if argv is not None else sys.argv[1:]) - {"resume"}
        cfg = resume_config(args.resume, flag_values(args, given))
        print(f"psring: resuming {cfg.resume}", file=sys.stderr)
    else:
        cfg = config_from_args(args)
    print(f"psring: running {cfg.strategy} with {cfg.workers} worker(s)", file=sys.stderr)
    run_dir = launch(cfg, progress=_progress_printer(cfg.steps * cfg.workers))
    print(render_table(summarize_all([str(run_dir)])))
    print(f"run directory: {run_dir}")
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    forking.allow()  # (as psring run: a script's workers are forked from here)
    from psring.config import config_from_args, given_fields
    from psring.library.start import script_refusals
    from psring.report import render_table, summarize_all
    from psring.runs.launch import launch

    command = _script_command(args.command)
    if not command:
        raise ConfigError("psring launch needs the command each worker runs, after --: "
                          "psring launch --strategy ps --workers 2 -- python train.py")
    argv = getattr(args, "argv", None)
    given = given_fields(argv if argv is not None else sys.argv[1:])
    # without --steps the script decides how many (0: no cap)
    cfg = config_from_args(args, **({} if "steps" in given else {"steps": 0}))
    script_refusals(cfg)
    print(f"psring: launching {cfg.workers} worker(s) of {cfg.strategy}: "
          f"{' '.join(command)}", file=sys.stderr)
    run_dir = launch(cfg, command=command, stream=args.stream)
    print(render_table(summarize_all([str(run_dir)])))
    print(f"run directory: {run_dir}")
    return 0


def _script_command(words: list[str]) -> list[str]:
    """The command after ``--`` (none: []); a leading ``python`` is the interpreter
    psring runs in (its venv's), whatever PATH says first."""
    command = list(words[1:] if words[:1] == ["--"] else words)
    if command[:1] in (["python"], ["python3"]):
        command = [sys.executable, *command[1:]]
    return command


def _progress_printer(total: int):
    """A plain one-line progress display on stderr (only when it is a terminal)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int = total) -> None:
        print(f"\r  {done}/{total} worker-steps", end="", file=sys.stderr, flush=True)
        if done >= total:
            print(file=sys.stderr)

    return lambda done, total: show(done, total)


def _cmd_report(args: argparse.Namespace) -> int:
    from psring.report import render_table, summarize_all, write_report
    from psring.runs.sweep import is_sweep_dir

    if len(args.dirs) == 1 and is_sweep_dir(args.dirs[0]) and not args.json:
        path, table = write_report(args.dirs[0])
        print(table)
        print(f"report: {path}")
        return 0
    rows = summarize_all(args.dirs)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_table(rows))
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from psring.records.merge import merge

    manifest = merge(args.dirs, args.out)
    parts = manifest["merged_from"]
    print(f"merged run {manifest['launch']['run_id']}: "
          + ", ".join(f"{p['dir']} (rank{'s' * (len(p['ranks']) != 1)} "
                      f"{', '.join(map(str, p['ranks']))})" for p in parts)
          + f" -> {args.out}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    forking.allow()  # first: its runs' processes are forked from it (see _cmd_run)
    from pathlib import Path

    from psring.runs.sweep import Sweep, default_out, format_summary, run_sweep_with_progress

    sweep = Sweep.load(args.spec)
    if args.repeats is not None:
        sweep = sweep.changed(repeats=args.repeats)
    out = Path(args.out) if args.out else default_out(sweep)
    res = run_sweep_with_progress(sweep, out)
    print(format_summary(res), file=sys.stderr)
    if args.report:
        from psring.report import write_report

        path, table = write_report(out)
        print(table)
        print(f"report: {path}")
    print(f"sweep directory: {out}")
    return 1 if res.failed else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    # first (see _cmd_run); a calibration that computes in this process leaves threads
    # behind, and its runs' processes then start anew
    forking.allow()
    from psring.report import write_report
    from psring.runs.compare import run_compare
    from psring.runs.sweep import format_summary

    root, res = run_compare(args.out, workers=args.workers, repeats=args.repeats)
    print(format_summary(res), file=sys.stderr)
    path, table = write_report(root)
    print(table)
    print(f"report: {path}")
    return 1 if res.failed else 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from psring.records.trace import TRACE, load_trace, render_png, write_trace

    run_dir = Path(args.dir)
    path = run_dir / TRACE
    if args.rebuild or not path.exists():
        write_trace(run_dir)
    png = render_png(load_trace(path), Path(args.png) if args.png else run_dir / "trace.png",
                     steps=args.steps)
    print(f"trace: {path} (open in https://ui.perfetto.dev)\npicture: {png}")
    return 0


def _cmd_server(args: argparse.Namespace) -> int:
    from psring.servers.entry import run_server

    return run_server(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from psring.train.models import MODELS, ModelSettings, describe

    s = ModelSettings(classes=args.classes, image_size=args.image_size, seq_len=args.seq_len,
                      features=args.features, width=args.width, depth=args.depth)
    names = args.model or list(MODELS)
    table = Table(title=f"psring models: {args.classes} classes, {args.image_size}x"
                  f"{args.image_size} images, {args.seq_len}-token sequences, "
                  f"{args.features} features; intensity at batch {args.batch_size}")
    for col in ("model", "input", "parameters", "gradient MB", "GFLOPs/sample",
                "FLOPs/byte"):
        table.add_column(col, justify="left" if col in ("model", "input") else "right")
    skipped = []
    for name in names:
        try:
            d = describe(name, s, args.batch_size)
        except ConfigError as e:
            if args.model:  # asked for by name: its error is the answer
                raise
            skipped.append(f"{name}: {e}")  # (inception_v3 at 32 x 32 images)
            continue
        i = d["inputs"]
        table.add_row(name, f"{i.kind} {'x'.join(map(str, i.shape))}", f"{d['parameters']:,}",
                      f"{d['gradient_bytes'] / 1e6:.2f}",
                      f"{d['flops_per_sample'] / 1e9:.4g}", f"{d['intensity']:.3g}")
    Console(width=130).print(table)
    for line in skipped:
        print(f"not at these sizes: {line}")
    print("FLOPs: forward+backward per sample (torch.utils.flop_counter: matmuls, "
          "convolutions, attention). FLOPs/byte: a batch's FLOPs per byte of float32 "
          "gradients, the arithmetic intensity a strategy's communication is set against.")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from psring.records.profile import load_host_copy
    from psring.runs.profiling import (
        PAPER_FLAGS,
        paper_profile,
        profile_config,
        take_profile,
    )

    paper = {k: getattr(args, k) for k in PAPER_FLAGS}
    flags = {k: v for k, v in vars(args).items()
             if k not in ("func", "argv", "command", "out", "on_paper", "host_copy", "script",
                          *PAPER_FLAGS) and v is not None}
    script = _script_command(args.script)
    host_copy = load_host_copy(args.host_copy) if args.host_copy else None
    if args.out:
        flags["out"] = args.out
    from psring.config import validate

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


def _cmd_strategies(args: argparse.Namespace) -> int:
    from psring.strategies import STRATEGIES

    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        doc = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip()
        print(f"{name:<10} {doc.splitlines()[0] if doc else ''}")
    return 0


def _add_run(sub) -> None:
    from psring.config import add_config_flags

    run = sub.add_parser("run", help="train with one strategy; logs to a run directory")
    add_config_flags(run)
    run.set_defaults(func=_cmd_run)


def _add_launch(sub) -> None:
    from psring.config import add_config_flags

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
    from psring.commands.calibrate import add_calibrate_parser

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
    from psring.servers.entry import add_server_flags

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
    from psring.config import add_config_flags

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
    from psring.commands.advise import add_advise_parser

    add_advise_parser(sub)


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
