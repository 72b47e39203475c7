"""The wheel a user installs works: build it, install it into a fresh virtual
environment, and run psring from there, away from this checkout.

``make`` installs psring in editable mode, which reads the source tree directly, so a
package missing from the wheel (psring.zoo once was) goes unseen by every other test.
The fresh environment reuses the torch, numpy, pyzmq... already installed here (a
``.pth`` line naming this environment's site-packages), so no network is needed and no
multi-GB torch is installed again; psring itself comes only from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import assert_no_processes

ROOT = Path(__file__).resolve().parents[2]


def _sh(*cmd, cwd=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n" \
                                 f"{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel without network "
                        "(--no-build-isolation) needs setuptools in this environment")
    # Build from a copy of the tracked files: a build in the checkout leaves build/ and
    # *.egg-info behind, and untracked files must not reach the wheel.
    src = tmp_path_factory.mktemp("src")
    files = _sh("git", "ls-files", "-z", cwd=ROOT).stdout.split("\0") \
        if (ROOT / ".git").exists() else None
    if files is None:
        shutil.copytree(ROOT, src, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build",
                                                      "*.egg-info", "__pycache__"))
    else:
        for f in filter(None, files):
            if (ROOT / f).is_file():
                (src / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "-q", "-w", out, src, timeout=180)
    (built,) = out.glob("psring-*.whl")
    return built


def test_the_wheel_holds_every_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    # Every package of the source tree, where it installs (workers/ and servers/ under
    # psring), and nothing at the top level but psring.
    expected = set()
    for top, installed in (("psring", "psring"), ("workers", "psring/workers"),
                           ("servers", "psring/servers")):
        for init in (ROOT / top).rglob("__init__.py"):
            expected.add(installed + str(init.parent.relative_to(ROOT / top))
                         .removeprefix(".").join(["/", "/__init__.py"]).replace("//", "/"))
    missing = sorted(e for e in expected if e not in names)
    assert not missing, f"packages missing from {wheel.name}: {missing}"
    assert "psring/zoo/__init__.py" in names
    assert "psring/runs/compare.toml" in names  # (psring compare's definition)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"psring"}, tops


@pytest.mark.timeout(300)
def test_psring_runs_from_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    # This environment's packages (torch and the rest) after the venv's own: a plain
    # path line does not run the .pth files there, so the editable psring is not seen.
    (site / "psring-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index",
        "--no-deps", wheel, timeout=180)
    psring = venv / "bin" / "psring"
    assert psring.exists(), "the wheel installed no psring command"
    work = tmp_path / "elsewhere"  # not the checkout: nothing may come from the source tree
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = _sh(python, "-c", "import psring, psring.zoo, psring.workers, psring.servers;"
                "print(psring.__file__)", cwd=work, env=env).stdout.strip()
    assert Path(where).is_relative_to(venv), f"psring imported from {where}, not the wheel"

    out = work / "run"
    _sh(psring, "run", "--strategy", "ps", "--workers", "2", "--steps", "2",
        "--timeout", "120", "--out", out, cwd=work, env=env, timeout=240)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert sorted({(s["worker"], s["step"]) for s in steps}) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert json.loads((out / "manifest.json").read_text())["config"]["strategy"] == "ps"
    assert_no_processes(str(out))
