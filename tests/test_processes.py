"""senseshield.processes: whether a process runs, and handing freed heap pages back."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from senseshield.processes import release_memory, running


def test_a_running_process_runs_and_a_reaped_or_zombie_one_does_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running(child.pid) and running(os.getpid())
    finally:
        child.kill()
    child.wait()
    assert not running(child.pid)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or platform.libc_ver()[0] != "glibc",
                    reason="reads RSS from /proc; malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_kernel():
    """A fragmented heap (every 16th 4 KB object kept, the rest freed) keeps its pages until
    release_memory hands the free ones back (about 90 MB here)."""
    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    held = [bytes(4000) + bytes([i % 256]) for i in range(25_000)]
    kept = held[::16]
    del held
    before = rss()
    assert release_memory()  # glibc: found and called
    assert before - rss() > 30e6 and len(kept) == 1563
