"""The multi-host failures of issue 19, reproduced on emulated hosts: how each torchrun
node of a two-host launch ends (exit status, seconds, last error line).

    python benchmarks/multihost_faults.py                       # this checkout
    python benchmarks/multihost_faults.py --python OLD/.venv/bin/python   # another one

Hosts are psring's emulated hosts (network namespaces, 198.18.0.0/15, their own host
names that resolve nowhere; root or user namespaces needed), built by this checkout;
the commands on them (torchrun, psring) are those of --python's environment. Cases:

- ``interface``: allreduce with nothing set in the environment (gloo's interface)
- ``fails-at-start``: host 1's worker has a bad flag; when does host 0's end?
- ``cut``: host 1's link goes down mid-run; when does each host end?
- ``run-id``: ps with a signed server on host 2, each host its own --out
- ``never-arrives``: only host 0 runs torchrun (its --rdzv-conf timeout bounds it)
- ``wrong-ifname``: the user sets GLOO_SOCKET_IFNAME=lo on both hosts (their setting
  wins): gloo's connection set-up fails, and waits up to 5x --timeout
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package

from tests.helpers.multihost import emulated_hosts, next_port, wait_all

SMALL = ["--model", "mlp", "--steps", "5", "--batch-size", "32", "--threads", "1"]
CASES = ("interface", "fails-at-start", "cut", "run-id", "never-arrives", "wrong-ifname")


def last_error(text: str) -> str:
    """The worker's own error line, else torch's, else the last line."""
    lines = text.splitlines()
    for pick in (lambda ln: re.match(r"\[worker \d+/\d+\] error: ", ln),
                 lambda ln: re.match(r"^[\w.]*(Error|Exception)\b.*: ", ln)
                 and "ChildFailedError" not in ln):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1][:400]
    return (lines or [""])[-1][:400]


def run_case(case: str, python: str, timeout: float, tmp: Path,
             ifname: bool = False) -> list[str]:
    flags = [*SMALL, "--timeout", f"{timeout:g}"]
    cap = 5 * timeout + 60
    rows = []
    with emulated_hosts(3, tmp, python) as hosts:
        port = next_port()

        def node(i: int, strategy: list[str]):
            last = []  # flags given last win
            if case == "fails-at-start" and i == 1:
                last = ["--lr", "-1"]
            if case == "cut":
                last = ["--steps", "100000"]
            return hosts.torchrun(i, 2, port, [*strategy, *flags, "--out",
                                               str(tmp / f"out{i}"), *last],
                                  rdzv_timeout=timeout, env=env)

        # as the user did by hand, to get past the interface on the old code
        env = {"GLOO_SOCKET_IFNAME": "eth0"} if ifname and case != "interface" else {}
        if case == "wrong-ifname":
            env = {"GLOO_SOCKET_IFNAME": "lo"}
        ar = ["--strategy", "allreduce"]
        if case == "run-id":
            secret = tmp / "secret"
            secret.write_text("ab" * 32)
            secret.chmod(0o600)
            addr = f"tcp://{hosts.address(2)}:5555"
            hosts.run(2, [hosts.command("psring"), "server", "--bind", addr,
                          "--secret-file", str(secret)], "server")
            time.sleep(2)
            ar = ["--strategy", "ps", "--server-addrs", addr, "--secret-file", str(secret)]
        nodes = [node(0, ar)] if case == "never-arrives" else [node(0, ar), node(1, ar)]
        origin = time.monotonic()
        if case == "cut":
            time.sleep(10)  # training by now
            hosts.cut(1)
            origin = time.monotonic()
        try:
            wait_all(nodes, origin + cap)
        except AssertionError:
            pass
        for i, n in enumerate(nodes):
            code = n.proc.returncode if n.ended is not None else "killed"
            took = f"{n.ended - origin:.1f} s" if n.ended is not None else f"> {cap:.0f} s"
            rows.append(f"  host {i}: exit {code} after {took}"
                        f"{' (from the cut)' if case == 'cut' else ''}: {last_error(n.output)}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the "
                    "environment under test (its torchrun and psring)")
    ap.add_argument("--timeout", type=float, default=20.0, help="--timeout and torchrun's "
                    "rendezvous timeout")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--set-ifname", action="store_true", help="set GLOO_SOCKET_IFNAME=eth0 "
                    "on the hosts, but in the interface case (for code that does not "
                    "choose the interface itself)")
    args = ap.parse_args()
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix=f"psring-{case}-") as tmp:
            print(f"{case} (--timeout {args.timeout:g}):", flush=True)
            for row in run_case(case, args.python, args.timeout, Path(tmp), args.set_ifname):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
