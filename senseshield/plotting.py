"""matplotlib for the project's figures (reports, compare, attacks): the Agg backend (no
display), and a note when matplotlib is about to create its folders in the home directory.

Matplotlib keeps a font cache in ``~/.cache/matplotlib`` and a config folder in
``~/.config/matplotlib`` (or under ``$XDG_CACHE_HOME``/``$XDG_CONFIG_HOME``, or in
``$MPLCONFIGDIR`` when set). SenseShield writes nothing in the home directory without
saying so: the first time a process plots and those folders do not exist yet, it logs
where matplotlib will write them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("senseshield")
_noted = False


def matplotlib_home_dirs() -> list[Path]:
    """The folders matplotlib will create in the home directory (none if ``$MPLCONFIGDIR``
    is set or they exist already)."""
    if os.environ.get("MPLCONFIGDIR"):
        return []
    home = Path.home()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "matplotlib"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "matplotlib"
    return [d for d in (config, cache) if not d.exists()]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; says (once per process) where matplotlib
    writes in the home directory if it is about to create its folders there."""
    global _noted
    if not _noted:
        _noted = True
        new = matplotlib_home_dirs()
        if new:
            log.warning("matplotlib keeps its font cache in %s (set MPLCONFIGDIR to put it elsewhere)",
                        " and ".join(str(d) for d in new))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
