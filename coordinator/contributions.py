"""The updates of one cluster's round, kept until the key server's verdict, and the search
for the one whose fingerprint does not match its ciphertext.

The key server checks an aggregate against the contributors' signed fingerprints before it
decrypts anything (:mod:`senseshield.he.fingerprint`, and the masked scheme's own). When the
check fails it says so (``AggregateResult.retry``): nothing was decrypted or spent, so the
coordinator may send the round's aggregate again over another set of the same updates.
:class:`Contributions` keeps every update the round folded in, and per device the latest
*other* update it sent in the round (a device that sent a bad update first and its genuine
one after: the genuine one is a spare instead of a dropped duplicate), and lists the
attempts to try, one at a time: for each device, the aggregate with its spare in place of
its first update (devices with a spare first), or without it. The first attempt the key
server accepts is decrypted; the key server names the device whose update the accepted
attempt left out or replaced. Verifying an attempt reveals nothing (no pad is removed, no
ciphertext decrypted), so trying several costs only their verification.

One bad update per cluster and round is found this way; with two, every leave-one-out
attempt fails and the cluster's round is lost (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from senseshield.engine.aggregation import StreamingAggregate

Entry = tuple[Any, Any]  # (the ProtectedUpdate, what the coordinator notes of it)


@dataclass
class Contributions:
    """One cluster's updates of a round (see the module docstring)."""

    kept: dict[str, Entry] = field(default_factory=dict)  # the update each device sent first
    spares: dict[str, Entry] = field(default_factory=dict)  # a later, different update of a device
    queue: list[dict[str, Entry]] | None = None  # attempts still to try (None: not searching yet)
    chosen: dict[str, Entry] | None = None  # the attempt in flight

    def keep(self, agent: str, update: Any, note: Any) -> None:
        self.kept[agent] = (update, note)

    def spare(self, agent: str, update: Any, note: Any) -> None:
        self.spares[agent] = (update, note)

    def next_attempt(self) -> dict[str, Entry] | None:
        """The next set of updates to aggregate after a refusal at the fingerprint check, or
        None when every attempt was tried."""
        if self.queue is None:
            first = sorted(self.spares) + sorted(a for a in self.kept if a not in self.spares)
            self.queue = []
            for suspect in first:
                attempt = {a: e for a, e in self.kept.items() if a != suspect}
                if suspect in self.spares:
                    attempt[suspect] = self.spares[suspect]
                if attempt:
                    self.queue.append(attempt)
        self.chosen = self.queue.pop(0) if self.queue else None
        return self.chosen

    def clear(self) -> None:
        """The round's verdict is in: the updates go (memory)."""
        self.kept, self.spares, self.queue = {}, {}, None


def aggregate_of(attempt: dict[str, Entry], make: Callable[[], StreamingAggregate]) -> StreamingAggregate:
    """A fresh running aggregate (``make()``) of the attempt's updates; a ProtocolError if
    one does not fold (it was checked on arrival, so only a spare can)."""
    running = make()
    for agent in sorted(attempt):
        running.add(attempt[agent][0])
    return running
