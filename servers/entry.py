"""Parameter-server process entry point: parse, bind, serve, always clean up.

    python -m psring.servers --bind tcp://127.0.0.1:5555 [--name server-0] [--log FILE]
                             [--secret-file FILE] [--max-frame-mb MB] [--io-threads N]

(``psring server`` is the same command.) The server starts empty; worker 0 of a run
initializes it with its shard of the parameters and the run's settings, so one server
process serves any model, one run after another. SIGTERM or Ctrl-C stops it cleanly.
Listening beyond loopback needs a shared secret (--secret-file or PSRING_SECRET).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from psring.errors import ConfigError, PsringError
from psring.runtime.process import die_with_parent, set_process_name


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="tcp://127.0.0.1:0",
                        help="ZeroMQ endpoint to listen on (default: loopback, a free port)")
    parser.add_argument("--name", default="server", help="name in logs and errors")
    parser.add_argument("--log", default=None, help="append one JSON line per request here")
    parser.add_argument("--secret-file", default="", metavar="PATH",
                        help="file holding the shared secret: every message is then signed "
                             "(HMAC-SHA256) and unsigned ones are dropped; required to bind "
                             "beyond loopback (default: the environment variable "
                             "PSRING_SECRET, else none)")
    parser.add_argument("--max-frame-mb", type=float, default=1024.0, metavar="MB",
                        help="largest message frame accepted, in MiB; a peer sending a larger "
                             "one is disconnected (must exceed the largest shard a run "
                             "initializes; default 1024)")
    parser.add_argument("--io-threads", type=int, default=0, metavar="N",
                        help="ZeroMQ I/O threads, each copying its connections' messages "
                             "in and out; 0 = one per core, at most 4 (default)")
    parser.add_argument("--credit-window", type=int, default=0, metavar="BYTES",
                        help="grant bounded-loss senders credit, keeping at most BYTES of "
                             "datagrams granted and not yet arrived (psring.comm.credits); "
                             "0 = no grants, every sender paces itself (default). A run "
                             "with --credit-window and --server-addrs needs its servers "
                             "started with it: its senders wait for grants")
    parser.add_argument("--control-rto-min-us", type=int, default=0, metavar="US",
                        help="least TCP retransmission timeout, in microseconds, of the "
                             "connections the server accepts (Linux 6.15+; elsewhere "
                             "unchanged): a bounded-loss run's TCP carries only one-segment "
                             "control messages, and a lost one otherwise waits the kernel's "
                             "200 ms. 0 = the kernel's (default); runs with "
                             "--loss-tolerance start their servers with 5000")


def run_server(args: argparse.Namespace) -> int:
    # (psring --help builds this module's flags; the server's code imports torch)
    from psring.comm.endpoints import load_secret
    from psring.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # received frames are freed and allocated again every round
    from psring.servers.server import Server

    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if not 0 < args.max_frame_mb <= 2**20:
        raise ConfigError(f"--max-frame-mb must be a positive number of MiB, at most 2**20 "
                          f"(got {args.max_frame_mb}).")
    secret = load_secret(args.secret_file)
    server = Server(args.bind, args.name, Path(args.log) if args.log else None,
                    secret=secret, max_frame_bytes=int(args.max_frame_mb * 2**20),
                    io_threads=args.io_threads, credit_window=args.credit_window,
                    rto_min_us=args.control_rto_min_us)
    try:
        print(f"[{args.name}] listening on {server.endpoint}"
              + (" (signed messages only)" if secret else ""), flush=True)
        server.serve(lambda: stop["now"])
    finally:
        server.close()
        print(f"[{args.name}] stopped; " + ", ".join(f"{k} {v}" for k, v in server.stats.items()),
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m psring.servers",
                                     description="a psring parameter server")
    add_server_flags(parser)
    args = parser.parse_args(argv)
    set_process_name(args.name)
    try:
        return run_server(args)
    except PsringError as e:
        print(f"[{args.name}] error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
