"""A round's kept updates (coordinator.contributions): spilled to a file while the round waits
for the key server's verdict, they come back with every check and aggregate, in every attempt
of the search, to the same bits as kept in memory; the file goes with the verdict."""

from __future__ import annotations

import numpy as np

from coordinator.contributions import Contributions, Spilled, UpdateCodec, aggregate_of
from senseshield.engine.aggregation import StreamingAggregate, protect_update
from senseshield.he import generate_keys
from senseshield.he.base import round_context
from senseshield.runtime.identity import Identity

SECRET = generate_keys("masked")
SIZE = 300


AGENTS = [Identity.generate(f"c{i:03d}") for i in range(4)]


def _update(i: int, seed: int):  # noqa: ANN202
    key = SECRET.public_key.for_contributor(AGENTS[i].exchange, round_context("f", "j", 2, 0), ring_bits=32)
    return protect_update(np.random.default_rng(seed).uniform(-0.5, 0.5, SIZE), np.ones(SIZE, bool), key,
                          client_id=AGENTS[i].name, round=2, cluster=0, n_samples=10 + i)


def _updates() -> list:
    return [_update(i, i) for i in range(len(AGENTS))]


def _words(running: StreamingAggregate) -> bytes:
    return np.asarray(running.result().ciphertext.payload).tobytes()


def test_spilled_updates_aggregate_to_the_same_bits_in_every_attempt():
    updates, spare = _updates(), _update(1, 99)  # c001 sent a second, different update
    make = lambda: StreamingAggregate(SECRET.public_key, size=SIZE, round=2, cluster=0)  # noqa: E731
    memory, disk = Contributions(), Contributions(codec=UpdateCodec(SECRET.public_key, SIZE))
    for book in (memory, disk):
        for u in updates:
            book.keep(u.client_id, u, note=u.client_id)
        book.spare("c001", spare, note="spare")
    assert all(isinstance(part, Spilled) for part, _ in disk.kept.values())  # nothing of them in memory
    assert all(not isinstance(part, Spilled) for part, _ in memory.kept.values())
    attempts = 0
    while (a := memory.next_attempt()) is not None:
        b = disk.next_attempt()
        assert sorted(a) == sorted(b) and [n for _, n in a.values()] == [n for _, n in b.values()]
        assert _words(aggregate_of(a, make)) == _words(aggregate_of(b, make, disk.load))
        attempts += 1
    assert attempts >= 4 and disk.next_attempt() is None
    spill = disk._spill
    disk.clear()
    assert spill.closed and disk._spill is None and disk.kept == {}
