"""XLA_FLAGS for a test's subprocess: the suite's own flags (conftest.py's fast-compile
settings) kept, the simulated CPU device count replaced."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
    """The suite's XLA_FLAGS without a forced CPU device count, plus `devices` simulated CPU
    devices when given (None: the child picks its own count, e.g. the lab's --cpu-devices)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    if devices is not None:
        flags.append(f"{DEVICE_COUNT}={devices}")
    return " ".join(flags)
