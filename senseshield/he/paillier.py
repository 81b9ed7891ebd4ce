"""Per-value Paillier encryption, the paper-faithful scheme (SenseCrypt sec. 3.3, App. I).

Built on python-paillier (``phe``, accelerated by gmpy2): key generation, the randomised
encryption ``public_key.raw_encrypt`` (obfuscator ``r^n mod n^2`` with ``r`` drawn from
:class:`random.SystemRandom`, a CSPRNG) and the CRT decryption ``private_key.raw_decrypt``.
Everything else (the fixed-point encoding, the weighted mixed ciphertext/plaintext
aggregation, the wire format) is implemented here.

Keys
----
The modulus ``n = p q`` has :data:`DEFAULT_KEY_BITS` = 2048 bits by default: NIST SP 800-57
Part 1 Rev. 5 (Table 2) rates a 2048-bit factoring modulus at ~112 bits of security
(acceptable through 2030), and 2048 bits is the key size the SenseCrypt paper uses. Smaller
moduli (at least :data:`MIN_KEY_BITS` = 512, for fast tests) are accepted but emit an
:class:`InsecureKeyWarning`; they are not secure.

Encoding
--------
A float ``v`` becomes the integer ``m = round(v * 2**precision_bits)`` (round half to even;
``precision_bits`` defaults to :data:`DEFAULT_PRECISION_BITS` = 40, i.e. a resolution of
2**-40 ~ 9.1e-13). Negative ``m`` is represented as ``n - |m|``; decoding reads a plaintext
``r > n // 2`` as ``r - n``. One ciphertext (a Python ``int`` in ``[1, n^2)``) per value.

Homomorphic invariants (``g = n + 1``)::

    D(E(a) * E(b) mod n^2)         = a + b        (mod n)
    D(E(a)^k mod n^2)              = k * a        (mod n)
    D(E(a) * (1 + n*m) mod n^2)    = a + m        (mod n)   since g^m = 1 + n*m mod n^2

so :meth:`PaillierPublicKey.aggregate` computes, per position ``x`` of the union mask,
``prod_i E(v_ix)^{w_i} * (1 + n * sum_j w_j m_jx)``, whose decryption is the FedAvg numerator
``sum_i w_i v_ix + sum_j w_j p_jx`` in fixed point; :meth:`PaillierSecretKey.decrypt` returns
it divided by ``2**precision_bits`` (the caller divides by the total weight).

Headroom
--------
The decoded sum is only correct while ``|sum_i w_i m_i| < n / 2`` (else it wraps around mod
``n``). With a 2048-bit key and 40 fractional bits that leaves ~2**2006 for
``|value| * total_weight``, so overflow needs absurd inputs. :meth:`aggregate` checks the
plaintext contributions cheaply (``ceil(max |p|) * 2**precision_bits * total_weight < n / 2``)
and raises :class:`~senseshield.errors.ProtocolError` otherwise; it cannot see the values
inside ciphertexts: there the client-side clipping of updates (and the per-value check of
:meth:`PaillierPublicKey.encrypt`, ``|m| <= n // 2``) is what protects the sum.

What the encoding leaks
-----------------------
Paillier is IND-CPA under the decisional composite residuosity assumption, so ciphertexts
hide the values. They do not hide *which* positions are encrypted nor *how many* (one
ciphertext per value, positions travel in the clear), nor the key size. A union position
must be covered by at least one ciphertext: a position with only plaintext contributions
would give ``1 + n*m``, which anyone can decode without the key, so it is refused. The
aggregate is not re-randomised; only the key server, which learns the aggregate anyway,
decrypts it.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import gmpy2
import numpy as np
from phe import paillier as _phe

from senseshield.errors import ConfigError, ProtocolError, SecretKeyExportError
from senseshield.he.encoding import (
    check_size,
    check_sorted,
    check_width,
    fixed_point,
    read_ciphertexts,
    read_header,
    union_positions,
)
from senseshield.he.fingerprint import bytes_ints, check, fingerprint, int_bytes, ints_bytes
from senseshield.he.base import (
    CipherPart,
    EncryptedVector,
    PlainPart,
    PublicKey,
    SCHEMES,
    Scheme,
    SecretKey,
    check_public_fields,
    check_values,
    check_weight,
    int_param,
    plain_inside,
    select_units,
    short_hash,
)

__all__ = [
    "DEFAULT_KEY_BITS",
    "DEFAULT_PRECISION_BITS",
    "MIN_KEY_BITS",
    "InsecureKeyWarning",
    "PaillierFamilyKey",
    "PaillierPublicKey",
    "PaillierScheme",
    "PaillierSecretKey",
]

DEFAULT_KEY_BITS = 2048
"""Modulus size: ~112-bit security (NIST SP 800-57 Pt. 1 Rev. 5, Table 2); SenseCrypt's size."""
MIN_KEY_BITS = 512
"""Smallest modulus accepted at all (tests only; warns)."""
SECURE_KEY_BITS = 2048
"""Moduli below this emit :class:`InsecureKeyWarning`."""
DEFAULT_PRECISION_BITS = 40
"""Fractional bits of the fixed-point encoding (resolution 2**-40 ~ 9.1e-13)."""
MAX_PRECISION_BITS = 128

_WIRE_MAGIC = b"SSPV"
_WIRE_VERSION = 1
# magic, version, key id (8 raw bytes), value count, ciphertext width in bytes
_WIRE_HEADER = struct.Struct(">4sB8sQI")


class InsecureKeyWarning(UserWarning):
    """A Paillier modulus below 2048 bits was generated or loaded: fine for tests only."""


def _key_bytes(n: int) -> int:
    return (n.bit_length() + 7) // 8


def check_modulus(n: int) -> None:
    """A Paillier modulus is odd and has at least :data:`MIN_KEY_BITS` bits (:class:`ConfigError`)."""
    if n.bit_length() < MIN_KEY_BITS or n % 2 == 0:
        raise ConfigError(
            f"A Paillier modulus must be odd and have at least {MIN_KEY_BITS} bits; "
            f"got {n.bit_length()} bits."
        )


def check_key_bits(key_bits: Any) -> int:
    """``generate``'s ``key_bits``: an even int of at least :data:`MIN_KEY_BITS` (:class:`ConfigError`)."""
    key_bits = int_param(key_bits, "key_bits")
    if key_bits < MIN_KEY_BITS or key_bits % 2:
        raise ConfigError(
            f"key_bits is {key_bits}; use an even size >= {MIN_KEY_BITS} "
            f"({DEFAULT_KEY_BITS} or more outside tests)."
        )
    return key_bits


def warn_insecure(bits: int, *, stacklevel: int) -> None:
    """:class:`InsecureKeyWarning` for a modulus below :data:`SECURE_KEY_BITS` (``stacklevel``
    as the caller's own ``warnings.warn`` would take it)."""
    if bits < SECURE_KEY_BITS:
        warnings.warn(
            f"A {bits}-bit Paillier modulus is insecure (use >= {SECURE_KEY_BITS} bits outside tests).",
            InsecureKeyWarning,
            stacklevel=stacklevel + 1,
        )


def _locate(union: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of ``positions`` in the sorted ``union`` and which of them are in it at all."""
    if union.size == 0:
        return np.zeros(positions.size, dtype=np.int64), np.zeros(positions.size, dtype=bool)
    idx = np.searchsorted(union, positions)
    inside = idx < union.size
    inside[inside] = union[idx[inside]] == positions[inside]
    return idx, inside


class PaillierFamilyKey(PublicKey):
    """What the Paillier-family public keys (per-value and packed) share: the modulus ``n``,
    its sizes and the key id, the frame of a ciphertext on the wire, and the inputs of the
    key server's fingerprint check (:mod:`senseshield.he.fingerprint`). A subclass sets
    ``_n``, ``_key_bytes``, ``_nsquare`` and ``_key_id``."""

    _n: int
    _key_bytes: int
    _nsquare: Any
    _key_id: str
    verifiable: ClassVar[bool] = True

    @property
    def key_id(self) -> str:
        return self._key_id

    @property
    def n(self) -> int:
        """The public modulus."""
        return self._n

    @property
    def key_bits(self) -> int:
        return self._n.bit_length()

    @property
    def ciphertext_nbytes(self) -> int:
        """Bytes per ciphertext on the wire: an element of Z_{n^2}, ``2 * ceil(bits/8)``."""
        return 2 * self._key_bytes

    def _read_frame(self, data: bytes, header: struct.Struct, magic: bytes, what: str, unit: str) -> tuple[Any, ...]:
        """A frame's header fields (:func:`~senseshield.he.encoding.read_header`; its last field
        the ciphertext width, its fourth the count of ``unit``), with the width and the
        frame's length checked: header, ``count`` i64/u32 pairs of positions or block fields,
        ``count`` ciphertexts."""
        fields = read_header(data, header, magic, (_WIRE_VERSION,), self._key_id, what)
        count, width = fields[3], fields[-1]
        check_width(width, self.ciphertext_nbytes)
        check_size(data, header.size + count * (8 + width), what, count, unit)
        return fields

    def plain_fold(self, aggregate: EncryptedVector) -> bytes:
        return self._fold_bytes(aggregate.meta.get("plain") or [])

    def _fold_bytes(self, plain: Sequence[int]) -> bytes:
        return b"" if not any(plain) else ints_bytes(plain, self._key_bytes)

    def _check_inputs(self, contributions: Sequence[tuple[bytes, int]], plain: bytes,
                      units: int) -> tuple[list[tuple[int, int]], list[int] | None]:
        """:meth:`verify_aggregate`'s fingerprints (as ints, with their weights) and plaintext
        fold (one int per unit, or None), checked for size (:class:`ProtocolError`)."""
        width = 2 * self._key_bytes
        fps = []
        for f, w in contributions:
            if len(f) != width:
                raise ProtocolError(f"A fingerprint has {len(f)} bytes; this key's have {width}.")
            fps.append((int.from_bytes(f, "big"), int(w)))
        try:
            folded = bytes_ints(plain, self._key_bytes, units, "The plaintext fold") if plain else None
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        return fps, folded


class PaillierPublicKey(PaillierFamilyKey):
    """Paillier public key ``n`` (``g = n + 1``) plus the fixed-point ``precision_bits``.

    Encrypts, aggregates and (de)serialises keys and ciphertexts; never decrypts. The key id
    is ``short_hash(n as big-endian bytes)``. ``precision_bits`` is part of the serialised key
    (every party must decode with the same value) but not of the key id.
    """

    scheme: ClassVar[str] = "paillier"
    ragged_masks: ClassVar[bool] = True

    def __init__(self, n: int, precision_bits: int = DEFAULT_PRECISION_BITS) -> None:
        n = int_param(n, "n")
        precision_bits = int_param(precision_bits, "precision_bits")
        check_modulus(n)
        if not 1 <= precision_bits <= MAX_PRECISION_BITS:
            raise ConfigError(
                f"precision_bits is {precision_bits}; choose 1..{MAX_PRECISION_BITS} (default "
                f"{DEFAULT_PRECISION_BITS})."
            )
        warn_insecure(n.bit_length(), stacklevel=3)
        self._phe_key = _phe.PaillierPublicKey(n)
        self._n = n
        self._half = n // 2
        self._nsquare = gmpy2.mpz(n) * n
        self._n_mpz = gmpy2.mpz(n)
        self._precision_bits = precision_bits
        self._key_bytes = _key_bytes(n)
        self._key_id = short_hash(n.to_bytes(self._key_bytes, "big"))

    # -- properties -------------------------------------------------------------------
    @property
    def precision_bits(self) -> int:
        return self._precision_bits

    def __repr__(self) -> str:
        return (
            f"PaillierPublicKey(key_bits={self.key_bits}, precision_bits={self._precision_bits}, "
            f"key_id={self._key_id!r})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PaillierPublicKey)
            and other._n == self._n
            and other._precision_bits == self._precision_bits
        )

    def __hash__(self) -> int:
        return hash((self._n, self._precision_bits))

    # -- encryption -------------------------------------------------------------------
    def encrypt(self, values: np.ndarray, positions: np.ndarray) -> EncryptedVector:
        """One ciphertext per value; ``|round(v * 2**precision_bits)|`` must be ``<= n // 2``."""
        values, positions = check_values(values, positions)
        encoded = fixed_point(values, self._precision_bits)
        if values.size:
            bound = math.ceil(float(np.max(np.abs(values)))) << self._precision_bits
            if bound > self._half:
                for i, m in enumerate(encoded):
                    if abs(m) > self._half:
                        raise ValueError(
                            f"Value at position {int(positions[i])} is {values[i]}; it does not "
                            f"fit a {self.key_bits}-bit Paillier plaintext with "
                            f"{self._precision_bits} fractional bits."
                        )
        n = self._n
        raw_encrypt = self._phe_key.raw_encrypt
        payload = [raw_encrypt(m % n) for m in encoded]
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=payload,
            nbytes=len(payload) * self.ciphertext_nbytes,
        )

    # -- aggregation ------------------------------------------------------------------
    def aggregate(
        self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray
    ) -> EncryptedVector:
        """``prod_i E(v_i)^{w_i} * (1 + n * sum_j w_j m_j) mod n^2`` at every union position.

        Validates everything before any modular arithmetic: keys (``check``), positive
        integer weights, ciphertext positions inside ``positions``, every position covered
        by a ciphertext, finite and unique plaintext values, and the plaintext headroom
        (see the module docstring). Raises :class:`ProtocolError` (or
        :class:`KeyMismatchError`) naming the part or position.
        """
        union = union_positions(positions)
        size = union.size
        nsquare = self._nsquare
        covered = np.zeros(size, dtype=bool)
        cipher_jobs: list[tuple[list[int], list[int], int]] = []
        plain_jobs: list[tuple[np.ndarray, np.ndarray, int]] = []
        total_weight = 0
        max_abs_plain = 0.0

        for k, part in enumerate(parts):
            if isinstance(part, CipherPart):
                weight = check_weight(part.weight, k)
                vector = part.vector
                self.check(vector)
                vpos = np.asarray(vector.positions, dtype=np.int64).ravel()
                payload = vector.payload
                if len(payload) != vpos.size:
                    raise ProtocolError(
                        f"Ciphertext part {k} has {len(payload)} ciphertexts for {vpos.size} "
                        "positions."
                    )
                if vpos.size > 1 and np.any(np.diff(vpos) <= 0):
                    raise ProtocolError(f"Ciphertext part {k} has unsorted or repeated positions.")
                idx, inside = _locate(union, vpos)
                if not np.all(inside):
                    outside = int(vpos[np.argmin(inside)])
                    raise ProtocolError(
                        f"Ciphertext part {k} encrypts position {outside}, which is outside the "
                        "aggregate's positions."
                    )
                for i, c in enumerate(payload):
                    if not (isinstance(c, int) and 0 < c < nsquare):
                        raise ProtocolError(
                            f"Ciphertext part {k} at position {int(vpos[i])} is not an element "
                            "of Z_{n^2}."
                        )
                covered[idx] = True
                cipher_jobs.append((idx.tolist(), payload, weight))
            elif isinstance(part, PlainPart):
                weight = check_weight(part.weight, k)
                job = self._plain_job(part, union, k)
                if job is not None:
                    max_abs_plain = max(max_abs_plain, float(np.max(np.abs(job[1]))))
                    plain_jobs.append(job)
            else:
                raise ProtocolError(
                    f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart."
                )
            total_weight += weight

        if not np.all(covered):
            missing = int(union[np.argmin(covered)])
            raise ProtocolError(
                f"Position {missing} is not covered by any ciphertext part; every aggregated "
                "position needs at least one (a plaintext-only sum would be public)."
            )
        if plain_jobs:
            bound = (math.ceil(max_abs_plain) << self._precision_bits) * total_weight
            if bound > self._half:
                raise ProtocolError(
                    f"Plaintext contributions up to {max_abs_plain:g} with total weight "
                    f"{total_weight} could overflow a {self.key_bits}-bit Paillier plaintext "
                    f"(|sum| * 2**{self._precision_bits} must stay below n/2)."
                )

        plain = self._fold(plain_jobs, size)
        acc: list[Any] = [None] * size
        powmod, mpz = gmpy2.powmod, gmpy2.mpz
        for idx_list, payload, weight in cipher_jobs:
            if weight == 1:
                for j, c in zip(idx_list, payload):
                    a = acc[j]
                    acc[j] = mpz(c) if a is None else a * c % nsquare
            else:
                for j, c in zip(idx_list, payload):
                    t = powmod(c, weight, nsquare)
                    a = acc[j]
                    acc[j] = t if a is None else a * t % nsquare
        n = self._n_mpz
        for j, m in enumerate(plain):
            if m:
                acc[j] = acc[j] * (1 + n * m) % nsquare

        return EncryptedVector(
            meta={"plain": plain},
            scheme=self.scheme,
            key_id=self._key_id,
            positions=union.copy(),
            payload=[int(a) for a in acc],
            nbytes=size * self.ciphertext_nbytes,
        )

    def _plain_job(self, part: PlainPart, union: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Plaintext part ``k`` inside ``union``: (rows of the union, values, weight), checked;
        None if it has no position there."""
        weight = check_weight(part.weight, k)
        inside = plain_inside(part, union, k)
        if inside is None:
            return None
        idx, _, vals = inside
        return idx, vals, weight

    def _fold(self, plain_jobs: Sequence[tuple[np.ndarray, np.ndarray, int]], size: int) -> list[int]:
        """``Σ_j w_j m_j mod n`` per union row: the plaintext folded into each ciphertext."""
        plain = [0] * size
        if not plain_jobs:
            return plain
        plain_sum = np.zeros(size, dtype=object)
        for idx, vals, weight in plain_jobs:
            encoded = np.empty(idx.size, dtype=object)
            encoded[:] = fixed_point(vals, self._precision_bits)
            plain_sum[idx] += encoded * weight
        n = self._n_mpz
        for j in np.flatnonzero(plain_sum != 0).tolist():
            plain[j] = int(plain_sum[j] % n)
        return plain

    def plain_fold_of(self, like: EncryptedVector, parts: Sequence[PlainPart]) -> bytes:
        self.check(like)
        union = np.asarray(like.positions, dtype=np.int64)
        jobs = [job for k, part in enumerate(parts) if (job := self._plain_job(part, union, k)) is not None]
        return self._fold_bytes(self._fold(jobs, union.size))

    def select(self, vector: EncryptedVector, positions: np.ndarray) -> EncryptedVector | None:
        if len(positions) == 0:
            return None
        rows, plain = select_units(vector, positions, np.asarray(vector.positions, dtype=np.int64), 1)
        return EncryptedVector(
            meta={"plain": plain} if plain is not None else {}, scheme=self.scheme, key_id=vector.key_id,
            positions=np.asarray(positions, dtype=np.int64).copy(), payload=[vector.payload[i] for i in rows.tolist()],
            nbytes=int(rows.size) * self.ciphertext_nbytes,
        )

    # -- verification (senseshield.he.fingerprint; units are positions) ---------------------
    def fingerprint(self, vector: EncryptedVector, seed: bytes) -> bytes:
        self.check(vector)
        value = fingerprint(vector.payload, np.asarray(vector.positions).tolist(), seed, int(self._nsquare))
        return int_bytes(value, 2 * self._key_bytes)

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        self.check(aggregate)
        units = np.asarray(aggregate.positions).tolist()
        fps, folded = self._check_inputs(contributions, plain, len(units))
        return check(aggregate.payload, units, seed, self._n, fps, folded)

    # -- serialisation ----------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """JSON ``{"scheme", "n" (hex), "precision_bits"}`` (UTF-8)."""
        return json.dumps(
            {
                "scheme": self.scheme,
                "n": format(self._n, "x"),
                "precision_bits": self._precision_bits,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PaillierPublicKey":
        try:
            obj = json.loads(bytes(data).decode())
            if not isinstance(obj, dict) or obj.get("scheme") != cls.scheme:
                raise ValueError("not a Paillier public key")
            check_public_fields(obj, {"scheme", "n", "precision_bits"}, "Paillier public key")
            n = int(obj["n"], 16)
            precision_bits = obj.get("precision_bits", DEFAULT_PRECISION_BITS)
            return cls(n, precision_bits)
        except ProtocolError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"Malformed Paillier public key: {exc}") from None

    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """Self-contained wire format (big-endian)::

            "SSPV" | version u8 | key id (8 bytes) | count u64 | width u32
            | count x position i64 | count x ciphertext (width bytes, width = 2*key_bytes)
        """
        self.check(vector)
        positions = np.asarray(vector.positions, dtype=np.int64).ravel()
        if len(vector.payload) != positions.size:
            raise ProtocolError(
                f"Ciphertext has {len(vector.payload)} values for {positions.size} positions."
            )
        width = self.ciphertext_nbytes
        header = _WIRE_HEADER.pack(
            _WIRE_MAGIC, _WIRE_VERSION, bytes.fromhex(self._key_id), positions.size, width
        )
        try:
            body = b"".join(int(c).to_bytes(width, "big") for c in vector.payload)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ProtocolError(f"Ciphertext does not fit {width} bytes: {exc}") from None
        return header + positions.astype(">i8").tobytes() + body

    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        """Inverse of :meth:`ciphertext_bytes`; checks sizes, key id and ``0 < c < n^2``."""
        data = bytes(data)
        _, _, _, count, width = self._read_frame(data, _WIRE_HEADER, _WIRE_MAGIC, "Paillier ciphertext", "values")
        hsize = _WIRE_HEADER.size
        positions = check_sorted(np.frombuffer(data, dtype=">i8", count=count, offset=hsize).astype(np.int64),
                                 "Ciphertext positions must be sorted, unique and non-negative.")
        payload = read_ciphertexts(data, hsize + 8 * count, count, width, self._nsquare,
                                   lambda i: f"Ciphertext at position {int(positions[i])}")
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=payload,
            nbytes=count * width,
        )


class _GuardedPrivateKey(_phe.PaillierPrivateKey):
    """phe's CRT private key that refuses to pickle/copy and never prints or hashes p, q."""

    def __reduce__(self) -> Any:
        raise SecretKeyExportError("The Paillier private key does not pickle or copy.")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__reduce__()

    def __repr__(self) -> str:
        return "<Paillier private key>"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class PaillierSecretKey(SecretKey):
    """The primes ``p, q`` (key server only). Decrypts with phe's CRT ``raw_decrypt``.

    Guarantees: never pickles or copies (``SecretKeyExportError``), serialises only through
    ``to_bytes(include_secret=True)``, and ``repr``/``str`` show the key id only. Python has
    no real privacy: code running in the key server's process can still reach the primes.
    """

    scheme: ClassVar[str] = "paillier"

    def __init__(self, p: int, q: int, precision_bits: int = DEFAULT_PRECISION_BITS) -> None:
        p, q = int_param(p, "p"), int_param(q, "q")
        if p == q or p < 3 or q < 3:
            raise ConfigError("Paillier primes p and q must be distinct odd primes.")
        self._public = PaillierPublicKey(p * q, precision_bits)
        self.__private = _GuardedPrivateKey(self._public._phe_key, p, q)

    @property
    def public_key(self) -> PaillierPublicKey:
        return self._public

    def __repr__(self) -> str:
        public = self._public
        return f"PaillierSecretKey(key_bits={public.key_bits}, key_id={public.key_id!r})"

    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:  # one thread
        """Decoded ``m / 2**precision_bits`` as float64, in the order of ``vector.positions``."""
        public = self._public
        public.check(vector)
        positions = np.asarray(vector.positions).ravel()
        payload = vector.payload
        if len(payload) != positions.size:
            raise ProtocolError(
                f"Ciphertext has {len(payload)} values for {positions.size} positions."
            )
        n, half, nsquare = public._n, public._half, public._nsquare
        scale = 1 << public._precision_bits
        raw_decrypt = self.__private.raw_decrypt
        out: list[float] = []
        for i, c in enumerate(payload):
            if not (isinstance(c, int) and 0 < c < nsquare):
                raise ProtocolError(
                    f"Ciphertext at position {int(positions[i])} is not an element of Z_{{n^2}}."
                )
            m = raw_decrypt(c)
            if m > half:
                m -= n
            try:
                out.append(m / scale)
            except OverflowError:
                raise ProtocolError(
                    f"Decrypted value at position {int(positions[i])} exceeds the float64 range."
                ) from None
        return np.asarray(out, dtype=np.float64)

    def _export(self) -> bytes:
        private = self.__private
        return json.dumps(
            {
                "scheme": self.scheme,
                "p": format(private.p, "x"),
                "q": format(private.q, "x"),
                "precision_bits": self._public.precision_bits,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def _import(cls, data: bytes) -> "PaillierSecretKey":
        try:
            obj = json.loads(bytes(data).decode())
            if not isinstance(obj, dict) or obj.get("scheme") != cls.scheme:
                raise ValueError("not a Paillier secret key")
            p, q = int(obj["p"], 16), int(obj["q"], 16)
            precision_bits = obj.get("precision_bits", DEFAULT_PRECISION_BITS)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"Malformed Paillier secret key: {exc}") from None
        if not (gmpy2.is_prime(p) and gmpy2.is_prime(q)):
            raise ProtocolError("Malformed Paillier secret key: p and q must be primes.")
        try:
            return cls(p, q, precision_bits)
        except ConfigError as exc:
            raise ProtocolError(f"Malformed Paillier secret key: {exc}") from None


@SCHEMES.register("paillier")
class PaillierScheme(Scheme):
    """Per-value Paillier (``ragged_masks = True``: every client encrypts its own positions).

    ``generate(key_bits=2048, precision_bits=40)``.
    """

    name: ClassVar[str] = "paillier"
    public_key_class: ClassVar[type[PublicKey]] = PaillierPublicKey
    secret_key_class: ClassVar[type[SecretKey]] = PaillierSecretKey
    ragged_masks: ClassVar[bool] = True
    description: ClassVar[str] = (
        "Per-value Paillier (python-paillier + gmpy2), 2048-bit modulus, 40-bit fixed point; "
        "one ciphertext per encrypted parameter, ragged masks."
    )

    defaults: ClassVar[dict[str, Any]] = {
        "key_bits": DEFAULT_KEY_BITS,
        "precision_bits": DEFAULT_PRECISION_BITS,
    }

    @classmethod
    def generate(cls, **params: Any) -> PaillierSecretKey:
        """New key pair. ``key_bits`` (even, >= 512; < 2048 warns) and ``precision_bits``."""
        unknown = sorted(set(params) - {"key_bits", "precision_bits"})
        if unknown:
            raise ConfigError(
                f"Unknown Paillier parameter(s) {', '.join(unknown)}; use key_bits, precision_bits."
            )
        key_bits = check_key_bits(params.get("key_bits", DEFAULT_KEY_BITS))
        precision_bits = int_param(
            params.get("precision_bits", DEFAULT_PRECISION_BITS), "precision_bits"
        )
        if not 1 <= precision_bits <= MAX_PRECISION_BITS:
            raise ConfigError(
                f"precision_bits is {precision_bits}; choose 1..{MAX_PRECISION_BITS}."
            )
        _, private = _phe.generate_paillier_keypair(n_length=key_bits)
        p, q = private.p, private.q
        del private
        return PaillierSecretKey(p, q, precision_bits)
