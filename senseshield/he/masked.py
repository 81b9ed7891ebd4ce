"""Masked aggregation through the key server: one-time pads instead of public-key HE.

Under the trust the design already assumes (a key server that does not collude with the
coordinator), symmetric one-time pads protect every parameter at about plaintext cost.

Keys and pads
-------------
The scheme's key pair is an X25519 pair held by the key server (``keys/public`` announces
the public half, signed by the key server's identity). Each agent already has an X25519
box key pinned in the fleet's trust file. For round ``r`` of cluster ``k`` agent ``a`` and
the key server both compute

    pad_key(a) = HKDF-SHA256(X25519(agent, key server), info = "senseshield-mask" | fleet/run/r/k)

and expand it with ChaCha20 into one 64-bit word per model position: the pad ``p_a[i]``.
Nobody else can compute it (the coordinator holds neither secret).

Encoding (all arithmetic modulo 2^64)
-------------------------------------
An agent sends, for each masked position ``i``, ``y_a[i] = round(x_a[i] · 2^24) + p_a[i]``
with ``|x| < 2^12`` (:data:`VALUE_LIMIT`; a larger value is refused at encryption). The
coordinator, which sees only ``y`` (uniformly random words, independent of ``x``: a one-time
pad), computes the weighted sum ``Σ w_a y_a`` modulo 2^64 and may add plaintext parts
``w_j · round(p_j · 2^24)``. The key server subtracts ``Σ w_a p_a`` for the contributors the
signed receipts name and reads the signed 64-bit result as ``2^24 ·`` the weighted sum.

Invariant (property-tested)::

    unmask(Σ_a w_a · mask_a(x_a) + Σ_j w_j · enc(p_j), {(a, w_a)}) == Σ_a w_a · enc(x_a) + Σ_j w_j · enc(p_j)

exactly, in integers, whatever subset of agents contributes (dropouts need nothing).

Head-room: ``Σ w · |enc(x)| < 2^26 · 2^12 · 2^24 = 2^62 < 2^63``, so the total weight of an
aggregate must stay below 2^26 = 67 million samples (:data:`MAX_TOTAL_WEIGHT`; refused
beyond). A sum outside the range a genuine aggregate can reach is refused at unmasking: an
aggregate that is not the sum of exactly the named contributions (one left out, one added,
one altered) keeps a uniformly random pad, which lands inside that range with probability
at most 2^-1 per position, so it is refused on any model of more than a few dozen
parameters (the range is Σw · 2^36 of the 2^64 words, so the odds fall as the total weight
falls). A forged subset therefore yields noise, never an individual value.

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

import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError
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

SCHEME = "masked"
FRACTION_BITS = 24
SCALE = float(1 << FRACTION_BITS)
VALUE_LIMIT = float(1 << 12)  # |x| < 2^12 per value
MAX_TOTAL_WEIGHT = 1 << 26  # Σ w < 2^26 keeps Σ w |enc(x)| < 2^62
_MAGIC, _VERSION = b"SSMK", 1
_HEADER = struct.Struct(">4sB8sQI")  # magic, version, key id, count, position runs
_RUN = struct.Struct(">qq")  # a run of positions: start, length
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw

Exchange = Callable[[bytes], bytes]
"""X25519 with the contributor's own private key: peer public key -> shared secret."""


def pad_key(shared: bytes, context: bytes) -> bytes:
    """The 32-byte ChaCha20 key of one contributor's pads in one context (fleet/run/round/cluster)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"senseshield-mask\0" + context).derive(shared)


def pads(key: bytes, positions: np.ndarray) -> np.ndarray:
    """The pad words (uint64) at ``positions``: word ``i`` of the ChaCha20 keystream of ``key``."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return np.zeros(0, dtype=np.uint64)
    n = int(positions[-1]) + 1
    buffer = bytearray(8 * n + 15)  # update_into wants room for a block more than it writes
    Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor().update_into(_zeros(8 * n), buffer)
    words = np.frombuffer(buffer, dtype="<u8", count=n)
    if positions.size == n:  # every position up to the last: the whole stream
        return words
    return words[positions]


_ZERO_CACHE: list[bytes] = [b""]


def _zeros(nbytes: int) -> memoryview:
    """``nbytes`` zero bytes (the keystream is ChaCha20 applied to zeros), kept for reuse."""
    if len(_ZERO_CACHE[0]) < nbytes:
        _ZERO_CACHE[0] = bytes(nbytes)
    return memoryview(_ZERO_CACHE[0])[:nbytes]


def challenge_words(seed: bytes, positions: np.ndarray) -> np.ndarray:
    """The round's challenge word (uint64) of every position, from the sealed seed."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=b"senseshield-masked-challenge").derive(bytes(seed))
    return pads(key, positions)


def _dot(a: np.ndarray, words: np.ndarray) -> int:
    """``Σ a[i] · words[i] mod 2^64`` (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        return int((np.asarray(a, dtype=np.uint64) * np.asarray(words, dtype=np.uint64)).sum(dtype=np.uint64))


def encode(values: np.ndarray) -> np.ndarray:
    """Fixed-point ``round(x · 2^24)`` as uint64 (two's complement); |x| < 2^12 or ValueError."""
    values = np.asarray(values, dtype=np.float64)
    if values.size and (values.max() >= VALUE_LIMIT or values.min() <= -VALUE_LIMIT):
        too_big = np.flatnonzero(np.abs(values) >= VALUE_LIMIT)
        raise ValueError(f"Value {float(values[too_big[0]])!r} at index {int(too_big[0])} is outside the masked "
                         f"encoding's range |x| < {VALUE_LIMIT:g}; clip the update.")
    scaled = values * SCALE
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int64).view(np.uint64)


def decode(words: np.ndarray) -> np.ndarray:
    """Signed 64-bit words read as fixed-point sums (float64)."""
    return np.asarray(words, dtype=np.uint64).view(np.int64).astype(np.float64) / SCALE


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


class MaskedPublicKey(PublicKey):
    """The key server's X25519 public key. Unbound (the coordinator's), it adds masked
    vectors; bound to a contributor (:meth:`for_contributor`), it also masks."""

    scheme = SCHEME
    ragged_masks = False
    ragged_capable = True
    needs_contributors = True
    block_size = 1

    def __init__(self, box: bytes, *, pad: bytes | None = None) -> None:
        if len(box) != 32:
            raise ProtocolError(f"A masked scheme key is a 32-byte X25519 key, got {len(box)} bytes.")
        self.box = bytes(box)
        self._key_id = short_hash(b"masked-v1", self.box)
        self._pad = pad

    @property
    def key_id(self) -> str:
        return self._key_id

    def for_contributor(self, exchange: Exchange, context: bytes) -> "MaskedPublicKey":
        """This key bound to one contributor in one context: its :meth:`encrypt` masks with
        the pads only that contributor and the key server can compute."""
        bound = MaskedPublicKey(self.box, pad=pad_key(exchange(self.box), context))
        bound.ragged_masks = self.ragged_masks
        return bound

    def encrypt(self, values: np.ndarray, positions: np.ndarray) -> EncryptedVector:
        if self._pad is None:
            raise ConfigError("Masked encryption needs the contributor's pads; bind the key with "
                              "for_contributor(exchange, context) first.")
        values, positions = check_values(values, positions)
        words = encode(values)
        words += pads(self._pad, positions)  # wraps modulo 2^64
        return EncryptedVector(SCHEME, self._key_id, positions, words, self._nbytes(positions))

    def _nbytes(self, positions: np.ndarray) -> int:
        return _HEADER.size + _RUN.size * len(_runs(positions)) + 8 * positions.size

    def aggregate(self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray) -> EncryptedVector:
        accumulator = MaskedAccumulator(self, 0)
        for part in parts:
            accumulator.add(part)
        return accumulator.result(np.asarray(positions, dtype=np.int64))

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
        out = EncryptedVector(SCHEME, self._key_id, positions, np.asarray(vector.payload, dtype=np.uint64)[rows],
                              self._nbytes(positions))
        out.meta = {k: v for k, v in vector.meta.items() if k != "plain"}
        if "plain" in vector.meta:
            out.meta["plain"] = np.asarray(vector.meta["plain"], dtype=np.uint64)[rows]
        return out

    # -- verification (see "Fingerprints" above) -------------------------------------
    verifiable = True

    def fingerprint(self, vector: EncryptedVector, seed: bytes) -> bytes:
        self.check(vector)
        return _dot(challenge_words(seed, vector.positions), vector.payload).to_bytes(8, "big")

    def plain_fold(self, aggregate: EncryptedVector) -> bytes:
        fold = aggregate.meta.get("plain")
        return b"" if fold is None or not np.any(fold) else np.asarray(fold, dtype=">u8").tobytes()

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        self.check(aggregate)
        a = challenge_words(seed, aggregate.positions)
        expected = 0
        for f, w in contributions:
            if len(f) != 8:
                raise ProtocolError(f"A masked fingerprint has 8 bytes, got {len(f)}.")
            expected += int.from_bytes(f, "big") * int(w)
        if plain:
            if len(plain) != 8 * aggregate.positions.size:
                raise ProtocolError(f"The plaintext fold has {len(plain)} bytes; {aggregate.positions.size} "
                                    "positions need 8 each.")
            expected += _dot(a, np.frombuffer(plain, dtype=">u8").astype(np.uint64))
        return _dot(a, aggregate.payload) == expected % (1 << 64)

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
        i64 | count x word u64`` (big-endian header, little-endian words)."""
        self.check(vector)
        runs = _runs(vector.positions)
        return b"".join([
            _HEADER.pack(_MAGIC, _VERSION, bytes.fromhex(self._key_id), vector.positions.size, len(runs)),
            runs.astype(">i8").tobytes(),
            np.asarray(vector.payload, dtype="<u8").tobytes(),
        ])

    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise ProtocolError(f"Masked vector of {len(data)} bytes is shorter than its header.")
        magic, version, raw_id, count, nruns = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != _VERSION:
            raise ProtocolError("Not a SenseShield masked vector (bad magic or version).")
        if raw_id.hex() != self._key_id:
            raise KeyMismatchError(f"Masked vector was made under key {raw_id.hex()!r}, not the current key "
                                   f"{self._key_id!r}; it is rejected.")
        expected = _HEADER.size + _RUN.size * nruns + 8 * count
        if len(data) != expected:
            raise ProtocolError(f"Masked vector has {len(data)} bytes; its header announces {expected}.")
        runs = np.frombuffer(data, dtype=">i8", count=2 * nruns, offset=_HEADER.size).reshape(-1, 2).astype(np.int64)
        if nruns and (np.any(runs[:, 1] < 1) or runs[0, 0] < 0 or np.any(runs[1:, 0] <= runs[:-1].sum(axis=1))
                      or int(runs[:, 1].sum()) != count):
            raise ProtocolError("Masked vector positions must be sorted, unique and non-negative runs covering its count.")
        if count > (1 << 32):
            raise ProtocolError(f"Masked vector announces {count} values; too many.")
        positions = (np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs])
                     if nruns else np.zeros(0, dtype=np.int64))
        words = np.frombuffer(data, dtype="<u8", count=count, offset=_HEADER.size + _RUN.size * nruns).astype(np.uint64)
        return EncryptedVector(SCHEME, self._key_id, positions, words, len(data))

    def __repr__(self) -> str:
        return f"MaskedPublicKey(key_id={self._key_id!r}{', bound' if self._pad else ''})"


class MaskedAccumulator(Accumulator):
    """Running ``Σ w · y`` modulo 2^64 (exact: the order of arrival does not matter).

    Shared masks (``ragged_masks = False``): every part masks the aggregate's positions, a
    part that does not is refused. Ragged masks: each part adds its words at its own
    positions (one running word per model position) and the union is the aggregate."""

    def __init__(self, public_key: MaskedPublicKey, size: int) -> None:
        self.public_key = public_key
        self.total = np.zeros(0, dtype=np.uint64)
        self.positions: np.ndarray | None = None
        self.plain: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.count = 0
        self.ragged = bool(public_key.ragged_masks)
        self.covered = np.zeros(0, dtype=bool)  # ragged: positions some part masked

    def add(self, part: CipherPart | PlainPart, key: str = "") -> None:
        index = self.count
        if isinstance(part, CipherPart):
            weight = check_weight(part.weight, index, limit=MAX_TOTAL_WEIGHT, why="the masked head-room")
            self.public_key.check(part.vector)
            positions = part.vector.positions
            if self.positions is not None and not np.array_equal(positions, self.positions):
                raise ProtocolError(f"Part {index} masks other positions than the aggregate's; every contributor "
                                    "of a masked aggregate masks the same positions.")
            words = np.asarray(part.vector.payload, dtype=np.uint64)
            if words.shape != positions.shape:
                raise ProtocolError(f"Part {index} has {words.size} words for {positions.size} positions.")
            if self.ragged:
                need = int(positions[-1]) + 1 if positions.size else 0
                if need > self.total.size:
                    self.total = np.concatenate([self.total, np.zeros(need - self.total.size, dtype=np.uint64)])
                    self.covered = np.concatenate([self.covered, np.zeros(need - self.covered.size, dtype=bool)])
                self.total[positions] += words * np.uint64(weight)  # modulo 2^64
                self.covered[positions] = True
                self.count += 1
                return
            if self.positions is None:
                self.positions, self.total = positions.copy(), np.zeros(positions.size, dtype=np.uint64)
            self.total += words * np.uint64(weight)  # modulo 2^64
        else:
            weight = check_weight(part.weight, index, limit=MAX_TOTAL_WEIGHT, why="the masked head-room")
            self.plain.append((np.asarray(part.positions, dtype=np.int64),
                               np.asarray(part.values, dtype=np.float64), weight))
        self.count += 1

    def result(self, positions: np.ndarray) -> EncryptedVector:
        positions = np.asarray(positions, dtype=np.int64)
        if self.ragged:
            if not np.array_equal(np.flatnonzero(self.covered), positions):
                raise ProtocolError("A masked aggregate's positions must be exactly the union of its contributors' masks.")
            self.positions, self.total = positions, self.total[positions]
        if self.positions is None or not np.array_equal(self.positions, positions):
            raise ProtocolError("A masked aggregate's positions must be exactly those its contributors masked.")
        fold = np.zeros(positions.size, dtype=np.uint64)
        for where, values, weight in self.plain:  # plaintext inside the masked positions, if any
            inside = np.isin(where, positions)
            if inside.any():
                fold[np.searchsorted(positions, where[inside])] += encode(values[inside]) * np.uint64(weight)
        vector = EncryptedVector(SCHEME, self.public_key.key_id, positions, self.total + fold,
                                 self.public_key._nbytes(positions))
        vector.meta["plain"] = fold  # what the key server's fingerprint check needs (plain_fold)
        return vector


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

    def contributor_pad_key(self, contributor_box: bytes, context: bytes) -> bytes:
        """The pad key contributor ``contributor_box`` derived in ``context`` (same as its own)."""
        return pad_key(self._private.exchange(X25519PublicKey.from_public_bytes(contributor_box)), context)

    def bind_contributions(self, vector: EncryptedVector, contributions: Sequence[tuple[bytes, int]],
                           context: bytes, masks: Sequence[np.ndarray] | None = None) -> None:
        """Name the contributors of aggregate ``vector``: (box key, weight) from their signed
        receipts, and the context their pads were made in; :meth:`decrypt` removes exactly these.
        ``masks`` (ragged masks): each contributor's signed mask (np.packbits over the model),
        in the order of ``contributions``; its pads are removed only where it masked."""
        if masks is not None and len(masks) != len(contributions):
            raise ProtocolError(f"{len(masks)} masks for {len(contributions)} contributions.")
        vector.meta["contributions"] = [(bytes(box), int(w)) for box, w in contributions]
        vector.meta["context"] = bytes(context)
        vector.meta["masks"] = None if masks is None else [np.asarray(m, dtype=np.uint8) for m in masks]

    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:
        self._public.check(vector)
        contributions = vector.meta.get("contributions")
        if not contributions:
            raise ProtocolError("A masked aggregate is decrypted only with its named contributors "
                                "(bind_contributions); none were given.")
        total_weight = sum(w for _, w in contributions)
        if total_weight >= MAX_TOTAL_WEIGHT:
            raise ProtocolError(f"The aggregate weighs {total_weight} samples; the masked encoding's head-room "
                                f"allows fewer than {MAX_TOTAL_WEIGHT}.")
        words = np.asarray(vector.payload, dtype=np.uint64).copy()
        masks = vector.meta.get("masks")
        for i, (box, weight) in enumerate(contributions):
            rows = slice(None)
            if masks is not None:  # ragged: this contributor's pads only where it masked
                bits = np.unpackbits(masks[i])
                if vector.positions.size and int(vector.positions[-1]) >= bits.size:
                    raise ProtocolError("A contributor's mask is shorter than the aggregate.")
                rows = np.flatnonzero(bits[vector.positions])
            pad = pads(self.contributor_pad_key(box, vector.meta["context"]), vector.positions[rows])
            if weight == 1:
                words[rows] -= pad
            else:
                words[rows] -= pad * np.uint64(weight)
        signed = words.view(np.int64)
        # a genuine sum is below Σw · 2^12 · 2^24 in magnitude; a leftover pad is uniform on 2^64
        limit = float(total_weight) * VALUE_LIMIT * SCALE
        outside = np.flatnonzero(np.abs(signed.astype(np.float64)) >= limit)
        if outside.size:
            raise ProtocolError(f"The unmasked sum is out of range at {outside.size} of {signed.size} positions: the "
                                "aggregate is not the sum of exactly the named contributions (refused).")
        return signed.astype(np.float64) / SCALE

    def _export(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())

    @classmethod
    def _import(cls, data: bytes) -> "MaskedSecretKey":
        return cls(bytes(data))


@SCHEMES.register(SCHEME)
class MaskedScheme(Scheme):
    name = SCHEME
    ragged_masks = False
    ragged_capable = True  # per-client masks when the job's strategy gives them (PublicKey.for_masks)
    exact = True
    description = (f"one-time pads agreed with the key server (X25519 + HKDF + ChaCha20), fixed point 2^-{FRACTION_BITS} "
                   "modulo 2^64; 8 bytes per parameter; every parameter at about plaintext cost; shared masks, or each client's own under a per-client-mask "
                   "strategy (SenseCrypt).")
    defaults: dict[str, Any] = {}

    @classmethod
    def generate(cls, **params: Any) -> MaskedSecretKey:
        if params:
            raise ConfigError(f"The masked scheme takes no parameters; got {sorted(params)}.")
        return MaskedSecretKey(X25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()))

    @classmethod
    def public_key_from_bytes(cls, data: bytes) -> MaskedPublicKey:
        return MaskedPublicKey.from_bytes(data)

    @classmethod
    def secret_key_from_bytes(cls, data: bytes) -> MaskedSecretKey:
        return MaskedSecretKey._import(data)

