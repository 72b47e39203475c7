"""Taking a profile: one short traced ``single`` run, read back as a
:class:`psring.predict.profile.Profile` (what ``psring profile`` and ``advise`` do).

Apart from psring.predict.profile so that reading a profile needs neither the run's
configuration nor the launcher (psring.config validates --device-profile with it).
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..config import RunConfig
from ..launch import launch
from .profile import Profile


def profile_config(**run_flags: Any):
    """The RunConfig of a profiling run: ``single``, traced, 8 steps unless told."""
    values = {"steps": 8, **run_flags}
    values.update(strategy="single", workers=1, trace=True, hosts=1)
    values.setdefault("out", os.path.join("runs", f"profile-{time.strftime('%Y%m%d-%H%M%S')}"))
    return RunConfig(**values)


def take_profile(cfg) -> Profile:
    """Run ``cfg`` (see :func:`profile_config`), then read and save its profile in the
    run directory."""
    run_dir = launch(cfg)
    prof = Profile.from_run(run_dir)
    prof.save(run_dir)
    return prof
