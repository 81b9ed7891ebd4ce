"""The coordinator's job book: the queue, each job's state and events, kept on disk.

A job is queued when submitted (``senseshield job submit``, or ``coordinator serve --job``),
``waiting`` while too few devices are ready, ``running``, then ``done``, ``failed`` or
``cancelled``. One job runs at a time, in submission order. Every change of a job's record
is saved in the coordinator's store (:mod:`coordinator.store`: with ``--state-dir`` a
restarted coordinator resumes the running job and keeps the queue) and the book is published
as the retained ``jobs/board`` message (what ``job list``, ``job status`` and ``job logs`` read).
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from senseshield.job import Job

if TYPE_CHECKING:
    from coordinator.store import Store

STATES = ("queued", "waiting", "running", "done", "failed", "cancelled")
OPEN = ("queued", "waiting", "running")
MAX_EVENTS = 500  # event lines kept per job
MAX_BOARD = 50  # jobs on the board (the newest; every open one)


@dataclass
class JobRecord:
    """One job's entry in the book (JSON as is on ``jobs/board`` and on disk)."""

    id: str
    job: dict[str, Any]
    name: str
    state: str = "queued"
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    round: int = 0
    rounds: int = 0
    accuracy: float | None = None  # the job's metric when it is accuracy (older books: only this)
    metric_name: str = "accuracy"  # the job's metric (accuracy, mse, ...) and its latest value
    metric: float | None = None
    devices: int = 0
    out: str | None = None  # where its report.json is (on the coordinator's host)
    reason: str = ""
    events: list[str] = field(default_factory=list)
    # the operator's signed jobs/submit frame, base64 ("": an unsigned job); forwarded to the
    # key server in fleet/config (senseshield.runtime.jobsig), not shown on the board
    submission: str = ""

    @property
    def spec(self) -> Job:
        return Job(**self.job)

    @property
    def signed(self) -> bytes:
        """The operator's signed job frame (b"": unsigned)."""
        return base64.b64decode(self.submission)


class JobBook:
    """The queue and the finished jobs, kept in ``store`` (None: a
    :class:`~coordinator.store.MemoryStore` of its own)."""

    def __init__(self, store: Store | None = None) -> None:
        if store is None:
            from coordinator.store import MemoryStore

            store = MemoryStore()
        self.store = store
        self.records: dict[str, JobRecord] = {record.id: record for record in store.load_jobs()}

    def add(self, job: Job, job_id: str | None = None, *, signed: bytes = b"", operator: str = "") -> JobRecord:
        """Queue ``job`` (a fresh id unless given), with the frame ``operator`` signed it in
        (``signed``, b"": unsigned), and return its record."""
        job_id = job_id or f"j-{uuid.uuid4().hex[:8]}"
        record = JobRecord(job_id, job.model_dump(mode="json"), job.label, rounds=job.rounds,
                           submission=base64.b64encode(signed).decode())
        self.records[job_id] = record
        self.event(record, f"queued: {job.label} ({job.strategy}, model {job.model}, {job.rounds} rounds, "
                           f"at least {job.min_devices} devices; " + (f"signed by {operator}" if signed else "unsigned") + ")")
        return record

    def get(self, job_id: str) -> JobRecord | None:
        return self.records.get(job_id)

    def next_open(self) -> JobRecord | None:
        """The running (or waiting) job, else the oldest queued one."""
        for state in ("running", "waiting", "queued"):
            found = [r for r in self.records.values() if r.state == state]
            if found:
                return min(found, key=lambda r: r.submitted_at)
        return None

    def cancel(self, job_id: str) -> tuple[JobRecord | None, str]:
        """Cancel job ``job_id``: a queued one now; a waiting or running one is returned as it
        is, for its loop to stop at its next step. (None, why) if it is not queued or running."""
        record = self.get(job_id)
        if record is None or record.state not in OPEN:
            return None, f"job {job_id!r} is not queued or running" + ("" if record is None else f" (it is {record.state})")
        if record.state == "queued":
            self.set(record, state="cancelled", finished_at=time.time(), reason="cancelled before it started")
            self.event(record, "cancelled before it started")
        return record, ""

    def event(self, record: JobRecord, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        record.events.append(f"{stamp} {line}")
        del record.events[:-MAX_EVENTS]
        self.store.save_job(record)

    def set(self, record: JobRecord, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(record, name, value)
        self.store.save_job(record)

    def board(self) -> list[dict[str, Any]]:
        """The jobs for ``jobs/board``: every open one and the newest others, oldest first."""
        ordered = sorted(self.records.values(), key=lambda r: r.submitted_at)
        keep = [r for r in ordered if r.state in OPEN]
        rest = [r for r in ordered if r.state not in OPEN][-max(MAX_BOARD - len(keep), 0):]
        return [{k: v for k, v in asdict(r).items() if k != "submission"}
                for r in sorted(keep + rest, key=lambda r: r.submitted_at)]
