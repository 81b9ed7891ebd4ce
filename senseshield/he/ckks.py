"""CKKS packing via TenSEAL (Microsoft SEAL): thousands of values per ciphertext.

Parameters (defaults, all overridable in :meth:`CKKSScheme.generate`)
--------------------------------------------------------------------
* ``poly_modulus_degree = 8192`` -> ``8192 / 2 = 4096`` slots per ciphertext;
* ``coeff_mod_bit_sizes = [60, 40, 40, 60]`` (200 bits in total);
* global scale ``2**40`` (``scale_bits = 40``).

128-bit security: the HomomorphicEncryption.org security standard (Albrecht et al., 2018,
Table 1, classical, ternary secret), which SEAL enforces as ``CoeffModulus::MaxBitCount``,
allows at most 27/54/109/218/438/881 coefficient-modulus bits for degrees
1024/2048/4096/8192/16384/32768 (:data:`MAX_COEFF_MODULUS_BITS_128`); 200 <= 218.

Layout: the ``k`` values at ``positions`` are packed in order into ``ceil(k / slots)``
CKKS vectors (chunks). The payload of an :class:`EncryptedVector` is that list of
``tenseal.CKKSVector``; ``nbytes`` is the sum of their serialised sizes.

Homomorphic invariant (approximate)::

    D(sum_i w_i * E(v_i)) ~= sum_i w_i v_i

:meth:`CKKSPublicKey.aggregate` multiplies each ciphertext by its integer weight (a plaintext
scalar multiplication followed by a rescale, which consumes one of the two 40-bit levels;
skipped when every weight is 1) and adds them. CKKS is *approximate* (errors of order
1e-6 relative, never exact): with the defaults, a fresh encryption/decryption of values of
order 0.1-1 is off by ~1e-8 absolute, and the weighted sum ``30 E(v) + 70 E(v)`` of such
values (magnitude up to ~50) by ~5e-6 absolute (measured). :meth:`CKKSSecretKey.decrypt`
returns float64.

Headroom: after the weighting rescale the ciphertext lives modulo ~2**100 at scale 2**40,
so ``|sum_i w_i v_i|`` must stay well below 2**59; fresh ciphertexts must satisfy
``|v| * 2**40 < 2**139``. Weights are limited to :data:`MAX_WEIGHT`. As with Paillier, the
coordinator cannot see encrypted magnitudes: client-side clipping is what keeps sums small.

Masks: ``ragged_masks = False``. Packing fixes which value sits in which slot, so every
contributor must encrypt exactly the aggregate's positions; :meth:`aggregate` refuses a
ciphertext over other positions, and plaintext contributions inside the union (which only
make sense for ragged masks) are refused too. Plaintext parts outside the union are ignored.

What leaks: the positions and the number of encrypted values (and hence the chunk count),
the parameters, and the key id. Ciphertexts are IND-CPA under RLWE. Caveat (Li &
Micciancio, EUROCRYPT 2021): CKKS decryptions carry key-dependent noise, so publishing
exact decryptions of adversarially chosen ciphertexts can leak the secret key (IND-CPA-D);
the key server only decrypts aggregates, which are released as model updates.

Sum-only variant ``"ckks-sum"`` (:class:`CKKSSumScheme`)
-------------------------------------------------------
Federated averaging only needs additions if every client pre-scales its update by its
integer sample count: the client encrypts ``w_i * v_i`` (``CKKSSumPublicKey.encrypt(values,
positions, weight=w_i)``), the coordinator adds the ciphertexts and the key server divides
the decrypted ``sum_i w_i v_i`` by ``sum_i w_i``. No multiplication means no rescaling level,
so the chain is one data prime plus the special prime TenSEAL/SEAL needs for its key
material:

* ``poly_modulus_degree = 4096`` (2048 slots), ``coeff_mod_bit_sizes = (56, 40)``: 96 bits,
  within the 109 bits the HE standard allows at degree 4096 for 128-bit security (degree
  2048 would allow 54 bits, but TenSEAL refuses a context without key switching);
* scale ``2^36``; head-room ``|sum_i w_i v_i| < 2^(56 - 36 - 1) = 2^19`` per slot
  (``CKKSSumPublicKey.headroom``; ``encrypt`` refuses a single ``|w v|`` beyond it, the
  coordinator cannot see sums, so clip updates to keep ``sum_i w_i |v_i|`` below it);
* ~30 bytes per parameter on the wire (a fresh ciphertext at one 56-bit level, SEAL's
  compressed serialisation), against ~100 for the default context;
* error: pre-scaling makes the absolute error of ``sum_i w_i v_i`` independent of the
  weights; measured ~5e-7 absolute after adding 100 clients with ``|w_i v_i|`` up to 600
  (``tests/test_ckks_sum.py`` checks < 1e-5), i.e. ~1e-11 on the mean update once divided by
  the total weight. A ciphertext that was *not* pre-scaled (``weight=1``) is multiplied by
  its integer weight with doublings and additions (no level consumed; error grows by the
  weight).

Symmetric-key encryption (not used for clients): SEAL can encrypt with the secret key,
which lets it replace the uniformly random half of a fresh ciphertext by a seed and so
halves its size (~15 bytes per parameter here). It needs the *secret* key at the encrypting
party. In SenseShield's threat model only the key server holds the secret key; the clients
hold the public context. A client able to encrypt symmetrically could also decrypt every
other client's update (e.g. ciphertexts it sees at or through the coordinator), defeating
the point of encrypting. It is therefore not applicable to client updates; it would only fit
a deployment where the encrypting party is also the only decrypting party (e.g. the key
server re-encrypting its own data), which SenseShield does not have.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


class _Tenseal:
    """``tenseal``, imported when a CKKS key is first used (a service that never meets CKKS
    does not load it)."""

    def __getattr__(self, name: str) -> Any:
        import tenseal

        return getattr(tenseal, name)


ts = _Tenseal()

from senseshield.errors import ConfigError, ProtocolError
from senseshield.he.base import (
    SCHEMES,
    CipherPart,
    EncryptedVector,
    PlainPart,
    PublicKey,
    Scheme,
    SecretKey,
    check_values,
    check_weight,
    short_hash,
)
from senseshield.he.encoding import check_sorted, read_header, union_positions

__all__ = [
    "DEFAULT_COEFF_MOD_BIT_SIZES",
    "DEFAULT_POLY_MODULUS_DEGREE",
    "DEFAULT_SCALE_BITS",
    "MAX_COEFF_MODULUS_BITS_128",
    "SUM_COEFF_MOD_BIT_SIZES",
    "SUM_POLY_MODULUS_DEGREE",
    "SUM_SCALE_BITS",
    "CKKSPublicKey",
    "CKKSScheme",
    "CKKSSecretKey",
    "CKKSSumPublicKey",
    "CKKSSumScheme",
    "CKKSSumSecretKey",
    "PrescaledVector",
]

DEFAULT_POLY_MODULUS_DEGREE = 8192
DEFAULT_COEFF_MOD_BIT_SIZES: tuple[int, ...] = (60, 40, 40, 60)
DEFAULT_SCALE_BITS = 40
MAX_COEFF_MODULUS_BITS_128: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}
"""Max total coefficient-modulus bits for 128-bit security (HE standard 2018, as in SEAL)."""
MAX_WEIGHT = 2**31
"""Largest integer weight :meth:`CKKSPublicKey.aggregate` accepts (sample counts)."""

_WIRE_MAGIC = b"SSCK"
_WIRE_VERSION = 1
# magic, version, key id (8 raw bytes), value count, chunk count
_WIRE_HEADER = struct.Struct(">4sB8sQI")
_CHUNK_LEN = struct.Struct(">Q")


def _serialise_context(context: ts.Context, *, secret: bool) -> bytes:
    return context.serialize(
        save_public_key=True,
        save_secret_key=secret,
        save_galois_keys=False,
        save_relin_keys=False,
    )


def _context_params(context: ts.Context) -> dict[str, Any]:
    """Read the CKKS parameters back from a (loaded) context; ProtocolError if not CKKS."""
    seal = context.seal_context().data
    key_data = seal.key_context_data()
    parms = key_data.parms()
    if parms.scheme().name != "CKKS":
        raise ProtocolError(f"Context is for {parms.scheme().name}, not CKKS.")
    chain: list[int] = []
    level = seal.first_context_data()
    while level is not None:
        chain.append(int(level.total_coeff_modulus_bit_count()))
        level = level.next_context_data()
    try:
        scale = float(context.global_scale)
    except Exception as exc:  # TenSEAL raises if no global scale was set
        raise ProtocolError(f"CKKS context has no global scale: {exc}") from None
    if not scale > 1.0:
        raise ProtocolError(f"CKKS context has global scale {scale}; it must be > 1.")
    degree = int(parms.poly_modulus_degree())
    return {
        "poly_modulus_degree": degree,
        "slots": degree // 2,
        "coeff_modulus_bits": int(key_data.total_coeff_modulus_bit_count()),
        "data_levels_bits": chain,
        "global_scale": scale,
    }


def _chunk_sizes(count: int, slots: int) -> list[int]:
    return [min(slots, count - start) for start in range(0, count, slots)]


def _nbytes(chunks: Sequence[ts.CKKSVector]) -> int:
    return sum(len(chunk.serialize()) for chunk in chunks)


def _make_context(
    params: dict[str, Any],
    *,
    degree: int,
    sizes: Sequence[int],
    scale_bits: int,
    min_primes: int,
    why: str,
) -> ts.Context:
    """A secret TenSEAL CKKS context from ``params`` (defaults given), validated against the
    128-bit security table and the scale; raises :class:`ConfigError`."""
    allowed = {"poly_modulus_degree", "coeff_mod_bit_sizes", "scale_bits"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigError(
            f"Unknown CKKS parameter(s) {', '.join(unknown)}; use {', '.join(sorted(allowed))}."
        )
    degree = params.get("poly_modulus_degree", degree)
    sizes = params.get("coeff_mod_bit_sizes", sizes)
    scale_bits = params.get("scale_bits", scale_bits)
    if isinstance(degree, bool) or degree not in MAX_COEFF_MODULUS_BITS_128:
        raise ConfigError(
            f"poly_modulus_degree is {degree!r}; choose one of "
            f"{', '.join(map(str, MAX_COEFF_MODULUS_BITS_128))}."
        )
    try:
        sizes = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise ConfigError(f"coeff_mod_bit_sizes is {sizes!r}; give a list of ints.") from None
    if len(sizes) < min_primes or not all(17 <= s <= 60 for s in sizes):
        raise ConfigError(
            f"coeff_mod_bit_sizes is {sizes}; give at least {min_primes} primes of 17..60 bits "
            f"({why})."
        )
    limit = MAX_COEFF_MODULUS_BITS_128[int(degree)]
    if sum(sizes) > limit:
        raise ConfigError(
            f"coeff_mod_bit_sizes sum to {sum(sizes)} bits; 128-bit security allows at most "
            f"{limit} for poly_modulus_degree {degree} (HE standard, SEAL)."
        )
    if isinstance(scale_bits, bool) or not isinstance(scale_bits, (int, np.integer)):
        raise ConfigError(f"scale_bits is {scale_bits!r}; give an integer.")
    if not 10 <= int(scale_bits) < sizes[0]:
        raise ConfigError(
            f"scale_bits is {scale_bits}; choose 10..{sizes[0] - 1} (below the first prime)."
        )
    try:
        context = ts.context(
            ts.SCHEME_TYPE.CKKS, poly_modulus_degree=int(degree), coeff_mod_bit_sizes=sizes
        )
    except ValueError as exc:
        raise ConfigError(f"TenSEAL refused the CKKS parameters: {exc}") from None
    context.global_scale = 2.0 ** int(scale_bits)
    return context


class CKKSPublicKey(PublicKey):
    """A public TenSEAL CKKS context (public key only; no secret, relin or Galois keys).

    ``to_bytes()`` is exactly the serialised public context; the key id is
    ``short_hash(those bytes)``, so every party that loaded the same bytes agrees on it.
    """

    scheme: ClassVar[str] = "ckks"
    ragged_masks: ClassVar[bool] = False
    _min_data_levels: ClassVar[int] = 2  # the weighting multiply needs one rescale

    def __init__(self, data: bytes) -> None:
        data = bytes(data)
        try:
            context = ts.context_from(data)
        except Exception as exc:
            raise ProtocolError(f"Malformed CKKS public context: {exc}") from None
        if context.has_secret_key():
            raise ProtocolError(
                "The CKKS context contains the secret key; a public key must not (use "
                "CKKSSecretKey.public_key.to_bytes())."
            )
        if not context.has_public_key():
            raise ProtocolError("The CKKS context has no public key.")
        self._params = _context_params(context)
        if len(self._params["data_levels_bits"]) < self._min_data_levels:
            raise ProtocolError(
                f"The {self.scheme} context needs at least {self._min_data_levels} data "
                "level(s)."
            )
        self._context = context
        self._bytes = data
        self._slots = int(self._params["slots"])
        self._key_id = short_hash(data)

    @property
    def key_id(self) -> str:
        return self._key_id

    @property
    def slots(self) -> int:
        """Values per ciphertext chunk (``poly_modulus_degree / 2``)."""
        return self._slots

    @property
    def params(self) -> dict[str, Any]:
        """Degree, slots, total modulus bits, bits per level, global scale."""
        return dict(self._params)

    @property
    def context(self) -> ts.Context:
        """The public TenSEAL context (for advanced use; holds no secret)."""
        return self._context

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(poly_modulus_degree={self._params['poly_modulus_degree']}, "
            f"key_id={self._key_id!r})"
        )

    def __reduce__(self) -> Any:
        return (type(self), (self._bytes,))

    def encrypt(self, values: np.ndarray, positions: np.ndarray) -> EncryptedVector:
        """Pack ``values`` in order into ``ceil(len / slots)`` CKKS vectors."""
        values, positions = check_values(values, positions)
        slots = self._slots
        try:
            chunks = [
                ts.ckks_vector(self._context, values[start : start + slots].tolist())
                for start in range(0, values.size, slots)
            ]
        except Exception as exc:  # SEAL refuses values too large for the modulus
            raise ValueError(f"CKKS encryption failed: {exc}") from None
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=chunks,
            nbytes=_nbytes(chunks),
        )

    def _check_layout(self, vector: EncryptedVector, where: str) -> np.ndarray:
        positions = np.asarray(vector.positions, dtype=np.int64).ravel()
        expected = _chunk_sizes(positions.size, self._slots)
        try:
            sizes = [int(chunk.size()) for chunk in vector.payload]
        except Exception:
            raise ProtocolError(f"{where} does not hold CKKS vectors.") from None
        if sizes != expected:
            raise ProtocolError(
                f"{where} has chunks of sizes {sizes} for {positions.size} positions; "
                f"expected {expected}."
            )
        return positions

    def aggregate(
        self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray
    ) -> EncryptedVector:
        """``sum_i w_i * E(v_i)`` chunk by chunk; all ciphertexts must be over ``positions``."""
        union = union_positions(positions)
        cipher: list[tuple[list[ts.CKKSVector], int]] = []
        for k, part in enumerate(parts):
            if isinstance(part, CipherPart):
                weight = check_weight(part.weight, k, limit=MAX_WEIGHT, why="the CKKS weight limit")
                self.check(part.vector)
                vpos = self._check_layout(part.vector, f"Ciphertext part {k}")
                if not np.array_equal(vpos, union):
                    diff = np.setxor1d(vpos, union)
                    raise ProtocolError(
                        f"Ciphertext part {k} encrypts {vpos.size} positions but the aggregate "
                        f"has {union.size}; they differ first at position {int(diff[0])}. "
                        "CKKS packing needs every contributor to encrypt the same positions."
                    )
                cipher.append((list(part.vector.payload), weight))
            elif isinstance(part, PlainPart):
                check_weight(part.weight, k, limit=MAX_WEIGHT, why="the CKKS weight limit")
                ppos = np.asarray(part.positions, dtype=np.int64).ravel()
                inside = np.isin(ppos, union)
                if np.any(inside):
                    raise ProtocolError(
                        f"Plaintext part {k} contributes position {int(ppos[np.argmax(inside)])} "
                        "inside the encrypted positions; CKKS (ragged_masks=False) needs every "
                        "contributor to encrypt them."
                    )
            else:
                raise ProtocolError(
                    f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart."
                )
        if union.size and not cipher:
            raise ProtocolError(
                f"Position {int(union[0])} is not covered by any ciphertext part."
            )
        scale_all = any(weight != 1 for _, weight in cipher)
        out: list[ts.CKKSVector] = []
        try:
            for c in range(len(_chunk_sizes(union.size, self._slots))):
                first, weight = cipher[0]
                acc = first[c] * weight if scale_all else first[c].copy()
                for chunks, weight in cipher[1:]:
                    acc.add_(chunks[c] * weight if scale_all else chunks[c])
                out.append(acc)
        except (ValueError, RuntimeError) as exc:  # e.g. fresh ciphertexts mixed with aggregates
            raise ProtocolError(f"CKKS aggregation failed: {exc}") from None
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=union.copy(),
            payload=out,
            nbytes=_nbytes(out),
        )

    def to_bytes(self) -> bytes:
        return self._bytes

    @classmethod
    def from_bytes(cls, data: bytes) -> "CKKSPublicKey":
        return cls(data)

    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """Self-contained wire format (big-endian)::

            "SSCK" | version u8 | key id (8 bytes) | count u64 | chunks u32
            | count x position i64 | chunks x (length u64 | TenSEAL CKKSVector bytes)
        """
        self.check(vector)
        positions = self._check_layout(vector, "Ciphertext")
        blobs = [chunk.serialize() for chunk in vector.payload]
        parts = [
            _WIRE_HEADER.pack(
                _WIRE_MAGIC, _WIRE_VERSION, bytes.fromhex(self._key_id), positions.size, len(blobs)
            ),
            positions.astype(">i8").tobytes(),
        ]
        for blob in blobs:
            parts.append(_CHUNK_LEN.pack(len(blob)))
            parts.append(blob)
        return b"".join(parts)

    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        """Inverse of :meth:`ciphertext_bytes`; raises ProtocolError on malformed input."""
        data = bytes(data)
        hsize = _WIRE_HEADER.size
        _, _, _, count, nchunks = read_header(data, _WIRE_HEADER, _WIRE_MAGIC, (_WIRE_VERSION,), self._key_id,
                                              "CKKS ciphertext")
        offset = hsize + 8 * count
        if len(data) < offset:
            raise ProtocolError(f"CKKS ciphertext is truncated ({len(data)} bytes).")
        if nchunks != -(-count // self._slots):
            raise ProtocolError(
                f"CKKS ciphertext announces {nchunks} chunks for {count} values; expected "
                f"{-(-count // self._slots)}."
            )
        sizes = _chunk_sizes(count, self._slots)
        positions = check_sorted(np.frombuffer(data, dtype=">i8", count=count, offset=hsize).astype(np.int64),
                                 "Ciphertext positions must be sorted, unique and non-negative.")
        chunks: list[ts.CKKSVector] = []
        for i, size in enumerate(sizes):
            if len(data) < offset + _CHUNK_LEN.size:
                raise ProtocolError(f"CKKS ciphertext is truncated in chunk {i}.")
            (length,) = _CHUNK_LEN.unpack_from(data, offset)
            offset += _CHUNK_LEN.size
            if len(data) < offset + length:
                raise ProtocolError(f"CKKS ciphertext is truncated in chunk {i}.")
            try:
                chunk = ts.ckks_vector_from(self._context, data[offset : offset + length])
            except Exception as exc:
                raise ProtocolError(f"Malformed CKKS chunk {i}: {exc}") from None
            if chunk.size() != size:
                raise ProtocolError(f"CKKS chunk {i} holds {chunk.size()} values, not {size}.")
            chunks.append(chunk)
            offset += length
        if offset != len(data):
            raise ProtocolError(f"CKKS ciphertext has {len(data) - offset} trailing bytes.")
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=chunks,
            nbytes=offset - hsize - 8 * count - _CHUNK_LEN.size * nchunks,
        )


class CKKSSecretKey(SecretKey):
    """The full (private) TenSEAL context: key server only.

    Never pickles or copies (``SecretKeyExportError``), serialises only through
    ``to_bytes(include_secret=True)``; ``repr`` shows the key id only.
    """

    scheme: ClassVar[str] = "ckks"
    _public_class: ClassVar[type[CKKSPublicKey]] = CKKSPublicKey

    def __init__(self, context: ts.Context) -> None:
        if not context.has_secret_key():
            raise ConfigError("A CKKSSecretKey needs a context that holds the secret key.")
        public = context.copy()
        public.make_context_public()
        self._public = self._public_class(_serialise_context(public, secret=False))
        self.__context = context

    @property
    def public_key(self) -> CKKSPublicKey:
        return self._public

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_id={self._public.key_id!r})"

    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:  # one thread
        self._public.check(vector)
        positions = self._public._check_layout(vector, "Ciphertext")
        secret = self.__context.secret_key()
        values: list[float] = []
        try:
            for chunk in vector.payload:
                values.extend(chunk.decrypt(secret))
        except Exception as exc:
            raise ProtocolError(f"CKKS decryption failed: {exc}") from None
        out = np.asarray(values, dtype=np.float64)
        if out.size != positions.size:
            raise ProtocolError(f"Decrypted {out.size} values for {positions.size} positions.")
        return out

    def _export(self) -> bytes:
        return _serialise_context(self.__context, secret=True)

    @classmethod
    def _import(cls, data: bytes) -> "CKKSSecretKey":
        try:
            context = ts.context_from(bytes(data))
        except Exception as exc:
            raise ProtocolError(f"Malformed CKKS secret context: {exc}") from None
        if not context.has_secret_key():
            raise ProtocolError("The CKKS context holds no secret key.")
        _context_params(context)
        return cls(context)


@SCHEMES.register("ckks")
class CKKSScheme(Scheme):
    """CKKS packing (``ragged_masks = False``: all contributors encrypt the same positions).

    ``generate(poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 40, 40, 60), scale_bits=40)``.
    """

    name: ClassVar[str] = "ckks"
    public_key_class: ClassVar[type[PublicKey]] = CKKSPublicKey
    secret_key_class: ClassVar[type[SecretKey]] = CKKSSecretKey
    ragged_masks: ClassVar[bool] = False
    exact: ClassVar[bool] = False
    description: ClassVar[str] = (
        "CKKS via TenSEAL: degree 8192 (4096 slots), modulus 60-40-40-60 bits, scale 2^40, "
        "128-bit security; approximate (~1e-6 relative), shared masks only."
    )

    defaults: ClassVar[dict[str, Any]] = {
        "poly_modulus_degree": DEFAULT_POLY_MODULUS_DEGREE,
        "coeff_mod_bit_sizes": list(DEFAULT_COEFF_MOD_BIT_SIZES),
        "scale_bits": DEFAULT_SCALE_BITS,
    }

    @classmethod
    def generate(cls, **params: Any) -> CKKSSecretKey:
        """New key. ``poly_modulus_degree``, ``coeff_mod_bit_sizes`` (>= 3 primes: the
        weighting needs one rescaling level), ``scale_bits``."""
        context = _make_context(
            params,
            degree=DEFAULT_POLY_MODULUS_DEGREE,
            sizes=DEFAULT_COEFF_MOD_BIT_SIZES,
            scale_bits=DEFAULT_SCALE_BITS,
            min_primes=3,
            why="the weighting needs one rescaling level",
        )
        return CKKSSecretKey(context)



# --------------------------------------------------------------------------- sum-only CKKS

SUM_POLY_MODULUS_DEGREE = 4096
"""Ring degree of ``ckks-sum``: 2048 slots per ciphertext."""
SUM_COEFF_MOD_BIT_SIZES: tuple[int, ...] = (56, 40)
"""One 56-bit data prime + the 40-bit special prime: 96 <= 109 bits (128-bit security)."""
SUM_SCALE_BITS = 36
"""Scale 2^36: |sum_i w_i v_i| must stay below 2^(56 - 36 - 1) = 2^19."""


@dataclass
class PrescaledVector(EncryptedVector):
    """A ``ckks-sum`` ciphertext of ``weight * values`` (the client pre-scaled by its
    integer sample count, so the coordinator only adds). Aggregates have ``weight = 1``."""

    weight: int = 1


def _prescale_weight(value: Any, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    weight = int(value)
    if not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"{what} is {weight}; choose 1..{MAX_WEIGHT}.")
    return weight


def _times(chunk: ts.CKKSVector, weight: int) -> ts.CKKSVector:
    """``weight * chunk`` by doubling and adding: no plaintext multiply, no rescale, so no
    level is consumed (the noise grows by at most ``weight``)."""
    result: ts.CKKSVector | None = None
    base = chunk
    while True:
        if weight & 1:
            result = base.copy() if result is None else result + base
        weight >>= 1
        if not weight:
            break
        base = base + base
    assert result is not None
    return result


class CKKSSumPublicKey(CKKSPublicKey):
    """Public context of the sum-only CKKS variant ``"ckks-sum"`` (see the section below).

    Differs from :class:`CKKSPublicKey` in three ways: one data prime (no rescaling level),
    :meth:`encrypt` takes ``weight=`` and encrypts ``weight * values`` (the client pre-scales),
    and :meth:`aggregate` only adds.
    """

    scheme: ClassVar[str] = "ckks-sum"
    ragged_masks: ClassVar[bool] = False
    _min_data_levels: ClassVar[int] = 1

    @property
    def headroom(self) -> float:
        """Bound on ``|sum_i w_i v_i|`` per slot: ``2^(data bits - scale bits - 1)``."""
        data_bits = int(self._params["data_levels_bits"][0])
        scale_bits = math.log2(float(self._params["global_scale"]))
        return 2.0 ** (data_bits - scale_bits - 1)

    def encrypt(  # type: ignore[override]
        self, values: np.ndarray, positions: np.ndarray, *, weight: int = 1
    ) -> PrescaledVector:
        """Encrypt ``weight * values`` (pre-scaling by the client's sample count).

        Raises ``ValueError`` if ``|weight * v|`` reaches :attr:`headroom`.
        """
        weight = _prescale_weight(weight, "weight")
        values, positions = check_values(values, positions)
        scaled = values * weight
        if scaled.size and float(np.max(np.abs(scaled))) >= self.headroom:
            i = int(np.argmax(np.abs(scaled)))
            raise ValueError(
                f"Value at position {int(positions[i])} times weight {weight} is {scaled[i]:g}; "
                f"{self.scheme} holds magnitudes below {self.headroom:g}."
            )
        plain = super().encrypt(scaled, positions)
        return PrescaledVector(
            scheme=plain.scheme,
            key_id=plain.key_id,
            positions=plain.positions,
            payload=plain.payload,
            nbytes=plain.nbytes,
            weight=weight,
        )

    def aggregate(
        self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray
    ) -> PrescaledVector:
        """``sum_i w_i E(v_i)`` by additions only.

        A ciphertext pre-scaled by its client (``vector.weight == part.weight``) is added as
        is; an unscaled one (``vector.weight == 1``) is multiplied by the integer weight with
        additions (:func:`_times`); any other mismatch is a :class:`ProtocolError`. Every
        contributor must encrypt exactly ``positions`` (``ragged_masks = False``).
        """
        union = union_positions(positions)
        cipher: list[tuple[list[ts.CKKSVector], int]] = []
        for k, part in enumerate(parts):
            if isinstance(part, CipherPart):
                weight = check_weight(part.weight, k, limit=MAX_WEIGHT, why="the CKKS weight limit")
                vector = part.vector
                self.check(vector)
                vpos = self._check_layout(vector, f"Ciphertext part {k}")
                if not np.array_equal(vpos, union):
                    raise ProtocolError(
                        f"Ciphertext part {k} encrypts {vpos.size} positions but the aggregate "
                        f"has {union.size}; {self.scheme} needs every contributor to encrypt the "
                        "same positions."
                    )
                prescaled = int(getattr(vector, "weight", 1))
                if prescaled == weight:
                    factor = 1
                elif prescaled == 1:
                    factor = weight
                else:
                    raise ProtocolError(
                        f"Ciphertext part {k} was pre-scaled by {prescaled} but is aggregated "
                        f"with weight {weight}; they must match."
                    )
                cipher.append((list(vector.payload), factor))
            elif isinstance(part, PlainPart):
                check_weight(part.weight, k, limit=MAX_WEIGHT, why="the CKKS weight limit")
                ppos = np.asarray(part.positions, dtype=np.int64).ravel()
                inside = np.isin(ppos, union)
                if np.any(inside):
                    raise ProtocolError(
                        f"Plaintext part {k} contributes position {int(ppos[np.argmax(inside)])} "
                        f"inside the encrypted positions; {self.scheme} (ragged_masks=False) "
                        "needs every contributor to encrypt them."
                    )
            else:
                raise ProtocolError(
                    f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart."
                )
        if union.size and not cipher:
            raise ProtocolError(f"Position {int(union[0])} is not covered by any ciphertext part.")
        out: list[ts.CKKSVector] = []
        try:
            for c in range(len(_chunk_sizes(union.size, self._slots))):
                acc: ts.CKKSVector | None = None
                for chunks, factor in cipher:
                    term = chunks[c] if factor == 1 else _times(chunks[c], factor)
                    if acc is None:
                        acc = term.copy() if term is chunks[c] else term
                    else:
                        acc.add_(term)
                assert acc is not None
                out.append(acc)
        except (ValueError, RuntimeError) as exc:
            raise ProtocolError(f"CKKS aggregation failed: {exc}") from None
        return PrescaledVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=union.copy(),
            payload=out,
            nbytes=_nbytes(out),
            weight=1,
        )

    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """``"SSCW" | pre-scale weight u64 |`` the :class:`CKKSPublicKey` wire format."""
        weight = _prescale_weight(getattr(vector, "weight", 1), "The vector's weight")
        return _SUM_PREFIX.pack(_SUM_MAGIC, weight) + super().ciphertext_bytes(vector)

    def vector_from_bytes(self, data: bytes) -> PrescaledVector:
        data = bytes(data)
        if len(data) < _SUM_PREFIX.size:
            raise ProtocolError(f"{self.scheme} ciphertext of {len(data)} bytes is truncated.")
        magic, weight = _SUM_PREFIX.unpack_from(data)
        if magic != _SUM_MAGIC:
            raise ProtocolError(f"Not a SenseShield {self.scheme} ciphertext (bad magic).")
        try:
            weight = _prescale_weight(weight, "The ciphertext's weight")
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        plain = super().vector_from_bytes(data[_SUM_PREFIX.size :])
        return PrescaledVector(
            scheme=plain.scheme,
            key_id=plain.key_id,
            positions=plain.positions,
            payload=plain.payload,
            nbytes=plain.nbytes,
            weight=weight,
        )


_SUM_MAGIC = b"SSCW"
_SUM_PREFIX = struct.Struct(">4sQ")


class CKKSSumSecretKey(CKKSSecretKey):
    """Secret context of ``"ckks-sum"`` (key server only); decrypts like :class:`CKKSSecretKey`."""

    scheme: ClassVar[str] = "ckks-sum"
    _public_class: ClassVar[type[CKKSPublicKey]] = CKKSSumPublicKey

    @property
    def public_key(self) -> CKKSSumPublicKey:
        return self._public  # type: ignore[return-value]


@SCHEMES.register("ckks-sum")
class CKKSSumScheme(Scheme):
    """Sum-only CKKS (``ragged_masks = False``): clients pre-scale, the coordinator adds.

    ``generate(poly_modulus_degree=4096, coeff_mod_bit_sizes=(56, 40), scale_bits=36)``.
    """

    name: ClassVar[str] = "ckks-sum"
    public_key_class: ClassVar[type[PublicKey]] = CKKSSumPublicKey
    secret_key_class: ClassVar[type[SecretKey]] = CKKSSumSecretKey
    ragged_masks: ClassVar[bool] = False
    exact: ClassVar[bool] = False
    description: ClassVar[str] = (
        "Sum-only CKKS via TenSEAL: degree 4096 (2048 slots), one 56-bit data prime + 40-bit "
        "special prime, scale 2^36, 128-bit security; clients pre-scale by their weight, the "
        "coordinator only adds (~30 B/param); shared masks only."
    )

    defaults: ClassVar[dict[str, Any]] = {
        "poly_modulus_degree": SUM_POLY_MODULUS_DEGREE,
        "coeff_mod_bit_sizes": list(SUM_COEFF_MOD_BIT_SIZES),
        "scale_bits": SUM_SCALE_BITS,
    }

    @classmethod
    def generate(cls, **params: Any) -> CKKSSumSecretKey:
        """New key. ``poly_modulus_degree``, ``coeff_mod_bit_sizes`` (>= 2 primes: one data
        prime and the special prime TenSEAL needs), ``scale_bits``."""
        context = _make_context(
            params,
            degree=SUM_POLY_MODULUS_DEGREE,
            sizes=SUM_COEFF_MOD_BIT_SIZES,
            scale_bits=SUM_SCALE_BITS,
            min_primes=2,
            why="one data prime and the special prime",
        )
        return CKKSSumSecretKey(context)
