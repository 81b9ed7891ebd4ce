"""A running job that does not progress says why (without a broker): what it waits for, in
one sentence (:func:`waiting_for`), and when to say it (:class:`StallWatch`: after
:data:`STALL_S` s without progress, again every :data:`STALL_S` s while it stays so). The
service logs the sentence, adds it to the job's events and the Prometheus gauges."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.state import JobState

STALL_S = 60.0
"""A running job that has not progressed for this long says what it waits for."""


def progress_mark(s: JobState, key_ready: bool) -> tuple:
    """What changes whenever the job progresses (a device ready, a proposal or update in, a
    verdict, a round closed, the key announced)."""
    clusters = tuple((k, cr.phase, len(cr.proposals), len(cr.updates), cr.accepted)
                     for k, cr in sorted(s.clusters.items()))
    return (s.plan is None, len(s.agents), len(s.ready_agents()) if s.plan is None else 0, s.round, s.completed,
            clusters, key_ready)


def waiting_for(s: JobState | None, *, key_ready: bool, link_up: bool, keyserver_online: bool | None,
                now: float | None = None) -> str:
    """One sentence: what the running job ``s`` waits for now (devices, updates, the key
    server's verdict), and the links it depends on when they are down."""
    if s is None:
        return "no job is running"
    now = time.time() if now is None else now
    parts = []
    if not link_up:
        parts.append("the broker link is down (reconnecting)")
    if keyserver_online is False:
        parts.append("the key server is offline")
    if not key_ready and s.plan is None:
        parts.append("the key server's public key for this job")
    elif s.plan is None:
        ready = len(s.ready_agents())
        parts.append(f"devices: {ready}/{s.config.min_devices} ready ({len(s.agents)} said hello"
                     + (f", {len(s.declined)} declined" if s.declined else "") + ")")
    else:
        for k, cr in sorted(s.clusters.items()):
            if cr.phase == "proposals":
                parts.append(f"round {s.round} cluster {k}: {len(cr.proposals)}/{len(cr.members)} proposals")
            elif cr.phase == "updates":
                parts.append(f"round {s.round} cluster {k}: {len(cr.updates)}/{len(cr.expected)} updates "
                             f"(deadline in {max(cr.deadline - now, 0):.0f} s)")
            elif cr.phase == "decrypting":
                asked = f"{now - cr.requested_at:.0f} s ago" if cr.requested_at else "not yet asked"
                parts.append(f"round {s.round} cluster {k}: the key server's verdict (asked {asked})")
        if not parts:
            parts.append(f"round {s.round + 1} to open")
    return "; ".join(parts)


@dataclass
class StallWatch:
    """When a job's lack of progress is said (see the module docstring)."""

    after: float = STALL_S
    mark: tuple | None = None
    since: float = 0.0
    said: float = 0.0
    checked: float = float("-inf")

    def check(self, mark_of, *, now: float | None = None) -> float | None:  # noqa: ANN001 - () -> tuple
        """``mark_of()``: the job's progress mark (computed at most once a second: it costs
        O(devices)). Returns the seconds without progress when that is to be said now, 0.0
        when the job just progressed (the gauge resets), else None."""
        now = time.monotonic() if now is None else now
        if now - self.checked < 1.0:
            return None
        self.checked = now
        mark = mark_of()
        if self.mark != mark:
            self.mark, self.since, self.said = mark, now, now
            return 0.0
        if now - self.said < self.after:
            return None
        self.said = now
        return now - self.since

    def reset(self) -> None:
        self.mark = None
