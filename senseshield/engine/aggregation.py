"""FedAvg over selectively encrypted updates (SenseCrypt sec. 3.3, Alg. 1 lines 10-14).

Each client i sends its update Δ_i = W_i − W_global split by its own mask X_i: the values
at X_i as one :class:`~senseshield.he.base.EncryptedVector`, the rest in plaintext. The
coordinator, which holds only the public key, computes

    A = Σ_i n_i Δ_i                      (n_i = sample count, an integer weight)

position by position: inside the union mask X̂ = ∪_i X_i as one ciphertext (ciphertexts of
the clients that encrypted the position, plus the plaintexts of those that did not: Paillier
adds plaintext to ciphertext), outside X̂ in plaintext. Only X̂ is decrypted, by the key
server. The mean update is A / Σ_i n_i, exactly plaintext FedAvg up to the scheme's
fixed-point encoding (property-tested).

What the coordinator learns: every client's mask and its plaintext values outside it, and
the aggregate. Everything here is pure computation, no I/O.

Never a sum of fewer than k: with schemes whose clients encrypt different
positions (``ragged_masks``: Paillier, packed Paillier), a union position that only one
client encrypted would be decrypted as that client's value plus the others' plaintext,
which the coordinator knows: the individual value. With ``min_encryptors = k`` (default 2)
a union position encrypted by 1..k-1 clients is *thin*: it stays in the verified
ciphertext but is never decrypted; its mean comes from the clients that sent it in
plaintext alone (:attr:`EncryptedAggregate.thin_mask`, :func:`thin_positions`), so the
encryptors' values there do not enter the model that round. The key server recounts the
encryptors from the contributors' signed masks and refuses an aggregate that would decrypt
a thin position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from senseshield.errors import ProtocolError
from senseshield.he.base import (
    Accumulator,
    CipherPart,
    EncryptedVector,
    PartsAccumulator,
    PlainPart,
    PublicKey,
    SecretKey,
)

MASK_BYTES_PER_PARAM = 1 / 8  # masks travel as bitsets
PLAIN_BYTES_PER_PARAM = 4  # float32


@dataclass
class ProtectedUpdate:
    """One client's protected update for one round (agent -> coordinator).

    ``mask`` marks encrypted positions; ``ciphertext`` holds Δ at the mask (None if the mask
    is empty); ``withheld`` (None = nothing) marks positions the client does not send at all
    (SelectiveShield's personalised zone); ``plaintext`` holds Δ at the remaining positions
    (neither masked nor withheld), in position order.
    """

    client_id: str
    round: int
    cluster: int
    n_samples: int
    size: int
    mask: np.ndarray
    ciphertext: EncryptedVector | None
    plaintext: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    withheld: np.ndarray | None = None

    @property
    def sent(self) -> np.ndarray:
        """Positions this update contributes to (encrypted or plaintext)."""
        if self.withheld is None:
            return np.ones(self.size, dtype=bool)
        return ~self.withheld

    @property
    def plain_positions(self) -> np.ndarray:
        keep = ~self.mask if self.withheld is None else ~self.mask & ~self.withheld
        return np.flatnonzero(keep)

    @property
    def he_ratio(self) -> float:
        return float(np.count_nonzero(self.mask)) / self.size if self.size else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: mask bitset(s) + float32 plaintext + ciphertext."""
        cipher = self.ciphertext.nbytes if self.ciphertext is not None else 0
        bitsets = 1 if self.withheld is None else 2
        return int(
            np.ceil(self.size * MASK_BYTES_PER_PARAM) * bitsets
            + self.plaintext.size * PLAIN_BYTES_PER_PARAM
            + cipher
        )


@dataclass
class EncryptedAggregate:
    """Σ n_i Δ_i of one cluster: ciphertext over the union mask, plaintext elsewhere."""

    round: int
    cluster: int
    size: int
    union_mask: np.ndarray
    ciphertext: EncryptedVector | None
    plain_sum: np.ndarray  # float64 weighted sum at ~union_mask positions
    total_weight: int
    contributors: list[str]
    # Σ n_i over the clients that sent each position; None when every client sent every
    # position (then total_weight divides everywhere). Positions nobody sent get mean 0.
    position_weight: np.ndarray | None = None
    # union positions encrypted by fewer than min_encryptors clients (never decrypted), and the
    # plaintext senders' weighted sums there (position_weight then holds their weights)
    thin_mask: np.ndarray | None = None
    thin_sum: np.ndarray | None = None
    # every contributor's packed encryption mask (np.packbits; ragged schemes: the key server
    # recounts the encryptors from them, each checked against its signed receipt)
    masks: dict[str, np.ndarray] | None = None
    # verifiable schemes: every contributor's plaintext part (withheld mask or None, float32
    # values), for the key server to recompute the plaintext side (recompute_plain_side)
    plains: dict[str, tuple[np.ndarray | None, np.ndarray]] | None = None

    @property
    def decrypted_mask(self) -> np.ndarray:
        """The positions the key server decrypts: the union minus the thin positions."""
        return self.union_mask if self.thin_mask is None else self.union_mask & ~self.thin_mask


def protect_update(
    delta: np.ndarray,
    mask: np.ndarray,
    public_key: PublicKey | None,
    *,
    client_id: str,
    round: int,
    cluster: int,
    n_samples: int,
    withheld: np.ndarray | None = None,
) -> ProtectedUpdate:
    """Encrypt ``delta[mask]``, drop ``delta[withheld]``, keep the rest in plaintext (Alg. 1 line 10)."""
    delta = np.asarray(delta, dtype=np.float64).ravel()
    mask = np.asarray(mask, dtype=bool).ravel()
    if delta.shape != mask.shape:
        raise ValueError(f"Update has {delta.size} values but the mask has {mask.size}.")
    if withheld is not None:
        withheld = np.asarray(withheld, dtype=bool).ravel()
        if withheld.shape != mask.shape:
            raise ValueError(f"Withheld mask has {withheld.size} positions; the update has {mask.size}.")
        if np.any(withheld & mask):
            raise ValueError("A position cannot be both encrypted and withheld.")
        if not np.any(withheld):
            withheld = None
    keep = ~mask if withheld is None else ~mask & ~withheld
    delta = np.where(keep | mask, delta, 0.0)  # withheld values never enter the update
    if not np.all(np.isfinite(delta)):
        bad = int(np.flatnonzero(~np.isfinite(delta))[0])
        raise ValueError(f"Update value at position {bad} is {delta[bad]}; it must be finite.")
    if n_samples < 1:
        raise ValueError(f"n_samples is {n_samples}; a contributing client has at least 1.")
    positions = np.flatnonzero(mask)
    ciphertext = None
    if positions.size:
        if public_key is None:
            raise ValueError("The mask selects positions to encrypt but no public key is set.")
        ciphertext = (public_key.encrypt(delta[positions], positions, weight=int(n_samples))
                      if public_key.prefolds_weight else public_key.encrypt(delta[positions], positions))
    return ProtectedUpdate(
        client_id=client_id,
        round=round,
        cluster=cluster,
        n_samples=int(n_samples),
        size=delta.size,
        mask=mask,
        ciphertext=ciphertext,
        plaintext=delta[keep].astype(np.float32),
        withheld=withheld,
    )


def validate_update(update: ProtectedUpdate, *, size: int, round: int) -> None:
    """Reject an update that does not fit the round (raises :class:`ProtocolError`)."""
    who = f"Update from {update.client_id!r}"
    if update.round != round:
        raise ProtocolError(f"{who} is for round {update.round}, not the current round {round}.")
    if update.size != size:
        raise ProtocolError(f"{who} covers {update.mask.size} parameters; the model has {size}.")
    check_plain_part(who, size=size, mask=update.mask, withheld=update.withheld, plaintext=update.plaintext,
                     n_samples=update.n_samples)
    cipher_positions = (
        update.ciphertext.positions if update.ciphertext is not None else np.empty(0, np.int64)
    )
    if not np.array_equal(cipher_positions, np.flatnonzero(update.mask)):
        raise ProtocolError(f"{who} has a ciphertext that does not match its mask.")


def check_plain_part(who: str, *, size: int, mask: np.ndarray, withheld: np.ndarray | None, plaintext: np.ndarray,
                     n_samples: int) -> None:
    """An update's masks, plaintext part and sample count must fit a model of ``size``
    parameters (raises :class:`ProtocolError` beginning with ``who``)."""
    if mask.shape != (size,):
        raise ProtocolError(f"{who} covers {mask.size} parameters; the model has {size}.")
    n_masked = int(np.count_nonzero(mask))
    n_withheld = 0
    if withheld is not None:
        if withheld.shape != (size,):
            raise ProtocolError(f"{who} has a withheld mask of {withheld.size} positions; the model has {size}.")
        if np.any(withheld & mask):
            raise ProtocolError(f"{who} marks positions as both encrypted and withheld.")
        n_withheld = int(np.count_nonzero(withheld))
    expected = size - n_masked - n_withheld
    if plaintext.shape != (expected,):
        raise ProtocolError(
            f"{who} has {plaintext.size} plaintext values; its masks leave {expected}."
        )
    if not np.all(np.isfinite(plaintext)):
        raise ProtocolError(f"{who} contains NaN or inf in its plaintext part.")
    if n_samples < 1:
        raise ProtocolError(f"{who} claims {n_samples} samples; at least 1 is required.")


def unit_starts(positions: np.ndarray, block_size: int) -> np.ndarray:
    """Indices of the first of each unit (``block_size`` consecutive model positions) in the
    sorted ``positions`` of a ciphertext."""
    units = np.asarray(positions, dtype=np.int64) // max(1, int(block_size))
    return np.flatnonzero(np.concatenate([[True], units[1:] != units[:-1]])) if units.size else units


def thin_positions(packed: Sequence[np.ndarray], union: np.ndarray, min_encryptors: int) -> np.ndarray:
    """Union positions that 1..``min_encryptors``-1 of the ``packed`` masks (np.packbits)
    encrypt (bool, like ``union``)."""
    if min_encryptors < 1:
        raise ValueError(f"min_encryptors={min_encryptors} is not allowed; it must be at least 1.")
    counts = np.zeros(union.shape, dtype=np.int64)
    for m in packed:
        counts += np.unpackbits(m, count=union.size).astype(bool)
    return union & (counts < min_encryptors)


def thin_report(packed: dict[str, np.ndarray], thin: np.ndarray, *, block_size: int = 1,
                limit: int = 20) -> dict:
    """What a report says of the thin positions: how many, and the first ``limit`` blocks
    with the clients that encrypted them (``{"positions": N, "blocks_total": B, "blocks":
    [[block, [ids]], ...]}``); ``packed``: every client's mask (np.packbits)."""
    where = np.flatnonzero(thin)
    B = max(1, int(block_size))
    blocks = np.unique(where // B)[:limit].tolist()
    named: dict[int, list[str]] = {b: [] for b in blocks}
    for c in sorted(packed):
        mask = np.unpackbits(packed[c], count=thin.size).astype(bool)
        for b in blocks:
            if mask[b * B : (b + 1) * B].any():
                named[b].append(c)
    return {"positions": int(where.size), "blocks_total": int(np.unique(where // B).size),
            "blocks": [[b, named[b]] for b in blocks]}


def aggregate_sealed(aggregate: "EncryptedAggregate", public_key: PublicKey | None) -> dict | None:
    """:func:`thin_report` of an aggregate's sealed positions, None if there are none."""
    if aggregate.thin_mask is None or not aggregate.masks:
        return None
    return thin_report(aggregate.masks, aggregate.thin_mask,
                       block_size=public_key.block_size if public_key is not None else 1)


SLICE_BITS = 32
_SLICES = [2.0 ** (SLICE_BITS * j) for j in range(4, -6, -1)]  # 2^128 .. 2^-160, high to low


class ExactSum:
    """Order-independent sums of float64 terms per position: each term is cut into 32-bit
    slices on a fixed exponent grid (2^-160 .. 2^160) and every slice is summed exactly
    (its terms are multiples of the slice's unit below 2^53 of them), so the total is the
    same bits whatever order the terms arrive in. Terms are weight x float32 values here:
    at most 44 significant bits, so nothing above 2^-160 is lost. Memory: one float64 per
    position for each slice the terms reach (model deltas: 2-3)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.slices: dict[int, np.ndarray] = {}  # allocated when a term first reaches the slice

    def add(self, positions: np.ndarray, terms: np.ndarray) -> None:
        terms = np.asarray(terms, dtype=np.float64)
        if not terms.size:
            return
        top = float(np.max(np.abs(terms)))
        above = np.zeros_like(terms)
        for i, unit in enumerate(_SLICES):
            if unit > top:  # every term is below this unit: its slice part is 0
                continue
            upto = np.trunc(terms / unit) * unit  # the term truncated to multiples of this unit
            part = upto - above
            if part.any():
                if i not in self.slices:
                    self.slices[i] = np.zeros(self.size, dtype=np.float64)
                self.slices[i][positions] += part
            if np.array_equal(upto, terms):  # nothing left below: the finer slices' parts are 0
                break
            above = upto

    def merge(self, other: "ExactSum") -> None:
        """Add ``other``'s sums (the same positions): exact, as if its terms were added here."""
        for i, part in other.slices.items():
            if i not in self.slices:
                self.slices[i] = np.zeros(self.size, dtype=np.float64)
            self.slices[i] += part

    def value(self) -> np.ndarray:
        """The sums, each correctly rounded once: the slices' sums are exact, and adding them
        in float64 would round at every step (a large slice cancelling another drops a small
        one's bits), so each position's slices are added by ``math.fsum``."""
        parts = [self.slices[i] for i in sorted(self.slices)]
        if not parts:
            return np.zeros(self.size, dtype=np.float64)
        if len(parts) == 1:
            return parts[0].copy()
        rows = np.stack(parts, axis=1).tolist()
        return np.fromiter((math.fsum(row) for row in rows), dtype=np.float64, count=self.size)


class StreamingAggregate:
    """Σ n_i Δ_i of one cluster built as updates arrive (the coordinator's running
    aggregate): each update is checked and folded in by :meth:`add`, and :meth:`result`
    gives the :class:`EncryptedAggregate` of everything added. Ciphertexts go to the
    scheme's :class:`~senseshield.he.base.Accumulator` (packed Paillier: a running product
    per block, exact; other schemes keep the parts), plaintext to :class:`ExactSum` sums,
    so the result does not depend on the arrival order and memory does not grow with the
    number of updates (packed Paillier, plaintext). A rejected update leaves it unchanged.

    The plaintext side alone (:meth:`add_plain`, :meth:`plain_side`) is what the key server
    rebuilds from the contributors' signed plaintext parts (:func:`recompute_plain_side`):
    the same code, so an honest coordinator's aggregate and the key server's recomputation
    agree bit for bit. With a verifiable key the aggregate keeps each contributor's
    plaintext part (references, no copy) for the aggregate request."""

    def __init__(self, public_key: PublicKey | None, *, size: int, round: int, cluster: int,
                 accumulator: Accumulator | None = None, min_encryptors: int = 1) -> None:
        self.public_key, self.size, self.round, self.cluster = public_key, int(size), round, cluster
        # the k rule applies where clients encrypt different positions (see the module doc)
        self.ragged = public_key is not None and public_key.ragged_masks
        self.min_encryptors = int(min_encryptors) if self.ragged else 1
        if self.min_encryptors < 1:
            raise ValueError(f"min_encryptors={min_encryptors} is not allowed; it must be at least 1.")
        self.encryptors = np.zeros(self.size, dtype=np.int32)
        self.plain_weight = np.zeros(self.size, dtype=np.int64)
        self.masks: dict[str, np.ndarray] = {}
        # the key server recomputes the plaintext side of a verifiable aggregate from these
        self.plains: dict[str, tuple[np.ndarray | None, np.ndarray]] | None = (
            {} if public_key is not None and public_key.verifiable else None)
        self.accumulator = accumulator if accumulator is not None else (
            public_key.accumulator(self.size) if public_key is not None else None)
        self.union = np.zeros(self.size, dtype=bool)
        self.plain = ExactSum(self.size)
        self.position_weight = np.zeros(self.size, dtype=np.int64)
        self.withheld = False
        self.total_weight = 0
        self.contributors: list[str] = []

    def add(self, update: ProtectedUpdate) -> None:
        """Check ``update`` against the round (:func:`validate_update`, one per client) and
        fold it in; :class:`ProtocolError` rejects it and changes nothing."""
        validate_update(update, size=self.size, round=self.round)
        if update.client_id in self.contributors:
            raise ProtocolError(f"Client {update.client_id!r} sent two updates for round {self.round}.")
        if update.ciphertext is not None:
            if self.accumulator is None:
                raise ProtocolError("Encrypted updates arrived but the coordinator has no public key.")
            self.accumulator.add(CipherPart(update.ciphertext, update.n_samples,
                                            folded=self.public_key.prefolds_weight), key=update.client_id)
        self._fold_plain(update.client_id, update.n_samples, update.mask, update.withheld, update.plaintext)

    def add_plain(self, part: "PlainContribution") -> None:
        """Fold in the plaintext side of one contribution whose ciphertext is not here (the
        key server's recomputation): its mask, withheld zone and plaintext values, checked
        as :meth:`add` checks an update's."""
        who = f"The plaintext part of {part.client_id!r}"
        check_plain_part(who, size=self.size, mask=part.mask, withheld=part.withheld, plaintext=part.plaintext,
                         n_samples=part.n_samples)
        if part.client_id in self.contributors:
            raise ProtocolError(f"{who} is given twice.")
        self._fold_plain(part.client_id, part.n_samples, part.mask, part.withheld, part.plaintext)

    def _fold_plain(self, client_id: str, n_samples: int, mask: np.ndarray, withheld: np.ndarray | None,
                    plaintext: np.ndarray) -> None:
        keep = ~mask if withheld is None else ~mask & ~withheld
        unmasked = np.flatnonzero(keep)
        values = plaintext.astype(np.float64)
        if self.accumulator is not None and unmasked.size:
            self.accumulator.add(PlainPart(unmasked, values, n_samples), key=client_id)
        self.union |= mask
        self.plain.add(unmasked, n_samples * values)
        self.position_weight += n_samples if withheld is None else n_samples * ~withheld
        if self.ragged:  # the key server recounts the encryptors from these (signed) masks
            self.encryptors += mask
            self.plain_weight[unmasked] += n_samples
            self.masks[client_id] = np.packbits(mask)
        if self.plains is not None:
            self.plains[client_id] = (withheld, plaintext)
        self.withheld |= withheld is not None
        self.total_weight += int(n_samples)
        self.contributors.append(client_id)

    def merge(self, other: "StreamingAggregate") -> None:
        """Fold in ``other``, the running aggregate of other contributors of the same round and
        cluster (a site's partial sum, :mod:`senseshield.engine.partial`): the result is the
        aggregate of both sets of updates, bit for bit, however they were split.
        :class:`ProtocolError`, changing nothing, if a contributor is in both or they do not fit."""
        if (other.size, other.round, other.cluster, other.ragged) != (self.size, self.round, self.cluster, self.ragged):
            raise ProtocolError(f"A partial sum of round {other.round} cluster {other.cluster} ({other.size} "
                                f"parameters) cannot join round {self.round} cluster {self.cluster} ({self.size}).")
        both = set(self.contributors) & set(other.contributors)
        if both:
            raise ProtocolError(f"A partial sum repeats contributor(s) {', '.join(sorted(both))} of round {self.round}.")
        if (self.plains is None) != (other.plains is None):
            raise ProtocolError("A partial sum without its contributors' plaintext parts cannot join a verifiable "
                                "aggregate, or the reverse.")
        if (other.accumulator is None) != (self.accumulator is None):
            raise ProtocolError("A partial sum under a public key cannot join a plaintext aggregate, or the reverse.")
        if other.accumulator is not None:
            self.accumulator.merge(other.accumulator)
        self.union |= other.union
        self.plain.merge(other.plain)
        self.position_weight += other.position_weight
        self.encryptors += other.encryptors
        self.plain_weight += other.plain_weight
        self.masks.update(other.masks)
        if self.plains is not None:
            self.plains.update(other.plains)
        self.withheld |= other.withheld
        self.total_weight += other.total_weight
        self.contributors.extend(other.contributors)

    def __len__(self) -> int:
        return len(self.contributors)

    def result(self) -> EncryptedAggregate:
        """The aggregate of every update added (Alg. 1 l. 11-12)."""
        if not self.contributors:
            raise ProtocolError(f"Cluster {self.cluster} has no updates to aggregate in round {self.round}.")
        union_positions = np.flatnonzero(self.union)
        ciphertext = None
        if union_positions.size:
            if self.accumulator is None:
                raise ProtocolError("Encrypted updates arrived but the coordinator has no public key.")
            ciphertext = self.accumulator.result(union_positions)
        plain_sum, weights, thin, thin_sum = self._plain_sums()
        return EncryptedAggregate(
            round=self.round,
            cluster=self.cluster,
            size=self.size,
            union_mask=self.union.copy(),
            ciphertext=ciphertext,
            plain_sum=plain_sum,
            total_weight=self.total_weight,
            contributors=sorted(self.contributors),
            position_weight=weights,
            thin_mask=thin,
            thin_sum=thin_sum,
            masks=dict(self.masks) if self.ragged and union_positions.size else None,
            plains=dict(self.plains) if self.plains is not None else None,
        )

    def _plain_sums(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """The aggregate's plaintext side outside the ciphertext: the sums at the positions
        nobody encrypted, the position weights (None: the total weight everywhere), and the
        thin positions with the plaintext senders' sums there (None, None: none)."""
        plain = self.plain.value()
        weights = self.position_weight.copy() if self.withheld else None
        thin = thin_sum = None
        if self.ragged and self.union.any():
            thin = self.union & (self.encryptors < self.min_encryptors)
            if thin.any():
                weights = self.position_weight.copy()
                weights[thin] = self.plain_weight[thin]
                thin_sum = plain[thin]
            else:
                thin = None
        return plain[~self.union], weights, thin, thin_sum

    def plain_side(self, like: EncryptedVector | None) -> "PlainSide":
        """The plaintext side of the parts added so far (:class:`PlainSide`); ``like``: the
        aggregate's ciphertext, whose units the plaintext fold and the unit weights are of."""
        plain_sum, weights, thin, thin_sum = self._plain_sums()
        fold, units = b"", None
        if like is not None:
            if self.accumulator is None:
                raise ProtocolError("An encrypted aggregate's plaintext side needs its public key.")
            fold = self.accumulator.fold(like)
            block = self.public_key.block_size if self.public_key is not None else 1
            positions = np.asarray(like.positions)
            units = self.position_weight[positions[unit_starts(positions, block)]]
        return PlainSide(plain_sum=plain_sum, position_weight=weights, thin_mask=thin, thin_sum=thin_sum,
                         fold=fold, unit_weights=units, union=self.union.copy())


@dataclass(frozen=True)
class PlainContribution:
    """One contributor's plaintext side, as the key server knows it: the sample count and
    mask its receipt signs, and its plaintext part (withheld zone, values) whose digest the
    receipt signs."""

    client_id: str
    n_samples: int
    mask: np.ndarray
    withheld: np.ndarray | None
    plaintext: np.ndarray


@dataclass
class PlainSide:
    """What an aggregate adds in plaintext, recomputed from its contributors' plaintext parts
    (:func:`recompute_plain_side`): ``plain_sum`` at the positions nobody encrypted,
    ``position_weight`` (None: the total weight everywhere), the thin positions and their
    plaintext senders' sums, ``fold``: the plaintext folded into each ciphertext unit
    (:meth:`~senseshield.he.base.PublicKey.plain_fold`'s bytes), ``unit_weights``: the total
    weight of each ciphertext unit's senders (what packed Paillier's block weights must
    be), and the union of the contributors' masks."""

    plain_sum: np.ndarray
    position_weight: np.ndarray | None
    thin_mask: np.ndarray | None
    thin_sum: np.ndarray | None
    fold: bytes
    unit_weights: np.ndarray | None
    union: np.ndarray


def recompute_plain_side(public_key: PublicKey | None, aggregate: EncryptedAggregate,
                         parts: Sequence[PlainContribution] | Iterator[PlainContribution], *,
                         min_encryptors: int = 1) -> PlainSide:
    """The key server's side of a verifiable aggregate: its plaintext side rebuilt from the
    contributors' ``parts`` with the coordinator's own code (:class:`StreamingAggregate`'s
    plaintext half and the scheme's accumulator, fed the same :class:`PlainPart` objects),
    never from what the coordinator declares. Parts are added in client-id order: a sequence
    is sorted, an iterator (a fleet's parts made one at a time) must yield them so. Pure;
    :class:`ProtocolError` for a part that does not fit the model, or an iterator out of order."""
    running = StreamingAggregate(public_key, size=aggregate.size, round=aggregate.round, cluster=aggregate.cluster,
                                 min_encryptors=min_encryptors)
    running.plains = None  # nothing to forward
    last = None
    for part in (parts if isinstance(parts, Iterator) else sorted(parts, key=lambda p: p.client_id)):
        if last is not None and part.client_id <= last:
            raise ProtocolError(f"Plaintext parts out of client-id order ({part.client_id!r} after {last!r}).")
        last = part.client_id
        running.add_plain(part)
    return running.plain_side(aggregate.ciphertext)


def aggregate_updates(
    updates: Sequence[ProtectedUpdate], public_key: PublicKey | None, *, round: int, cluster: int,
    streaming: bool = False, min_encryptors: int = 1,
) -> EncryptedAggregate:
    """Coordinator side: Σ n_i Δ_i with ciphertexts summed over the union mask (Alg. 1 l. 11-12).
    ``streaming=False`` (the reference): the scheme's batch ``aggregate`` over all parts at
    once; ``True``: its running accumulator. Both give the same aggregate (tested).
    ``min_encryptors``: union positions fewer clients encrypted are left undecrypted (thin)."""
    if not updates:
        raise ProtocolError(f"Cluster {cluster} has no updates to aggregate in round {round}.")
    size = updates[0].size
    accumulator = None
    if public_key is not None and not streaming:
        accumulator = PartsAccumulator(public_key)
    running = StreamingAggregate(public_key, size=size, round=round, cluster=cluster, accumulator=accumulator,
                                 min_encryptors=min_encryptors)
    for update in updates:
        running.add(update)
    return running.result()


def decrypt_aggregate(
    aggregate: EncryptedAggregate, secret_key: SecretKey | None, *, threads: int = 1
) -> np.ndarray:
    """Key server side: decrypt the union part only and return the mean update (float64).
    ``threads``: decryption threads where the scheme can use them (packed Paillier).

    Alg. 1 lines 13-14 with the dual-server split of SenseCrypt App. I.
    """
    mean = np.zeros(aggregate.size, dtype=np.float64)
    mean[~aggregate.union_mask] = aggregate.plain_sum
    if aggregate.ciphertext is not None:
        if secret_key is None:
            raise ProtocolError("The aggregate is encrypted but no secret key is available.")
        ciphertext = aggregate.ciphertext
        if aggregate.thin_mask is not None:  # never decrypted: the plaintext senders' sums alone
            if aggregate.thin_sum is None or aggregate.position_weight is None:
                raise ProtocolError("An aggregate with thin positions needs their plaintext sums and weights.")
            mean[aggregate.thin_mask] = aggregate.thin_sum
            ciphertext = secret_key.public_key.select(ciphertext, np.flatnonzero(aggregate.decrypted_mask))
        if ciphertext is not None:
            mean[ciphertext.positions] = secret_key.decrypt(ciphertext, threads=threads)
    if aggregate.position_weight is None:
        return mean / aggregate.total_weight
    weight = aggregate.position_weight.astype(np.float64)
    return np.divide(mean, weight, out=np.zeros_like(mean), where=weight > 0)


def fedavg(deltas: Sequence[np.ndarray], weights: Sequence[int]) -> np.ndarray:
    """Plaintext FedAvg Σ n_i Δ_i / Σ n_i (reference for tests and the plaintext strategy)."""
    stacked = np.stack([np.asarray(d, dtype=np.float64) for d in deltas])
    w = np.asarray(weights, dtype=np.float64)
    return (w[:, None] * stacked).sum(axis=0) / w.sum()
