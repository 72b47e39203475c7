"""psring.runtime.allocator: freed tensors stay mapped from one step to the next."""

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys, torch
from psring.runtime.allocator import keep_freed_memory
on = sys.argv[1] == "1" and keep_freed_memory()
faults = []
for i in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # four 8 MiB tensors alive together, then all freed: a step's gradients
    ts = [torch.ones(2 * 2**20) for _ in range(4)]
    del ts
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults.sort()
print(int(on), faults[len(faults) // 2])  # the median round
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
@pytest.mark.timeout(60)
def test_freed_tensors_are_not_faulted_in_again():
    def probe(on: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", PROBE, on], capture_output=True, text=True,
                             timeout=50, check=True, env={"PATH": "/usr/bin:/bin"})
        applied, faults = map(int, out.stdout.split())
        return applied, faults

    applied, faults = probe("1")
    if not applied:
        pytest.skip("not glibc (another C library's malloc is left alone)")
    # 32 MiB touched per round is 8192 pages: with the thresholds the median round
    # faults none back in (without them, 6 probes of 8 here faulted all 8192 every round)
    assert faults < 200
