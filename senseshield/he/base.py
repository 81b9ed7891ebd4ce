"""The small interface every homomorphic-encryption scheme implements.

Roles follow the dual-server design (SenseCrypt App. I, SelectiveShield sec. 4.5):

* clients hold a :class:`PublicKey` and call :meth:`PublicKey.encrypt` on the values their
  mask selects;
* the coordinator holds the same :class:`PublicKey` and calls :meth:`PublicKey.aggregate`,
  a weighted sum of ciphertexts *and plaintexts* over the union of the clients' masks;
* only the key server holds the :class:`SecretKey` and calls :meth:`SecretKey.decrypt`
  on aggregates.

Invariant every scheme satisfies (tested as a hypothesis property)::

    D(aggregate([(E(v_i), w_i)] + [(p_j, w_j)])) == sum_i w_i v_i + sum_j w_j p_j

per position of the union, exactly up to the scheme's fixed-point encoding.

Positions are indices into the flat parameter vector (see ``senseshield.engine.params``).
A scheme with ``ragged_masks = True`` lets every client encrypt its own positions (per-value
Paillier, block-packed Paillier with block-aligned masks); a scheme with ``ragged_masks =
False`` (CKKS packing) needs every contributor to encrypt the same positions.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError, SecretKeyExportError
from senseshield.registry import Registry


@dataclass
class EncryptedVector:
    """Ciphertext of the values at ``positions`` (sorted, unique int64 indices).

    ``payload`` is scheme specific (list of Paillier integers, TenSEAL vectors, ...);
    ``nbytes`` is its size on the wire. The vector records the ``key_id`` of the public key
    it was made under, and operations under another key raise :class:`KeyMismatchError`.
    """

    scheme: str
    key_id: str
    positions: np.ndarray
    payload: Any
    nbytes: int
    # in memory only, never on the wire: what a verifiable scheme keeps beside the payload
    # (``"openings"`` of a fresh encryption, ``"plain"``: the plaintext folded into each unit
    # of an aggregate), see :mod:`senseshield.he.fingerprint`
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.positions.size)


@dataclass
class PlainPart:
    """Plaintext contribution to an aggregate: ``values`` at ``positions`` times ``weight``."""

    positions: np.ndarray
    values: np.ndarray
    weight: int


@dataclass
class CipherPart:
    """Ciphertext contribution to an aggregate, to be multiplied by ``weight``; ``folded``:
    its encryptor already did (``PublicKey.prefolds_weight``), so it enters once."""

    vector: EncryptedVector
    weight: int
    folded: bool = False


@dataclass(frozen=True)
class SchemeInfo:
    """What a scheme reports about itself (for docs, CLI listings and benchmarks)."""

    name: str
    ragged_masks: bool
    description: str
    params: dict[str, Any] = field(default_factory=dict)


class Accumulator(ABC):
    """A running aggregate (:meth:`PublicKey.accumulator`): parts are added as they arrive and
    :meth:`result` gives what :meth:`PublicKey.aggregate` would give for all of them at once.
    ``key`` orders the parts where order could matter (the generic accumulator sorts by it;
    exact schemes ignore it), so the result does not depend on arrival order."""

    @abstractmethod
    def add(self, part: CipherPart | PlainPart, key: str = "") -> None:
        """Take one part in (checks it now; raises :class:`ProtocolError` for a bad one, which
        then leaves the running aggregate as it was)."""

    @abstractmethod
    def result(self, positions: np.ndarray) -> EncryptedVector:
        """The aggregate at ``positions`` (the union mask), as :meth:`PublicKey.aggregate`."""

    def fold(self, like: EncryptedVector) -> bytes:
        """The plaintext the plaintext parts added so far fold into the units of ``like`` (an
        aggregate under this key), in :meth:`PublicKey.plain_fold`'s bytes: what
        :meth:`result` would fold in, computed by the same code. The key server's
        recomputation adds only plaintext parts and calls this (verifiable schemes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot recompute a plaintext fold.")

    def merge(self, other: "Accumulator") -> None:
        """Take in ``other``'s parts (a running aggregate of other contributors under the same
        key: a site's partial sum), as if each had been added here; :class:`ProtocolError`,
        changing nothing, when the two do not fit. A scheme whose running aggregate cannot
        travel says so."""
        raise ProtocolError(f"{type(self).__name__}: this scheme's running aggregates cannot be folded at a site; "
                            "site aggregation folds the masked scheme, packed Paillier and plaintext.")

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What a partial sum carries of this running aggregate: JSON fields and 1-D arrays,
        read back by :meth:`PublicKey.accumulator_from_state`."""
        raise ProtocolError(f"{type(self).__name__}: this scheme's running aggregates cannot be folded at a site; "
                            "site aggregation folds the masked scheme, packed Paillier and plaintext.")


class PartsAccumulator(Accumulator):
    """The generic accumulator: keeps the parts (memory grows with them) and calls the
    scheme's :meth:`PublicKey.aggregate` in ``key`` order at the end. Schemes whose
    aggregate can run incrementally override :meth:`PublicKey.accumulator`."""

    def __init__(self, public_key: "PublicKey") -> None:
        self.public_key = public_key
        self.parts: list[tuple[str, int, CipherPart | PlainPart]] = []

    def add(self, part: CipherPart | PlainPart, key: str = "") -> None:
        if isinstance(part, CipherPart):
            self.public_key.check(part.vector)
        self.parts.append((key, len(self.parts), part))

    def result(self, positions: np.ndarray) -> EncryptedVector:
        ordered = [part for _, _, part in sorted(self.parts, key=lambda e: (e[0], e[1]))]
        return self.public_key.aggregate(ordered, positions)

    def fold(self, like: EncryptedVector) -> bytes:
        ordered = [part for _, _, part in sorted(self.parts, key=lambda e: (e[0], e[1]))]
        return self.public_key.plain_fold_of(like, [p for p in ordered if isinstance(p, PlainPart)])


class PublicKey(ABC):
    """Public key material: encrypt, aggregate, serialise. Never decrypts.

    ``block_size`` is the mask granularity: a mask must be a union of whole blocks
    ``[k*block_size, (k+1)*block_size)`` (the last block may be partial). Per-value schemes
    use 1; the packed Paillier scheme packs one block per ciphertext, so block k of every
    client holds the same positions and ciphertexts add directly. Mask solvers work on
    block sensitivities (``senseshield.engine.masks.block_scores``) when it is above 1.
    """

    scheme: ClassVar[str]
    ragged_masks: ClassVar[bool]
    ragged_capable: ClassVar[bool] = False
    """A shared-mask scheme that also aggregates per-client masks when the job's strategy gives
    them (the masked scheme; :meth:`for_masks`)."""
    block_size: int = 1
    needs_contributors: ClassVar[bool] = False
    """Decryption needs the contributors' box keys and weights (:meth:`SecretKey.bind_contributions`):
    the masked scheme."""
    verifiable: ClassVar[bool] = False
    """The key server can check an aggregate against the contributors' signed fingerprints
    (:mod:`senseshield.he.fingerprint`): Paillier-family schemes, whose aggregate is a
    product of powers of the contributions' ciphertexts. CKKS is not."""

    def fingerprint(self, vector: EncryptedVector, seed: bytes) -> bytes:
        """The contributor's fingerprint of ``vector`` under a round's challenge ``seed``."""
        raise NotImplementedError(f"{self.scheme} aggregates cannot be verified by fingerprints.")

    def plain_fold(self, aggregate: EncryptedVector) -> bytes:
        """What an aggregate folded in as plaintext, unit by unit, for the key server's check."""
        raise NotImplementedError(f"{self.scheme} aggregates cannot be verified by fingerprints.")

    def plain_fold_of(self, like: EncryptedVector, parts: Sequence[PlainPart]) -> bytes:
        """:meth:`plain_fold` of an aggregate at the units of ``like`` whose plaintext parts
        are ``parts``, computed by :meth:`aggregate`'s own code (schemes whose running
        aggregate is :class:`PartsAccumulator`; the others' accumulators fold themselves)."""
        raise NotImplementedError(f"{self.scheme} aggregates cannot be verified by fingerprints.")

    def unit_weights(self, vector: EncryptedVector) -> np.ndarray | None:
        """The total weight of each unit that an aggregate carries beside its ciphertexts and
        that decryption uses (packed Paillier's block weights, whose offsets it removes);
        None for a scheme without. The key server checks them against the signed counts."""
        return None

    def accumulator_from_state(self, size: int, fields: dict, arrays: dict[str, np.ndarray]) -> Accumulator:
        """The running aggregate :meth:`Accumulator.state` described (a site's partial sum),
        every field checked against this key and ``size``; :class:`ProtocolError` otherwise."""
        raise ProtocolError(f"The {self.scheme} scheme's running aggregates cannot be folded at a site; "
                            "site aggregation folds the masked scheme, packed Paillier and plaintext.")

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        """Whether ``aggregate`` is the product of the fingerprinted contributions (with
        their weights) and the plaintext ``plain`` under ``seed``."""
        raise NotImplementedError(f"{self.scheme} aggregates cannot be verified by fingerprints.")

    @property
    @abstractmethod
    def key_id(self) -> str:
        """Stable short hash of the public material; ciphertexts carry it."""

    # the encryptor multiplies its values by its sample weight (``encrypt(..., weight=n)``), so
    # the coordinator folds its ciphertext with one multiplication instead of an
    # exponentiation; the key server's fingerprint check then takes
    # exponent 1 for it. Accumulators tell a folded part by block weights equal to its weight.
    prefolds_weight: ClassVar[bool] = False

    @abstractmethod
    def encrypt(self, values: np.ndarray, positions: np.ndarray) -> EncryptedVector:
        """Encrypt ``values[i]`` as the value at flat position ``positions[i]``.

        ``values`` must be finite; ``positions`` sorted and unique. Raises ``ValueError``
        (with the offending index) otherwise.
        """

    @abstractmethod
    def aggregate(
        self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray
    ) -> EncryptedVector:
        """Weighted sum of ciphertexts and plaintexts at ``positions`` (the union mask).

        Every ciphertext part's positions must lie inside ``positions``; plaintext parts may
        cover more positions, only those inside ``positions`` are used. Every position of
        ``positions`` must be covered by at least one ciphertext part.
        """

    def accumulator(self, size: int) -> Accumulator:
        """A running aggregate over a model of ``size`` parameters (default: keeps the parts,
        :class:`PartsAccumulator`)."""
        return PartsAccumulator(self)

    def select(self, vector: EncryptedVector, positions: np.ndarray) -> EncryptedVector | None:
        """The part of ``vector`` at ``positions`` (a sorted subset of its own, whole units),
        None if empty: what the key server decrypts when part of an aggregate stays sealed
        (fewer than k encryptors). Schemes whose clients encrypt different positions
        (``ragged_masks``) implement it; the others never need it."""
        raise ProtocolError(f"The {self.scheme} scheme cannot decrypt part of an aggregate.")

    def for_masks(self, per_client: bool) -> "PublicKey":
        """This key as a job uses it: with ``per_client`` masks (the strategy gives each client
        its own) a ``ragged_capable`` scheme's key with ``ragged_masks = True`` (a copy), so
        aggregation, the k rule and the key server treat its masks as per client; otherwise
        the key itself."""
        if not per_client or self.ragged_masks or not self.ragged_capable:
            return self
        import copy

        ragged = copy.copy(self)
        ragged.ragged_masks = True  # type: ignore[misc]
        return ragged

    def for_contributor(self, exchange: Callable[[bytes], bytes], context: bytes, *,
                        ring_bits: int = 64) -> "PublicKey":
        """This key as one contributor encrypts with it in ``context`` (fleet/run/round/cluster).
        ``exchange``: X25519 with the contributor's own box key; ``ring_bits``: the round's
        ring (``RoundPlan.ring_bits``). Public-key schemes need none of them and return the key
        itself; the masked scheme derives the contributor's pads and masks in that ring."""
        return self

    @abstractmethod
    def to_bytes(self) -> bytes:
        """Serialise the public material (safe to publish)."""

    @classmethod
    @abstractmethod
    def from_bytes(cls, data: bytes) -> "PublicKey":
        """Inverse of :meth:`to_bytes`; raises :class:`ProtocolError` on malformed input."""

    @abstractmethod
    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """Serialise a ciphertext for the wire (fixed-width integers, positions, key id)."""

    @abstractmethod
    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        """Inverse of :meth:`ciphertext_bytes`; :class:`ProtocolError` on malformed input and
        :class:`KeyMismatchError` for a ciphertext under another key."""

    def check(self, vector: EncryptedVector) -> None:
        """Raise if ``vector`` was not made by this scheme under this key."""
        if vector.scheme != self.scheme:
            raise ProtocolError(
                f"Ciphertext of scheme {vector.scheme!r} cannot be used with a {self.scheme!r} key."
            )
        if vector.key_id != self.key_id:
            raise KeyMismatchError(
                f"Ciphertext was made under key {vector.key_id!r}, not the current key "
                f"{self.key_id!r}; it is rejected."
            )


class SecretKey(ABC):
    """Secret key material. Lives only in the key server; never pickles by accident."""

    scheme: ClassVar[str]

    @property
    @abstractmethod
    def public_key(self) -> PublicKey: ...

    @abstractmethod
    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:
        """Return the float64 values of ``vector`` in the order of ``vector.positions``
        (``threads``: decryption threads, where the scheme can use them)."""

    def bind_contributions(self, vector: EncryptedVector, contributions: Sequence[tuple[bytes, int]],
                           context: bytes | Sequence[bytes], masks: Sequence[np.ndarray] | None = None) -> None:
        """Name the verified contributors of aggregate ``vector`` before :meth:`decrypt`:
        (box key, weight) each, from their signed receipts, and the context of the round (one,
        or one per contribution: :func:`round_context` with the plan each receipt signs);
        ``masks``: with per-client masks, each one's signed mask (np.packbits), in the same order.
        Public-key schemes decrypt without them (no-op); the masked scheme removes exactly
        these contributors' pads (each only where it masked)."""

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        """:meth:`PublicKey.verify_aggregate`, where the secret may make it faster."""
        return self.public_key.verify_aggregate(aggregate, seed, contributions, plain)

    @abstractmethod
    def _export(self) -> bytes: ...

    @classmethod
    @abstractmethod
    def _import(cls, data: bytes) -> "SecretKey": ...

    def to_bytes(self, *, include_secret: bool = False) -> bytes:
        """Serialise the secret key; refuses unless ``include_secret=True`` is passed."""
        if not include_secret:
            raise SecretKeyExportError(
                "The secret key is only serialised with include_secret=True (key server only)."
            )
        return self._export()

    @classmethod
    def from_bytes(cls, data: bytes) -> "SecretKey":
        return cls._import(data)

    def __reduce__(self) -> Any:  # pickle, copy, multiprocessing
        raise SecretKeyExportError(
            "Secret keys do not pickle; use to_bytes(include_secret=True) in the key server."
        )


class Scheme(ABC):
    """Factory for one HE scheme's key pairs; registered in :data:`SCHEMES` by name."""

    name: ClassVar[str]
    ragged_masks: ClassVar[bool]
    ragged_capable: ClassVar[bool] = False  # per-client masks when the strategy asks (PublicKey.for_masks)
    description: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}  # generate() parameters and their defaults
    # decryption returns exactly what was encrypted (up to the fixed-point encoding); False
    # for CKKS, whose encryption noise moves results by ~1e-8 from run to run
    exact: ClassVar[bool] = True

    @classmethod
    def info(cls) -> SchemeInfo:
        """Name, mask model and the generate() parameters with their defaults."""
        return SchemeInfo(cls.name, cls.ragged_masks, cls.description, dict(cls.defaults))

    @classmethod
    @abstractmethod
    def generate(cls, **params: Any) -> SecretKey:
        """Generate a key pair; the public half is ``secret.public_key``."""

    public_key_class: ClassVar[type[PublicKey]]
    """The scheme's public key type: :meth:`public_key_from_bytes` reads one."""
    secret_key_class: ClassVar[type[SecretKey]]
    """The scheme's secret key type: :meth:`secret_key_from_bytes` reads one."""

    @classmethod
    def public_key_from_bytes(cls, data: bytes) -> PublicKey:
        return cls.public_key_class.from_bytes(data)

    @classmethod
    def secret_key_from_bytes(cls, data: bytes) -> SecretKey:
        return cls.secret_key_class.from_bytes(data)


SCHEMES: Registry[type[Scheme]] = Registry("HE scheme", group="senseshield.schemes")


def job_key(public_key: PublicKey | None, *, per_client_masks: bool) -> PublicKey | None:
    """:meth:`PublicKey.for_masks` of a job's key (None: the job encrypts nothing)."""
    return None if public_key is None else public_key.for_masks(per_client_masks)


def ephemeral_exchange(peer_box: bytes) -> bytes:
    """X25519 with a throw-away key: binds a key for measuring or benchmarking encryption,
    never for a contribution (nobody can remove pads made with it)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    return X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(peer_box))


def select_units(vector: EncryptedVector, positions: np.ndarray, units: np.ndarray,
                 unit_size: int) -> tuple[np.ndarray, list[Any] | None]:
    """Shared check of :meth:`PublicKey.select`: the rows (units of ``vector``, in order, whose
    unit index ``units`` lists; a unit is ``unit_size`` consecutive positions) that hold
    exactly ``positions``, and the folded plaintexts of those rows (``meta["plain"]``).
    :class:`ProtocolError` if ``positions`` are not whole units of the vector."""
    positions = np.asarray(positions, dtype=np.int64)
    wanted = np.unique(positions // unit_size)
    rows = np.searchsorted(units, wanted)
    if np.any(rows >= units.size) or not np.array_equal(units[np.minimum(rows, units.size - 1)], wanted):
        raise ProtocolError("A selection of an aggregate names positions outside it.")
    covered = vector.positions[np.isin(vector.positions // unit_size, wanted)]
    if not np.array_equal(covered, positions):
        raise ProtocolError("A selection of an aggregate must take whole units of it.")
    plain = vector.meta.get("plain")
    return rows, [plain[i] for i in rows.tolist()] if plain is not None else None


def model_digest(weights: np.ndarray) -> str:
    """SHA-256 of a model as devices receive it (float32): what a receipt says it trained from."""
    return hashlib.sha256(np.ascontiguousarray(weights, dtype=np.float32).tobytes()).hexdigest()


def round_context(fleet: str, run_id: str, round: int, cluster: int, plan_digest: str = "") -> bytes:
    """What binds a contribution to one round of one cluster of one job, under one round
    plan (``plan_digest``: :meth:`RoundPlan.digest`, signed in the receipt; "" in the
    simulator, which has no plan message). The masked scheme's pads are derived in it (and
    in the ring, :func:`senseshield.he.masked.pad_key`), so a masked vector is worthless
    anywhere else. ``run_id`` is the operator-signed job nonce on a fleet."""
    return f"{fleet}/{run_id}/{int(round)}/{int(cluster)}/{plan_digest}".encode()


def short_hash(*chunks: bytes) -> str:
    """16 hex characters of SHA-256 over ``chunks``; used for key ids."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()[:16]


def repeats(positions: np.ndarray) -> bool:
    """Whether ``positions`` repeats a value: O(n) for the sorted positions updates carry,
    a sort otherwise."""
    if positions.size < 2:
        return False
    if np.all(np.diff(positions) > 0):
        return False
    return np.unique(positions).size != positions.size


def plain_inside(part: PlainPart, union: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Plaintext part ``k``'s values at the positions of the sorted ``union``: (rows of the
    union, positions, values), or None if it has none there. :class:`ProtocolError` naming
    the part for values and positions of different sizes, a value that is not finite or a
    repeated position: the plaintext parts' checks every scheme's accumulator shares."""
    ppos = np.asarray(part.positions, dtype=np.int64).ravel()
    pvals = np.asarray(part.values, dtype=np.float64).ravel()
    if ppos.shape != pvals.shape:
        raise ProtocolError(f"Plaintext part {k} has {pvals.size} values for {ppos.size} positions.")
    if union.size == 0:
        return None
    rows = np.searchsorted(union, ppos)
    inside = rows < union.size
    inside[inside] = union[rows[inside]] == ppos[inside]
    if not np.any(inside):
        return None
    rows, ipos, vals = rows[inside], ppos[inside], pvals[inside]
    bad = np.flatnonzero(~np.isfinite(vals))
    if bad.size:
        raise ProtocolError(f"Plaintext part {k} has value {vals[bad[0]]} at position {int(ipos[bad[0]])}; "
                            "only finite values can be aggregated.")
    if repeats(ipos):
        raise ProtocolError(f"Plaintext part {k} repeats a position.")
    return rows, ipos, vals


def check_values(values: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate an (values, positions) pair for encryption; return float64/int64 copies."""
    values = np.asarray(values, dtype=np.float64).ravel()
    positions = np.asarray(positions, dtype=np.int64).ravel()
    if values.shape != positions.shape:
        raise ValueError(
            f"Got {values.size} values for {positions.size} positions; they must match."
        )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(
            f"Value at position {int(positions[bad[0]])} is {values[bad[0]]}; "
            "only finite values can be encrypted."
        )
    if positions.size and (np.any(np.diff(positions) <= 0) or positions[0] < 0):
        raise ValueError("Positions must be sorted, unique and non-negative.")
    return values, positions


SECRET_FIELDS = frozenset({"p", "q", "lambda", "lam", "mu", "phi", "hp", "hq", "alpha", "alpha_p", "alpha_q",
                           "private", "private_key",
                           "secret", "secret_key", "sk"})
"""Field names that hold secret-key material in any scheme's serialisation."""


def check_public_fields(obj: dict, allowed: set[str], what: str) -> None:
    """A public key's parsed fields: :class:`ProtocolError` if it carries secret material
    (a secret key serialised by mistake must never be taken, or re-published, as a public
    key) or fields the format does not have."""
    secret = sorted(set(obj) & SECRET_FIELDS)
    if secret:
        raise ProtocolError(
            f"The {what} holds secret field(s) {secret}; a public key must not (publish "
            "secret.public_key.to_bytes(), never the secret key file)."
        )
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ProtocolError(f"The {what} has unknown field(s) {unknown}; allowed: {sorted(allowed)}.")


def int_param(value: Any, name: str) -> int:
    """A key or scheme parameter as a Python int; ``ConfigError`` naming it otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}.")
    return int(value)


def check_weight(value: Any, index: int, *, limit: int | None = None, why: str = "") -> int:
    """An aggregation part's weight as a positive Python int, at most ``limit`` if given.

    Raises :class:`ProtocolError` naming the part; ``why`` says where the limit comes from.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"Part {index} has weight {value!r}; weights are positive integers.")
    weight = int(value)
    if weight < 1:
        raise ProtocolError(f"Part {index} has weight {weight}; weights are positive integers.")
    if limit is not None and weight > limit:
        raise ProtocolError(f"Part {index} has weight {weight}, above {why or 'the limit'} {limit}.")
    return weight

