"""The encodings of the HE schemes, in one place: values to plaintext integers and back, and
the parts of the ciphertext frames the schemes share.

* :func:`fixed_point`: per-value Paillier's exact fixed point ``round(v * 2**bits)``;
* :class:`PackedLayout`: packed Paillier's quantisation (``clip``, ``value_bits``) and slot
  layout, :func:`pack` / :func:`unpack` (many slots in one integer and back),
  :func:`block_layout` and :func:`groups` (positions as whole blocks);
* :func:`union_positions`, :func:`check_sorted`: the position checks every aggregate and
  every ciphertext frame makes;
* :func:`read_header`, :func:`check_width`, :func:`check_size`, :func:`read_ciphertexts`:
  reading a ciphertext frame (magic, version, key id, sizes, ciphertexts in ``Z_{n^2}``).

The masked scheme's ring encoding stays beside its rings (:mod:`senseshield.he.masked`).
Pure functions over arrays and bytes; no I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_MAX_TOTAL_WEIGHT",
    "DEFAULT_VALUE_BITS",
    "ClippingWarning",
    "PackedLayout",
    "block_layout",
    "check_size",
    "check_sorted",
    "check_width",
    "fixed_point",
    "groups",
    "pack",
    "read_ciphertexts",
    "read_header",
    "union_positions",
    "unpack",
]

DEFAULT_VALUE_BITS = 15
"""Bits per quantised value (sign included): q in [-(2^14 - 1), 2^14 - 1]."""
DEFAULT_CLIP = 1.0
"""Clip range [-1, 1]: model updates (local deltas) of this project stay well inside it."""
DEFAULT_MAX_TOTAL_WEIGHT = 2**16
"""Largest total sample-count weight per aggregated block (head-room of the slots)."""
MAX_SLOT_BITS = 62  # slot sums are computed in int64
MAX_WEIGHT_FIELD = 2**32 - 1  # per-block weights travel as u32
_PACK_CHUNK = 2048  # blocks per NumPy bit-packing chunk (bounds temporary memory)


class ClippingWarning(UserWarning):
    """Values outside the key's clip range were clipped before encryption or aggregation."""


@dataclass(frozen=True)
class PackedLayout:
    """Quantisation and slot layout of a packed key (all derived from four numbers)."""

    key_bits: int
    value_bits: int
    clip: float
    max_total_weight: int

    def __post_init__(self) -> None:
        if not 2 <= self.value_bits <= 32:
            raise ConfigError(f"value_bits is {self.value_bits}; choose 2..32 (default 15).")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip is {self.clip!r}; it must be a finite number > 0.")
        if not 1 <= self.max_total_weight <= MAX_WEIGHT_FIELD:
            raise ConfigError(
                f"max_total_weight is {self.max_total_weight}; choose 1..{MAX_WEIGHT_FIELD}."
            )
        if self.slot_bits > MAX_SLOT_BITS:
            raise ConfigError(
                f"value_bits={self.value_bits} with max_total_weight={self.max_total_weight} "
                f"needs {self.slot_bits}-bit slots; at most {MAX_SLOT_BITS} are supported."
            )
        if self.slots < 1:
            raise ConfigError(
                f"A {self.key_bits}-bit modulus cannot hold one {self.slot_bits}-bit slot."
            )

    @property
    def q_max(self) -> int:
        """Largest quantised magnitude ``2^(value_bits-1) - 1``; also the slot offset."""
        return (1 << (self.value_bits - 1)) - 1

    @property
    def offset(self) -> int:
        return self.q_max

    @property
    def u_max(self) -> int:
        """Largest encoded slot value of one contribution, ``2 q_max``."""
        return 2 * self.q_max

    @property
    def step(self) -> float:
        """Quantisation step ``clip / q_max`` (the error is at most half of it)."""
        return self.clip / self.q_max

    @property
    def slot_bits(self) -> int:
        return (self.max_total_weight * self.u_max).bit_length()

    @property
    def slots(self) -> int:
        """Values per ciphertext (= ``block_size``)."""
        return (self.key_bits - 1) // self.slot_bits

    def quantise(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """``(q, clipped)``: int64 ``round(clip(v) / step)`` and how many values were clipped."""
        v = np.asarray(values, dtype=np.float64)
        outside = int(np.count_nonzero(np.abs(v) > self.clip))
        q = np.rint(np.clip(v, -self.clip, self.clip) * (self.q_max / self.clip))
        q = np.clip(q, -self.q_max, self.q_max).astype(np.int64)
        return q, outside

    def dequantise(self, q: np.ndarray) -> np.ndarray:
        """float64 ``q * step`` (``q`` may be a weighted sum of quantised values)."""
        return np.asarray(q, dtype=np.int64).astype(np.float64) * self.step

    def as_dict(self) -> dict[str, Any]:
        return {
            "value_bits": self.value_bits,
            "clip": self.clip,
            "max_total_weight": self.max_total_weight,
            "slot_bits": self.slot_bits,
            "slots": self.slots,
            "step": self.step,
        }


def groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)``, in O(n) when ``keys`` is sorted (block indices
    of sorted positions), else by ``np.unique``."""
    if keys.size == 0:
        return keys[:0], np.zeros(0, dtype=np.int64)
    steps = np.diff(keys)
    if np.any(steps < 0):
        return np.unique(keys, return_counts=True)
    edges = np.concatenate([[0], np.flatnonzero(steps) + 1, [keys.size]])
    return keys[edges[:-1]], np.diff(edges)


def block_layout(positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(blocks, lengths)`` of sorted unique positions that form whole blocks.

    Raises ``ValueError`` naming the first block that is not whole (see the module doc).
    """
    if positions.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    blocks, starts, counts = np.unique(
        positions // block_size, return_index=True, return_counts=True
    )
    partial = np.flatnonzero(counts[:-1] != block_size)
    if partial.size:
        k = int(blocks[partial[0]])
        raise ValueError(
            f"Positions cover {int(counts[partial[0]])} of the {block_size} positions of block "
            f"{k} ({k * block_size}..{(k + 1) * block_size - 1}); packed Paillier encrypts "
            "whole blocks (only the highest block may be partial, as the end of the model)."
        )
    last, first = int(blocks[-1]), int(positions[starts[-1]])
    if first != last * block_size or int(positions[-1]) != first + int(counts[-1]) - 1:
        raise ValueError(
            f"The highest block {last} holds {int(counts[-1])} positions that do not run "
            f"contiguously from {last * block_size}; a partial block must be the model's end."
        )
    return blocks.astype(np.int64), counts.astype(np.int64)


def pack(slots: np.ndarray, slot_bits: int) -> list[int]:
    """Integers ``sum_j slots[k, j] << (slot_bits * j)`` for every row ``k`` (values >= 0)."""
    nblocks, width = slots.shape
    out: list[int] = []
    shifts = np.arange(slot_bits, dtype=np.int64)
    for start in range(0, nblocks, _PACK_CHUNK):
        chunk = slots[start : start + _PACK_CHUNK]
        bits = ((chunk[:, :, None] >> shifts) & 1).astype(np.uint8)
        packed = np.packbits(bits.reshape(chunk.shape[0], width * slot_bits), axis=1,
                             bitorder="little")
        size = packed.shape[1]
        raw = packed.tobytes()
        from_bytes = int.from_bytes
        out.extend(from_bytes(raw[i * size : (i + 1) * size], "little")
                   for i in range(chunk.shape[0]))
    return out


def unpack(values: Sequence[int], width: int, slot_bits: int) -> np.ndarray:
    """Inverse of :func:`pack` (int64 array ``(len(values), width)``); values must fit."""
    nbytes = (width * slot_bits + 7) // 8
    out = np.empty((len(values), width), dtype=np.int64)
    weights = np.int64(1) << np.arange(slot_bits, dtype=np.int64)
    for start in range(0, len(values), _PACK_CHUNK):
        chunk = values[start : start + _PACK_CHUNK]
        raw = b"".join(int(v).to_bytes(nbytes, "little") for v in chunk)
        bits = np.unpackbits(
            np.frombuffer(raw, dtype=np.uint8).reshape(len(chunk), nbytes), axis=1,
            bitorder="little",
        )[:, : width * slot_bits]
        out[start : start + len(chunk)] = (
            bits.reshape(len(chunk) * width, slot_bits).astype(np.int64) @ weights
        ).reshape(len(chunk), width)
    return out


def fixed_point(values: np.ndarray, precision_bits: int) -> list[int]:
    """Fixed-point integers ``round(v * 2**precision_bits)`` (half to even), exactly.

    Scaling by a power of two is exact in float64 unless it overflows to inf, which only
    happens for ``|v| >= 2**(1024 - precision_bits)``; such floats are integers, so
    ``int(v) << precision_bits`` is exact there.
    """
    if values.size == 0:
        return []
    with np.errstate(over="ignore"):
        scaled = np.rint(np.ldexp(values, precision_bits))
    if np.all(np.isfinite(scaled)):
        if float(np.max(np.abs(scaled))) < 2.0**63:
            return scaled.astype(np.int64).tolist()
        return [int(s) for s in scaled.tolist()]
    return [
        int(s) if math.isfinite(s) else int(v) << precision_bits
        for v, s in zip(values.tolist(), scaled.tolist())
    ]


def check_sorted(positions: np.ndarray, message: str) -> np.ndarray:
    """``positions`` as a flat int64 array; :class:`ProtocolError` with ``message`` unless
    they are sorted, unique and non-negative."""
    positions = np.asarray(positions, dtype=np.int64).ravel()
    if positions.size and (positions[0] < 0 or np.any(np.diff(positions) <= 0)):
        raise ProtocolError(message)
    return positions


def union_positions(positions: np.ndarray) -> np.ndarray:
    """An aggregate's positions (the union mask), checked as :func:`check_sorted`."""
    return check_sorted(positions, "Aggregate positions must be sorted, unique and non-negative.")


def _sentence(what: str) -> str:
    return what[:1].upper() + what[1:]


def read_header(data: bytes, header: struct.Struct, magic: bytes, versions: Collection[int], key_id: str,
                what: str, *, subject: str = "Ciphertext") -> tuple[Any, ...]:
    """The fields of a ciphertext frame's ``header`` (magic, version, raw key id, then the
    scheme's own), checked: long enough, ``magic`` and one of ``versions``
    (:class:`ProtocolError` naming ``what``, e.g. ``"Paillier ciphertext"``), made under
    ``key_id`` (:class:`KeyMismatchError` naming ``subject``)."""
    if len(data) < header.size:
        raise ProtocolError(f"{_sentence(what)} of {len(data)} bytes is shorter than its header.")
    fields = header.unpack_from(data)
    if fields[0] != magic or fields[1] not in versions:
        raise ProtocolError(f"Not a SenseShield {what} (bad magic or version).")
    raw_id = fields[2]
    if raw_id.hex() != key_id:
        raise KeyMismatchError(
            f"{subject} was made under key {raw_id.hex()!r}, not the current key "
            f"{key_id!r}; it is rejected."
        )
    return fields


def check_width(width: int, expected: int) -> None:
    """A frame's ciphertext width against the key's (:class:`ProtocolError`)."""
    if width != expected:
        raise ProtocolError(f"Ciphertext width is {width} bytes; this key uses {expected}.")


def check_size(data: bytes, expected: int, what: str, count: int, unit: str) -> None:
    """A frame's length against what its header announces (``count`` ``unit``)."""
    if len(data) != expected:
        raise ProtocolError(
            f"{_sentence(what)} has {len(data)} bytes; its header announces {count} {unit}, "
            f"i.e. {expected} bytes."
        )


def read_ciphertexts(data: bytes, offset: int, count: int, width: int, nsquare: Any,
                     label: Callable[[int], str]) -> list[int]:
    """``count`` big-endian ciphertexts of ``width`` bytes from ``offset``, each checked to lie
    in ``(0, n^2)``; :class:`ProtocolError` naming ``label(i)`` otherwise."""
    out: list[int] = []
    for i in range(count):
        start = offset + i * width
        c = int.from_bytes(data[start : start + width], "big")
        if not 0 < c < nsquare:
            raise ProtocolError(f"{label(i)} is not an element of Z_{{n^2}}.")
        out.append(c)
    return out
