"""The streaming packed-Paillier aggregate (:meth:`PackedPaillierPublicKey.accumulator`)."""

from __future__ import annotations

import warnings
from typing import Any

import gmpy2
import numpy as np

from senseshield.errors import ProtocolError
from senseshield.he.base import Accumulator, CipherPart, EncryptedVector, PlainPart, check_weight, repeats
from senseshield.he.encoding import ClippingWarning, block_layout, groups, pack, union_positions
from senseshield.he.packed_public import PackedPaillierPublicKey, PackedPayload, folded_weight

__all__ = ["PackedAccumulator"]


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
            weight = folded_weight(part, bweights, weight, k)
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
            blocks, counts = groups(ppos // pk.block_size)
            self.plain_weight[blocks] += weight
            self.plain_min[blocks] = np.minimum(self.plain_min[blocks], counts)
            self.plain_max[blocks] = np.maximum(self.plain_max[blocks], counts)
        else:
            raise ProtocolError(f"Part {k} is a {type(part).__name__}, not a CipherPart or PlainPart.")
        self.parts += 1

    def result(self, positions: np.ndarray) -> EncryptedVector:
        pk, lay, B = self.public, self.public.layout, self.public.block_size
        union = union_positions(positions)
        try:
            ublocks, ulengths = block_layout(union, B)
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
            for j, m in zip(rows.tolist(), pack(sums, self.public.layout.slot_bits)):
                plain[j] = int(m)
        return plain, touched

    def fold(self, like: EncryptedVector) -> bytes:
        _, _, blocks, lengths = self.public._check_payload(like, "The aggregate")
        return self.public._fold_bytes(self._fold(blocks, lengths)[0])

    # ---- a site's partial sum (senseshield.engine.partial) -------------------------------
    _ARRAYS = {"cipher_weight": np.int64, "plain": np.int64, "plain_clipped": np.int32, "plain_weight": np.int64,
               "plain_min": np.int64, "plain_max": np.int64}

    def merge(self, other: Accumulator) -> None:
        """Take in ``other``'s running products and sums (a site's partial sum under the same
        key): products multiply per block modulo n², sums and weights add, so the result is
        that of every part added here; ProtocolError, changing nothing, if they do not fit."""
        if not isinstance(other, PackedAccumulator) or other.public.key_id != self.public.key_id \
                or other.size != self.size:
            raise ProtocolError("A partial sum under another key or of another model cannot join this aggregate.")
        for b, length in other.lengths.items():
            if self.lengths.get(b, length) != length:
                raise ProtocolError("A partial sum covers a partial block that differs from the aggregate's.")
        limit = self.public.layout.max_total_weight
        after = self.cipher_weight + other.cipher_weight
        if np.any(after > limit):
            j = int(np.argmax(after > limit))
            self.public._raise_headroom(j, int(after[j]))
        nsquare = self.public._nsquare
        for b, c in other.products.items():
            acc = self.products.get(b)
            self.products[b] = c if acc is None else acc * c % nsquare
            self.lengths[b] = other.lengths[b]
        self.cipher_weight = after
        self.cipher_clipped += other.cipher_clipped
        self.plain = self.plain + other.plain
        self.plain_clipped = self.plain_clipped + other.plain_clipped
        self.plain_weight = self.plain_weight + other.plain_weight
        self.plain_min = np.minimum(self.plain_min, other.plain_min)
        self.plain_max = np.maximum(self.plain_max, other.plain_max)
        self.parts += other.parts

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        blocks = sorted(self.products)
        width = self.public.ciphertext_nbytes
        products = b"".join(int(self.products[b]).to_bytes(width, "big") for b in blocks)
        arrays = {name: getattr(self, name) for name in self._ARRAYS}
        arrays.update(blocks=np.array(blocks, dtype=np.int64), lengths=np.array([self.lengths[b] for b in blocks],
                                                                                dtype=np.int64),
                      products=np.frombuffer(products, dtype=np.uint8))
        return {"parts": int(self.parts), "cipher_clipped": int(self.cipher_clipped)}, arrays

    @classmethod
    def from_state(cls, public: PackedPaillierPublicKey, size: int, fields: dict,
                   arrays: dict[str, np.ndarray]) -> "PackedAccumulator":
        """The running aggregate :meth:`state` described, every field checked against the key
        and the model's ``size``; ProtocolError naming what does not fit."""
        acc = cls(public, size)
        for name in ("parts", "cipher_clipped"):
            value = fields.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"A partial sum's {name} must be a non-negative integer.")
        acc.parts, acc.cipher_clipped = fields["parts"], fields["cipher_clipped"]
        for name, dtype in cls._ARRAYS.items():
            value = arrays.get(f"{name}")
            like = getattr(acc, name)
            if value is None or value.shape != like.shape or value.dtype != np.dtype(dtype):
                raise ProtocolError(f"A partial sum's {name} must be {like.size} values of {np.dtype(dtype).name}.")
            setattr(acc, name, value.copy())
        limit = public.layout.max_total_weight
        if np.any(acc.cipher_weight < 0) or np.any(acc.cipher_weight > limit) or np.any(acc.plain_weight < 0) \
                or np.any(acc.plain_clipped < 0):
            raise ProtocolError(f"A partial sum's block weights must be within 0..{limit}.")
        blocks, lengths, products = arrays.get("blocks"), arrays.get("lengths"), arrays.get("products")
        width, nblocks = public.ciphertext_nbytes, acc.cipher_weight.size
        if blocks is None or lengths is None or products is None or blocks.dtype != np.int64 \
                or lengths.shape != blocks.shape or products.dtype != np.uint8 or products.size != width * blocks.size \
                or (blocks.size and (blocks[0] < 0 or blocks[-1] >= nblocks or np.any(np.diff(blocks) <= 0))) \
                or np.any(lengths < 1) or np.any(lengths > public.block_size):
            raise ProtocolError(f"A partial sum's blocks must be increasing within 0..{nblocks - 1}, each with its "
                                f"length and one {width}-byte ciphertext.")
        raw, nsquare = products.tobytes(), public._nsquare
        for i, (b, length) in enumerate(zip(blocks.tolist(), lengths.tolist())):
            c = gmpy2.mpz(int.from_bytes(raw[i * width:(i + 1) * width], "big"))
            if not 0 < c < nsquare:
                raise ProtocolError(f"A partial sum's ciphertext of block {b} is not below n².")
            acc.products[b], acc.lengths[b] = c, length
        return acc

