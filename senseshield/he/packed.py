"""Packed Paillier: many quantised values per plaintext, short-exponent obfuscation.

Scheme name ``"packed-paillier"`` (``ragged_masks = True``, ``block_size`` = slots per
ciphertext). Same cryptosystem as :mod:`senseshield.he.paillier` (``g = n + 1``, CRT
decryption); what changes is the encoding (one ciphertext per *block* of parameters) and
the obfuscator (:mod:`senseshield.he.obfuscation`).

Quantisation (documented key parameters)
----------------------------------------
``clip`` (default :data:`DEFAULT_CLIP` = 1.0) and ``value_bits`` (default
:data:`DEFAULT_VALUE_BITS` = 15). A value ``v`` is clipped to ``[-clip, clip]`` and
quantised to ``q = round(v / step)`` (half to even), ``step = clip / q_max``,
``q_max = 2^(value_bits-1) - 1``, so ``q`` is in ``[-q_max, q_max]`` and 0 is exact. With the
defaults ``step = 1/16383 ~ 6.1e-5``: every value inside the clip range is off by at most
``step / 2 ~ 3.05e-5``, and so is the weighted mean the key server computes (a convex
combination). Values outside the range are clipped: the count is in
``vector.payload.clipped`` and a :class:`ClippingWarning` names it once per call (the sum is
then the sum of the *clipped* values, never a silently wrapped one).

Unsigned offset encoding and head-room
--------------------------------------
A slot holds ``u = q + q_max`` in ``[0, 2 q_max]`` (no sign bits, no borrows between slots).
The coordinator computes ``sum_i w_i u_i`` per slot with integer sample-count weights;
the key server subtracts ``W * q_max`` where ``W = sum_i w_i`` is the block's total weight
(carried in ``payload.weights``, one integer per block, computed by :meth:`aggregate` from
the parts: every contribution's offset is multiplied by its weight). No carry can cross a
slot as long as ``W * 2 q_max < 2^slot_bits``, so the slot width is derived from the
declared ``max_total_weight`` (default :data:`DEFAULT_MAX_TOTAL_WEIGHT` = 2^16)::

    slot_bits = bit_length(max_total_weight * 2 * q_max)      # 31 with the defaults
    slots     = (bit_length(n) - 1) // slot_bits              # 66 for a 2048-bit n

and :meth:`PackedPaillierPublicKey.aggregate` refuses (``ProtocolError`` naming the numbers)
any block whose total weight exceeds ``max_total_weight``. ``slots * slot_bits < bit_length(n)``
keeps the packed plaintext below ``n``. A fresh ciphertext is 512 bytes for 66 values:
**7.76 bytes per parameter** (2048-bit key, defaults). Decryption checks that every slot lies
in ``[0, W * 2 q_max]`` and unused bits are zero, so a ciphertext of out-of-range plaintexts
(a faulty or malicious client) is reported instead of decoded wrongly where it is detectable.

Blocks
------
Block ``k`` is positions ``[k B, (k+1) B)`` with ``B = block_size = slots``; slot ``j`` of
block ``k`` holds position ``k B + j``. :meth:`PackedPaillierPublicKey.encrypt` requires the
positions to be a union of whole blocks and makes one ciphertext per block. The last block of
the model may be partial: a block with fewer than ``B`` positions is accepted only as the
highest block of the vector and only if it is contiguous from its start (``k B .. k B + c - 1``,
i.e. the model ends there; the scheme does not know the model size, so every client must use
the same one -- :meth:`aggregate` checks that all contributions to a block cover the same
positions). Because block ``k`` of every client holds the same positions, ciphertexts of
different clients add directly while each client chooses its own blocks (ragged masks at
block granularity; the mask solver works on ``senseshield.engine.masks.block_scores``).

Homomorphic operations (``N = n^2``)::

    E(M)                = (1 + M n) * h_s^a                    mod N   (a: short exponent)
    aggregate           = prod_i E(M_i)^{w_i} * (1 + n sum_j w_j M_j)   mod N

where plaintext parts (clients that did not encrypt a union block) are packed with the same
offset encoding; they must cover the whole block of the union.

Decryption (key server): CRT with ``p^2`` and ``q^2`` (two 1024-bit exponentiations per
block, then unpacking ~66 values at once); ``decrypt(..., threads=k)`` spreads blocks over
threads (gmpy2 releases the GIL in ``powmod``).

Obfuscators and the pool: ``h_s^a`` with an ``exponent_bits``-bit ``a`` (default half the
modulus, 1024 bits; shorter warns) computed from a fixed-base table (``window_bits``,
default 10: ~54 MB for a 2048-bit key, built on first use in ~0.5 s). Without a pool every
block costs one such power (~0.5 ms). With a started pool (``make_pool``) the powers are
computed in a background thread while the agent trains and encryption only multiplies
(~0.2 us per parameter). The pool is optional and never started implicitly.

What leaks: which blocks a client encrypts (the mask, as for per-value Paillier), the
parameters, the key id, the per-block total weights of aggregates (public sample counts).
The aggregate is not re-randomised; only the key server decrypts it.

Usage::

    secret = SCHEMES.get("packed-paillier").generate()       # key server (2048-bit)
    public = secret.public_key                                # publish public.to_bytes()
    B = public.block_size                                     # 66: mask granularity
    pool = public.make_pool(capacity=1024, start=True, attach=True)   # agent, optional
    vector = public.encrypt(delta[positions], positions)      # positions: whole blocks
    aggregate = public.aggregate(parts, union_positions)      # coordinator
    sums = secret.decrypt(aggregate)                          # sum_i w_i q_i * step
    pool.stop()
"""

from __future__ import annotations

import json
import math
import secrets
import struct
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import gmpy2
import numpy as np

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError, SecretKeyExportError
from senseshield.he.base import (
    Accumulator,
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
    repeats,
    select_units,
    short_hash,
)
from senseshield.he.fingerprint import (
    bytes_ints,
    check,
    fingerprint,
    fingerprint_from_openings,
    int_bytes,
    ints_bytes,
)
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
from senseshield.he.paillier import (
    DEFAULT_KEY_BITS,
    MIN_KEY_BITS,
    SECURE_KEY_BITS,
    InsecureKeyWarning,
)

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_MAX_TOTAL_WEIGHT",
    "DEFAULT_VALUE_BITS",
    "ClippingWarning",
    "PackedLayout",
    "PackedPaillierPublicKey",
    "PackedPaillierScheme",
    "PackedPaillierSecretKey",
    "PackedPayload",
]

SCHEME_NAME = "packed-paillier"
DEFAULT_VALUE_BITS = 15
"""Bits per quantised value (sign included): q in [-(2^14 - 1), 2^14 - 1]."""
DEFAULT_CLIP = 1.0
"""Clip range [-1, 1]: model updates (local deltas) of this project stay well inside it."""
DEFAULT_MAX_TOTAL_WEIGHT = 2**16
"""Largest total sample-count weight per aggregated block (head-room of the slots)."""
MAX_SLOT_BITS = 62  # slot sums are computed in int64
MAX_WEIGHT_FIELD = 2**32 - 1  # per-block weights travel as u32

_WIRE_MAGIC = b"SSPK"
_WIRE_VERSION = 1
# magic, version, key id (8 raw bytes), blocks u64, last block length u32, ciphertext width u32
_WIRE_HEADER = struct.Struct(">4sB8sQII")
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


def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)``, in O(n) when ``keys`` is sorted (block indices
    of sorted positions), else by ``np.unique``."""
    if keys.size == 0:
        return keys[:0], np.zeros(0, dtype=np.int64)
    steps = np.diff(keys)
    if np.any(steps < 0):
        return np.unique(keys, return_counts=True)
    edges = np.concatenate([[0], np.flatnonzero(steps) + 1, [keys.size]])
    return keys[edges[:-1]], np.diff(edges)


def _folded_weight(part: CipherPart, block_weights: np.ndarray, weight: int, index: int) -> int:
    """The exponent a ciphertext part enters with: 1 if its encryptor folded its weight in
    (``part.folded``; then every block weight must equal that weight), else ``weight``."""
    if not part.folded:
        return weight
    if block_weights.size and not np.all(block_weights == weight):
        raise ProtocolError(f"Ciphertext part {index} says its weight {weight} is folded in, but its blocks "
                            f"weigh {int(block_weights.min())}..{int(block_weights.max())}.")
    return 1


def _block_layout(positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
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


def _pack(slots: np.ndarray, slot_bits: int) -> list[int]:
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


def _unpack(values: Sequence[int], width: int, slot_bits: int) -> np.ndarray:
    """Inverse of :func:`_pack` (int64 array ``(len(values), width)``); values must fit."""
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


class PackedPaillierPublicKey(PublicKey):
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
        if n.bit_length() < MIN_KEY_BITS or n % 2 == 0:
            raise ConfigError(
                f"A Paillier modulus must be odd and have at least {MIN_KEY_BITS} bits; "
                f"got {n.bit_length()} bits."
            )
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
        if n.bit_length() < SECURE_KEY_BITS:
            warnings.warn(
                f"A {n.bit_length()}-bit Paillier modulus is insecure (use >= {SECURE_KEY_BITS} "
                "bits outside tests).",
                InsecureKeyWarning,
                stacklevel=3,
            )
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
    def key_id(self) -> str:
        return self._key_id

    @property
    def n(self) -> int:
        return self._n

    @property
    def hs(self) -> int:
        """The published base ``h_s = h^n mod n^2`` of the obfuscators."""
        return self._hs

    @property
    def key_bits(self) -> int:
        return self._n.bit_length()

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
    def ciphertext_nbytes(self) -> int:
        """Bytes per ciphertext (one block): ``2 * ceil(bits / 8)``."""
        return 2 * self._key_bytes

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
        blocks, lengths = _block_layout(positions, B)
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
        packed = _pack(slots, lay.slot_bits)
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
            blocks, lengths = _block_layout(positions, self.block_size)
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
        union = np.asarray(positions, dtype=np.int64).ravel()
        if union.size and (union[0] < 0 or np.any(np.diff(union) <= 0)):
            raise ProtocolError("Aggregate positions must be sorted, unique and non-negative.")
        try:
            ublocks, ulengths = _block_layout(union, B)
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
                weight = _folded_weight(part, bweights, weight, k)
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
                pblocks, pcounts = _groups(ipos // B)
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
            for j, m in zip(touched.tolist(), _pack(sums[touched], lay.slot_bits)):
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
        """An exact running aggregate (:class:`PackedAccumulator`): memory grows with the
        model, not with the parts."""
        return PackedAccumulator(self, size)

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
    verifiable: ClassVar[bool] = True

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

    def plain_fold(self, aggregate: EncryptedVector) -> bytes:
        return self._fold_bytes(aggregate.meta.get("plain") or [])

    def _fold_bytes(self, plain: Sequence[int]) -> bytes:
        return b"" if not any(plain) else ints_bytes(plain, self._key_bytes)

    def unit_weights(self, vector: EncryptedVector) -> np.ndarray:
        return np.asarray(vector.payload.weights, dtype=np.int64)

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes,
                         factors: tuple[int, int] | None = None) -> bool:
        payload, _, blocks, _ = self._check_payload(aggregate, "The aggregate")
        width = 2 * self._key_bytes
        fps = []
        for f, w in contributions:
            if len(f) != width:
                raise ProtocolError(f"A fingerprint has {len(f)} bytes; this key's have {width}.")
            fps.append((int.from_bytes(f, "big"), int(w)))
        try:
            folded = bytes_ints(plain, self._key_bytes, len(blocks), "The plaintext fold") if plain else None
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
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
        hsize = _WIRE_HEADER.size
        if len(data) < hsize:
            raise ProtocolError(
                f"Packed-Paillier ciphertext of {len(data)} bytes is shorter than its header."
            )
        magic, version, raw_id, count, last_len, width = _WIRE_HEADER.unpack_from(data)
        if magic != _WIRE_MAGIC or version != _WIRE_VERSION:
            raise ProtocolError("Not a SenseShield packed-Paillier ciphertext (bad magic/version).")
        if raw_id.hex() != self._key_id:
            raise KeyMismatchError(
                f"Ciphertext was made under key {raw_id.hex()!r}, not the current key "
                f"{self._key_id!r}; it is rejected."
            )
        if width != self.ciphertext_nbytes:
            raise ProtocolError(
                f"Ciphertext width is {width} bytes; this key uses {self.ciphertext_nbytes}."
            )
        expected = hsize + count * (8 + width)
        if len(data) != expected:
            raise ProtocolError(
                f"Packed-Paillier ciphertext has {len(data)} bytes; its header announces "
                f"{count} blocks, i.e. {expected} bytes."
            )
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
        offset = hsize + 8 * count
        nsquare = self._nsquare
        ciphertexts: list[int] = []
        for i in range(count):
            start = offset + i * width
            c = int.from_bytes(data[start : start + width], "big")
            if not 0 < c < nsquare:
                raise ProtocolError(
                    f"The ciphertext of block {int(blocks[i])} is not an element of Z_{{n^2}}."
                )
            ciphertexts.append(c)
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


class PackedAccumulator(Accumulator):
    """Streaming :meth:`PackedPaillierPublicKey.aggregate`: each ciphertext part is multiplied
    into a running product per block as it arrives; each plaintext part is quantised and
    added to an int64 sum per position (with the weight per block and the clip count), and
    :meth:`result` folds the sums of the union's blocks in. The result equals the batch
    aggregate of the same parts in any order, integer for integer (modular products and
    integer sums commute); the memory is the model's, not the parts'."""

    def __init__(self, public: PackedPaillierPublicKey, size: int) -> None:
        self.public = public
        B = public.block_size
        nblocks = -(-int(size) // B)
        self.size = int(size)
        self.products: dict[int, Any] = {}  # block -> running product of the ciphertext parts
        self.lengths: dict[int, int] = {}  # block -> positions its ciphertexts cover
        self.cipher_weight = np.zeros(nblocks, dtype=np.int64)
        self.cipher_clipped = 0
        self.plain = np.zeros(self.size, dtype=np.int64)  # sum of weight * (q + offset)
        self.plain_clipped = np.zeros(self.size, dtype=np.int32)
        self.plain_weight = np.zeros(nblocks, dtype=np.int64)  # per block: weights of the parts touching it
        # per block: the fewest and most positions a plaintext part covered (whole-block check)
        self.plain_min = np.full(nblocks, B + 1, dtype=np.int64)
        self.plain_max = np.zeros(nblocks, dtype=np.int64)
        self.parts = 0

    def add(self, part: CipherPart | PlainPart, key: str = "") -> None:
        pk, lay, k = self.public, self.public.layout, self.parts
        limit = lay.max_total_weight
        if isinstance(part, CipherPart):
            weight = check_weight(part.weight, k, limit=limit, why="the key's max_total_weight")
            payload, _, vblocks, vlengths = pk._check_payload(part.vector, f"Ciphertext part {k}")
            if vblocks.size and int(vblocks[-1]) >= self.cipher_weight.size:
                raise ProtocolError(f"Ciphertext part {k} encrypts block {int(vblocks[-1])}, beyond the model's "
                                    f"{self.size} parameters.")
            for b, length in zip(vblocks.tolist(), vlengths.tolist()):
                if self.lengths.get(b, length) != length:
                    raise ProtocolError(f"Ciphertext part {k} covers a partial block that differs from the "
                                        "aggregate's; all contributors must use the same model size.")
            bweights = np.asarray(payload.weights, dtype=np.int64)
            weight = _folded_weight(part, bweights, weight, k)
            after = self.cipher_weight[vblocks] + weight * bweights
            if np.any(after > limit):
                j = int(np.argmax(after > limit))
                pk._raise_headroom(int(vblocks[j]), int(after[j]))
            nsquare, mpz = pk._nsquare, gmpy2.mpz
            for b, length, c in zip(vblocks.tolist(), vlengths.tolist(), payload.ciphertexts):
                term = mpz(c) if weight == 1 else gmpy2.powmod(mpz(c), weight, nsquare)
                acc = self.products.get(b)
                self.products[b] = term if acc is None else acc * term % nsquare
                self.lengths[b] = length
            self.cipher_weight[vblocks] = after
            self.cipher_clipped += int(payload.clipped)
        elif isinstance(part, PlainPart):
            weight = check_weight(part.weight, k, limit=limit, why="the key's max_total_weight")
            ppos = np.asarray(part.positions, dtype=np.int64).ravel()
            pvals = np.asarray(part.values, dtype=np.float64).ravel()
            if ppos.shape != pvals.shape:
                raise ProtocolError(f"Plaintext part {k} has {pvals.size} values for {ppos.size} positions.")
            if ppos.size and (ppos.min() < 0 or ppos.max() >= self.size):
                raise ProtocolError(f"Plaintext part {k} has positions outside the model's 0..{self.size - 1}.")
            if repeats(ppos):
                raise ProtocolError(f"Plaintext part {k} repeats a position.")
            bad = np.flatnonzero(~np.isfinite(pvals))
            if bad.size:
                raise ProtocolError(f"Plaintext part {k} has value {pvals[bad[0]]} at position "
                                    f"{int(ppos[bad[0]])}; only finite values can be aggregated.")
            q, _ = lay.quantise(pvals)
            self.plain[ppos] += (q + lay.offset) * weight
            self.plain_clipped[ppos] += (np.abs(pvals) > lay.clip).astype(np.int32)
            blocks, counts = _groups(ppos // pk.block_size)
            self.plain_weight[blocks] += weight
            self.plain_min[blocks] = np.minimum(self.plain_min[blocks], counts)
            self.plain_max[blocks] = np.maximum(self.plain_max[blocks], counts)
        else:
            raise ProtocolError(f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart.")
        self.parts += 1

    def result(self, positions: np.ndarray) -> EncryptedVector:
        pk, lay, B = self.public, self.public.layout, self.public.block_size
        union = np.asarray(positions, dtype=np.int64).ravel()
        if union.size and (union[0] < 0 or np.any(np.diff(union) <= 0)):
            raise ProtocolError("Aggregate positions must be sorted, unique and non-negative.")
        try:
            ublocks, ulengths = _block_layout(union, B)
        except ValueError as exc:
            raise ProtocolError(f"Aggregate positions: {exc}") from None
        for b, length in zip(ublocks.tolist(), ulengths.tolist()):
            if b not in self.products:
                raise ProtocolError(f"Block {b} (positions {b * B}..) is not covered by any ciphertext part; every "
                                    "aggregated block needs at least one (a plaintext-only sum would be public).")
            if self.lengths[b] != length:
                raise ProtocolError("A ciphertext part covers a partial block that differs from the aggregate's; "
                                    "all contributors must use the same model size.")
        extra = sorted(set(self.products) - set(ublocks.tolist()))
        if extra:
            b = extra[0]
            raise ProtocolError(f"A ciphertext part encrypts block {b} (positions {b * B}..), which is outside "
                                "the aggregate's positions.")
        plain, touched = self._fold(ublocks, ulengths)
        total = self.cipher_weight[ublocks] + self.plain_weight[ublocks]
        if np.any(total > lay.max_total_weight):
            j = int(np.argmax(total > lay.max_total_weight))
            pk._raise_headroom(int(ublocks[j]), int(total[j]))
        clipped = int(self.plain_clipped[union].sum())
        if clipped:
            warnings.warn(f"{clipped} plaintext values outside the clip range [-{lay.clip:g}, {lay.clip:g}] were "
                          "clipped before aggregation.", ClippingWarning, stacklevel=2)
        nsquare, n = pk._nsquare, pk._n_mpz
        acc = [self.products[b] for b in ublocks.tolist()]
        for j in np.flatnonzero(touched).tolist():
            acc[j] = acc[j] * (1 + plain[j] * n) % nsquare
        return EncryptedVector(
            meta={"plain": plain},
            scheme=pk.scheme,
            key_id=pk.key_id,
            positions=union.copy(),
            payload=PackedPayload(blocks=ublocks, ciphertexts=[int(a) for a in acc], weights=total,
                                  clipped=self.cipher_clipped + clipped),
            nbytes=ublocks.size * pk.ciphertext_nbytes,
        )


    def _fold(self, ublocks: np.ndarray, ulengths: np.ndarray) -> tuple[list[int], np.ndarray]:
        """The packed plaintext sums of the plaintext parts in each union block (0 where none
        touched it) and which blocks they touched; :class:`ProtocolError` if a part covers a
        block only in part."""
        touched = self.plain_weight[ublocks] > 0
        short = np.flatnonzero(touched & ((self.plain_min[ublocks] != ulengths) | (self.plain_max[ublocks] != ulengths)))
        if short.size:
            b = int(ublocks[short[0]])
            raise ProtocolError(f"A plaintext part covers part of the {int(ulengths[short[0]])} aggregated positions "
                                f"of block {b}; plaintext parts must cover whole blocks of the aggregate.")
        B, plain = self.public.block_size, [0] * ublocks.size
        rows = np.flatnonzero(touched)
        if rows.size:
            sums = np.zeros((rows.size, B), dtype=np.int64)
            for i, j in enumerate(rows.tolist()):
                start = int(ublocks[j]) * B
                sums[i, : ulengths[j]] = self.plain[start : start + ulengths[j]]
            for j, m in zip(rows.tolist(), _pack(sums, self.public.layout.slot_bits)):
                plain[j] = int(m)
        return plain, touched

    def fold(self, like: EncryptedVector) -> bytes:
        _, _, blocks, lengths = self.public._check_payload(like, "The aggregate")
        return self.public._fold_bytes(self._fold(blocks, lengths)[0])


class _PrimePair:
    """The primes and CRT constants; refuses to pickle/copy and never prints them."""

    __slots__ = ("p", "q", "p2", "q2", "ep", "eq", "hp", "hq", "q_inv", "alphas")

    def __init__(self, p: int, q: int, alphas: tuple[int, int] | None = None) -> None:
        n = p * q
        self.p, self.q = gmpy2.mpz(p), gmpy2.mpz(q)
        self.p2, self.q2 = self.p * self.p, self.q * self.q
        self.alphas = alphas
        # the decryption exponents: p-1 and q-1 (standard key), or the orders alpha_p, alpha_q of
        # the obfuscator base modulo p^2 and q^2 (subgroup key): c^e kills the obfuscator
        self.ep, self.eq = (self.p - 1, self.q - 1) if alphas is None else (gmpy2.mpz(alphas[0]), gmpy2.mpz(alphas[1]))
        # h_p = L_p((n+1)^e_p mod p^2)^{-1} mod p, with L_p(u) = (u - 1) / p
        self.hp = gmpy2.invert((gmpy2.powmod(n + 1, self.ep, self.p2) - 1) // self.p, self.p)
        self.hq = gmpy2.invert((gmpy2.powmod(n + 1, self.eq, self.q2) - 1) // self.q, self.q)
        self.q_inv = gmpy2.invert(self.q, self.p)

    def decrypt(self, c: Any) -> Any:
        p, q = self.p, self.q
        mp = (gmpy2.powmod(c % self.p2, self.ep, self.p2) - 1) // p * self.hp % p
        mq = (gmpy2.powmod(c % self.q2, self.eq, self.q2) - 1) // q * self.hq % q
        return mq + q * ((mp - mq) * self.q_inv % p)

    def __reduce__(self) -> Any:
        raise SecretKeyExportError("The packed-Paillier primes do not pickle or copy.")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__reduce__()

    def __repr__(self) -> str:
        return "<packed-Paillier primes>"


def _decrypt_chunk(primes: _PrimePair, ciphertexts: Sequence[int]) -> list[Any]:
    with gmpy2.context(gmpy2.get_context(), allow_release_gil=True):
        return [primes.decrypt(c) for c in ciphertexts]


class PackedPaillierSecretKey(SecretKey):
    """The primes ``p, q`` (key server only) with the public key. CRT decryption, one per
    block; never pickles or copies; ``repr`` shows the key id only."""

    scheme: ClassVar[str] = SCHEME_NAME

    def __init__(self, p: int, q: int, public: PackedPaillierPublicKey,
                 alphas: tuple[int, int] | None = None) -> None:
        p, q = int_param(p, "p"), int_param(q, "q")
        if p == q or p < 3 or q < 3 or p * q != public.n:
            raise ConfigError("The primes do not match the public modulus.")
        if alphas is not None:
            a_p, a_q = (int_param(a, "alpha") for a in alphas)
            if ((p - 1) % a_p or (q - 1) % a_q
                    or pow(public.hs, a_p, p * p) != 1 or pow(public.hs, a_q, q * q) != 1):
                raise ConfigError("The subgroup orders do not fit the key: this public key's obfuscator base is "
                                  "not of that order (a standard key cannot be used as a subgroup key).")
            alphas = (a_p, a_q)
        self._public = public
        self.__primes = _PrimePair(p, q, alphas)

    def verify_aggregate(self, aggregate: EncryptedVector, seed: bytes,
                         contributions: Sequence[tuple[bytes, int]], plain: bytes) -> bool:
        """The public check, modulo ``p^2`` and ``q^2`` (CRT)."""
        primes = self.__primes
        return self._public.verify_aggregate(aggregate, seed, contributions, plain,
                                             factors=(int(primes.p), int(primes.q)))

    @property
    def structure(self) -> str:
        """``"subgroup"`` (short decryption exponents) or ``"standard"``."""
        return "standard" if self.__primes.alphas is None else "subgroup"

    @property
    def public_key(self) -> PackedPaillierPublicKey:
        return self._public

    def __repr__(self) -> str:
        return f"PackedPaillierSecretKey(key_id={self._public.key_id!r})"

    def decrypt_integers(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:
        """Exact int64 ``sum_i w_i q_i`` per position (offsets removed), in position order.

        Raises :class:`ProtocolError` if a decrypted slot lies outside ``[0, W * 2 q_max]``,
        an unused slot is not zero, or the plaintext has bits above the last slot.
        """
        public = self._public
        lay = public.layout
        B = public.block_size
        payload, positions, blocks, lengths = public._check_payload(vector, "Ciphertext")
        if blocks.size == 0:
            return np.zeros(0, dtype=np.int64)
        ciphertexts = payload.ciphertexts
        threads = max(1, int(threads))
        if threads == 1 or len(ciphertexts) < 2 * threads:
            plain = _decrypt_chunk(self.__primes, ciphertexts)
        else:
            size = -(-len(ciphertexts) // threads)
            chunks = [ciphertexts[i : i + size] for i in range(0, len(ciphertexts), size)]
            with ThreadPoolExecutor(max_workers=threads) as pool:
                parts = list(pool.map(lambda ch: _decrypt_chunk(self.__primes, ch), chunks))
            plain = [m for part in parts for m in part]
        limit_bits = B * lay.slot_bits
        for i, m in enumerate(plain):
            if m.bit_length() > limit_bits:
                raise ProtocolError(
                    f"Block {int(blocks[i])} decrypts to a plaintext with bits above its "
                    f"{B} slots; a contribution was out of range (corrupted ciphertext?)."
                )
        slots = _unpack(plain, B, lay.slot_bits)
        weights = np.asarray(payload.weights, dtype=np.int64)
        used = np.arange(B)[None, :] < lengths[:, None]
        if np.any(slots[~used] != 0):
            raise ProtocolError("An unused slot of a partial block is not zero.")
        high = (weights * lay.u_max)[:, None]
        bad = used & ((slots < 0) | (slots > high))
        if np.any(bad):
            j = int(np.argmax(bad.any(axis=1)))
            raise ProtocolError(
                f"Block {int(blocks[j])} has a slot outside [0, {int(high[j, 0])}] after "
                "decryption; a contribution was out of range (corrupted ciphertext?)."
            )
        sums = slots - (weights * lay.offset)[:, None]
        return sums[used]

    def decrypt(self, vector: EncryptedVector, *, threads: int = 1) -> np.ndarray:
        """float64 ``sum_i w_i q_i * step`` per position: the weighted sum of the quantised
        values (the caller divides by the total weight)."""
        return self._public.layout.dequantise(self.decrypt_integers(vector, threads=threads))

    def _export(self) -> bytes:
        primes = self.__primes
        public = json.loads(self._public.to_bytes())
        public.update({"p": format(int(primes.p), "x"), "q": format(int(primes.q), "x")})
        if primes.alphas is not None:
            public.update({"alpha_p": format(int(primes.alphas[0]), "x"), "alpha_q": format(int(primes.alphas[1]), "x")})
        return json.dumps(public, sort_keys=True).encode()

    @classmethod
    def _import(cls, data: bytes) -> "PackedPaillierSecretKey":
        try:
            obj = json.loads(bytes(data).decode())
            if not isinstance(obj, dict) or obj.get("scheme") != SCHEME_NAME:
                raise ValueError("not a packed-Paillier secret key")
            p, q = int(obj.pop("p"), 16), int(obj.pop("q"), 16)
            alphas = None
            if "alpha_p" in obj or "alpha_q" in obj:
                alphas = (int(obj.pop("alpha_p"), 16), int(obj.pop("alpha_q"), 16))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"Malformed packed-Paillier secret key: {exc}") from None
        if not (gmpy2.is_prime(p) and gmpy2.is_prime(q)):
            raise ProtocolError("Malformed packed-Paillier secret key: p and q must be primes.")
        public = PackedPaillierPublicKey.from_bytes(json.dumps(obj).encode())
        try:
            return cls(p, q, public, alphas)
        except ConfigError as exc:
            raise ProtocolError(f"Malformed packed-Paillier secret key: {exc}") from None


SUBGROUP_BITS = 256
"""Bits of each prime order alpha_p, alpha_q of the subgroup key's obfuscator base. The best
known attack on a hidden subgroup of order ~2^(2l) in Z*_n costs ~2^(l/2) (Coron, Joux, Mandal,
Naccache, Tibouchi, PKC 2011, against Groth's TCC 2005 parameters), so l = 256 gives 2^128,
above the ~112-bit strength of a 2048-bit modulus."""
STRUCTURES = ("subgroup", "standard")


def _subgroup_prime(bits: int, alpha: int) -> int:
    """A random ``bits``-bit prime ``p = 2 alpha k + 1`` (top two bits set), ``k`` from :mod:`secrets`."""
    top = 3 << (bits - 2)
    low, high = -(-top // (2 * alpha)), ((1 << bits) - 1) // (2 * alpha)
    while True:
        k = low + secrets.randbelow(high - low)
        candidate = 2 * alpha * k + 1
        if candidate >= top and gmpy2.is_prime(candidate, 50):
            return candidate


def _random_prime(bits: int) -> int:
    """A random ``bits``-bit prime with its two top bits set (so ``p q`` has ``2 bits`` bits),
    candidates from :mod:`secrets`, 50 Miller-Rabin rounds (gmpy2)."""
    top = 3 << (bits - 2)
    while True:
        candidate = secrets.randbits(bits) | top | 1
        if gmpy2.is_prime(candidate, 50):
            return candidate


@SCHEMES.register(SCHEME_NAME)
class PackedPaillierScheme(Scheme):
    """Packed Paillier with short-exponent obfuscation (``ragged_masks = True`` at block
    granularity; ``public_key.block_size`` = slots per ciphertext, 66 with the defaults)."""

    name: ClassVar[str] = SCHEME_NAME
    ragged_masks: ClassVar[bool] = True
    description: ClassVar[str] = (
        "Packed Paillier: 2048-bit modulus, 15-bit fixed point in [-1, 1], 66 values per "
        "ciphertext (7.8 B/param), DJN short-exponent obfuscation with a fixed-base table and "
        "optional background pool; block-granular ragged masks."
    )

    defaults: ClassVar[dict[str, Any]] = {
        "key_bits": DEFAULT_KEY_BITS,
        "value_bits": DEFAULT_VALUE_BITS,
        "clip": DEFAULT_CLIP,
        "max_total_weight": DEFAULT_MAX_TOTAL_WEIGHT,
        "exponent_bits": default_exponent_bits(DEFAULT_KEY_BITS),
        "structure": "subgroup",
    }

    @classmethod
    def generate(  # type: ignore[override]
        cls,
        *,
        key_bits: int = DEFAULT_KEY_BITS,
        value_bits: int = DEFAULT_VALUE_BITS,
        clip: float = DEFAULT_CLIP,
        max_total_weight: int = DEFAULT_MAX_TOTAL_WEIGHT,
        exponent_bits: int | None = None,
        structure: str = "subgroup",
        **unknown: Any,
    ) -> PackedPaillierSecretKey:
        """New key pair. ``key_bits`` (even, >= 512; < 2048 warns), the layout
        (``value_bits``, ``clip``, ``max_total_weight``) and ``exponent_bits`` (default
        ``key_bits // 2``; shorter warns).

        ``structure``: ``"subgroup"`` (default) makes ``p = 2 alpha_p k_p + 1`` and
        ``q = 2 alpha_q k_q + 1`` with secret :data:`SUBGROUP_BITS`-bit primes ``alpha`` and
        an obfuscator base ``h_s = h^n`` with ``h`` of order ``alpha_p alpha_q`` in ``Z*_n``, so
        decryption raises to ``alpha_p`` (256 bits) instead of ``p - 1`` (1024 bits): about 4x
        faster. Ciphertexts and public keys look exactly like the standard ones. Security: the
        obfuscators ``h_s^a`` lie in a small hidden-order subgroup, so semantic security rests on
        deciding membership in that subgroup being hard (Groth, "Cryptography in Subgroups of
        Z*_n", TCC 2005, the small-subgroup variant of Paillier/Damgard-Jurik) in addition to
        DCR; the order is sized against the best known attack (:data:`SUBGROUP_BITS`).
        ``"standard"``: the DJN base ``h = -x^2`` of order ``lambda / 2``."""
        if unknown:
            raise ConfigError(
                f"Unknown packed-Paillier parameter(s) {', '.join(sorted(unknown))}; use "
                "key_bits, value_bits, clip, max_total_weight, exponent_bits, structure."
            )
        if structure not in STRUCTURES:
            raise ConfigError(f"structure={structure!r} is not allowed; use one of: {', '.join(STRUCTURES)}.")
        key_bits = int_param(key_bits, "key_bits")
        if key_bits < MIN_KEY_BITS or key_bits % 2:
            raise ConfigError(
                f"key_bits is {key_bits}; use an even size >= {MIN_KEY_BITS} "
                f"({DEFAULT_KEY_BITS} or more outside tests)."
            )
        # Validate the layout before the (slower) prime search.
        PackedLayout(
            key_bits=key_bits,
            value_bits=int_param(value_bits, "value_bits"),
            clip=float(clip),
            max_total_weight=int_param(max_total_weight, "max_total_weight"),
        )
        alphas = None
        subgroup_bits = min(SUBGROUP_BITS, key_bits // 4)  # test keys: room for k in p = 2 alpha k + 1
        while True:
            if structure == "subgroup":
                alphas = (_random_prime(subgroup_bits), _random_prime(subgroup_bits))
                p, q = _subgroup_prime(key_bits // 2, alphas[0]), _subgroup_prime(key_bits // 2, alphas[1])
            else:
                p, q = _random_prime(key_bits // 2), _random_prime(key_bits // 2)
            n = p * q
            if (p != q and n.bit_length() == key_bits and math.gcd(n, (p - 1) * (q - 1)) == 1
                    and (alphas is None or alphas[0] != alphas[1])):
                break
        while True:
            x = secrets.randbelow(n - 2) + 2
            if math.gcd(x, n) != 1:
                continue
            if alphas is None:
                h = (-x * x) % n
                break
            # h of order alpha_p alpha_q: x to the cofactor, checked to be 1 neither mod p nor mod q
            h = int(gmpy2.powmod(x, ((p - 1) // alphas[0]) * ((q - 1) // alphas[1]), n))
            if h % p != 1 and h % q != 1:
                break
        hs = int(gmpy2.powmod(h, n, gmpy2.mpz(n) * n))
        with warnings.catch_warnings():
            # the public key warns again (once) below with the caller's stack level
            warnings.simplefilter("ignore", InsecureKeyWarning)
            public = PackedPaillierPublicKey(
                n,
                hs,
                value_bits=value_bits,
                clip=clip,
                max_total_weight=max_total_weight,
                exponent_bits=exponent_bits,
            )
        if key_bits < SECURE_KEY_BITS:
            warnings.warn(
                f"A {key_bits}-bit Paillier modulus is insecure (use >= {SECURE_KEY_BITS} bits "
                "outside tests).",
                InsecureKeyWarning,
                stacklevel=2,
            )
        if public.exponent_bits < default_exponent_bits(key_bits):
            warnings.warn(
                f"Obfuscator exponents of {public.exponent_bits} bits are shorter than half "
                f"the modulus ({default_exponent_bits(key_bits)} bits).",
                ShortExponentWarning,
                stacklevel=2,
            )
        return PackedPaillierSecretKey(p, q, public, alphas)

    @classmethod
    def public_key_from_bytes(cls, data: bytes) -> PackedPaillierPublicKey:
        return PackedPaillierPublicKey.from_bytes(data)

    @classmethod
    def secret_key_from_bytes(cls, data: bytes) -> PackedPaillierSecretKey:
        return PackedPaillierSecretKey.from_bytes(data)
