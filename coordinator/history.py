"""What the coordinator keeps of the devices' earlier rounds, packed: a fleet's history in a
fraction of the memory its objects would take.

The job's state keeps, for the whole job, every device's round record (plan, budget,
timings, what its update showed) and every evaluation it reported (:class:`Metrics`): the
report and the budgets read them. As Python objects that is a few kilobytes per device and
round, which at 10,000 devices is tens of MB a round, for every round of the job. Once a
round is closed (the next one opens), its records are kept as compact JSON bytes on disk
instead (a :class:`Shelf`: the process's private temporary SQLite database), and decoded
when read: what the coordinator holds in memory then does not grow with the rounds. What
still arrives of a closed round (a device's late metrics, an evaluation failure) is kept
as it comes and packed at the next round's opening.

* :class:`DeviceRounds`, one device's round records (round -> record), a mutable mapping.
  Reading a settled round with ``rounds[r]`` unpacks it for good (a late evaluation failure
  may still be written into it; the next :meth:`DeviceRounds.settle` packs it again);
  ``get``, ``items`` and ``values`` hand settled rounds out as fresh copies, to read.
* :class:`MetricsBook`, every device's evaluations ((device, round) -> :class:`Metrics`),
  written once each, packed the same way.

Both iterate lazily: a checkpoint or a report that walks them decodes one record at a time.
Records must be JSON (string keys; the checkpoint keeps them as JSON anyway).
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import asdict
from typing import Any

from senseshield.results import RoundTally
from senseshield.runtime.protocol.messages import Metrics


def _pack(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


class Shelf(MutableMapping):
    """Packed records on disk: key -> bytes in the process's shelf, a private temporary SQLite
    database (SQLite's own: a file in the temporary directory, deleted when the process ends)
    that every shelf shares, each under its own namespace; in memory only SQLite's page cache.
    Keys are JSON values (a list comes back as a tuple); iteration is in insertion order, as
    a dict's. Thread-safe (one lock for the database)."""

    __slots__ = ("ns", "__weakref__")
    _lock = threading.Lock()
    _db: sqlite3.Connection | None = None
    _spaces = itertools.count()

    def __init__(self) -> None:
        self.ns = next(Shelf._spaces)

    @classmethod
    def _run(cls, sql: str, args: tuple = ()) -> list[tuple]:
        """The rows of ``sql`` (for a change: one row, the number of rows it changed)."""
        with cls._lock:
            if cls._db is None:
                db = sqlite3.connect("", check_same_thread=False, isolation_level=None)
                db.execute("CREATE TABLE shelf (ns INTEGER, key TEXT, value BLOB)")
                db.execute("CREATE UNIQUE INDEX place ON shelf (ns, key)")
                cls._db = db
            cursor = cls._db.execute(sql, args)
            return cursor.fetchall() if sql.startswith("SELECT") else [(cursor.rowcount,)]

    @staticmethod
    def _key(key: Any) -> str:  # noqa: ANN401 - a JSON value
        return json.dumps(key, separators=(",", ":"))

    @staticmethod
    def _unkey(text: str) -> Any:  # noqa: ANN401
        key = json.loads(text)
        return tuple(key) if isinstance(key, list) else key

    def __getitem__(self, key: Any) -> bytes:  # noqa: ANN401
        rows = self._run("SELECT value FROM shelf WHERE ns = ? AND key = ?", (self.ns, self._key(key)))
        if not rows:
            raise KeyError(key)
        return rows[0][0]

    def __setitem__(self, key: Any, value: bytes) -> None:  # noqa: ANN401
        k = self._key(key)
        if not self._run("UPDATE shelf SET value = ? WHERE ns = ? AND key = ?", (value, self.ns, k))[0][0]:
            self._run("INSERT INTO shelf VALUES (?, ?, ?)", (self.ns, k, value))

    def __delitem__(self, key: Any) -> None:  # noqa: ANN401
        if not self._run("DELETE FROM shelf WHERE ns = ? AND key = ?", (self.ns, self._key(key)))[0][0]:
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return bool(self._run("SELECT 1 FROM shelf WHERE ns = ? AND key = ?", (self.ns, self._key(key))))

    def __iter__(self) -> Iterator[Any]:
        return iter([self._unkey(k) for (k,) in self._run("SELECT key FROM shelf WHERE ns = ? ORDER BY rowid",
                                                           (self.ns,))])

    def __len__(self) -> int:
        return self._run("SELECT count(*) FROM shelf WHERE ns = ?", (self.ns,))[0][0]

    def __del__(self) -> None:
        try:
            self._run("DELETE FROM shelf WHERE ns = ?", (self.ns,))
        except Exception:  # noqa: BLE001 - the interpreter may be going down; the file goes with it
            pass


class DeviceRounds(MutableMapping):
    """One device's round records: round -> record (see the module docstring)."""

    __slots__ = ("live", "packed")

    def __init__(self, records: dict[int, dict] | None = None) -> None:
        self.live: dict[int, dict] = dict(records or {})
        self.packed: MutableMapping[int, bytes] = Shelf()

    def __getitem__(self, r: int) -> dict:
        record = self.live.get(r)
        if record is None:
            record = self.live[r] = json.loads(self.packed.pop(r))  # KeyError: no such round
        return record

    def get(self, r: int, default: Any = None) -> Any:  # noqa: ANN401 - a record or the default
        record = self.live.get(r)
        if record is not None:
            return record
        raw = self.packed.get(r)
        return default if raw is None else json.loads(raw)

    def __setitem__(self, r: int, record: dict) -> None:
        self.packed.pop(r, None)
        self.live[r] = record

    def __delitem__(self, r: int) -> None:
        if self.packed.pop(r, None) is None:
            del self.live[r]

    def __contains__(self, r: object) -> bool:
        return r in self.live or r in self.packed

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self.live, *self.packed}))

    def __len__(self) -> int:
        return len(self.live) + len(self.packed)

    def items(self) -> Iterator[tuple[int, dict]]:  # type: ignore[override]
        """(round, record) in round order; settled ones as copies (read only)."""
        return ((r, self.get(r)) for r in self)

    def values(self) -> Iterator[dict]:  # type: ignore[override]
        return (self.get(r) for r in self)

    def settle(self, before: int) -> None:
        """Pack the records of the rounds before ``before``."""
        for r in [r for r in self.live if r < before]:
            self.packed[r] = _pack(self.live.pop(r))

    def __repr__(self) -> str:
        return f"DeviceRounds({dict(self.items())!r})"


class MetricsBook(MutableMapping):
    """Every device's evaluations: (device, round) -> :class:`Metrics` (see the module docstring)."""

    __slots__ = ("live", "packed")

    def __init__(self, metrics: dict[tuple[str, int], Metrics] | None = None) -> None:
        self.live: dict[tuple[str, int], Metrics] = dict(metrics or {})
        self.packed: MutableMapping[tuple[str, int], bytes] = Shelf()

    def __getitem__(self, key: tuple[str, int]) -> Metrics:
        m = self.live.get(key)
        if m is not None:
            return m
        return Metrics.model_validate_json(self.packed[key])

    def __setitem__(self, key: tuple[str, int], m: Metrics) -> None:
        self.packed.pop(key, None)
        self.live[key] = m

    def __delitem__(self, key: tuple[str, int]) -> None:
        if self.packed.pop(key, None) is None:
            del self.live[key]

    def __contains__(self, key: object) -> bool:
        return key in self.live or key in self.packed

    def __iter__(self) -> Iterator[tuple[str, int]]:
        yield from list(self.packed)
        yield from list(self.live)

    def __len__(self) -> int:
        return len(self.live) + len(self.packed)

    def settle(self, before: int) -> None:
        """Pack the evaluations of the rounds before ``before``."""
        for key in [k for k in self.live if k[1] < before]:
            self.packed[key] = self.live.pop(key).model_dump_json().encode()

    def __repr__(self) -> str:
        return f"MetricsBook({dict(self.items())!r})"


def record_json(record: dict) -> dict:
    """A closed round's record (:attr:`JobState.records`) as JSON, as a checkpoint holds it:
    its :class:`~senseshield.results.RoundTally` as a dict, cluster keys as strings."""
    return {**record, "tally": asdict(record["tally"]),
            "clusters": {str(k): c for k, c in record["clusters"].items()}}


def record_from_json(raw: dict) -> dict:
    """The inverse of :func:`record_json`."""
    return {**raw, "tally": RoundTally(**raw["tally"]), "clusters": {int(k): c for k, c in raw["clusters"].items()}}


class RoundBook(Sequence):
    """The closed rounds' records, oldest first (:attr:`JobState.records`): the latest as it
    was appended, every earlier one packed in a :class:`Shelf` as :func:`record_json` (a
    round's tally holds every sampled device's planned work) and decoded when read. The
    records of closed rounds are only read; an earlier one is read as a fresh copy. Which
    clusters each round accepted stays in memory (:meth:`accepted`): a device's late metrics
    are checked against it without decoding a record."""

    __slots__ = ("latest", "packed", "count", "clusters")

    def __init__(self, records: Iterable[dict] = ()) -> None:
        self.latest: dict | None = None
        self.packed: MutableMapping[int, bytes] = Shelf()
        self.count = 0
        self.clusters: dict[int, frozenset[int]] = {}  # round -> the clusters whose sum it released
        for record in records:
            self.append(record)

    def append(self, record: dict) -> None:
        if self.count:
            self.packed[self.count - 1] = _pack(record_json(self.latest))
        self.latest = record
        self.count += 1
        self.clusters.setdefault(int(record["round"]), frozenset(
            int(k) for k, c in record["clusters"].items() if c.get("accepted")))

    def accepted(self, r: int) -> frozenset[int]:
        """The clusters whose aggregate of closed round ``r`` was accepted (none: no such round)."""
        return self.clusters.get(r, frozenset())

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int | slice) -> Any:  # noqa: ANN401 - a record, or a list of them
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        j = i + self.count if i < 0 else i
        if not 0 <= j < self.count:
            raise IndexError(f"round record {i} of {self.count}")
        return self.latest if j == self.count - 1 else record_from_json(json.loads(self.packed[j]))

    def __iter__(self) -> Iterator[dict]:
        return (self[j] for j in range(self.count))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, RoundBook)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RoundBook({list(self)!r})"
