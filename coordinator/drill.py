"""Fault drills of ``coordinator serve`` (hidden options, for tests): the coordinator kills
itself (SIGKILL: no goodbye, nothing flushed) at a chosen point, so that a test can start it
again with the same command line and check that the job resumes and ends as it would have.

* ``--kill-before-close R``: once round R has every verdict, before the round is closed (not
  again in the round a restarted coordinator resumes);
* ``--kill-at-message N`` (repeatable): right after the coordinator handled the job's N-th
  inbound message, counted over the restarts (each kill point fires once). The count and
  the points fired are kept in ``--state-dir/drill-<fleet>.json``, which the option needs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from senseshield.errors import ConfigError
from senseshield.runtime.files import write_atomic

if TYPE_CHECKING:
    from senseshield.runtime.service import Inbound


def kill(log: logging.Logger, why: str) -> None:
    log.warning("fault drill: killing myself (SIGKILL) %s", why)
    os.kill(os.getpid(), signal.SIGKILL)


class Drill:
    """The drills one ``coordinator serve`` runs (see the module docstring)."""

    def __init__(self, state_dir: Path | None, fleet: str, *, kill_before_close: int | None = None,
                 kill_at_message: list[int] | tuple[int, ...] = (), log: logging.Logger) -> None:
        if kill_at_message and state_dir is None:
            raise ConfigError("--kill-at-message needs --state-dir (the messages handled are counted over restarts).")
        if any(n < 1 for n in kill_at_message):
            raise ConfigError(f"--kill-at-message {min(kill_at_message)} is not allowed; count messages from 1.")
        self.kill_before_close, self.points, self.log = kill_before_close, sorted(set(kill_at_message)), log
        self.path = state_dir / f"drill-{fleet}.json" if state_dir is not None else None
        self.handled, self.fired = 0, []
        if self.points and self.path.exists():
            saved = json.loads(self.path.read_text())
            self.handled, self.fired = int(saved["handled"]), list(saved["fired"])

    @property
    def counts(self) -> bool:
        """Whether messages are counted (``--kill-at-message``)."""
        return bool(self.points)

    def message_handled(self, item: Inbound) -> None:
        """One more inbound message (``item``) handled: SIGKILL if that reaches a kill point not yet fired."""
        self.handled += 1
        self.log.debug("fault drill: message %d: %s from %s (round %d)", self.handled, item.suffix, item.sender,
                       item.round)
        due = [n for n in self.points if n <= self.handled and n not in self.fired]
        if due:
            self.fired.append(due[0])
        write_atomic(self.path, json.dumps({"handled": self.handled, "fired": self.fired}))
        if due:
            kill(self.log, f"after message {self.handled}, {item.suffix} from {item.sender} (kill point {due[0]})")

    def before_close(self, r: int, *, restarted: bool) -> None:
        """Round ``r`` has every verdict: SIGKILL if it is the drill's round (``restarted``: the
        round a restarted coordinator resumed)."""
        if self.kill_before_close == r and not restarted:
            kill(self.log, f"before closing round {r}")
