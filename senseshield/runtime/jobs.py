"""The operator's side of jobs: submit, list, follow and cancel jobs on a running coordinator.

A :class:`JobClient` is one MQTT link (client id ``operator-<random>``, sender
``operator``): it publishes ``jobs/submit`` and ``jobs/cancel``, waits for the answer on
its own ``jobs/replies/<request id>`` topic, and reads the coordinator's retained
``jobs/board`` (every job, its state, progress and event lines). ``senseshield job ...``
and :func:`senseshield.submit` use it.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any

from senseshield.errors import ConfigError
from senseshield.job import Job
from senseshield.runtime.protocol.messages import (
    JobBoard,
    JobCancel,
    JobReply,
    JobSubmit,
    Message,
    Status,
    from_frame,
    to_frame,
)
from senseshield.runtime.identity import Identity, Trust, check_frame
from senseshield.runtime.transport import Link

OPEN_STATES = ("queued", "waiting", "running")


class JobClient:
    """A connection to a fleet's coordinator for jobs (use as a context manager)."""

    def __init__(self, broker: str, *, fleet: str, protocol: str = "5", identity: Identity | None = None,
                 trust: Trust | None = None, **security: Any) -> None:
        """``identity``: the operator's (default ``~/.senseshield/identities/operator.key``,
        created if missing; a fleet with a trust file accepts jobs only from the operators it
        pins); ``trust``: whose answers to believe (default: trust on first use)."""
        self.fleet = fleet
        self.identity = identity if identity is not None else Identity.load_or_create(
            "operator", Path.home() / ".senseshield" / "identities" / "operator.key")
        self.trust = trust if trust is not None else Trust(fleet=fleet, tofu=True)
        self._online: bool | None = None  # the coordinator's retained status
        self._board: list[dict[str, Any]] | None = None
        self._replies: dict[str, JobReply] = {}
        self._changed = threading.Condition()
        self.link = Link(broker, client_id=f"operator-{uuid.uuid4().hex[:8]}", fleet=fleet,
                         on_frame=self._on_frame, protocol=protocol)
        if any(v is not None for v in security.values()):
            self.link.secure(**security)
        self.link.subscribe("jobs/board")
        self.link.subscribe("coordinator/status")

    def __enter__(self) -> "JobClient":
        self.link.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.link.stop()

    def _on_frame(self, topic: str, frame: Any) -> None:
        check_frame(self.trust, frame)
        message = from_frame(frame)
        with self._changed:
            if isinstance(message, Status) and frame.sender == "coordinator":
                self._online = message.online
            elif isinstance(message, JobBoard) and frame.sender == "coordinator":
                self._board = list(message.jobs)
            elif isinstance(message, JobReply) and frame.sender == "coordinator":
                self._replies[message.request_id] = message
            self._changed.notify_all()

    def _send(self, suffix: str, message: Message) -> None:
        self.link.publish(suffix, to_frame(message, fleet=self.fleet, sender=self.identity.name, round=0,
                                                signer=self.identity))

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = end - time.monotonic()
                if left <= 0:
                    raise ConfigError(f"No {what} from the coordinator of fleet {self.fleet!r} within {timeout:g} s; "
                                      "is `coordinator serve` running on this broker and fleet?")
                self._changed.wait(min(left, 0.5))

    def check_operator(self) -> None:
        """A coordinator with a trust file acts only on jobs signed by an operator it pins,
        and says nothing to anyone else (docs/security.md). So this client checks its own
        identity against the trust file it was given, and says at once, instead of waiting
        for an answer that never comes. :class:`ConfigError` naming the identity."""
        if self.trust.tofu:
            return
        me = self.identity
        pinned = self.trust.principals.get(me.name)
        if pinned is None:
            why = f"does not list {me.name!r}"
        elif pinned.role != "operator":
            why = f"gives {me.name!r} role {pinned.role!r}, not operator"
        elif (pinned.sign != me.sign_key) if pinned.sign is not None else (pinned.pinned_fingerprint != me.fingerprint):
            why = f"pins another key for {me.name!r}"
        else:
            return
        raise ConfigError(
            f"The trust file of fleet {self.fleet!r} {why}, so the coordinator ignores jobs signed with this "
            f"identity (key {me.fingerprint}); give the --identity the trust file pins, or add this one to the "
            f"trust file (`senseshield identity show --name {me.name} --identity FILE`, then `senseshield "
            "identity build`).")

    def _ask(self, suffix: str, message: JobSubmit | JobCancel, timeout: float) -> JobReply:
        """Send ``message`` once the coordinator is online, again every few seconds until it
        answers (it answers a repeated request id with its first answer)."""
        self.check_operator()
        self.link.subscribe(f"jobs/replies/{message.request_id}")
        end = time.monotonic() + timeout
        self._wait(lambda: self._online is True, timeout, "online status")
        while True:
            self._send(suffix, message)
            try:
                self._wait(lambda: message.request_id in self._replies, min(5.0, max(end - time.monotonic(), 0.1)),
                           "answer")
                return self._replies[message.request_id]
            except ConfigError:
                if time.monotonic() >= end:
                    raise

    def submit(self, job: Job, *, timeout: float = 60.0) -> str:
        """Queue ``job``; returns its id. ConfigError with the coordinator's reason if refused."""
        from senseshield.runtime.jobsig import job_submission

        reply = self._ask("jobs/submit", job_submission(job), timeout)
        if not reply.accepted:
            raise ConfigError(f"The coordinator refused the job: {reply.reason}")
        return reply.job_id

    def cancel(self, job_id: str, *, timeout: float = 30.0) -> None:
        reply = self._ask("jobs/cancel", JobCancel(request_id=uuid.uuid4().hex[:12], job_id=job_id), timeout)
        if not reply.accepted:
            raise ConfigError(f"Cannot cancel: {reply.reason}.")

    def board(self, *, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every job the coordinator knows (oldest first)."""
        self._wait(lambda: self._board is not None, timeout, "job board")
        return list(self._board or [])

    def record(self, job_id: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """One job's record; ConfigError naming the known ids if there is none."""
        jobs = self.board(timeout=timeout)
        for job in jobs:
            if job["id"] == job_id:
                return job
        known = ", ".join(j["id"] for j in jobs[-10:]) or "none"
        raise ConfigError(f"No job {job_id!r} on fleet {self.fleet!r}; known jobs: {known}.")

    def follow(self, job_id: str, on_line: Callable[[str], None], *, timeout: float | None = None) -> dict[str, Any]:
        """Call ``on_line`` for every event line of the job (those so far, then new ones)
        until it ends; returns its final record."""
        seen = 0
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            record = self.record(job_id)
            for line in record["events"][seen:]:
                on_line(line)
            seen = len(record["events"])
            if record["state"] not in OPEN_STATES:
                return record
            if end is not None and time.monotonic() > end:
                raise ConfigError(f"Job {job_id} did not end within {timeout:g} s (it is {record['state']}).")
            with self._changed:
                self._changed.wait(1.0)
