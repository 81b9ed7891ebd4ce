"""Masked aggregation through the key server: one-time pads instead of public-key HE.

Under the trust the design already assumes (a key server that does not collude with the
coordinator), symmetric one-time pads protect every parameter at about plaintext cost.

Keys and pads
-------------
The scheme's key pair is an X25519 pair held by the key server (``keys/public`` announces
the public half, signed by the key server's identity). Each agent already has an X25519
box key pinned in the fleet's trust file. For round ``r`` of cluster ``k`` agent ``a`` and
the key server both compute

    pad_key(a) = HKDF-SHA256(X25519(agent, key server),
                             info = "senseshield-mask" | ring | fleet/job/r/k/plan)

and expand it with ChaCha20 into one 64-bit word per model position: the pad ``p_a[i]``.
Nobody else can compute it (the coordinator holds neither secret). ``job`` is the nonce
the operator signed (the coordinator cannot choose it), ``plan`` the digest of the round
plan the agent masked under (signed in its receipt), ``ring`` 32 or 64: whatever the
coordinator changes gives another, independent pad. The agent keeps a durable record of
every (job, round) it has masked in and never masks a second, different vector in one
(:mod:`edge_agent.padlog`), so no pad is used twice whatever the coordinator says.

Encoding (all arithmetic modulo 2^64; modulo 2^32 in the 32-bit ring, below)
---------------------------------------------------------------------------
An agent sends, for each masked position ``i``, ``y_a[i] = round(x_a[i] · 2^24) + p_a[i]``
with ``|x| < 2^12`` (:data:`VALUE_LIMIT`; a larger value is refused at encryption). The
coordinator, which sees only ``y`` (uniformly random words, independent of ``x``: a one-time
pad), computes the weighted sum ``Σ w_a y_a`` modulo 2^64 and may add plaintext parts
``w_j · round(p_j · 2^24)``. The key server subtracts ``Σ w_a p_a`` for the contributors the
signed receipts name and reads the signed 64-bit result as ``2^24 ·`` the weighted sum.

Invariant (property-tested)::

    unmask(Σ_a w_a · mask_a(x_a) + Σ_j w_j · enc(p_j), {(a, w_a)}) == Σ_a w_a · enc(x_a) + Σ_j w_j · enc(p_j)

exactly, in integers, whatever subset of agents contributes (dropouts need nothing).

Head-room (64-bit ring): ``Σ w · |enc(x)| < 2^26 · 2^12 · 2^24 = 2^62 < 2^63``, so the total weight of an
aggregate must stay below 2^26 = 67 million samples (:data:`MAX_TOTAL_WEIGHT`; refused
beyond). A sum outside the range a genuine aggregate can reach is refused at unmasking: an
aggregate that is not the sum of exactly the named contributions (one left out, one added,
one altered) keeps a uniformly random pad, which lands inside that range with probability
at most 2^-1 per position, so it is refused on any model of more than a few dozen
parameters (the range is Σw · 2^36 of the 2^64 words, so the odds fall as the total weight
falls). A forged subset therefore yields noise, never an individual value.

The 32-bit ring (:data:`RING32`, 4 bytes per parameter)
-------------------------------------------------------
The same scheme modulo 2^32 with fixed point 2^-15 (step 3.05e-5, rounding error at most
1.53e-5, half the packed Paillier key's 3.05e-5), values clipped to [-1, 1] (the packed
key's clip; counted in one :class:`ClippingWarning`) and a total weight below 2^16 (the
packed key's default ``max_total_weight``)::

    |Σ w · enc(x)| <= (2^16 - 1) · 2^15 < 2^31

so the signed 32-bit word reads back exactly. A part that would take the aggregate's total
weight to 2^16 is refused alone (:class:`MaskedAccumulator`); the key server refuses named
weights of 2^16 or more and any word beyond ``Σ w · 2^15`` (a leftover pad lands inside
with probability ``Σ w · 2^-16`` per position, at most 1/2 as in the 64-bit ring). The ring
is chosen per cluster and round (:func:`choose_ring`) from the job's ``ring_bits``
(``auto``: 32 when the members' total weight is below 2^16 and the strategy adds no noise
to what it masks, else 64), by the simulator and the coordinator from the same numbers;
the round plan carries it to the agents and the vector's version byte to the key server.
Pads are the ChaCha20 keystream read as 32-bit words; fingerprints hold modulo 2^32, so a
difference ``D`` the coordinator adds passes with probability ``2^-(32 - v)`` (and a large
one then fails the range check).

What leaks: the positions (the mask), the count of values, the key id; to the key server,
each aggregate's sum, as with every scheme. Fixed-point step 2^-24 ≈ 6e-8 (finer than the
packed Paillier encoding's 3e-5).

Fingerprints (verifiable before unmasking)
------------------------------------------
Like the Paillier schemes (:mod:`senseshield.he.fingerprint`), the masked scheme is
verifiable: per round the key server seals a secret seed to the round's agents; it defines
one 64-bit challenge word per position, ``a[i]`` (ChaCha20 keystream of
HKDF(seed, "senseshield-masked-challenge"), :func:`challenge_words`). Each agent signs, in its
receipt, the fingerprint ``t_a = Σ_i a[i] · y_a[i] mod 2^64`` of its masked words; the key
server accepts an aggregate ``S`` only if ``Σ_i a[i] · S[i] == Σ_a w_a t_a + Σ_i a[i] · P[i]``
(mod 2^64, ``P`` the plaintext the coordinator folded in) -- *before* it removes any pad,
so checking a subset of contributions (leave-one-out, to find the contributor whose
fingerprint does not match its words) reveals nothing. A difference ``D`` the coordinator
(who does not know ``a``) adds to the aggregate passes with probability ``2^-(64 - v)``, ``v``
the 2-adic valuation of ``D``; a ``D`` that passes for large ``v`` moves positions by
multiples of ``2^(v)`` and is caught by the range check at unmasking (then refused, spent).

Masks: ``ragged_masks = False``: every contributor masks the same positions (the key server
removes each contributor's pad over the aggregate's positions and checks that each
receipt signs that mask). ``ragged_capable``: a job whose strategy gives each client its own
mask (SenseCrypt) uses the key with ``ragged_masks = True`` (:meth:`PublicKey.for_masks`):
each contributor masks its own positions, the coordinator sums, per union position, the
words of the contributors that masked it and folds in the others' plaintext, and the key
server removes each contributor's pads only at the positions its signed mask names
(``bind_contributions(..., masks=)``); positions fewer than ``min_encryptors`` masked stay
sealed (:meth:`select` takes the rest), as with packed Paillier.
"""

from __future__ import annotations

import os
import struct
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from senseshield.errors import ConfigError, ProtocolError
from senseshield.he.base import (
    SCHEMES,
    Accumulator,
    CipherPart,
    EncryptedVector,
    PlainPart,
    PublicKey,
    Scheme,
    SecretKey,
    check_public_fields,
    check_values,
    check_weight,
    select_units,
    short_hash,
)
from senseshield.he.encoding import ClippingWarning, read_header

SCHEME = "masked"
FRACTION_BITS = 24
SCALE = float(1 << FRACTION_BITS)
VALUE_LIMIT = float(1 << 12)  # |x| < 2^12 per value
MAX_TOTAL_WEIGHT = 1 << 26  # Σ w < 2^26 keeps Σ w |enc(x)| < 2^62
_MAGIC = b"SSMK"
_HEADER = struct.Struct(">4sB8sQI")  # magic, version (the ring), key id, count, position runs
_RUN = struct.Struct(">qq")  # a run of positions: start, length
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


@dataclass(frozen=True)
class Ring:
    """One encoding of the scheme: words modulo ``2^bits``, fixed point ``2^-fraction_bits``.

    A genuine weighted sum stays below ``max_total_weight · word_limit`` in magnitude, which
    is below ``2^(bits - 1)``: the signed word reads back exactly (see "Head-room" above).
    ``clips``: values beyond ``value_limit`` are clipped to it (counted, :class:`ClippingWarning`)
    instead of refused.
    """

    bits: int
    version: int  # the wire format's version byte
    fraction_bits: int
    value_limit: float
    clips: bool
    max_total_weight: int  # Σ w must stay below this

    @property
    def dtype(self) -> type:
        return np.uint64 if self.bits == 64 else np.uint32

    @property
    def scale(self) -> float:
        return float(1 << self.fraction_bits)

    @property
    def word_limit(self) -> int:
        """The largest ``|enc(x)|`` of one value (64: ``< 2^36``; 32, clipped: ``<= 2^15``)."""
        return int(self.value_limit * self.scale)

    @property
    def word_bytes(self) -> int:
        return self.bits // 8


RING64 = Ring(64, 1, FRACTION_BITS, VALUE_LIMIT, False, MAX_TOTAL_WEIGHT)
RING32 = Ring(32, 2, 15, 1.0, True, 1 << 16)
RINGS = {64: RING64, 32: RING32}
_BY_VERSION = {r.version: r for r in RINGS.values()}
RING_OPTIONS = ("auto", 32, 64)


def ring_option(value: Any) -> str | int:
    """A job's ``ring_bits`` option: ``"auto"``, 32 or 64 (``"32"`` is read as 32)."""
    if isinstance(value, str) and value.strip() in ("32", "64"):
        value = int(value)
    if isinstance(value, bool) or value not in RING_OPTIONS:
        raise ConfigError(f"ring_bits={value!r} is not allowed; use auto, 32 or 64.")
    return value


def choose_ring(option: Any, total_weight: int, *, bounded: bool = True) -> int:
    """The ring of one cluster's round: ``option`` (the job's ``ring_bits``), the cluster's
    planned total weight ``Σ w`` and whether the strategy's sent values may be clipped to
    ±1 without breaking its guarantee (``bounded``: not for noise shares, masked-dp).
    ``auto`` takes 32 bits when ``bounded`` and ``Σ w < 2^16`` (the 32-bit head-room), else 64.
    The simulator and the coordinator call it with the same numbers: the same choice."""
    option = ring_option(option)
    if option == 32 and not bounded:
        raise ConfigError("ring_bits=32 is not allowed for a strategy that adds noise to what it masks "
                          "(the 32-bit ring clips values to ±1); use 64 or auto.")
    if option == "auto":
        return 32 if bounded and int(total_weight) < RING32.max_total_weight else 64
    return int(option)


def ring_of(bits: Any) -> Ring:
    if isinstance(bits, bool) or bits not in RINGS:
        raise ConfigError(f"ring_bits={bits!r} is not allowed; the masked scheme has rings of 32 and 64 bits.")
    return RINGS[bits]


def ring_of_words(words: np.ndarray) -> Ring:
    """The ring of masked words, from their dtype (uint32 or uint64)."""
    dtype = np.asarray(words).dtype
    if dtype == np.uint64:
        return RING64
    if dtype == np.uint32:
        return RING32
    raise ProtocolError(f"Masked words must be uint32 or uint64, got {dtype}.")


Exchange = Callable[[bytes], bytes]
"""X25519 with the contributor's own private key: peer public key -> shared secret."""


def pad_key(shared: bytes, context: bytes, ring: Ring) -> bytes:
    """The 32-byte ChaCha20 key of one contributor's pads in one context
    (fleet/job/round/cluster/plan, :func:`senseshield.he.base.round_context`) and ring: the
    ring is in the key, so the same context read as 32-bit and as 64-bit words gives two
    independent pads (one keystream read both ways would be a pad used twice)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"senseshield-mask\0" + f"ring{ring.bits}".encode() + b"\0" + context).derive(shared)


def pads(key: bytes, positions: np.ndarray, ring: Ring = RING64) -> np.ndarray:
    """The pad words (``ring.dtype``) at ``positions``: word ``i`` of the ChaCha20 keystream
    of ``key`` read as ``ring.bits``-bit words."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return np.zeros(0, dtype=ring.dtype)
    n = int(positions[-1]) + 1
    size = ring.word_bytes * n
    buffer = bytearray(size + 15)  # update_into wants room for a block more than it writes
    Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor().update_into(_zeros(size), buffer)
    words = np.frombuffer(buffer, dtype=f"<u{ring.word_bytes}", count=n)
    if positions.size == n:  # every position up to the last: the whole stream
        return words
    return words[positions]


_ZERO_CACHE: list[bytes] = [b""]


def _zeros(nbytes: int) -> memoryview:
    """``nbytes`` zero bytes (the keystream is ChaCha20 applied to zeros), kept for reuse."""
    if len(_ZERO_CACHE[0]) < nbytes:
        _ZERO_CACHE[0] = bytes(nbytes)
    return memoryview(_ZERO_CACHE[0])[:nbytes]


def challenge_words(seed: bytes, positions: np.ndarray, ring: Ring = RING64) -> np.ndarray:
    """The round's challenge word (``ring.dtype``) of every position, from the sealed seed."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=b"senseshield-masked-challenge").derive(bytes(seed))
    return pads(key, positions, ring)


def _dot(a: np.ndarray, words: np.ndarray, ring: Ring = RING64) -> int:
    """``Σ a[i] · words[i] mod 2^ring.bits`` (uint64 arithmetic wraps modulo 2^64, a multiple)."""
    with np.errstate(over="ignore"):
        total = int((np.asarray(a, dtype=np.uint64) * np.asarray(words, dtype=np.uint64)).sum(dtype=np.uint64))
    return total % (1 << ring.bits)


def encode(values: np.ndarray, ring: Ring = RING64) -> np.ndarray:
    """Fixed-point ``round(x · 2^f)`` as ``ring.dtype`` (two's complement). The 64-bit ring
    refuses ``|x| >= 2^12`` (ValueError); the 32-bit ring clips to [-1, 1], counted in one
    :class:`ClippingWarning`."""
    values = np.asarray(values, dtype=np.float64)
    limit = ring.value_limit
    if values.size and (values.max() >= limit or values.min() <= -limit):
        if ring.clips:
            outside = int(np.count_nonzero(np.abs(values) > limit))
            if outside:
                warnings.warn(f"{outside} of {values.size} values were outside the 32-bit masked ring's range "
                              f"[-{limit:g}, {limit:g}] and were clipped.", ClippingWarning, stacklevel=2)
                values = np.clip(values, -limit, limit)
        else:
            too_big = np.flatnonzero(np.abs(values) >= limit)
            raise ValueError(f"Value {float(values[too_big[0]])!r} at index {int(too_big[0])} is outside the masked "
                             f"encoding's range |x| < {limit:g}; clip the update.")
    scaled = values * ring.scale
    np.rint(scaled, out=scaled)
    signed = np.int64 if ring.bits == 64 else np.int32
    return scaled.astype(signed).view(ring.dtype)


def decode(words: np.ndarray) -> np.ndarray:
    """Signed words (uint64 or uint32, the ring) read as fixed-point sums (float64)."""
    ring = ring_of_words(words)
    signed = np.int64 if ring.bits == 64 else np.int32
    return np.asarray(words).view(signed).astype(np.float64) / ring.scale


def _runs(positions: np.ndarray) -> np.ndarray:
    """Sorted positions as runs (start, length): one run for a full mask."""
    if positions.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if int(positions[-1]) - int(positions[0]) + 1 == positions.size:  # sorted and unique: one run
        return np.array([[positions[0], positions.size]], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate([[0], breaks])]
    lengths = np.diff(np.concatenate([[0], breaks, [positions.size]]))
    return np.stack([starts, lengths], axis=1).astype(np.int64)


def _fold_bytes(fold: np.ndarray | None) -> bytes:
    """A plaintext fold (words of the ring) as the aggregate request carries it: big-endian
    words, empty when nothing was folded in."""
    if fold is None or not np.any(fold):
        return b""
    return np.asarray(fold).astype(f">u{ring_of_words(fold).word_bytes}").tobytes()


class MaskedPublicKey(PublicKey):
    """The key server's X25519 public key. Unbound (the coordinator's), it adds masked
    vectors; bound to a contributor (:meth:`for_contributor`), it also masks."""

    scheme = SCHEME
    ragged_masks = False
    ragged_capable = True
    needs_contributors = True
    block_size = 1

    def __init__(self, box: bytes, *, pad: bytes | None = None, ring: Ring = RING64) -> None:
        if len(box) != 32:
            raise ProtocolError(f"A masked scheme key is a 32-byte X25519 key, got {len(box)} bytes.")
        self.box = bytes(box)
        self._key_id = short_hash(b"masked-v1", self.box)
        self._pad = pad
        self.ring = ring  # what a bound key masks in (an unbound key adds words of either ring)

    @property
    def key_id(self) -> str:
        return self._key_id

    def for_contributor(self, exchange: Exchange, context: bytes, *, ring_bits: int = 64) -> "MaskedPublicKey":
        """This key bound to one contributor in one context: its :meth:`encrypt` masks with
        the pads only that contributor and the key server can compute, modulo ``2^ring_bits``
        (the round's ring, :func:`choose_ring`)."""
        ring = ring_of(ring_bits)
        bound = MaskedPublicKey(self.box, pad=pad_key(exchange(self.box), context, ring), ring=ring)
        bound.ragged_masks = self.ragged_masks
        return bound

    def encrypt(self, values: np.ndarray, positions: np.ndarray) -> EncryptedVector:
        if self._pad is None:
            raise ConfigError("Masked encryption needs the contributor's pads; bind the key with "
                              "for_contributor(exchange, context) first.")
        values, positions = check_values(values, positions)
        words = encode(values, self.ring)
        words += pads(self._pad, positions, self.ring)  # wraps modulo 2^bits
        return EncryptedVector(SCHEME, self._key_id, positions, words, self._nbytes(positions, self.ring))

    @staticmethod
    def _nbytes(positions: np.ndarray, ring: Ring) -> int:
        return _HEADER.size + _RUN.size * len(_runs(positions)) + ring.word_bytes * positions.size

    def aggregate(self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray) -> EncryptedVector:
        accumulator = MaskedAccumulator(self, 0)
        for part in parts:
            accumulator.add(part)
        return accumulator.result(np.asarray(positions, dtype=np.int64))

    def accumulator_from_state(self, size: int, fields: dict, arrays: dict[str, np.ndarray]) -> "MaskedAccumulator":
        return MaskedAccumulator.from_state(self, size, fields, arrays)

    def accumulator(self, size: int) -> "MaskedAccumulator":
        return MaskedAccumulator(self, size)

    def select(self, vector: EncryptedVector, positions: np.ndarray) -> EncryptedVector | None:
        """The aggregate at ``positions`` (ragged masks: the positions that are not sealed),
        with its plaintext fold and the contributors bound to it."""
        self.check(vector)
        if len(positions) == 0:
            return None
        rows, _ = select_units(vector, positions, np.asarray(vector.positions, dtype=np.int64), 1)
        positions = np.asarray(positions, dtype=np.int64).copy()
        words = np.asarray(vector.payload)
        out = EncryptedVector(SCHEME, self._key_id, positions, words[rows],
                              MaskedPublicKey._nbytes(positions, ring_of_words(words)))
        out.meta = {k: v for k, v in vector.meta.items() if k != "plain"}
        if "plain" in vector.meta:
            out.meta["plain"] = np.asarray(vector.meta["plain"])[rows]
        return out

    # -- verification (see "Fingerprints" above) -------------------------------------
    verifiable = True

    def fingerprint(self, vector: EncryptedVector, seed: bytes) -> bytes:
        self.check(vector)
        ring = ring_of_words(vector.payload)
        return _dot(challenge_words(seed, vector.positions, ring), vector.payload, ring).to_bytes(8, "big")

    def plain_fold(self, aggregate: EncryptedVector) -> bytes:
        return _fold_bytes(aggregate.meta.get("plain"))

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        self.check(aggregate)
        ring = ring_of_words(aggregate.payload)
        a = challenge_words(seed, aggregate.positions, ring)
        expected = 0
        for f, w in contributions:
            if len(f) != 8:
                raise ProtocolError(f"A masked fingerprint has 8 bytes, got {len(f)}.")
            expected += int.from_bytes(f, "big") * int(w)
        if plain:
            width = ring.word_bytes
            if len(plain) != width * aggregate.positions.size:
                raise ProtocolError(f"The plaintext fold has {len(plain)} bytes; {aggregate.positions.size} "
                                    f"positions need {width} each in the {ring.bits}-bit ring.")
            expected += _dot(a, np.frombuffer(plain, dtype=f">u{width}").astype(np.uint64), ring)
        return _dot(a, aggregate.payload, ring) == expected % (1 << ring.bits)

    def to_bytes(self) -> bytes:
        import json

        return json.dumps({"scheme": SCHEME, "box": self.box.hex(), "fraction_bits": FRACTION_BITS}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "MaskedPublicKey":
        import json

        try:
            obj = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError):
            raise ProtocolError("A masked scheme public key is not JSON.") from None
        if not isinstance(obj, dict):
            raise ProtocolError("A masked scheme public key is a JSON object.")
        check_public_fields(obj, {"scheme", "box", "fraction_bits"}, "masked scheme public key")
        if obj.get("scheme") != SCHEME or obj.get("fraction_bits") != FRACTION_BITS:
            raise ProtocolError(f"Not a {SCHEME!r} public key with {FRACTION_BITS} fraction bits.")
        try:
            box = bytes.fromhex(str(obj.get("box")))
        except ValueError:
            raise ProtocolError("The masked scheme public key's box key is not hex.") from None
        return cls(box)

    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """``"SSMK" | version u8 | key id (8) | count u64 | runs u32 | runs x (start, length)
        i64 | count x word`` (big-endian header, little-endian words); version 1: u64 words
        (the 64-bit ring), 2: u32 words (the 32-bit ring)."""
        self.check(vector)
        ring = ring_of_words(vector.payload)
        runs = _runs(vector.positions)
        return b"".join([
            _HEADER.pack(_MAGIC, ring.version, bytes.fromhex(self._key_id), vector.positions.size, len(runs)),
            runs.astype(">i8").tobytes(),
            np.asarray(vector.payload).astype(f"<u{ring.word_bytes}", copy=False).tobytes(),
        ])

    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        data = bytes(data)
        _, version, _, count, nruns = read_header(data, _HEADER, _MAGIC, _BY_VERSION, self._key_id, "masked vector",
                                                  subject="Masked vector")
        ring = _BY_VERSION[version]
        expected = _HEADER.size + _RUN.size * nruns + ring.word_bytes * count
        if len(data) != expected:
            raise ProtocolError(f"Masked vector has {len(data)} bytes; its header announces {expected} "
                                f"({count} words of {ring.word_bytes} bytes, the {ring.bits}-bit ring).")
        runs = np.frombuffer(data, dtype=">i8", count=2 * nruns, offset=_HEADER.size).reshape(-1, 2).astype(np.int64)
        if nruns and (np.any(runs[:, 1] < 1) or runs[0, 0] < 0 or np.any(runs[1:, 0] <= runs[:-1].sum(axis=1))
                      or int(runs[:, 1].sum()) != count):
            raise ProtocolError("Masked vector positions must be sorted, unique and non-negative runs covering its count.")
        if count > (1 << 32):
            raise ProtocolError(f"Masked vector announces {count} values; too many.")
        positions = (np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs])
                     if nruns else np.zeros(0, dtype=np.int64))
        words = np.frombuffer(data, dtype=f"<u{ring.word_bytes}", count=count,
                              offset=_HEADER.size + _RUN.size * nruns).astype(ring.dtype)
        return EncryptedVector(SCHEME, self._key_id, positions, words, len(data), meta={"ring_bits": ring.bits})

    def __repr__(self) -> str:
        return f"MaskedPublicKey(key_id={self._key_id!r}{f', bound, {self.ring.bits}-bit' if self._pad else ''})"


class MaskedAccumulator(Accumulator):
    """Running ``Σ w · y`` modulo the ring of its parts (exact: the order of arrival does not
    matter). Every masked part must be in the same ring; a part that would take the total
    weight to the ring's head-room is refused alone.

    Shared masks (``ragged_masks = False``): every part masks the aggregate's positions, a
    part that does not is refused. Ragged masks: each part adds its words at its own
    positions (one running word per model position) and the union is the aggregate."""

    def __init__(self, public_key: MaskedPublicKey, size: int) -> None:
        self.public_key, self.size = public_key, int(size)
        self.total = np.zeros(0, dtype=np.uint64)
        self.positions: np.ndarray | None = None
        self.ring: Ring | None = None
        self.weight = 0  # Σ w of the masked parts
        self.plain: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.count = 0
        self.ragged = bool(public_key.ragged_masks)
        self.covered = np.zeros(0, dtype=bool)  # ragged: positions some part masked

    def add(self, part: CipherPart | PlainPart, key: str = "") -> None:
        index = self.count
        if isinstance(part, CipherPart):
            self.public_key.check(part.vector)
            ring = ring_of_words(part.vector.payload)
            if self.ring is not None and ring is not self.ring:
                raise ProtocolError(f"Part {index} is masked modulo 2^{ring.bits}; the aggregate's other parts are "
                                    f"modulo 2^{self.ring.bits}, and every part of one aggregate must be in one ring.")
            weight = check_weight(part.weight, index, limit=ring.max_total_weight - 1 - self.weight,
                                  why=f"the {ring.bits}-bit masked head-room's remaining weight (an aggregate's "
                                      f"total stays below {ring.max_total_weight})")
            positions = part.vector.positions
            if self.positions is not None and not np.array_equal(positions, self.positions):
                raise ProtocolError(f"Part {index} masks other positions than the aggregate's; every contributor "
                                    "of a masked aggregate masks the same positions.")
            words = np.asarray(part.vector.payload)
            if words.shape != positions.shape:
                raise ProtocolError(f"Part {index} has {words.size} words for {positions.size} positions.")
            if self.ragged:  # one running word per model position, in the parts' ring
                if self.ring is None:
                    self.ring, self.total = ring, np.zeros(0, dtype=ring.dtype)
                need = int(positions[-1]) + 1 if positions.size else 0
                if need > self.total.size:
                    self.total = np.concatenate([self.total, np.zeros(need - self.total.size, dtype=ring.dtype)])
                    self.covered = np.concatenate([self.covered, np.zeros(need - self.covered.size, dtype=bool)])
                self.total[positions] += words * ring.dtype(weight)  # modulo 2^bits
                self.covered[positions] = True
                self.weight += weight
                self.count += 1
                return
            if self.positions is None:
                self.positions, self.total, self.ring = positions.copy(), np.zeros(positions.size, dtype=ring.dtype), ring
            self.total += words * ring.dtype(weight)  # modulo 2^bits
            self.weight += weight
        else:
            weight = check_weight(part.weight, index, limit=MAX_TOTAL_WEIGHT, why="the masked head-room")
            self.plain.append((np.asarray(part.positions, dtype=np.int64),
                               np.asarray(part.values, dtype=np.float64), weight))
        self.count += 1

    def result(self, positions: np.ndarray) -> EncryptedVector:
        positions = np.asarray(positions, dtype=np.int64)
        if self.ragged:
            if self.ring is None or not np.array_equal(np.flatnonzero(self.covered), positions):
                raise ProtocolError("A masked aggregate's positions must be exactly the union of its contributors' masks.")
            total = self.total[positions]
        elif self.positions is None or self.ring is None or not np.array_equal(self.positions, positions):
            raise ProtocolError("A masked aggregate's positions must be exactly those its contributors masked.")
        else:
            total = self.total
        ring = self.ring
        fold = self._fold(positions, ring)
        vector = EncryptedVector(SCHEME, self.public_key.key_id, positions, total + fold,
                                 MaskedPublicKey._nbytes(positions, ring))
        vector.meta["plain"] = fold  # what the key server's fingerprint check needs (plain_fold)
        return vector

    def _fold(self, positions: np.ndarray, ring: Ring) -> np.ndarray:
        """``Σ w · enc(p)`` of the plaintext parts at ``positions`` (the masked ones), in ``ring``."""
        fold = np.zeros(positions.size, dtype=ring.dtype)
        for where, values, weight in self.plain:  # plaintext inside the masked positions, if any
            inside = np.isin(where, positions)
            if inside.any():
                fold[np.searchsorted(positions, where[inside])] += encode(values[inside], ring) * ring.dtype(weight)
        return fold

    def fold(self, like: EncryptedVector) -> bytes:
        self.public_key.check(like)
        return _fold_bytes(self._fold(np.asarray(like.positions, dtype=np.int64), ring_of_words(like.payload)))

    def merge(self, other: Accumulator) -> None:
        """Add ``other``'s running sum (a site's partial sum of other contributors): the words
        add modulo the ring and the plaintext parts join, so the result is the one of every
        part added here; ProtocolError, changing nothing, if the rings, positions or weights
        do not fit."""
        if not isinstance(other, MaskedAccumulator) or other.public_key.key_id != self.public_key.key_id:
            raise ProtocolError("A partial sum under another key cannot join a masked aggregate.")
        if other.ragged != self.ragged:
            raise ProtocolError("A partial sum of per-client masks cannot join one of a shared mask, or the reverse.")
        if other.ring is not None:
            if self.ring is not None and other.ring is not self.ring:
                raise ProtocolError(f"A partial sum is masked modulo 2^{other.ring.bits}; the aggregate is modulo "
                                    f"2^{self.ring.bits}, and every part of one aggregate must be in one ring.")
            if self.weight + other.weight >= other.ring.max_total_weight:
                raise ProtocolError(f"A partial sum of weight {other.weight} would take the aggregate's weight to "
                                    f"{self.weight + other.weight}; the {other.ring.bits}-bit masked head-room stays "
                                    f"below {other.ring.max_total_weight}.")
            if not self.ragged and self.positions is not None and not np.array_equal(self.positions, other.positions):
                raise ProtocolError("A partial sum masks other positions than the aggregate's; every contributor "
                                    "of a masked aggregate masks the same positions.")
            if self.ring is None:
                self.ring, self.total = other.ring, np.zeros(0 if self.ragged else other.total.size, dtype=other.ring.dtype)
                if not self.ragged:
                    self.positions = other.positions.copy()
            if self.ragged:
                need = max(self.total.size, other.total.size)
                total = np.zeros(need, dtype=self.ring.dtype)
                covered = np.zeros(need, dtype=bool)
                total[: self.total.size] += self.total
                total[: other.total.size] += other.total  # modulo 2^bits
                covered[: self.covered.size] |= self.covered
                covered[: other.covered.size] |= other.covered
                self.total, self.covered = total, covered
            else:
                self.total = self.total + other.total  # modulo 2^bits
            self.weight += other.weight
        self.plain.extend(other.plain)
        self.count += other.count

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        fields = {"ring_bits": self.ring.bits if self.ring is not None else 0, "weight": int(self.weight),
                  "count": int(self.count), "ragged": self.ragged}
        plain = self.plain
        arrays = {
            "total": self.total, "covered": self.covered.astype(np.uint8),
            "positions": np.packbits(np.isin(np.arange(self.size), self.positions)) if self.positions is not None
            else np.zeros(0, dtype=np.uint8),  # as a bitset over the model (positions are sorted)
            "plain_lengths": np.array([where.size for where, _, _ in plain], dtype=np.int64),
            "plain_weights": np.array([w for _, _, w in plain], dtype=np.int64),
            "plain_positions": np.concatenate([w for w, _, _ in plain]) if plain else np.zeros(0, dtype=np.int64),
            "plain_values": np.concatenate([v for _, v, _ in plain]) if plain else np.zeros(0),
        }
        return fields, arrays

    @classmethod
    def from_state(cls, public_key: MaskedPublicKey, size: int, fields: dict, arrays: dict[str, np.ndarray]) -> "MaskedAccumulator":
        """The running sum :meth:`state` described, every field checked (a partial sum comes
        from another process); ProtocolError naming what does not fit."""
        acc = cls(public_key, size)
        bits, weight, count = fields.get("ring_bits"), fields.get("weight"), fields.get("count")
        if fields.get("ragged") is not acc.ragged:
            raise ProtocolError("A partial sum's masks are per-client where the key's are shared, or the reverse.")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (bits, weight, count)):
            raise ProtocolError("A partial sum's ring, weight and count must be non-negative integers.")
        need = ("total", "covered", "positions", "plain_lengths", "plain_weights", "plain_positions", "plain_values")
        if any(name not in arrays for name in need):
            raise ProtocolError(f"A masked partial sum needs the arrays {', '.join(need)}.")
        lengths, weights = arrays["plain_lengths"].astype(np.int64), arrays["plain_weights"].astype(np.int64)
        where, values = arrays["plain_positions"].astype(np.int64), arrays["plain_values"].astype(np.float64)
        if lengths.size != weights.size or int(lengths.sum()) != where.size or where.size != values.size \
                or np.any(lengths < 0) or np.any(weights < 1) or np.any((where < 0) | (where >= size)) \
                or not np.all(np.isfinite(values)):
            raise ProtocolError("A partial sum's plaintext parts are inconsistent (lengths, weights, positions "
                                f"within 0..{size - 1}, finite values).")
        starts = np.concatenate([[0], np.cumsum(lengths)])
        acc.plain = [(where[a:b], values[a:b], int(w)) for a, b, w in zip(starts[:-1], starts[1:], weights)]
        acc.count = count
        if bits == 0:
            if weight or arrays["total"].size or arrays["positions"].size:
                raise ProtocolError("A partial sum without a ring carries masked words.")
            return acc
        ring = ring_of(bits) if bits in (32, 64) else None
        if ring is None:
            raise ProtocolError(f"A partial sum's ring is 2^{bits}; the masked scheme has rings of 32 and 64 bits.")
        total = arrays["total"]
        if total.dtype != ring.dtype or not weight or weight >= ring.max_total_weight:
            raise ProtocolError(f"A partial sum in the {bits}-bit ring needs {np.dtype(ring.dtype).name} words and a "
                                f"weight in 1..{ring.max_total_weight - 1}.")
        acc.ring, acc.weight, acc.total = ring, weight, total.copy()
        if acc.ragged:
            covered = arrays["covered"].astype(bool)
            if covered.size != total.size or total.size > size:
                raise ProtocolError(f"A partial sum's per-position words and coverage must be as long, at most {size}.")
            acc.covered = covered
        else:
            bits = arrays["positions"]
            if bits.dtype != np.uint8 or bits.size != -(-size // 8) or np.unpackbits(bits)[size:].any():
                raise ProtocolError(f"A partial sum's positions must be a bitset of the model's {size} positions.")
            positions = np.flatnonzero(np.unpackbits(bits)[:size])
            if positions.size != total.size:
                raise ProtocolError(f"A partial sum has {total.size} masked words for {positions.size} positions.")
            acc.positions = positions
        return acc


PADS_PER_PROCESS = 64
"""A decryption spreads its contributors' pads over processes only from this many per process
(below, starting the work costs more than it saves)."""


def pad_total(private: bytes, items: Sequence[tuple[bytes, int, bytes, np.ndarray | None]], positions: np.ndarray,
              ring_bits: int) -> np.ndarray:
    """``Σ w · pad`` of contributions ``items`` ((box key, weight, context, packed mask or
    None)) at ``positions`` in the ring of ``ring_bits``, under the key server's X25519
    ``private`` key: what unmasking an aggregate subtracts. A ragged contributor's pads count
    only where its mask is set."""
    ring = ring_of(ring_bits)
    key = X25519PrivateKey.from_private_bytes(private)
    total = np.zeros(positions.size, dtype=ring.dtype)
    for box, weight, context, mask in items:
        rows = slice(None) if mask is None else np.flatnonzero(np.unpackbits(mask)[positions])
        pad = pads(pad_key(key.exchange(X25519PublicKey.from_public_bytes(box)), context, ring), positions[rows], ring)
        total[rows] += pad if weight == 1 else pad * ring.dtype(weight)
    return total


_WORKER_KEY: list[bytes] = []


def _init_worker(private: bytes, owner: int) -> None:
    """A pad worker: keeps the key, and ends when the process that started it is gone (a key
    server stopped with ``os._exit`` runs no clean-up, and a worker must not outlive it)."""
    import threading

    from senseshield.processes import running

    _WORKER_KEY[:] = [private]

    def watch() -> None:
        while running(owner):
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="pad-worker-owner", daemon=True).start()


def _pad_total_in_worker(args: tuple) -> np.ndarray:
    items, positions, ring_bits = args
    return pad_total(_WORKER_KEY[0], items, positions, ring_bits)


_POOLS: dict[tuple[bytes, int], Any] = {}


def _pad_pool(private: bytes, workers: int):  # noqa: ANN202 - a ProcessPoolExecutor
    """The processes that regenerate pads for this key (started once, kept: forkserver, so a
    service's threads are not forked)."""
    import hashlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ident = (hashlib.sha256(private).digest(), workers)
    if not _POOLS:
        import atexit

        atexit.register(lambda: [pool.shutdown(wait=False, cancel_futures=True) for pool in _POOLS.values()])
    if ident not in _POOLS:
        _POOLS[ident] = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"),
                                            initializer=_init_worker, initargs=(private, os.getpid()))
    return _POOLS[ident]


class MaskedSecretKey(SecretKey):
    """The key server's X25519 private key: removes the named contributors' pads."""

    scheme = SCHEME

    def __init__(self, private: bytes) -> None:
        if len(private) != 32:
            raise ConfigError(f"A masked scheme secret is 32 bytes, got {len(private)}.")
        self._private = X25519PrivateKey.from_private_bytes(private)
        self._public = MaskedPublicKey(self._private.public_key().public_bytes(*_RAW))

    @property
    def public_key(self) -> MaskedPublicKey:
        return self._public

    def contributor_pad_key(self, contributor_box: bytes, context: bytes, ring: Ring = RING64) -> bytes:
        """The pad key contributor ``contributor_box`` derived in ``context`` and ``ring`` (same as its own)."""
        return pad_key(self._private.exchange(X25519PublicKey.from_public_bytes(contributor_box)), context, ring)

    def bind_contributions(self, vector: EncryptedVector, contributions: Sequence[tuple[bytes, int]],
                           context: bytes | Sequence[bytes], masks: Sequence[np.ndarray] | None = None) -> None:
        """Name the contributors of aggregate ``vector``: (box key, weight) from their signed
        receipts, and the context their pads were made in (one for all, or one per
        contribution: each receipt signs the plan it was made under); :meth:`decrypt`
        removes exactly these. ``masks`` (ragged masks): each contributor's signed mask
        (np.packbits over the model), in the order of ``contributions``; its pads are
        removed only where it masked."""
        if masks is not None and len(masks) != len(contributions):
            raise ProtocolError(f"{len(masks)} masks for {len(contributions)} contributions.")
        contexts = [bytes(context)] * len(contributions) if isinstance(context, (bytes, bytearray)) else \
            [bytes(c) for c in context]
        if len(contexts) != len(contributions):
            raise ProtocolError(f"{len(contexts)} contexts for {len(contributions)} contributions.")
        vector.meta["contributions"] = [(bytes(box), int(w)) for box, w in contributions]
        vector.meta["context"] = contexts
        vector.meta["masks"] = None if masks is None else [np.asarray(m, dtype=np.uint8) for m in masks]

    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:
        self._public.check(vector)
        contributions = vector.meta.get("contributions")
        if not contributions:
            raise ProtocolError("A masked aggregate is decrypted only with its named contributors "
                                "(bind_contributions); none were given.")
        ring = ring_of_words(vector.payload)
        total_weight = sum(w for _, w in contributions)
        if total_weight >= ring.max_total_weight:
            raise ProtocolError(f"The aggregate weighs {total_weight} samples; the {ring.bits}-bit masked encoding's "
                                f"head-room allows fewer than {ring.max_total_weight}.")
        words = np.asarray(vector.payload, dtype=ring.dtype).copy()
        masks = vector.meta.get("masks")
        if masks is not None:
            for m in masks:
                if vector.positions.size and int(vector.positions[-1]) >= 8 * m.size:
                    raise ProtocolError("A contributor's mask is shorter than the aggregate.")
        items = [(box, weight, vector.meta["context"][i], None if masks is None else masks[i])
                 for i, (box, weight) in enumerate(contributions)]
        words -= self._pads_of(items, vector.positions, ring, threads)
        signed = words.view(np.int64 if ring.bits == 64 else np.int32).astype(np.float64)
        # a genuine sum is at most Σw · word_limit (2^36 or 2^15) in magnitude; a leftover
        # pad is uniform on the ring
        limit = float(total_weight) * ring.word_limit
        outside = np.flatnonzero(np.abs(signed) > limit)
        if outside.size:
            raise ProtocolError(f"The unmasked sum is out of range at {outside.size} of {signed.size} positions: the "
                                "aggregate is not the sum of exactly the named contributions (refused).")
        return signed / ring.scale

    def _pads_of(self, items: list, positions: np.ndarray, ring: Ring, threads: int) -> np.ndarray:
        """``Σ w · pad`` of the contributions ``items`` ((box key, weight, context, packed mask
        or None) each) at ``positions``, modulo the ring: with ``threads`` > 1 and enough
        contributions, split among that many processes (regenerating pads is the key server's
        work per contributor: ChaCha20 holds the GIL). The sum does not depend on the split."""
        workers = max(1, min(int(threads), len(items) // PADS_PER_PROCESS))
        if workers == 1:
            return pad_total(self._export(), items, positions, ring.bits)
        pool = _pad_pool(self._export(), workers)
        chunks = [items[i::workers] for i in range(workers)]
        total = np.zeros(positions.size, dtype=ring.dtype)
        for part in pool.map(_pad_total_in_worker, [(chunk, positions, ring.bits) for chunk in chunks]):
            total += part
        return total

    def _export(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())

    @classmethod
    def _import(cls, data: bytes) -> "MaskedSecretKey":
        return cls(bytes(data))


@SCHEMES.register(SCHEME)
class MaskedScheme(Scheme):
    name = SCHEME
    public_key_class = MaskedPublicKey
    secret_key_class = MaskedSecretKey
    ragged_masks = False
    ragged_capable = True  # per-client masks when the job's strategy gives them (PublicKey.for_masks)
    exact = True
    description = ("one-time pads agreed with the key server (X25519 + HKDF + ChaCha20); fixed point 2^-15 modulo 2^32 "
                   "(4 bytes per parameter, values clipped to ±1) while a cluster's total weight is below 2^16, else "
                   f"2^-{FRACTION_BITS} modulo 2^64 (8 bytes; job option ring_bits); every parameter at about "
                   "plaintext cost; shared masks, or each client's own under a per-client-mask strategy (SenseCrypt).")
    defaults: dict[str, Any] = {}

    @classmethod
    def generate(cls, **params: Any) -> MaskedSecretKey:
        if params:
            raise ConfigError(f"The masked scheme takes no parameters; got {sorted(params)}.")
        return MaskedSecretKey(X25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()))
