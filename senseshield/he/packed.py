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

Modules: this one holds the secret key (CRT decryption) and key generation, and registers
the scheme; the public key (encryption, aggregation, wire format, fingerprints) is
:mod:`senseshield.he.packed_public`, the streaming aggregate
:mod:`senseshield.he.packed_accumulator`, and the quantisation and packing
:mod:`senseshield.he.encoding`. Their public names are importable from here.
"""

from __future__ import annotations

import json
import math
import secrets
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import gmpy2
import numpy as np

from senseshield.errors import ConfigError, ProtocolError, SecretKeyExportError
from senseshield.he.base import SCHEMES, EncryptedVector, PublicKey, Scheme, SecretKey, int_param
from senseshield.he.encoding import (
    DEFAULT_CLIP,
    DEFAULT_MAX_TOTAL_WEIGHT,
    DEFAULT_VALUE_BITS,
    ClippingWarning,
    PackedLayout,
    unpack,
)
from senseshield.he.obfuscation import ShortExponentWarning, default_exponent_bits
from senseshield.he.packed_accumulator import PackedAccumulator
from senseshield.he.packed_public import SCHEME_NAME, PackedPaillierPublicKey, PackedPayload
from senseshield.he.paillier import DEFAULT_KEY_BITS, InsecureKeyWarning, check_key_bits, warn_insecure

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_MAX_TOTAL_WEIGHT",
    "DEFAULT_VALUE_BITS",
    "ClippingWarning",
    "PackedAccumulator",
    "PackedLayout",
    "PackedPaillierPublicKey",
    "PackedPaillierScheme",
    "PackedPaillierSecretKey",
    "PackedPayload",
]


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
        slots = unpack(plain, B, lay.slot_bits)
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
    public_key_class: ClassVar[type[PublicKey]] = PackedPaillierPublicKey
    secret_key_class: ClassVar[type[SecretKey]] = PackedPaillierSecretKey
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
        key_bits = check_key_bits(key_bits)
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
        warn_insecure(key_bits, stacklevel=2)
        if public.exponent_bits < default_exponent_bits(key_bits):
            warnings.warn(
                f"Obfuscator exponents of {public.exponent_bits} bits are shorter than half "
                f"the modulus ({default_exponent_bits(key_bits)} bits).",
                ShortExponentWarning,
                stacklevel=2,
            )
        return PackedPaillierSecretKey(p, q, public, alphas)
