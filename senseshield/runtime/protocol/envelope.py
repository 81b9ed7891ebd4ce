"""The one wire format of every SenseShield message: a JSON header and binary sections.

Frame layout (all integers big-endian)::

    b"SSHD" | u8 frame version | u32 header length H | H bytes of UTF-8 JSON header | sections
           [| 64-byte Ed25519 signature over everything before it]

The header names the message ``schema`` and its ``version``, the ``fleet``, the
``sender``, the ``round``, a ``sent_at`` timestamp, the message's small fields (``fields``)
and one descriptor per binary section: its name, dtype, shape and byte length. Sections
follow the header in descriptor order: numeric arrays little-endian, raw bytes as they are.

:func:`decode_frame` checks everything before it hands out a payload: magic, frame version,
header size, JSON validity (no NaN or infinite numbers in the header), descriptor types, that every section's length equals
``prod(shape) * itemsize``, that the lengths add up to the frame, the total size limit, and
(for float sections) finiteness. Any violation raises :class:`ProtocolError` with the reason.

Signatures (frame version 2): a signed frame's header holds ``"sig": {"alg": "ed25519",
"key": <base64 public key>}`` and the frame ends with the 64-byte signature over every byte
before it (prefix, header, sections), so the sender, fleet, round, schema, fields and
sections are all covered. :func:`decode_frame` only parses; whether the key is one the
receiver trusts is decided by :class:`senseshield.runtime.identity.Trust`, which every
service applies to every frame before handling it.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from senseshield.errors import ProtocolError

MAGIC = b"SSHD"
FRAME_VERSION = 2  # 2: optional Ed25519 signature trailer
SIGNATURE_BYTES = 64
_PREFIX = struct.Struct(">4sBI")
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_FRAME_BYTES = 256 << 20  # Mosquitto's default message_size_limit is 256 MB

# dtype name on the wire -> numpy dtype (little-endian); "bytes" is an opaque byte string
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f64": np.dtype("<f8"),
    "i64": np.dtype("<i8"),
    "u8": np.dtype("u1"),
    "bool": np.dtype("u1"),  # stored one byte per value, 0 or 1
}


@dataclass
class Frame:
    """A decoded frame: header facts, small fields and named sections."""

    schema: str
    version: int
    fleet: str
    sender: str
    round: int
    sent_at: float
    fields: dict[str, Any]
    sections: dict[str, np.ndarray | bytes] = field(default_factory=dict)
    signer_key: bytes | None = None  # the public key the frame says signed it (None: unsigned)
    signature: bytes = b""
    # the bytes the signature covers: a view of the frame as received (no copy of a large
    # frame's sections; it keeps those bytes alive as long as the frame)
    signed: bytes | memoryview | None = b""  # None: released (release_signed)

    @property
    def is_signed(self) -> bool:
        return self.signer_key is not None

    @property
    def raw(self) -> bytes:
        """A signed frame's bytes as they were sent (what the signature covers, then the
        signature): kept to forward it, e.g. the operator's signed job to the key server."""
        if not self.is_signed:
            raise ProtocolError(f"The {self.schema!r} frame from {self.sender!r} is unsigned; only a signed frame is kept.")
        if self.signed is None:
            raise ProtocolError(f"The {self.schema!r} frame from {self.sender!r} let its signed bytes go after its check.")
        return bytes(self.signed) + self.signature

    def release_signed(self) -> None:
        """Let the frame's signed bytes go once its signature was checked: they are a view of
        the whole frame as received, which its decoded sections copy, so a receiver that keeps
        the frame would otherwise hold a large message twice. :attr:`raw` then raises."""
        if self.is_signed:
            self.signed = None


def _descriptor(name: str, value: np.ndarray | bytes | list[bytes]) -> tuple[dict[str, Any], bytes | list[bytes]]:
    if isinstance(value, list):  # a bytes section given as pieces, written one after another
        size = sum(len(piece) for piece in value)
        return {"name": name, "dtype": "bytes", "shape": [size], "nbytes": size}, value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return {"name": name, "dtype": "bytes", "shape": [len(raw)], "nbytes": len(raw)}, raw
    array = np.asarray(value)
    if array.dtype == np.bool_:
        kind, raw = "bool", array.astype("u1").tobytes()
    else:
        kind = next((k for k, d in DTYPES.items() if k != "bool" and d == array.dtype.newbyteorder("<")), None)
        if kind is None:
            raise ValueError(f"Section {name!r} has dtype {array.dtype}; allowed: {', '.join(DTYPES)}, bytes.")
        raw = array.astype(DTYPES[kind]).tobytes()
    return {"name": name, "dtype": kind, "shape": list(array.shape), "nbytes": len(raw)}, raw


def encode_frame(
    *,
    schema: str,
    version: int,
    fleet: str,
    sender: str,
    round: int,
    fields: dict[str, Any],
    sections: dict[str, np.ndarray | bytes] | None = None,
    sent_at: float | None = None,
    signer: Any = None,
) -> bytes:
    """Serialise one message; ``fields`` must be JSON-serialisable (no arrays).
    ``signer`` (an :class:`~senseshield.runtime.identity.Identity`): sign the frame. A bytes
    section may be given as a list of pieces (e.g. a fleet's receipts), which the frame then
    holds without their being joined first."""
    descriptors, blobs = [], []
    for name, value in (sections or {}).items():
        descriptor, raw = _descriptor(name, value)
        descriptors.append(descriptor)
        blobs.extend(raw) if isinstance(raw, list) else blobs.append(raw)
    header = {
        "schema": schema,
        "version": version,
        "fleet": fleet,
        "sender": sender,
        "round": round,
        "sent_at": time.time() if sent_at is None else sent_at,
        "fields": fields,
        "sections": descriptors,
    }
    if signer is not None:
        header["sig"] = {"alg": "ed25519", "key": base64.b64encode(signer.sign_key).decode()}
    encoded = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    parts = [_PREFIX.pack(MAGIC, FRAME_VERSION, len(encoded)), encoded, *blobs]
    if signer is None:
        return b"".join(parts)
    body = b"".join(parts)
    signature = signer.sign(body)
    del body  # joined again with the signature: a large frame is never held three times
    return b"".join([*parts, signature])


def decode_frame(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, views: bool = False) -> Frame:
    """Parse and check a frame; raises :class:`ProtocolError` naming the first problem.
    ``views``: the sections are read-only views of ``data`` (memoryview, numpy arrays over
    it), not copies: for a sender checking its own frame before it goes out."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"A frame must be bytes, got {type(data).__name__}.")
    data = bytes(data)
    view = memoryview(data)
    if len(data) > max_bytes:
        raise ProtocolError(f"Frame of {len(data):,} bytes exceeds the limit of {max_bytes:,}.")
    if len(data) < _PREFIX.size:
        raise ProtocolError(f"Frame of {len(data)} bytes is shorter than its {_PREFIX.size}-byte prefix.")
    magic, frame_version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"Frame starts with {magic!r}, not the SenseShield magic {MAGIC!r}.")
    if frame_version != FRAME_VERSION:
        raise ProtocolError(
            f"Frame version {frame_version} is not supported (this build speaks {FRAME_VERSION}); "
            "upgrade the older side."
        )
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(data):
        raise ProtocolError(f"Header length {header_len:,} does not fit the {len(data):,}-byte frame.")
    try:
        header = json.loads(
            data[_PREFIX.size : _PREFIX.size + header_len],
            parse_constant=_no_constant, parse_float=_finite_float,
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"Header is not valid JSON ({exc.__class__.__name__}).") from None
    except RecursionError:
        raise ProtocolError("Header JSON is nested too deeply.") from None
    _check_header(header)
    offset = _PREFIX.size + header_len
    sections: dict[str, np.ndarray | bytes] = {}
    for descriptor in header["sections"]:
        name, kind, shape, nbytes = _check_descriptor(descriptor, sections)
        if offset + nbytes > len(data):
            raise ProtocolError(f"Section {name!r} runs past the end of the frame.")
        raw = view[offset : offset + nbytes]
        offset += nbytes
        if kind == "bytes":
            sections[name] = raw if views else bytes(raw)
            continue
        array = np.frombuffer(raw, dtype=DTYPES[kind]).reshape(shape)
        if kind == "bool":
            if np.any(array > 1):
                raise ProtocolError(f"Section {name!r} is boolean but holds values other than 0 and 1.")
            array = array.view(bool) if views else array.astype(bool)
        elif kind in ("f32", "f64") and not np.all(np.isfinite(array)):
            raise ProtocolError(f"Section {name!r} contains NaN or inf.")
        sections[name] = array if views else array.astype(array.dtype.newbyteorder("="))
    signer_key, signature = _signature(header.get("sig"))
    expected_end = offset + (SIGNATURE_BYTES if signer_key is not None else 0)
    if expected_end != len(data):
        what = "its signature" if signer_key is not None else "its sections"
        raise ProtocolError(f"Frame has {len(data) - expected_end:,} trailing bytes after {what} (or is cut short).")
    if signer_key is not None:
        signature = bytes(view[offset:])
    return Frame(
        schema=header["schema"],
        version=header["version"],
        fleet=header["fleet"],
        sender=header["sender"],
        round=header["round"],
        sent_at=float(header["sent_at"]),
        fields=header["fields"],
        sections=sections,
        signer_key=signer_key,
        signature=signature,
        signed=view[:offset] if signer_key is not None else b"",
    )


def _signature(sig: Any) -> tuple[bytes | None, bytes]:
    if sig is None:
        return None, b""
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519" or not isinstance(sig.get("key"), str):
        raise ProtocolError("Header field 'sig' must be {alg: ed25519, key: base64}.")
    try:
        key = base64.b64decode(sig["key"], validate=True)
    except (ValueError, TypeError):
        key = b""
    if len(key) != 32:
        raise ProtocolError("Header field 'sig' names a key that is not a 32-byte Ed25519 public key.")
    return key, b""


def _no_constant(name: str) -> float:
    raise ProtocolError(f"Header holds the number {name}; only finite numbers are allowed.")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"Header holds the number {text[:20]}, which overflows a float; only finite numbers are allowed.")
    return value


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise ProtocolError("Header must be a JSON object.")
    expected = {
        "schema": str, "version": int, "fleet": str, "sender": str, "round": int,
        "sent_at": (int, float), "fields": dict, "sections": list,
    }
    for key, kind in expected.items():
        value = header.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(f"Header field {key!r} is missing or has the wrong type.")
    if header["round"] < 0:
        raise ProtocolError(f"Header round is {header['round']}; rounds are >= 0.")


def _check_descriptor(
    descriptor: Any, seen: dict[str, Any]
) -> tuple[str, str, tuple[int, ...], int]:
    if not isinstance(descriptor, dict):
        raise ProtocolError("A section descriptor must be a JSON object.")
    name, kind = descriptor.get("name"), descriptor.get("dtype")
    shape, nbytes = descriptor.get("shape"), descriptor.get("nbytes")
    if not isinstance(name, str) or name in seen:
        raise ProtocolError(f"Section name {name!r} is missing or repeated.")
    if kind != "bytes" and kind not in DTYPES:
        raise ProtocolError(f"Section {name!r} has dtype {kind!r}; allowed: {', '.join(DTYPES)}, bytes.")
    if (
        not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or not isinstance(nbytes, int)
        or nbytes < 0
    ):
        raise ProtocolError(f"Section {name!r} has a malformed shape or size.")
    itemsize = 1 if kind == "bytes" else DTYPES[kind].itemsize
    if (kind == "bytes" and len(shape) != 1) or math.prod(shape) * itemsize != nbytes:
        raise ProtocolError(
            f"Section {name!r} declares shape {shape} of {kind} but {nbytes} bytes."
        )
    return name, kind, tuple(shape), nbytes
