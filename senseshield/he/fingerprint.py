"""Fingerprints that let the key server check an aggregate before it decrypts it.

Paillier-family aggregates (per-value and packed) are, unit by unit (a unit is a position,
or a block of the packed scheme), ``C_u = prod_i c_{i,u}^{w_i} * (1 + n P_u) mod n^2``: the
contributors' ciphertexts raised to their sample-count weights, times the plaintext ``P_u``
the coordinator folded in for the contributors that sent unit ``u`` in the clear.

Per round the key server draws a secret 32-byte seed and seals it to the round's agents
(never to the coordinator). It defines one odd 128-bit exponent per unit,
``a_u = HMAC-SHA256(seed, u)[:16] | 2^127 | 1`` (:func:`exponents`). Each agent signs, with
its update, its fingerprint ``F_i = prod_u c_{i,u}^{a_u} mod n^2``; the key server accepts
an aggregate only if::

    prod_u C_u^{a_u}  ==  prod_i F_i^{w_i} * (1 + n * (sum_u a_u P_u mod n))   (mod n^2)

Soundness (argued in docs/security.md): let ``D_u`` be the quotient of the submitted and the
honest aggregate. The check passes iff ``prod_u D_u^{a_u} = 1``. The coordinator fixes
``D`` without knowing the exponents (the seed is sealed to the agents, and recovering it
from the fingerprints is a discrete logarithm), so for a ``D != 1`` the check passes only if
``D`` has an order that divides the random ``a``'s combination: with exponents uniform over
2^126 odd values this has probability <= 2^-126 unless the coordinator can make elements of
small order other than -1 in Z*_{n^2}, which needs the factorisation of ``n`` (the low-order
assumption in RSA groups). ``-1`` itself is harmless: ``-C`` decrypts like ``C``.
Were the exponents public (as in a first design), the integer lattice
``{e : sum_u a_u e_u = 0}`` would have vectors with entries near ``2^(128/(U-1))``, tiny for
a model of hundreds of units, and a coordinator could move small multiples of one agent's
ciphertexts between units undetected; sealing the seed is what closes that.

An agent that made the ciphertext computes its fingerprint from the *openings* (the packed
plaintexts ``m_u`` and obfuscator exponents ``r_u`` its encryption used, kept in
``vector.meta``): ``F = (1 + n (sum a_u m_u mod n)) * h_s^(sum a_u r_u) mod n^2``, one
exponentiation instead of one per unit. Without openings it uses a shared-squaring
multi-exponentiation (:func:`multi_power`).

Pure functions over integers; no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import gmpy2

EXPONENT_BITS = 128
SEED_BYTES = 32


def exponents(seed: bytes, units: Sequence[int]) -> list[int]:
    """The round's challenge exponent of every unit (odd, exactly 128 bits)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"A challenge seed has {SEED_BYTES} bytes, got {len(seed)}.")
    top = 1 << (EXPONENT_BITS - 1)
    out = []
    for u in units:
        digest = hmac.new(seed, b"senseshield-challenge\0" + int(u).to_bytes(8, "big"), hashlib.sha256).digest()
        out.append(int.from_bytes(digest[: EXPONENT_BITS // 8], "big") | top | 1)
    return out


def multi_power(terms: Sequence[tuple[Any, int]], modulus: Any) -> Any:
    """``prod_i c_i^{e_i} mod modulus`` by Pippenger's bucket method: the exponents are cut
    into ``w``-bit windows; per window every base is multiplied into the bucket of its digit
    and the buckets are combined with two running products, so the cost is about
    ``(bits / w) * (K + 2^(w+1))`` multiplications for ``K`` bases instead of ``K * bits / 2``
    plus ``bits`` squarings (Straus); ``w`` grows with ``log2 K``."""
    terms = [(c, int(e)) for c, e in terms if e]
    if not terms:
        return gmpy2.mpz(1)
    if any(e < 0 for _, e in terms):
        raise ValueError("multi_power takes non-negative exponents.")
    bits = max(e for _, e in terms).bit_length()
    w = max(1, min(12, len(terms).bit_length() - 2))
    mask = (1 << w) - 1
    one = gmpy2.mpz(1)
    result = one
    for shift in range(((bits + w - 1) // w - 1) * w, -1, -w):
        if result != 1:
            for _ in range(w):
                result = result * result % modulus
        buckets: dict[int, Any] = {}
        for c, e in terms:
            d = (e >> shift) & mask
            if d:
                b = buckets.get(d)
                buckets[d] = c if b is None else b * c % modulus
        if not buckets:
            continue
        running, total = one, one
        for d in range(max(buckets), 0, -1):
            b = buckets.get(d)
            if b is not None:
                running = running * b % modulus
            total = total * running % modulus
        result = result * total % modulus
    return result


def fingerprint(ciphertexts: Sequence[int], units: Sequence[int], seed: bytes, nsquare: int) -> int:
    """``prod_u c_u^{a_u} mod n^2`` from the ciphertexts alone (anyone holding them)."""
    a = exponents(seed, units)
    m = gmpy2.mpz(nsquare)
    return int(multi_power([(gmpy2.mpz(c), e) for c, e in zip(ciphertexts, a)], m))


def fingerprint_from_openings(plaintexts: Sequence[int], randomness: Sequence[int], units: Sequence[int],
                              seed: bytes, n: int, base: int, power: Any = None) -> int:
    """The same value for ciphertexts ``(1 + m_u n) base^{r_u} mod n^2``, from their openings:
    ``(1 + n (sum a_u m_u mod n)) * base^(sum a_u r_u)``. ``power(x)``, if given, computes
    ``base^x mod n^2`` (e.g. from a fixed-base table)."""
    a = exponents(seed, units)
    nsquare = gmpy2.mpz(n) * n
    m = sum(e * int(p) for e, p in zip(a, plaintexts)) % n
    r = sum(e * int(x) for e, x in zip(a, randomness))
    obfuscator = power(r) if power is not None else gmpy2.powmod(base, r, nsquare)
    return int((1 + gmpy2.mpz(m) * n) * obfuscator % nsquare)


def check(aggregate: Sequence[int], units: Sequence[int], seed: bytes, n: int,
          contributions: Sequence[tuple[int, int]], plain: Sequence[int] | None,
          factors: tuple[int, int] | None = None) -> bool:
    """Whether ``aggregate`` (one ciphertext per unit) equals the product of the contributions
    (fingerprint, weight) and the folded plaintexts ``plain`` (one per unit, or None), modulo
    ``n^2``. ``factors`` (the key server's ``p, q``): the same equation checked modulo ``p^2``
    and ``q^2`` (equivalent by the CRT; half-size numbers make it ~1.4x faster)."""
    a = exponents(seed, units)
    nsquare = gmpy2.mpz(n) * n
    folded = sum(e * int(p) for e, p in zip(a, plain)) % n if plain is not None else None
    moduli = [nsquare] if factors is None else [gmpy2.mpz(f) * f for f in factors]
    for m in moduli:
        lhs = multi_power([(gmpy2.mpz(c) % m, e) for c, e in zip(aggregate, a)], m)
        rhs = multi_power([(gmpy2.mpz(f) % m, w) for f, w in contributions], m)
        if folded is not None:
            rhs = rhs * (1 + gmpy2.mpz(folded) * n) % m
        if lhs != rhs:
            return False
    return True


def int_bytes(value: int, width: int) -> bytes:
    return int(value).to_bytes(width, "big")


def ints_bytes(values: Sequence[int], width: int) -> bytes:
    return b"".join(int(v).to_bytes(width, "big") for v in values)


def bytes_ints(data: bytes, width: int, count: int, what: str) -> list[int]:
    """Inverse of :func:`ints_bytes`; ``ValueError`` naming ``what`` if the length is wrong."""
    if len(data) != width * count:
        raise ValueError(f"{what} has {len(data)} bytes; {count} values of {width} bytes need {width * count}.")
    return [int.from_bytes(data[i * width : (i + 1) * width], "big") for i in range(count)]
