"""Fixtures and hooks only; the helpers the test files share are in tests/helpers
(``from tests.helpers import psring, SMALL, ...``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    SMALL,
    assert_no_processes,
    once_across_workers,
    psring,
    psring_together,
)


@pytest.fixture(autouse=True, scope="session")
def _own_calibration(tmp_path_factory):
    """No test reads or writes this machine's calibration (~/.cache/psring): the
    default path points into the session's temporary directory (a test that wants the
    real default unsets the variable with monkeypatch)."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    old = os.environ.get("PSRING_CALIBRATION")
    os.environ["PSRING_CALIBRATION"] = str(path)
    yield path
    if old is None:
        os.environ.pop("PSRING_CALIBRATION", None)
    else:
        os.environ["PSRING_CALIBRATION"] = old


@pytest.fixture(scope="session")
def small_runs(tmp_path_factory) -> dict[str, Path]:
    """single (1 worker), allreduce and ddp (2 workers) on SMALL, run once per session."""
    def make(root: Path) -> dict:
        runs = {s: root / s for s in ("single", "allreduce", "ddp")}
        psring_together(*(["run", "--strategy", s, "--workers", 1 if s == "single" else 2,
                           *SMALL, "--out", out] for s, out in runs.items()))
        assert_no_processes(root)
        return {s: str(p) for s, p in runs.items()}

    return {s: Path(p) for s, p in once_across_workers(tmp_path_factory, "small",
                                                       make).items()}


@pytest.fixture(scope="session")
def compare_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``psring compare --repeats 1`` (every strategy on experiments/compare.toml's
    workload, ~1 min here), run once per session: its report is checked in
    tests/multiproc/test_report.py and its single point, which is the default task's
    single run, in tests/multiproc/test_learning.py. (Its directory and the command's
    output.)"""
    def make(root: Path) -> dict:
        out = root / "cmp"
        proc = psring("compare", "--out", out, "--repeats", 1, timeout=280)
        assert_no_processes(out)
        return {"out": str(out), "args": proc.args, "stdout": proc.stdout,
                "stderr": proc.stderr}

    got = once_across_workers(tmp_path_factory, "compare", make)
    return Path(got["out"]), subprocess.CompletedProcess(got["args"], 0, got["stdout"],
                                                         got["stderr"])


#: folders whose tests run one at a time, after the others (``make test``'s second
#: pytest): emulated clusters build network namespaces and shape links, and time what
#: crosses them; a test running beside them on the 2 cores would skew what they measure.
#: A test there marked ``untimed`` (it compares parameters, or waits out a deadline
#: whose slack allows for a loaded machine: it times no link) runs with the others.
SERIAL_FOLDERS = ("emulation",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent.name in SERIAL_FOLDERS \
                and item.get_closest_marker("untimed") is None:
            item.add_marker(pytest.mark.serial)
    # the longest first, so that two xdist workers end together rather than one waiting
    # on the other's last long test: one test on compare_run (the fixture's minute),
    # then the slow ones, then the rest (the other tests on compare_run among them: not
    # beside the first, where they would wait for the fixture, idle)
    on_compare = [i for i in items if "compare_run" in getattr(i, "fixturenames", ())]
    items.sort(key=lambda item: 0 if on_compare and item is on_compare[0]
               else 1 if item.get_closest_marker("slow") is not None
               and item not in on_compare else 2)
