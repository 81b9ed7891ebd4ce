"""A real Mosquitto broker for the tests, on a free loopback port (no mock transport).

The class is the project's own (:class:`senseshield.runtime.broker.MosquittoProcess`, which trials
use too); this module keeps the names the tests import.
"""

from __future__ import annotations

import socket
from pathlib import Path

from senseshield.runtime.broker import MosquittoProcess
from senseshield.runtime.broker import mosquitto_binary as _find


def mosquitto_binary() -> str:
    found = _find()
    if found is None:
        raise RuntimeError(
            "The broker tests need Mosquitto; `make test` installs the Debian package "
            "(apt-get install mosquitto) when it can."
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mosquitto(MosquittoProcess):
    """Start/stop/restart a Mosquitto process with a config written to ``workdir``."""

    def __init__(self, workdir: Path, *, message_size_limit: int = 0, max_queued_messages: int | None = None,
                 max_inflight_messages: int | None = None) -> None:
        super().__init__(workdir, "127.0.0.1", message_size_limit=message_size_limit,
                         max_queued_messages=max_queued_messages, max_inflight_messages=max_inflight_messages)

    def start(self, timeout: float = 10.0) -> "Mosquitto":
        mosquitto_binary()  # a clear message when it is missing
        return super().start(timeout)
