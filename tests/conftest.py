"""Fixtures and hooks only; the helpers the test files share are in tests/helpers
(``from tests.helpers import psring, SMALL, ...``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import SMALL, assert_no_processes, psring_together


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
    root = tmp_path_factory.mktemp("small")
    runs = {s: root / s for s in ("single", "allreduce", "ddp")}
    psring_together(*(["run", "--strategy", s, "--workers", 1 if s == "single" else 2, *SMALL,
                       "--out", out] for s, out in runs.items()))
    assert_no_processes(root)
    return runs
