"""What the coordinator keeps of the devices' earlier rounds, packed: a fleet's history in a
fraction of the memory its objects would take.

The job's state keeps, for the whole job, every device's round record (plan, budget,
timings, what its update showed) and every evaluation it reported (:class:`Metrics`): the
report and the budgets read them. As Python objects that is a few kilobytes per device and
round, which at 10,000 devices is tens of MB a round. Once a round is closed (the next one
opens), its records are kept as compact JSON bytes instead, about a sixth of the size, and
decoded when read; what still arrives of it (a device's late metrics, an evaluation failure)
is kept as it comes and packed at the next round's opening.

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

import json
from collections.abc import Iterator, MutableMapping
from typing import Any

from senseshield.runtime.protocol.messages import Metrics


def _pack(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


class DeviceRounds(MutableMapping):
    """One device's round records: round -> record (see the module docstring)."""

    __slots__ = ("live", "packed")

    def __init__(self, records: dict[int, dict] | None = None) -> None:
        self.live: dict[int, dict] = dict(records or {})
        self.packed: dict[int, bytes] = {}

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
        self.packed: dict[tuple[str, int], bytes] = {}

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
