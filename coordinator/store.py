"""Where the coordinator keeps what outlives its process: the job book's records
(:class:`~coordinator.jobs.JobRecord`) and the running job's state
(:class:`~coordinator.state.JobState`).

:class:`Store` is the interface: save and load job records, save and load the running job's
state, clear it when the job ends. Two implementations keep the same contract
(tests/test_store.py runs one suite over both):

* :class:`MemoryStore`: in the process only (no ``--state-dir``); it keeps what it is given
  as JSON text, so what it hands back is a copy, as the durable store's is;
* :class:`SqliteStore`: one SQLite file, ``--state-dir/coordinator-<fleet>.sqlite`` (mode
  0600: the state holds the fleet plan and every agent's hello). Every save is one
  transaction (the old row or the new one, never a part), made durable before it returns.
  A state is encoded piece by piece into a temporary file and copied into its row a MB at a
  time (:func:`~senseshield.runtime.files.json_pieces`): a large fleet's checkpoint is never
  one string in the coordinator's memory.

A store that cannot write says so as :class:`~senseshield.errors.StorageError` (one sentence
naming the file and the reason; the coordinator stops with exit 74 and resumes from what was
saved when started again). A saved state that cannot be read is a
:class:`~senseshield.errors.ConfigError` naming the file, never a traceback.

A state directory of earlier versions (``jobs-<fleet>.json`` and ``coordinator-<fleet>.json``)
is read once: :meth:`SqliteStore.open` imports both into a new database and renames them to
``*.imported``.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordinator.jobs import JobRecord
from coordinator.state import JobState
from senseshield.errors import ConfigError, StorageError
from senseshield.runtime.files import json_pieces, write_pieces


def unreadable(where: object, run_id: str | None, exc: Exception) -> ConfigError:
    """The sentence for a saved state of job ``run_id`` (None: not known) in ``where`` that
    cannot be read."""
    what = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc).split("\n")[0]
    job = f"job {run_id}" if run_id else "its job"
    return ConfigError(f"The coordinator's checkpoint {str(where)!r} cannot be read ({what}); move it away to start "
                       f"{job} anew.")


def decode_state(text: str | bytes, where: object, run_id: str) -> JobState | None:
    """The state of job ``run_id`` in ``text`` (JSON of :meth:`JobState.to_json`); None if it is
    another job's; ConfigError (:func:`unreadable`) if it cannot be read."""
    try:
        raw = json.loads(text)
        if raw["run_id"] != run_id:
            return None
        return JobState.from_json(raw)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise unreadable(where, run_id, exc) from None


class Store(ABC):
    """The coordinator's durable things (see the module docstring). ``where``: what a message
    names (the file, or "memory")."""

    where: str = "memory"

    @abstractmethod
    def load_jobs(self) -> list[JobRecord]:
        """Every saved job record, in the order they were first saved."""

    @abstractmethod
    def save_job(self, record: JobRecord) -> None:
        """Add ``record``, or replace the saved record of its id."""

    @abstractmethod
    def save_state(self, state: JobState) -> None:
        """Replace the saved state with ``state`` (one running job at a time)."""

    @abstractmethod
    def load_state(self, run_id: str) -> JobState | None:
        """The saved state of job ``run_id``; None if there is none or it is another job's."""

    @abstractmethod
    def clear_state(self) -> None:
        """Forget the saved state (the job ended); nothing saved: nothing happens."""

    def close(self) -> None:
        """Let go of what the store holds open."""


class MemoryStore(Store):
    """A store in this process only (see the module docstring)."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}
        self.state: str | None = None

    def load_jobs(self) -> list[JobRecord]:
        return [JobRecord(**json.loads(text)) for text in self.jobs.values()]

    def save_job(self, record: JobRecord) -> None:
        self.jobs[record.id] = json.dumps(asdict(record))

    def save_state(self, state: JobState) -> None:
        self.state = json.dumps(state.to_json())

    def load_state(self, run_id: str) -> JobState | None:
        return None if self.state is None else decode_state(self.state, self.where, run_id)

    def clear_state(self) -> None:
        self.state = None


SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, record TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS state (slot INTEGER PRIMARY KEY CHECK (slot = 0), run_id TEXT NOT NULL, "
    "state TEXT NOT NULL)",
)


def _create(db: sqlite3.Connection) -> None:
    for statement in SCHEMA:
        db.execute(statement)


class SqliteStore(Store):
    """The store in one SQLite file ``path`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        try:
            if not self.path.exists():  # private from the start (the journal gets the same mode)
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA synchronous = FULL")  # a committed save survives a power loss
        except (OSError, sqlite3.Error) as exc:
            raise self._cannot_write(exc) from None
        self._write(_create)

    @classmethod
    def open(cls, state_dir: Path, fleet: str, log: logging.Logger | None = None) -> "SqliteStore":
        """The store of fleet ``fleet`` in ``state_dir`` (created if missing), with what an
        earlier version left there imported (see the module docstring)."""
        path = state_dir / f"coordinator-{fleet}.sqlite"
        fresh = not path.exists()
        store = cls(path)
        if fresh:
            import_json_dir(store, state_dir, fleet, log or logging.getLogger("senseshield.coordinator"))
        return store

    # ---- the interface ------------------------------------------------------------------
    def load_jobs(self) -> list[JobRecord]:
        rows = self._read(lambda db: db.execute("SELECT record FROM jobs ORDER BY rowid").fetchall(), "job book")
        try:
            return [JobRecord(**json.loads(text)) for (text,) in rows]
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"The coordinator's job book {self.where!r} cannot be read ({exc}); move it away to "
                              "start with an empty queue.") from None

    def save_job(self, record: JobRecord) -> None:
        text = json.dumps(asdict(record))
        self._write(lambda db: db.execute(
            "INSERT INTO jobs (id, record) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            (record.id, text)))

    def save_state(self, state: JobState) -> None:
        try:
            spool = tempfile.TemporaryFile(prefix="senseshield-checkpoint-", dir=self.path.parent)
        except OSError as exc:
            raise self._cannot_write(exc) from None
        with spool:
            try:
                size = write_pieces(json_pieces(state.to_json(lazy=True), depth=3), spool)
                spool.seek(0)
            except OSError as exc:
                raise self._cannot_write(exc) from None

            def change(db: sqlite3.Connection) -> None:
                # the row first (zeroblob: its size), then its bytes a MB at a time
                db.execute("INSERT OR REPLACE INTO state (slot, run_id, state) VALUES (0, ?, zeroblob(?))",
                           (state.run_id, size))
                with db.blobopen("state", "state", 0) as blob:
                    while chunk := spool.read(1 << 20):
                        blob.write(chunk)

            self._write(change)

    def load_state(self, run_id: str) -> JobState | None:
        try:
            row = self.db.execute("SELECT state FROM state WHERE slot = 0").fetchone()
        except sqlite3.Error as exc:
            raise unreadable(self.where, run_id, exc) from None
        return None if row is None else decode_state(row[0], self.where, run_id)

    def clear_state(self) -> None:
        self._write(lambda db: db.execute("DELETE FROM state"))

    def close(self) -> None:
        self.db.close()

    # ---- internals ----------------------------------------------------------------------
    def _write(self, change: Any) -> None:  # noqa: ANN401 - a function of the connection
        """Run ``change(connection)`` as one transaction; StorageError if it cannot be written."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                change(self.db)
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:  # OSError: a checkpoint's spool file
            raise self._cannot_write(exc) from None

    def _read(self, query: Any, what: str) -> Any:  # noqa: ANN401
        try:
            return query(self.db)
        except sqlite3.Error as exc:
            raise ConfigError(f"The coordinator's {what} {self.where!r} cannot be read ({exc}); move it away to "
                              "start anew.") from None

    def _cannot_write(self, exc: Exception) -> StorageError:
        if isinstance(exc, OSError):
            return StorageError.writing(self.path, exc)
        name = getattr(exc, "sqlite_errorname", None)
        return StorageError(f"Cannot write {self.where!r}: {exc}" + (f" ({name})" if name else ""), path=self.where)


def import_json_dir(store: Store, state_dir: Path, fleet: str, log: logging.Logger) -> None:
    """What an earlier version kept in ``state_dir`` as JSON files, saved into ``store``: the
    job book (``jobs-<fleet>.json``) and the running job's checkpoint
    (``coordinator-<fleet>.json``); each file is renamed to ``*.imported`` once saved."""
    book, checkpoint = state_dir / f"jobs-{fleet}.json", state_dir / f"coordinator-{fleet}.json"
    if book.exists():
        try:
            records = [JobRecord(**entry) for entry in json.loads(book.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"The coordinator's job book {str(book)!r} cannot be read ({exc}); move it away to "
                              "start with an empty queue.") from None
        for record in records:
            store.save_job(record)
        _set_aside(book)
        log.info("imported %d job(s) from %s into %s", len(records), book, store.where)
    if checkpoint.exists():
        raw: dict = {}
        try:
            raw = json.loads(checkpoint.read_text())
            state = legacy_state(raw)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise unreadable(checkpoint, raw.get("run_id") if isinstance(raw, dict) else None, exc) from None
        store.save_state(state)
        _set_aside(checkpoint)
        log.info("imported the checkpoint of job %s from %s into %s", state.run_id, checkpoint, store.where)


def _set_aside(path: Path) -> None:
    try:
        path.replace(path.with_name(path.name + ".imported"))
    except OSError as exc:
        raise StorageError.writing(path, exc) from None


def legacy_state(raw: dict[str, Any]) -> JobState:
    """The :class:`JobState` of a checkpoint in the JSON format of earlier versions (the
    plan's fields at the top level, agents as their hellos; no model shape, which is
    rebuilt from the job as the coordinator builds it)."""
    from senseshield.job import Job, initial_model, job_shape
    from senseshield.training import layout_of

    config = Job(**raw["config"])
    input_shape, num_classes = job_shape(config)
    model, _ = initial_model(config, input_shape, num_classes)
    hellos = raw["hellos"]
    plan = {"cluster_of": raw["cluster_of"], "budget_of": raw["budget_of"],
            "budget_notes": raw.get("budget_notes", {}), "fixed_masks": raw["fixed_masks"],
            "rankings": raw.get("rankings", {})}
    fresh = JobState(raw["run_id"], config, layout_of(model).size, list(input_shape), num_classes).to_json()
    converted = {
        **fresh,
        **{k: v for k, v in raw.items() if k in fresh},
        "plan": plan,
        "agents": {a: {"hello": h, "online": True, "joined_at": time.time()} for a, h in hellos.items()},
        "user_accountant": raw["accountant"],
        "records": [{**rec, "clusters": rec.get("clusters", {})} for rec in raw["records"]],
    }
    return JobState.from_json(converted)
