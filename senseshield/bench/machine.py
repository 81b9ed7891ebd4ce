"""What a benchmark or a trial records of the machine it ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(default: str | None = None) -> str:
    """The CPU's model name (``model name`` in ``/proc/cpuinfo``); where there is none,
    ``default`` (None: ``platform.processor()``, else ``platform.machine()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default if default is not None else (platform.processor() or platform.machine())
