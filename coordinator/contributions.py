"""The updates of one cluster's round, kept until the key server's verdict, and the search
for the ones whose fingerprint does not match their ciphertext.

The key server checks an aggregate against the contributors' signed fingerprints before it
decrypts anything (:mod:`senseshield.he.fingerprint`, and the masked scheme's own). When the
check fails it says so (``AggregateResult.retry``): nothing was decrypted or spent, so the
coordinator may send the round's aggregate again over another set of the same updates.
:class:`Contributions` keeps every update the round folded in, and per device the latest
*other* update it sent in the round (a device that sent a bad update first and its genuine
one after: the genuine one is a spare instead of a dropped duplicate), and lists the
attempts to try, one at a time: when two or more devices sent a spare, first the aggregate
with every spare in place of its device's first update (several devices sending a bad update
before their genuine one are all dropped in one retry); then for each device, the aggregate
with its spare in place of its first update (devices with a spare first), or without it.
The first attempt the key server accepts is decrypted; the key server names every device
whose update the accepted attempt left out or replaced, in one verdict. Verifying an attempt
reveals nothing (no pad is removed, no ciphertext decrypted), so trying several costs only
their verification.

The key server sees aggregates only, never one device's ciphertext, so it cannot check a
single contributor's fingerprint: two bad updates per cluster and round are found when both
devices also sent a genuine one (the spares attempt); two bad updates without later genuine
ones still fail every leave-one-out attempt, and the cluster's round is lost (docs/security.md).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

from senseshield.engine.aggregation import StreamingAggregate

Entry = tuple[Any, Any]  # (the ProtectedUpdate, what the coordinator notes of it)


@dataclass(frozen=True)
class Spilled:
    """Where a kept update's bytes are in its round's spill file."""

    offset: int
    length: int


@dataclass
class UpdateCodec:
    """How a kept update is written to the spill file and read back: as its ``update``
    message's frame, decoded with every check again (the job's key ``public``, the model's
    ``size``). The coordinator's memory then holds no device's update while a round waits
    for its verdict: a fleet's worth of them would grow with the fleet."""

    public: Any
    size: int

    def encode(self, update: Any) -> bytes:
        from senseshield.runtime.protocol.messages import to_frame, update_to_message

        return to_frame(update_to_message(update, self.public), fleet="spill", sender=update.client_id,
                        round=update.round)

    def decode(self, data: bytes) -> Any:
        from senseshield.runtime.protocol import decode_frame
        from senseshield.runtime.protocol.messages import from_frame, update_from_message

        frame = decode_frame(data)
        return update_from_message(from_frame(frame), self.public, client_id=frame.sender, round=frame.round,
                                   size=self.size)


@dataclass
class Contributions:
    """One cluster's updates of a round (see the module docstring)."""

    kept: dict[str, Entry] = field(default_factory=dict)  # the update each device sent first
    spares: dict[str, Entry] = field(default_factory=dict)  # a later, different update of a device
    queue: list[dict[str, Entry]] | None = None  # attempts still to try (None: to be listed)
    chosen: dict[str, Entry] | None = None  # the attempt in flight
    tried: set[frozenset] = field(default_factory=set)  # the attempts sent
    codec: UpdateCodec | None = None  # set: updates are kept in a spill file, not in memory
    _spill: Any = None  # the round's spill file (a temporary file, gone when closed)

    def _put(self, update: Any) -> Any:
        """``update`` as it is kept: spilled to the round's file when there is a codec (a site's
        partial sum, one per site, stays in memory)."""
        if self.codec is None or isinstance(update, StreamingAggregate):
            return update
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(prefix="senseshield-round-")
        data = self.codec.encode(update)
        offset = self._spill.seek(0, 2)
        self._spill.write(data)
        return Spilled(offset, len(data))

    def load(self, part: Any) -> Any:
        """A kept update back (read from the spill file if it was spilled)."""
        if not isinstance(part, Spilled):
            return part
        self._spill.seek(part.offset)
        return self.codec.decode(self._spill.read(part.length))

    def keep(self, agent: str, update: Any, note: Any) -> None:
        self.kept[agent] = (self._put(update), note)

    def first(self, agent: str) -> Any:
        """The note of the update ``agent`` sent first in the round (None: none kept)."""
        entry = self.kept.get(agent)
        return entry[1] if entry is not None else None

    def spare(self, agent: str, update: Any, note: Any) -> None:
        """A later, different update of ``agent``; one arriving during the search lists the
        attempts again (those already sent are not repeated)."""
        self.spares[agent] = (self._put(update), note)
        self.queue = None

    def next_attempt(self) -> dict[str, Entry] | None:
        """The next set of updates to aggregate after a refusal at the fingerprint check, or
        None when every attempt was tried."""
        if self.queue is None:
            first = sorted(self.spares) + sorted(a for a in self.kept if a not in self.spares)
            self.queue = []
            if len(self.spares) >= 2:  # every spare in place at once
                self.queue.append({**self.kept, **{a: e for a, e in self.spares.items() if a in self.kept}})
            for suspect in first:
                attempt = {a: e for a, e in self.kept.items() if a != suspect}
                if suspect in self.spares:
                    attempt[suspect] = self.spares[suspect]
                if attempt:
                    self.queue.append(attempt)
            self.queue = [attempt for attempt in self.queue if _signature(attempt) not in self.tried]
        self.chosen = self.queue.pop(0) if self.queue else None
        if self.chosen is not None:
            self.tried.add(_signature(self.chosen))
        return self.chosen

    def clear(self) -> None:
        """The round's verdict is in: the updates go (memory, and the spill file)."""
        self.kept, self.spares, self.queue, self.tried = {}, {}, None, set()
        if self._spill is not None:
            self._spill.close()
            self._spill = None


def _signature(attempt: dict[str, Entry]) -> frozenset:
    """Which update of which device an attempt aggregates (the same objects: the same attempt)."""
    return frozenset((agent, id(update)) for agent, (update, _) in attempt.items())


def aggregate_of(attempt: dict[str, Entry], make: Callable[[], StreamingAggregate],
                 load: Callable[[Any], Any] = lambda part: part) -> StreamingAggregate:
    """A fresh running aggregate (``make()``) of the attempt's updates (``load``: a kept one
    back from the spill file, :meth:`Contributions.load`) and partial sums (a site's running
    aggregate, kept as one entry, :mod:`coordinator.sites`); a ProtocolError if one does not
    fold (it was checked on arrival, so only a spare can)."""
    running = make()
    for agent in sorted(attempt):
        part = load(attempt[agent][0])
        if isinstance(part, StreamingAggregate):
            running.merge(part)
        else:
            running.add(part)
    return running


def notes_of(attempt: dict[str, Entry]) -> dict[str, Any]:
    """What the report keeps of each update in the attempt, per device (a partial sum's entry
    holds its contributors' notes)."""
    notes: dict[str, Any] = {}
    for agent, (part, note) in attempt.items():
        if isinstance(part, StreamingAggregate):
            notes.update(note)
        else:
            notes[agent] = note
    return notes
