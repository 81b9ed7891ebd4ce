"""Chunking of frames larger than the broker's message limit, and their reassembly.

A large frame travels as ``count`` chunk frames (schema ``"chunk"``) carrying
``message_id``, ``index``, ``count``, the total length and the SHA-256 of the whole frame,
with the bytes in section ``"data"``. The :class:`Reassembler` holds partial messages
within a byte budget (oldest evicted first) and an idle-time limit, rejects inconsistent
chunks, and returns the original frame bytes once complete and verified.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from senseshield.errors import ProtocolError
from senseshield.runtime.protocol.envelope import Frame, encode_frame

CHUNK_SCHEMA = "chunk"


def split_frame(
    frame: bytes, *, limit: int, fleet: str, sender: str, round: int
) -> list[bytes]:
    """The frame itself if it fits in ``limit`` bytes, else chunk frames that each fit."""
    return list(iter_chunks(frame, limit=limit, fleet=fleet, sender=sender, round=round))


def iter_chunks(
    frame: bytes, *, limit: int, fleet: str, sender: str, round: int
) -> Iterator[bytes]:
    """:func:`split_frame` one chunk at a time: a sender that publishes each as it comes holds
    no second copy of a large frame."""
    if limit < 1024:
        raise ValueError(f"limit is {limit} bytes; chunking needs at least 1024.")
    if len(frame) <= limit:
        yield frame
        return
    payload = limit - 512  # room for the chunk frame's own header
    count = -(-len(frame) // payload)
    message_id = secrets.token_hex(8)
    digest = hashlib.sha256(frame).hexdigest()
    view = memoryview(frame)
    yield from (
        encode_frame(
            schema=CHUNK_SCHEMA,
            version=1,
            fleet=fleet,
            sender=sender,
            round=round,
            fields={
                "message_id": message_id,
                "index": i,
                "count": count,
                "total": len(frame),
                "sha256": digest,
            },
            sections={"data": view[i * payload : (i + 1) * payload]},
        )
        for i in range(count)
    )


@dataclass
class _Partial:
    count: int
    total: int
    sha256: str
    touched: float  # when its last chunk arrived
    size: int = 0  # bytes held
    parts: dict[int, bytes] = field(default_factory=dict)


DEFAULT_MAX_IDLE = 30.0
"""Seconds an incomplete stream may go without a new chunk before it is dropped."""


class Reassembler:
    """Collects chunk frames per (sender, message_id); bounded in bytes and idle time.

    At most ``max_bytes`` of incomplete streams are held in all: a chunk that would go
    beyond evicts the oldest streams first (a single stream never exceeds ``max_bytes``,
    its declared total). A stream that gets no chunk for ``max_idle`` seconds is dropped
    (on the next chunk, or when the owner calls :meth:`expire`). Thread-safe.
    """

    def __init__(self, *, max_bytes: int = 512 << 20, max_idle: float = DEFAULT_MAX_IDLE) -> None:
        self.max_bytes = max_bytes
        self.max_idle = max_idle
        self._partials: dict[tuple[str, str], _Partial] = {}  # insertion order = age
        self._held = 0
        self._lock = threading.Lock()
        self.dropped = 0  # incomplete streams evicted or expired so far

    def add(self, chunk: Frame, *, now: float | None = None) -> bytes | None:
        """Add one decoded chunk frame; return the whole frame when it is complete."""
        now = time.monotonic() if now is None else now
        f = chunk.fields
        try:
            key = (chunk.sender, str(f["message_id"]))
            index, count, total, digest = int(f["index"]), int(f["count"]), int(f["total"]), str(f["sha256"])
            data = chunk.sections["data"]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"Chunk from {chunk.sender!r} lacks its message id, index, count, total or data.") from None
        if not isinstance(data, bytes) or not 0 <= index < count or not 0 < total <= self.max_bytes or count > total:
            raise ProtocolError(f"Chunk {index}/{count} from {chunk.sender!r} is inconsistent or too large.")
        with self._lock:
            self._expire(now)
            partial = self._partials.get(key)
            if partial is None:
                partial = self._partials[key] = _Partial(count, total, digest, now)
            if (partial.count, partial.total, partial.sha256) != (count, total, digest):
                raise ProtocolError(f"Chunk {index} of message {key[1]} disagrees with the earlier chunks.")
            grow = len(data) - len(partial.parts.get(index, b""))
            if partial.size + grow > total:
                self._drop(key)
                raise ProtocolError(f"Chunks of message {key[1]} from {chunk.sender!r} exceed its total of {total:,} bytes.")
            while self._held + grow > self.max_bytes:  # oldest streams go first
                oldest = next(iter(self._partials))
                self._drop(oldest)
                if oldest == key:
                    raise ProtocolError(f"Reassembly buffer is full; message {key[1]} from {chunk.sender!r} dropped.")
            partial.parts[index] = data
            partial.size += grow
            partial.touched = now
            self._held += grow
            if len(partial.parts) < count:
                return None
            self._partials.pop(key)
            self._held -= partial.size
        whole = b"".join(partial.parts[i] for i in range(count))
        if len(whole) != total or hashlib.sha256(whole).hexdigest() != digest:
            raise ProtocolError(f"Message {key[1]} from {chunk.sender!r} does not match its checksum.")
        return whole

    def expire(self, now: float | None = None) -> None:
        """Drop streams idle for more than ``max_idle`` seconds."""
        with self._lock:
            self._expire(time.monotonic() if now is None else now)

    def _expire(self, now: float) -> None:
        for key in [k for k, p in self._partials.items() if now - p.touched > self.max_idle]:
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        partial = self._partials.pop(key)
        self._held -= partial.size
        self.dropped += 1

    @property
    def pending(self) -> int:
        """Incomplete streams held."""
        return len(self._partials)

    @property
    def held_bytes(self) -> int:
        """Bytes of incomplete streams held."""
        return self._held
