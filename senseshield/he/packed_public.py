"""The packed-Paillier public key: encryption (one ciphertext per block), aggregation, the
wire format and the fingerprints (the scheme and its encoding are described in
:mod:`senseshield.he.packed`; the quantisation and slot layout are in
:mod:`senseshield.he.encoding`)."""

from __future__ import annotations

import json
import math
import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import gmpy2
import numpy as np

from senseshield.errors import ConfigError, ProtocolError
from senseshield.he.base import (
    CipherPart,
    EncryptedVector,
    PlainPart,
    check_public_fields,
    check_values,
    check_weight,
    int_param,
    plain_inside,
    select_units,
    short_hash,
)
from senseshield.he.encoding import (
    DEFAULT_CLIP,
    DEFAULT_MAX_TOTAL_WEIGHT,
    DEFAULT_VALUE_BITS,
    MAX_WEIGHT_FIELD,
    ClippingWarning,
    PackedLayout,
    block_layout,
    groups,
    pack,
    read_ciphertexts,
    union_positions,
)
from senseshield.he.fingerprint import check, fingerprint, fingerprint_from_openings, int_bytes
from senseshield.he.obfuscation import (
    DEFAULT_POOL_CAPACITY,
    DEFAULT_WINDOW_BITS,
    MIN_EXPONENT_BITS,
    FixedBaseTable,
    ObfuscatorPool,
    ShortExponentWarning,
    default_exponent_bits,
    random_exponent,
)
from senseshield.he.paillier import PaillierFamilyKey, check_modulus, warn_insecure

if TYPE_CHECKING:
    from senseshield.he.packed_accumulator import PackedAccumulator

__all__ = ["SCHEME_NAME", "PackedPaillierPublicKey", "PackedPayload"]

SCHEME_NAME = "packed-paillier"
_WIRE_MAGIC = b"SSPK"
# magic, version, key id (8 raw bytes), blocks u64, last block length u32, ciphertext width u32
_WIRE_HEADER = struct.Struct(">4sB8sQII")
_WIRE_VERSION = 1


@dataclass
class PackedPayload:
    """Payload of a packed-Paillier :class:`EncryptedVector`.

    ``blocks``: sorted int64 block indices; ``ciphertexts``: one int in ``[1, n^2)`` per
    block; ``weights``: int64 total weight per block (1 for a fresh ciphertext; the key
    server subtracts ``weight * q_max`` per slot); ``clipped``: values clipped while making
    this vector (for an aggregate: clipped plaintexts plus the ``clipped`` of the ciphertext
    parts it was given in memory; not part of the wire format).
    """

    blocks: np.ndarray
    ciphertexts: list[int]
    weights: np.ndarray
    clipped: int = 0

    def __len__(self) -> int:
        return len(self.ciphertexts)




def folded_weight(part: CipherPart, block_weights: np.ndarray, weight: int, index: int) -> int:
    """The exponent a ciphertext part enters with: 1 if its encryptor folded its weight in
    (``part.folded``; then every block weight must equal that weight), else ``weight``."""
    if not part.folded:
        return weight
    if block_weights.size and not np.all(block_weights == weight):
        raise ProtocolError(f"Ciphertext part {index} says its weight {weight} is folded in, but its blocks "
                            f"weigh {int(block_weights.min())}..{int(block_weights.max())}.")
    return 1




def _multi_power(terms: Sequence[tuple[Any, int]], modulus: Any) -> Any:
    """``prod_i c_i^{w_i} mod modulus`` with one shared chain of squarings (Straus):
    ``max bits(w)`` squarings plus one multiplication per set bit of every weight, instead
    of one exponentiation per term."""
    if len(terms) == 1:
        c, w = terms[0]
        return c if w == 1 else gmpy2.powmod(c, w, modulus)
    acc = None
    for bit in range(max(w for _, w in terms).bit_length() - 1, -1, -1):
        if acc is not None:
            acc = acc * acc % modulus
        for c, w in terms:
            if w >> bit & 1:
                acc = c if acc is None else acc * c % modulus
    return acc


class PackedPaillierPublicKey(PaillierFamilyKey):
    """Public key ``(n, h_s)`` plus the layout (``value_bits``, ``clip``, ``max_total_weight``)
    and the obfuscator ``exponent_bits``.

    The key id is ``short_hash("packed-paillier", n, h_s, layout)``: ciphertexts made under
    another modulus, base or layout are refused. ``exponent_bits`` is serialised but not part
    of the id (it changes nothing for decryption). ``window_bits`` (fixed-base table size) is
    a local performance knob, not serialised; the table is built on first use.
    """

    scheme: ClassVar[str] = SCHEME_NAME
    ragged_masks: ClassVar[bool] = True

    def __init__(
        self,
        n: int,
        hs: int,
        *,
        value_bits: int = DEFAULT_VALUE_BITS,
        clip: float = DEFAULT_CLIP,
        max_total_weight: int = DEFAULT_MAX_TOTAL_WEIGHT,
        exponent_bits: int | None = None,
        window_bits: int = DEFAULT_WINDOW_BITS,
    ) -> None:
        n = int_param(n, "n")
        hs = int_param(hs, "hs")
        check_modulus(n)
        nsquare = n * n
        if not 1 < hs < nsquare or math.gcd(hs, n) != 1:
            raise ConfigError("h_s must be a unit of Z_{n^2} other than 1.")
        if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating, np.integer)):
            raise ConfigError(f"clip must be a number, got {clip!r}.")
        self._layout = PackedLayout(
            key_bits=n.bit_length(),
            value_bits=int_param(value_bits, "value_bits"),
            clip=float(clip),
            max_total_weight=int_param(max_total_weight, "max_total_weight"),
        )
        if exponent_bits is None:
            exponent_bits = default_exponent_bits(n.bit_length())
        exponent_bits = int_param(exponent_bits, "exponent_bits")
        if not MIN_EXPONENT_BITS <= exponent_bits <= 2 * n.bit_length():
            raise ConfigError(
                f"exponent_bits is {exponent_bits}; choose {MIN_EXPONENT_BITS}.."
                f"{2 * n.bit_length()} (default {default_exponent_bits(n.bit_length())})."
            )
        if exponent_bits < default_exponent_bits(n.bit_length()):
            warnings.warn(
                f"Obfuscator exponents of {exponent_bits} bits are shorter than half the "
                f"modulus ({default_exponent_bits(n.bit_length())} bits, the DJN / published "
                "choice); only use this for tests or after your own analysis.",
                ShortExponentWarning,
                stacklevel=3,
            )
        warn_insecure(n.bit_length(), stacklevel=3)
        self._n = n
        self._hs = hs
        self._n_mpz = gmpy2.mpz(n)
        self._nsquare = gmpy2.mpz(nsquare)
        self._exponent_bits = exponent_bits
        self._window_bits = int_param(window_bits, "window_bits")
        self._key_bytes = (n.bit_length() + 7) // 8
        self.block_size = self._layout.slots
        layout_id = json.dumps(
            {
                "value_bits": self._layout.value_bits,
                "clip": self._layout.clip,
                "max_total_weight": self._layout.max_total_weight,
            },
            sort_keys=True,
        ).encode()
        self._key_id = short_hash(
            SCHEME_NAME.encode(),
            n.to_bytes(self._key_bytes, "big"),
            hs.to_bytes(2 * self._key_bytes, "big"),
            layout_id,
        )
        self._table: FixedBaseTable | None = None
        self._table_lock = threading.Lock()
        self._pool: ObfuscatorPool[Any] | None = None

    # -- properties -------------------------------------------------------------------
    @property
    def hs(self) -> int:
        """The published base ``h_s = h^n mod n^2`` of the obfuscators."""
        return self._hs

    @property
    def layout(self) -> PackedLayout:
        return self._layout

    @property
    def exponent_bits(self) -> int:
        return self._exponent_bits

    @property
    def window_bits(self) -> int:
        return self._window_bits

    @window_bits.setter
    def window_bits(self, value: int) -> None:
        value = int_param(value, "window_bits")
        with self._table_lock:
            if value != self._window_bits:
                self._window_bits = value
                self._table = None

    @property
    def bytes_per_param(self) -> float:
        """Ciphertext bytes per parameter of a full block."""
        return self.ciphertext_nbytes / self.block_size

    def __repr__(self) -> str:
        lay = self._layout
        return (
            f"PackedPaillierPublicKey(key_bits={self.key_bits}, slots={lay.slots}, "
            f"value_bits={lay.value_bits}, clip={lay.clip:g}, "
            f"max_total_weight={lay.max_total_weight}, key_id={self._key_id!r})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PackedPaillierPublicKey)
            and other._key_id == self._key_id
            and other._n == self._n
            and other._hs == self._hs
            and other._layout == self._layout
            and other._exponent_bits == self._exponent_bits
        )

    def __hash__(self) -> int:
        return hash((self._n, self._hs, self._layout))

    def __reduce__(self) -> Any:  # pickles without the table or the pool
        return (PackedPaillierPublicKey.from_bytes, (self.to_bytes(),))

    # -- obfuscators ------------------------------------------------------------------
    def obfuscator_table(self) -> FixedBaseTable:
        """The fixed-base table of ``h_s`` (built on first use; thread-safe)."""
        table = self._table
        if table is None:
            with self._table_lock:
                if self._table is None:
                    self._table = FixedBaseTable(
                        self._hs, int(self._nsquare), self._exponent_bits, self._window_bits
                    )
                table = self._table
        return table

    def new_obfuscator(self) -> Any:
        """One fresh obfuscator ``h_s^a mod n^2`` (``a`` from the CSPRNG)."""
        return self.obfuscator_table().random_power()

    def new_opening(self) -> tuple[int, Any]:
        """``(a, h_s^a mod n^2)``: an obfuscator with its exponent, which the encrypting agent
        keeps to compute its fingerprint cheaply (:mod:`senseshield.he.fingerprint`)."""
        table = self.obfuscator_table()
        a = random_exponent(table.exponent_bits)
        return a, table.pow(a)

    def make_pool(
        self, capacity: int = DEFAULT_POOL_CAPACITY, *, start: bool = False, attach: bool = False
    ) -> ObfuscatorPool[Any]:
        """An :class:`ObfuscatorPool` of this key's obfuscators (``start``: start its thread;
        ``attach``: make :meth:`encrypt` use it by default)."""
        pool: ObfuscatorPool[Any] = ObfuscatorPool(
            self.new_opening, capacity=capacity, owner=self._key_id
        )
        if attach:
            self.attach_pool(pool)
        if start:
            self.obfuscator_table()  # build the table before the thread needs it
            pool.start()
        return pool

    def attach_pool(self, pool: ObfuscatorPool[Any]) -> None:
        """Use ``pool`` for every :meth:`encrypt` without an explicit ``pool``."""
        if not isinstance(pool, ObfuscatorPool) or pool.owner != self._key_id:
            raise ConfigError("The pool was not made for this key (use key.make_pool()).")
        self._pool = pool

    def detach_pool(self) -> ObfuscatorPool[Any] | None:
        """Stop using the attached pool (it is not stopped); returns it."""
        pool, self._pool = self._pool, None
        return pool

    @property
    def pool(self) -> ObfuscatorPool[Any] | None:
        return self._pool

    # -- encryption -------------------------------------------------------------------
    prefolds_weight: ClassVar[bool] = True

    def encrypt(
        self, values: np.ndarray, positions: np.ndarray, *, pool: ObfuscatorPool[Any] | None = None,
        weight: int = 1,
    ) -> EncryptedVector:
        """One ciphertext per block of ``positions`` (a union of whole blocks).

        Values outside ``[-clip, clip]`` are clipped, counted in ``payload.clipped`` and
        reported with one :class:`ClippingWarning`. Obfuscators come from ``pool`` (or the
        attached pool), else they are computed inline from the fixed-base table.
        ``weight``: the sample weight folded in here (every slot holds ``weight * (q +
        offset)`` and every block weight is ``weight``), so aggregating it costs one
        multiplication per block instead of an exponentiation.
        """
        values, positions = check_values(values, positions)
        weight = check_weight(weight, 0, limit=self._layout.max_total_weight, why="the key's max_total_weight")
        B = self.block_size
        blocks, lengths = block_layout(positions, B)
        lay = self._layout
        q, clipped = lay.quantise(values)
        if clipped:
            warnings.warn(
                f"{clipped} of {values.size} values lie outside the clip range "
                f"[-{lay.clip:g}, {lay.clip:g}] and were clipped (payload.clipped).",
                ClippingWarning,
                stacklevel=2,
            )
        slots = np.zeros((blocks.size, B), dtype=np.int64)
        rows = np.repeat(np.arange(blocks.size), lengths)
        slots[rows, positions % B] = (q + lay.offset) * weight
        packed = pack(slots, lay.slot_bits)
        if pool is None:
            pool = self._pool
        if pool is not None:
            if pool.owner != self._key_id:
                raise ConfigError("The pool was not made for this key (use key.make_pool()).")
            items = pool.take(len(packed))
        else:
            items = [self.new_opening() for _ in packed]
        openings = all(isinstance(item, tuple) for item in items)
        obfuscators = [item[1] for item in items] if openings else items
        n, nsquare = self._n_mpz, self._nsquare
        ciphertexts = [int((1 + m * n) * r % nsquare) for m, r in zip(packed, obfuscators)]
        return EncryptedVector(
            meta={"openings": (packed, [item[0] for item in items])} if openings else {},
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=PackedPayload(
                blocks=blocks,
                ciphertexts=ciphertexts,
                weights=np.full(blocks.size, weight, dtype=np.int64),
                clipped=clipped,
            ),
            nbytes=len(ciphertexts) * self.ciphertext_nbytes,
        )

    # -- validation helpers -----------------------------------------------------------
    def _check_payload(self, vector: EncryptedVector, where: str) -> tuple[
        PackedPayload, np.ndarray, np.ndarray, np.ndarray
    ]:
        """Key, payload type, positions = whole blocks matching ``payload.blocks``, counts,
        weights in range and ciphertexts in ``(0, n^2)``. Returns payload, positions,
        blocks, lengths."""
        self.check(vector)
        payload = vector.payload
        if not isinstance(payload, PackedPayload):
            raise ProtocolError(f"{where} does not hold a packed-Paillier payload.")
        positions = np.asarray(vector.positions, dtype=np.int64).ravel()
        if positions.size and (positions[0] < 0 or np.any(np.diff(positions) <= 0)):
            raise ProtocolError(f"{where} has unsorted, repeated or negative positions.")
        try:
            blocks, lengths = block_layout(positions, self.block_size)
        except ValueError as exc:
            raise ProtocolError(f"{where}: {exc}") from None
        pblocks = np.asarray(payload.blocks, dtype=np.int64).ravel()
        if not np.array_equal(pblocks, blocks):
            raise ProtocolError(f"{where} has payload blocks that do not match its positions.")
        weights = np.asarray(payload.weights).ravel()
        if len(payload.ciphertexts) != blocks.size or weights.size != blocks.size:
            raise ProtocolError(
                f"{where} has {len(payload.ciphertexts)} ciphertexts and {weights.size} weights "
                f"for {blocks.size} blocks."
            )
        if weights.size and (
            not np.issubdtype(weights.dtype, np.integer)
            or weights.min() < 1
            or weights.max() > self._layout.max_total_weight
        ):
            raise ProtocolError(
                f"{where} has block weights outside 1..{self._layout.max_total_weight}."
            )
        nsquare = self._nsquare
        for i, c in enumerate(payload.ciphertexts):
            if not (isinstance(c, (int, type(nsquare))) and 0 < c < nsquare):
                raise ProtocolError(
                    f"{where}: the ciphertext of block {int(blocks[i])} is not an element of "
                    "Z_{n^2}."
                )
        return payload, positions, blocks, lengths

    # -- aggregation ------------------------------------------------------------------
    def aggregate(
        self, parts: Sequence[CipherPart | PlainPart], positions: np.ndarray
    ) -> EncryptedVector:
        """``prod_i E_i^{w_i} * (1 + n * sum_j w_j M_j) mod n^2`` per block of ``positions``.

        ``positions`` must be whole blocks; every block needs at least one ciphertext part,
        whose blocks must cover exactly the same positions; plaintext parts must cover whole
        blocks of the union (positions outside the union are ignored). Each block's total
        weight (sum of the weights of the parts that touch it, times the block weights of
        aggregated ciphertexts) must stay ``<= max_total_weight``; otherwise
        :class:`ProtocolError` names the block and the numbers. Plaintext values outside the
        clip range are clipped, counted and warned about as in :meth:`encrypt`.
        """
        lay = self._layout
        B = self.block_size
        limit = lay.max_total_weight
        union = union_positions(positions)
        try:
            ublocks, ulengths = block_layout(union, B)
        except ValueError as exc:
            raise ProtocolError(f"Aggregate positions: {exc}") from None
        nb = ublocks.size
        total = np.zeros(nb, dtype=np.int64)
        covered = np.zeros(nb, dtype=bool)
        cipher_jobs: list[tuple[list[int], list[int], int]] = []
        plain_jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []
        clipped = 0

        for k, part in enumerate(parts):
            if isinstance(part, CipherPart):
                weight = check_weight(part.weight, k, limit=limit, why="the key's max_total_weight")
                payload, _, vblocks, vlengths = self._check_payload(
                    part.vector, f"Ciphertext part {k}"
                )
                rows = np.searchsorted(ublocks, vblocks)
                inside = rows < nb
                inside[inside] = ublocks[rows[inside]] == vblocks[inside]
                if not np.all(inside):
                    b = int(vblocks[np.argmin(inside)])
                    raise ProtocolError(
                        f"Ciphertext part {k} encrypts block {b} (positions {b * B}..), which is "
                        "outside the aggregate's positions."
                    )
                if not np.array_equal(ulengths[rows], vlengths):
                    raise ProtocolError(
                        f"Ciphertext part {k} covers a partial block that differs from the "
                        "aggregate's; all contributors must use the same model size."
                    )
                bweights = np.asarray(payload.weights, dtype=np.int64)
                weight = folded_weight(part, bweights, weight, k)
                if bweights.size and weight * int(bweights.max()) > limit:
                    j = int(np.argmax(bweights))  # Python ints: no int64 overflow
                    self._raise_headroom(
                        int(vblocks[j]), int(total[rows[j]]) + weight * int(bweights[j])
                    )
                total[rows] += weight * bweights
                if np.any(total[rows] > limit):
                    j = int(np.argmax(total > limit))
                    self._raise_headroom(int(ublocks[j]), int(total[j]))
                covered[rows] = True
                clipped += int(payload.clipped)
                cipher_jobs.append((rows.tolist(), list(payload.ciphertexts), weight))
            elif isinstance(part, PlainPart):
                weight = check_weight(part.weight, k, limit=limit, why="the key's max_total_weight")
                inside = plain_inside(part, union, k)
                if inside is None:
                    continue
                _, ipos, vals = inside
                pblocks, pcounts = groups(ipos // B)
                rows = np.searchsorted(ublocks, pblocks)
                short = np.flatnonzero(pcounts != ulengths[rows])
                if short.size:
                    b = int(pblocks[short[0]])
                    raise ProtocolError(
                        f"Plaintext part {k} covers {int(pcounts[short[0]])} of the "
                        f"{int(ulengths[rows[short[0]]])} aggregated positions of block {b}; "
                        "plaintext parts must cover whole blocks of the aggregate."
                    )
                total[rows] += weight
                if np.any(total[rows] > limit):
                    j = int(np.argmax(total > limit))
                    self._raise_headroom(int(ublocks[j]), int(total[j]))
                q, c = lay.quantise(vals)
                clipped_here = c
                if clipped_here:
                    clipped += clipped_here
                    warnings.warn(
                        f"Plaintext part {k}: {clipped_here} values outside the clip range "
                        f"[-{lay.clip:g}, {lay.clip:g}] were clipped before aggregation.",
                        ClippingWarning,
                        stacklevel=2,
                    )
                row_of = np.searchsorted(ublocks, ipos // B)
                plain_jobs.append((row_of, ipos % B, q + lay.offset, weight))
            else:
                raise ProtocolError(
                    f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart."
                )

        if not np.all(covered):
            b = int(ublocks[np.argmin(covered)])
            raise ProtocolError(
                f"Block {b} (positions {b * B}..) is not covered by any ciphertext part; every "
                "aggregated block needs at least one (a plaintext-only sum would be public)."
            )

        nsquare, n = self._nsquare, self._n_mpz
        per_block: list[list[tuple[Any, int]]] = [[] for _ in range(nb)]
        mpz = gmpy2.mpz
        for rows_list, ciphertexts, weight in cipher_jobs:
            for j, c in zip(rows_list, ciphertexts):
                per_block[j].append((mpz(c), weight))
        acc = [_multi_power(terms, nsquare) for terms in per_block]
        plain = [0] * nb
        if plain_jobs:
            sums = np.zeros((nb, B), dtype=np.int64)
            for row_of, cols, encoded, weight in plain_jobs:
                np.add.at(sums, (row_of, cols), encoded * weight)
            touched = np.flatnonzero(sums.any(axis=1))
            for j, m in zip(touched.tolist(), pack(sums[touched], lay.slot_bits)):
                acc[j] = acc[j] * (1 + m * n) % nsquare
                plain[j] = int(m)
        return EncryptedVector(
            meta={"plain": plain},
            scheme=self.scheme,
            key_id=self._key_id,
            positions=union.copy(),
            payload=PackedPayload(
                blocks=ublocks,
                ciphertexts=[int(a) for a in acc],
                weights=total,
                clipped=clipped,
            ),
            nbytes=nb * self.ciphertext_nbytes,
        )

    def accumulator(self, size: int) -> "PackedAccumulator":
        """An exact running aggregate (:class:`~senseshield.he.packed_accumulator.PackedAccumulator`):
        memory grows with the model, not with the parts."""
        from senseshield.he.packed_accumulator import PackedAccumulator

        return PackedAccumulator(self, size)

    def accumulator_from_state(self, size: int, fields: dict, arrays: dict) -> "PackedAccumulator":
        from senseshield.he.packed_accumulator import PackedAccumulator

        return PackedAccumulator.from_state(self, size, fields, arrays)

    def _raise_headroom(self, block: int, total: int) -> None:
        lay = self._layout
        limit = lay.max_total_weight
        raise ProtocolError(
            f"Block {block} (positions {block * self.block_size}..) would aggregate a total "
            f"weight of at least {total}, above the key's head-room max_total_weight={limit} "
            f"({lay.slot_bits}-bit slots of {lay.value_bits}-bit values: {limit} * "
            f"{lay.u_max} < 2^{lay.slot_bits}); aggregate fewer samples or generate a key with "
            "a larger max_total_weight."
        )

    # -- verification (senseshield.he.fingerprint) ---------------------------------------
    def select(self, vector: EncryptedVector, positions: np.ndarray) -> EncryptedVector | None:
        if len(positions) == 0:
            return None
        payload = vector.payload
        rows, plain = select_units(vector, positions, np.asarray(payload.blocks, dtype=np.int64), self.block_size)
        return EncryptedVector(
            meta={"plain": plain} if plain is not None else {}, scheme=self.scheme, key_id=vector.key_id,
            positions=np.asarray(positions, dtype=np.int64).copy(),
            payload=PackedPayload(blocks=payload.blocks[rows], ciphertexts=[payload.ciphertexts[i] for i in rows.tolist()],
                                  weights=np.asarray(payload.weights)[rows]),
            nbytes=int(rows.size) * self.ciphertext_nbytes,
        )

    def fingerprint(self, vector: EncryptedVector, seed: bytes) -> bytes:
        """``prod_k c_k^{a_k} mod n^2`` over the vector's blocks (from the openings when this
        process encrypted it: one exponentiation), as ``2 * key bytes`` big-endian."""
        payload, _, blocks, _ = self._check_payload(vector, "The fingerprinted vector")
        units = blocks.tolist()
        opened = vector.meta.get("openings")
        if opened is not None and len(opened[0]) == len(units):
            value = fingerprint_from_openings(opened[0], opened[1], units, seed, self._n, self._hs, self._hs_power)
        else:
            value = fingerprint(payload.ciphertexts, units, seed, int(self._nsquare))
        return int_bytes(value, 2 * self._key_bytes)

    def _hs_power(self, exponent: int) -> Any:
        """``h_s^exponent mod n^2`` for an exponent longer than the fixed-base table's: the
        table for the low ``exponent_bits`` bits, one short powmod of ``h_s^(2^bits)`` for the rest."""
        table = self.obfuscator_table()
        bits = table.exponent_bits
        low, high = exponent & ((1 << bits) - 1), exponent >> bits
        result = table.pow(low)
        if high:
            top = getattr(self, "_hs_top", None)
            if top is None:  # a small second table: h_s^(2^bits)^x for x < 2^192 (~1.3 MB, built once)
                top = self._hs_top = FixedBaseTable(gmpy2.powmod(self._hs, 1 << bits, self._nsquare),
                                                    int(self._nsquare), 192, 6)
            result = result * top.pow(high) % self._nsquare
        return result

    def unit_weights(self, vector: EncryptedVector) -> np.ndarray:
        return np.asarray(vector.payload.weights, dtype=np.int64)

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes,
                         factors: tuple[int, int] | None = None) -> bool:
        payload, _, blocks, _ = self._check_payload(aggregate, "The aggregate")
        fps, folded = self._check_inputs(contributions, plain, len(blocks))
        return check(payload.ciphertexts, blocks.tolist(), seed, self._n, fps, folded, factors)

    # -- serialisation ----------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """JSON ``{"scheme", "n", "hs" (hex), "value_bits", "clip", "max_total_weight",
        "exponent_bits"}`` (UTF-8)."""
        lay = self._layout
        return json.dumps(
            {
                "scheme": self.scheme,
                "n": format(self._n, "x"),
                "hs": format(self._hs, "x"),
                "value_bits": lay.value_bits,
                "clip": lay.clip,
                "max_total_weight": lay.max_total_weight,
                "exponent_bits": self._exponent_bits,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PackedPaillierPublicKey":
        try:
            obj = json.loads(bytes(data).decode())
            if not isinstance(obj, dict) or obj.get("scheme") != SCHEME_NAME:
                raise ValueError("not a packed-Paillier public key")
            check_public_fields(obj, {"scheme", "n", "hs", "value_bits", "clip", "max_total_weight", "exponent_bits"},
                                "packed-Paillier public key")
            return cls(
                int(obj["n"], 16),
                int(obj["hs"], 16),
                value_bits=obj["value_bits"],
                clip=obj["clip"],
                max_total_weight=obj["max_total_weight"],
                exponent_bits=obj["exponent_bits"],
            )
        except ConfigError as exc:
            raise ProtocolError(f"Malformed packed-Paillier public key: {exc}") from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"Malformed packed-Paillier public key: {exc}") from None

    def ciphertext_bytes(self, vector: EncryptedVector) -> bytes:
        """Self-contained wire format (big-endian)::

            "SSPK" | version u8 | key id (8 bytes) | blocks u64 | last block length u32
            | width u32 | blocks x index u32 | blocks x weight u32
            | blocks x ciphertext (width bytes, width = 2 * key bytes)

        Positions are implied: every block is whole except the last, which holds ``last
        block length`` positions from its start. ``payload.clipped`` is not sent.
        """
        payload, _, blocks, lengths = self._check_payload(vector, "Ciphertext")
        if blocks.size and int(blocks[-1]) > MAX_WEIGHT_FIELD:
            raise ProtocolError(f"Block index {int(blocks[-1])} does not fit the wire format.")
        width = self.ciphertext_nbytes
        header = _WIRE_HEADER.pack(
            _WIRE_MAGIC,
            _WIRE_VERSION,
            bytes.fromhex(self._key_id),
            blocks.size,
            int(lengths[-1]) if blocks.size else 0,
            width,
        )
        body = b"".join(int(c).to_bytes(width, "big") for c in payload.ciphertexts)
        return (
            header
            + blocks.astype(">u4").tobytes()
            + np.asarray(payload.weights, dtype=np.int64).astype(">u4").tobytes()
            + body
        )

    def vector_from_bytes(self, data: bytes) -> EncryptedVector:
        """Inverse of :meth:`ciphertext_bytes`: checks the key id (KeyMismatchError), the
        exact size, block order, weights and ``0 < c < n^2`` (ProtocolError)."""
        data = bytes(data)
        _, _, _, count, last_len, width = self._read_frame(data, _WIRE_HEADER, _WIRE_MAGIC,
                                                           "packed-Paillier ciphertext", "blocks")
        hsize = _WIRE_HEADER.size
        B = self.block_size
        if (count == 0) != (last_len == 0) or last_len > B:
            raise ProtocolError(f"Last block length {last_len} is not allowed (1..{B}).")
        blocks = np.frombuffer(data, dtype=">u4", count=count, offset=hsize).astype(np.int64)
        weights = np.frombuffer(data, dtype=">u4", count=count, offset=hsize + 4 * count)
        weights = weights.astype(np.int64)
        if count and np.any(np.diff(blocks) <= 0):
            raise ProtocolError("Ciphertext blocks must be sorted and unique.")
        if count and (weights.min() < 1 or weights.max() > self._layout.max_total_weight):
            raise ProtocolError(
                f"Ciphertext block weights must lie in 1..{self._layout.max_total_weight}."
            )
        ciphertexts = read_ciphertexts(data, hsize + 8 * count, count, width, self._nsquare,
                                       lambda i: f"The ciphertext of block {int(blocks[i])}")
        if count:
            lengths = np.full(count, B, dtype=np.int64)
            lengths[-1] = last_len
            positions = (
                np.repeat(blocks * B, lengths)
                + np.arange(int(lengths.sum()), dtype=np.int64)
                - np.repeat(np.cumsum(lengths) - lengths, lengths)
            )
        else:
            positions = np.zeros(0, dtype=np.int64)
        return EncryptedVector(
            scheme=self.scheme,
            key_id=self._key_id,
            positions=positions,
            payload=PackedPayload(blocks=blocks, ciphertexts=ciphertexts, weights=weights),
            nbytes=count * width,
        )

