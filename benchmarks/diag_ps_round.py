"""Diagnostic (not a target): bench_ps.py's 16 MiB PS round with and without the
server's arithmetic, beside the raw relay, alternated.

    .venv/bin/python benchmarks/diag_ps_round.py      # ~2 min

The second server is psring's own with its store's sum and update replaced by no-ops
(the round still streams the unchanged parameters), so the difference between the two
PS rounds is what the arithmetic costs inside a round, where it shares the cores and
the memory bus with the copies; compare with bench_ps.py's arithmetic measured alone.
"""
import os
import statistics as st
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ps

NOOP = ("import sys; from psring.servers.store import ShardStore as S; "
        "S.begin = S.add = S.finish = lambda self, g, start=0: None; "
        "from psring.servers.entry import main; sys.exit(main(sys.argv[1:]))")

def starter(noop):
    def start_server(addr, servers):
        cmd = [sys.executable, "-c", NOOP] if noop else [sys.executable, "-m", "psring.servers"]
        return subprocess.Popen(cmd + ["--bind", addr], stdout=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    return start_server

if __name__ == "__main__":
    numel = 16 * 2**20 // 4
    res = {"ps": [], "ps-noarith": [], "raw": []}
    for i in range(4):
        for k in (list(res) if i % 2 == 0 else list(res)[::-1]):
            if k == "raw":
                res[k].append(bench_ps.run_raw(numel * 4, 15, barrier=True))
            else:
                bench_ps.start_server = starter(k == "ps-noarith")
                res[k].append(bench_ps.run_ps(numel, 1, 15))
    for k, v in res.items():
        print(k, " ".join(f"{x*1e3:.1f}" for x in v), "median", f"{st.median(v)*1e3:.1f} ms")
