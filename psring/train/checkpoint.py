"""Checkpoints: consistent, atomic, verified; and the exact resume built on them.

    psring run --strategy allreduce --workers 2 --steps 1000 --checkpoint-every 100 --out runs/a
    # ... the run is killed at step 640 ...
    psring run --resume runs/a         # continues from step 600; same flags as the run

Layout, inside the run directory::

    checkpoints/step-00000600/state.pt         the tensors (torch.save of a flat dict)
    checkpoints/step-00000600/checkpoint.json  written last: the commit mark

``state.pt`` is written atomically (temporary file, fsync, rename); then
``checkpoint.json`` records the step, the run's config and the SHA-256 and size of
``state.pt``, also atomically. A checkpoint without ``checkpoint.json`` was torn by a
crash and is ignored; one whose ``state.pt`` does not match its recorded hash was torn
or tampered with and is refused with a message naming it; either way the previous
checkpoint is used. ``state.pt`` is loaded with ``torch.load(weights_only=True)``:
tensors and plain containers only, never unpickled code. The two newest checkpoints
are kept.

What is in one is the strategy's business (``Strategy.checkpoint_state``): for the
replicated strategies the model and the optimizer's momentum, for the parameter
servers every shard at the same version with its momentum and the workers' last
applied sequence numbers. The step counter is the data position: every worker's
batch is a pure function of (step, rank), so resuming at step s feeds exactly the
batches the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from psring.errors import ConfigError
from psring.records.runlog import atomic_write_bytes, atomic_write_json

CHECKPOINTS = "checkpoints"
STATE = "state.pt"
COMMIT = "checkpoint.json"
FORMAT = 1
KEEP = 2
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class Checkpoint:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(run_dir: Path, step: int, tensors: dict[str, torch.Tensor],
         meta: dict[str, Any] | None = None, keep: int = KEEP) -> Path:
    """Write the checkpoint of ``step`` (all tensors moved to the CPU) and prune old
    ones. Safe against a crash at any point, and against another writer of the same
    directory (hosts of a torchrun launch sharing one ``--out``): the checkpoint is
    built in a directory of its own, its commit mark written last, then renamed into
    place whole."""
    root = Path(run_dir) / CHECKPOINTS
    d = root / f"step-{step:08d}"
    tmp = root / f".{d.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buf)
    data = buf.getvalue()
    atomic_write_bytes(tmp / STATE, data)
    atomic_write_json(tmp / COMMIT, {
        "format": FORMAT, "step": step, "meta": meta or {},
        "files": {STATE: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}})
    _put_in_place(tmp, d)
    _prune(root, keep)
    return d


def _put_in_place(tmp: Path, d: Path) -> None:
    """Rename the finished ``tmp`` to ``d``. A ``d`` already there is a checkpoint of
    the same step that a resume went back past (an older one was agreed on, or this
    one was refused): the new one replaces it."""
    if d.exists():
        old = d.with_name(f".{d.name}.{socket.gethostname()}.{os.getpid()}.old")
        try:
            d.rename(old)
        except FileNotFoundError:
            pass  # (another writer of the directory moved it first)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(d)
    except OSError:
        if not (d / COMMIT).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another writer put the same step in place


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints; drop older ones and what crashed writers
    left of them (a writer still at work is at a step no older than the kept ones)."""
    kept = _candidates(root.parent)
    for old in kept[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    if len(kept) >= keep:
        oldest = kept[keep - 1].name
        for left in root.glob(".step-*"):
            if left.name[1:len(oldest) + 1] < oldest:
                shutil.rmtree(left, ignore_errors=True)


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoint directories, newest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def verify(d: Path) -> Checkpoint:
    """Load and check one checkpoint directory; ConfigError says what is wrong."""
    step, info = _checked(d)
    state = d / STATE
    try:
        tensors = torch.load(state, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to load is a refusal
        raise ConfigError(f"{state} cannot be loaded with weights_only=True ({e})") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ConfigError(f"{state} does not hold a flat dict of tensors")
    return Checkpoint(step, tensors, info.get("meta", {}), d)


def _checked(d: Path) -> tuple[int, dict[str, Any]]:
    """The step and commit mark of ``d``, its file matching the recorded size and
    SHA-256 (not yet loaded); ConfigError says what is wrong."""
    commit = d / COMMIT
    if not commit.exists():
        raise ConfigError(f"{d}: no {COMMIT} (the write was interrupted before its commit mark)")
    try:
        info = json.loads(commit.read_text())
        expected = info["files"][STATE]
        step = int(info["step"])
        if info.get("format") != FORMAT:
            raise ValueError(f"format {info.get('format')!r}, expected {FORMAT}")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{commit} is not a valid commit mark ({e})") from None
    state = d / STATE
    if not state.exists():
        raise ConfigError(f"{d}: {STATE} is missing")
    size = state.stat().st_size
    if size != expected.get("bytes") or _sha256(state) != expected.get("sha256"):
        raise ConfigError(f"{state} does not match the SHA-256 recorded in {COMMIT} "
                          f"({size} bytes, {expected.get('bytes')} recorded): torn or "
                          f"tampered with")
    return step, info


def usable_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints in ``run_dir`` whose files match their commit
    marks, newest first (what a host of a restarted torchrun launch can resume from)."""
    steps = []
    for d in _candidates(run_dir):
        try:
            steps.append(_checked(d)[0])
        except ConfigError:
            continue
    return steps


def at(run_dir: Path, step: int) -> Checkpoint:
    """The checkpoint of ``step`` in ``run_dir``, verified (ConfigError if it is not
    there or does not verify)."""
    return verify(Path(run_dir) / CHECKPOINTS / f"step-{step:08d}")


def latest(run_dir: Path, log=None) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when there is none at all. Refused
    ones are reported through ``log`` (a callable taking a line); if some exist and
    none verifies, that is an error listing why."""
    refused = []
    for d in _candidates(run_dir):
        try:
            return verify(d)
        except ConfigError as e:
            refused.append(str(e))
            if log is not None:
                log(f"checkpoint refused, trying the previous one: {e}")
    if refused:
        raise ConfigError("no usable checkpoint in " + str(Path(run_dir) / CHECKPOINTS) +
                          ": " + "; ".join(refused) + ". Start the run again without "
                          "--resume.")
    return None
