"""Whether an OS process runs, asked of the kernel in one place (pad workers watching the key
server that started them, trials finding stale runs, benchmarks watching their services)."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
    """Whether process ``pid`` runs. An exited process that its parent has not reaped yet (a
    zombie) does not: read from ``/proc`` where there is one, else asked with signal 0 (which
    counts a zombie as running)."""
    if os.path.exists("/proc/self/stat"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
