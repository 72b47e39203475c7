"""Taking a profile: one short traced ``single`` run, read back as a
:class:`psring.records.profile.Profile` (what ``psring profile`` and ``advise`` do).

Apart from psring.records.profile so that reading a profile needs neither the run's
configuration nor the launcher (psring.config validates --device-profile with it).
"""

from __future__ import annotations

import os
import time
from typing import Any

from psring.config import RunConfig, validate
from psring.errors import ConfigError
from psring.library.start import script_refusals
from psring.records.profile import MODEL_KEYS, Profile, load_host_copy
from psring.runs.launch import launch
from psring.train.models import ModelSettings, meta_backward_shares
from psring.train.workload import meta_model


def profile_config(**run_flags: Any):
    """The RunConfig of a profiling run: ``single``, traced, 8 steps unless told."""
    values = {"steps": 8, **run_flags}
    values.update(strategy="single", workers=1, trace=True, hosts=1)
    # the rows its steps read and no held-out ones: a profile times steps, and 4096
    # synthetic 224 x 224 images alone would fill 2.5 GB before the first step
    batch = int(values.get("batch_size") or RunConfig.batch_size)
    values.setdefault("samples", min(RunConfig.samples, batch * int(values["steps"])))
    values.setdefault("eval_samples", 0)
    values.setdefault("out", os.path.join("runs", f"profile-{time.strftime('%Y%m%d-%H%M%S')}"))
    return RunConfig(**values)


def take_profile(cfg, command: list[str] | None = None) -> Profile:
    """Run ``cfg`` (see :func:`profile_config`), then read and save its profile in the
    run directory. ``command``: a user's script to run instead of psring's loop
    (psring.library; its model is the script's)."""
    if command:

        script_refusals(cfg)
    run_dir = launch(cfg, command=command or None)
    prof = Profile.from_run(run_dir)
    prof.save(run_dir)
    return prof


#: the `psring profile --on-paper` flags: paper_profile's arguments
PAPER_FLAGS = ("forward_ms", "backward_ms", "step_ms", "update_ms", "source")


def paper_profile_from(settings: dict[str, Any], out: str | os.PathLike) -> Profile:
    """``psring profile --on-paper`` from a dict of its flags (``_`` for ``-``), saved
    atomically as ``out/profile.json``: what a sweep's ``[profiles]`` table builds."""

    paper = {k: settings.get(k) for k in PAPER_FLAGS}
    paper["update_ms"] = paper["update_ms"] or 0.0
    paper["source"] = paper["source"] or ""

    cfg = validate(profile_config(**{k: v for k, v in settings.items()
                                     if k not in (*PAPER_FLAGS, "host_copy")}, out=str(out)))
    prof = paper_profile(cfg, **paper)
    if settings.get("host_copy"):
        prof.host_copy = load_host_copy(settings["host_copy"])
    prof.save(out)
    return prof


#: --step-ms without a split: backward takes twice the forward's time (two matrix
#: products per layer against one), the usual rule for dense networks
BACKWARD_SHARE = 2 / 3


def paper_profile(cfg: RunConfig, forward_ms: float | None, backward_ms: float | None,
                  step_ms: float | None, update_ms: float = 0.0,
                  source: str = "") -> Profile:
    """A profile from published figures for ``cfg``'s model at ``cfg.batch_size`` (its
    parameter list from the model itself, built on the meta device: no compute). Give
    forward and backward times, or a step time (split by :data:`BACKWARD_SHARE`).
    Each gradient is ready when backward's FLOPs reach it (psring.train.models.backward_shares),
    else in proportion to bytes (Profile.on_paper)."""

    if step_ms is not None and (forward_ms is not None or backward_ms is not None):
        raise ConfigError("--on-paper takes --step-ms, or --forward-ms and --backward-ms, "
                          "not both.")
    if step_ms is not None:
        forward_ms, backward_ms = step_ms * (1 - BACKWARD_SHARE), step_ms * BACKWARD_SHARE
    if forward_ms is None or backward_ms is None:
        raise ConfigError("--on-paper needs the device's times: --forward-ms and "
                          "--backward-ms, or --step-ms (forward and backward together).")
    for name, v in (("forward", forward_ms), ("backward", backward_ms), ("update", update_ms)):
        if not (v >= 0 and v != float("inf")):
            raise ConfigError(f"--{name}-ms must be a time in milliseconds >= 0 (got {v}).")

    model, _ = meta_model(cfg)
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    rule = ("forward and backward as given" if step_ms is None else
            f"step {step_ms:g} ms split {1 - BACKWARD_SHARE:.2f}:{BACKWARD_SHARE:.2f} "
            f"forward:backward")
    # where in backward each gradient is ready: as backward's FLOPs reach it (on the meta
    # device, at this configuration's data shape: image size and sequence length count)
    shares = meta_backward_shares(cfg.model, ModelSettings.from_config(cfg))
    shares = None if shares is None else list(shares)
    rule += ("; each gradient ready when backward's FLOPs (torch's counter, autograd's "
             "order) reach it" if shares is not None else
             "; gradients ready in proportion to their bytes, last parameter first "
             "(no FLOPs counted)")
    return Profile.on_paper(sizes, forward_ms / 1e3, backward_ms / 1e3, update_ms / 1e3,
                            batch_size=cfg.batch_size, shares=shares,
                            source={"model": cfg.model, "cited": source, "rule": rule,
                                    **{k: getattr(cfg, k) for k in MODEL_KEYS}})
