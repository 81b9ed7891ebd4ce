"""What a process asks of the kernel, in one place: whether an OS process runs (pad workers
watching the key server that started them, trials finding stale runs, benchmarks watching
their services), and handing freed heap pages back (:func:`release_memory`, the services
after a round's large messages)."""

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


def release_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``): after a round's
    large messages were handled, what they freed no longer counts in the process's RSS and
    the next round's start from there, not from the last peak. False where there is no glibc
    (nothing happens)."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if not _TRIM:
        return False
    _TRIM(0)
    return True


_TRIM = None  # glibc's malloc_trim once looked up (False: none here)
