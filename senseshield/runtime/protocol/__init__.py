"""The wire protocol of the fleet: one envelope, one codec, chunking (see docs/protocol.md)."""

from senseshield.runtime.protocol.chunks import CHUNK_SCHEMA, Reassembler, iter_chunks, split_frame
from senseshield.runtime.protocol.envelope import Frame, decode_frame, encode_frame

__all__ = ["CHUNK_SCHEMA", "Frame", "Reassembler", "decode_frame", "encode_frame", "iter_chunks", "split_frame"]
