"""Chunking of frames larger than the broker's message limit, and their reassembly.

A large frame travels as ``count`` chunk frames (schema ``"chunk"``) carrying
``message_id``, ``index``, ``count``, the total length and the SHA-256 of the whole frame,
with the bytes in section ``"data"``. The :class:`Reassembler` holds partial messages
within a byte budget and an age limit, rejects inconsistent chunks, and returns the
original frame bytes once complete and verified.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

from senseshield.errors import ProtocolError
from senseshield.runtime.protocol.envelope import Frame, encode_frame

CHUNK_SCHEMA = "chunk"


def split_frame(
    frame: bytes, *, limit: int, fleet: str, sender: str, round: int
) -> list[bytes]:
    """The frame itself if it fits in ``limit`` bytes, else chunk frames that each fit."""
    if limit < 1024:
        raise ValueError(f"limit is {limit} bytes; chunking needs at least 1024.")
    if len(frame) <= limit:
        return [frame]
    payload = limit - 512  # room for the chunk frame's own header
    count = -(-len(frame) // payload)
    message_id = secrets.token_hex(8)
    digest = hashlib.sha256(frame).hexdigest()
    return [
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
            sections={"data": frame[i * payload : (i + 1) * payload]},
        )
        for i in range(count)
    ]


@dataclass
class _Partial:
    count: int
    total: int
    sha256: str
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts.values())


class Reassembler:
    """Collects chunk frames per (sender, message_id); bounded in bytes and age."""

    def __init__(self, *, max_bytes: int = 512 << 20, max_age: float = 300.0) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._partials: dict[tuple[str, str], _Partial] = {}

    def add(self, chunk: Frame, *, now: float | None = None) -> bytes | None:
        """Add one decoded chunk frame; return the whole frame when it is complete."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        f = chunk.fields
        try:
            key = (chunk.sender, str(f["message_id"]))
            index, count, total, digest = int(f["index"]), int(f["count"]), int(f["total"]), str(f["sha256"])
            data = chunk.sections["data"]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"Chunk from {chunk.sender!r} lacks its message id, index, count, total or data.") from None
        if not isinstance(data, bytes) or not 0 <= index < count or total > self.max_bytes:
            raise ProtocolError(f"Chunk {index}/{count} from {chunk.sender!r} is inconsistent or too large.")
        partial = self._partials.setdefault(key, _Partial(count, total, digest, now))
        if (partial.count, partial.total, partial.sha256) != (count, total, digest):
            raise ProtocolError(f"Chunk {index} of message {key[1]} disagrees with the earlier chunks.")
        partial.parts[index] = data
        if sum(p.size for p in self._partials.values()) > self.max_bytes:
            del self._partials[key]
            raise ProtocolError(f"Reassembly buffer is full; message {key[1]} from {chunk.sender!r} dropped.")
        if len(partial.parts) < count:
            return None
        del self._partials[key]
        whole = b"".join(partial.parts[i] for i in range(count))
        if len(whole) != total or hashlib.sha256(whole).hexdigest() != digest:
            raise ProtocolError(f"Message {key[1]} from {chunk.sender!r} does not match its checksum.")
        return whole

    def _expire(self, now: float) -> None:
        for key in [k for k, p in self._partials.items() if now - p.started > self.max_age]:
            del self._partials[key]

    @property
    def pending(self) -> int:
        return len(self._partials)
