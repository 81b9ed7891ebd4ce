"""Fingerprints of Paillier aggregates (senseshield.he.fingerprint) against brute force.

Honest aggregates pass, for random weights, ragged block masks and plaintext parts; every
deviation a coordinator could make without the round's seed fails: a dropped or added
contributor, another weight, a unit multiplied by someone's ciphertext, units swapped,
another round's seed. The fast path (from the encryption's openings) equals the definition
(a product of powers of the ciphertexts)."""

from __future__ import annotations

import os
import warnings

import gmpy2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from senseshield.he import SCHEMES, CipherPart, PlainPart
from senseshield.he import fingerprint as fp

warnings.filterwarnings("ignore", message=".*insecure.*")


@pytest.fixture(scope="module", params=["packed-paillier", "paillier"])
def key(request):  # noqa: ANN001, ANN201
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SCHEMES.get(request.param).generate(key_bits=1024)


def _unit(public) -> int:  # noqa: ANN001
    return public.block_size


def _setup(public, seed: int, n_agents: int, units: int):  # noqa: ANN001, ANN202
    """Agents encrypting random whole units, the others sending those units in the clear."""
    rng = np.random.default_rng(seed)
    B, size = _unit(public), _unit(public) * units
    masks = [rng.random(units) < 0.5 for _ in range(n_agents)]
    masks[0][:] = True  # every unit is encrypted by someone
    for i, m in enumerate(masks):
        m[i % units] = True  # and every agent encrypts something
    values = [rng.normal(0, 0.1, size) for _ in range(n_agents)]
    weights = [int(w) for w in rng.integers(1, 50, n_agents)]
    vectors, parts = [], []
    for m, v, w in zip(masks, values, weights):
        pos = np.flatnonzero(np.repeat(m, B))
        vec = public.encrypt(v[pos], pos) if pos.size else None
        vectors.append(vec)
        if vec is not None:
            parts.append(CipherPart(vec, w))
        plain = np.flatnonzero(~np.repeat(m, B))
        if plain.size:
            parts.append(PlainPart(plain, v[plain], w))
    union = np.arange(size)
    return vectors, weights, parts, union, values


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), n_agents=st.integers(1, 4), units=st.integers(1, 5))
def test_honest_aggregates_pass_and_decrypt_to_the_weighted_sum(key, seed, n_agents, units):
    public = key.public_key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors, weights, parts, union, values = _setup(public, seed, n_agents, units)
        aggregate = public.aggregate(parts, union)
    challenge = os.urandom(32)
    contributions = [(public.fingerprint(v, challenge), w) for v, w in zip(vectors, weights) if v is not None]
    plain = public.plain_fold(aggregate)
    assert public.verify_aggregate(aggregate, challenge, contributions, plain)
    assert key.verify_aggregate(aggregate, challenge, contributions, plain)  # the key server's (CRT for packed)
    # brute force: what the key server then decrypts is the weighted sum of every agent's values
    expected = sum(w * v for w, v in zip(weights, values))
    got = key.decrypt(aggregate)
    tolerance = 1e-4 * sum(weights) if public.scheme == "packed-paillier" else 1e-6 * sum(weights)
    assert np.max(np.abs(got - expected[union])) <= tolerance
    # the definition: a product of powers of the ciphertexts, for the fast path's result too
    for v in vectors:
        if v is None:
            continue
        units_of = v.payload.blocks.tolist() if public.scheme == "packed-paillier" else v.positions.tolist()
        cts = v.payload.ciphertexts if public.scheme == "packed-paillier" else v.payload
        a = fp.exponents(challenge, units_of)
        nsq = public.n * public.n
        brute = 1
        for c, e in zip(cts, a):
            brute = brute * pow(int(c), e, nsq) % nsq
        assert public.fingerprint(v, challenge) == brute.to_bytes(len(public.fingerprint(v, challenge)), "big")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), attack=st.sampled_from(["drop", "weight", "inject", "swap", "seed", "plain"]))
def test_every_deviation_without_the_seed_fails(key, seed, attack):
    public = key.public_key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors, weights, parts, union, _ = _setup(public, seed, 3, 3)
        aggregate = public.aggregate(parts, union)
    challenge = os.urandom(32)
    contributions = [(public.fingerprint(v, challenge), w) for v, w in zip(vectors, weights)]
    plain = public.plain_fold(aggregate)
    payload = aggregate.payload.ciphertexts if public.scheme == "packed-paillier" else aggregate.payload
    nsq = gmpy2.mpz(public.n) ** 2
    if attack == "drop":  # a signed contribution whose ciphertext is not in the aggregate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            extra = public.encrypt(np.zeros(_unit(public)), np.arange(_unit(public)))
        contributions.append((public.fingerprint(extra, challenge), 1))
    elif attack == "weight":
        contributions[1] = (contributions[1][0], contributions[1][1] + 1)
    elif attack == "inject":  # add agent 2's first ciphertext once more to unit 0
        payload[0] = int(payload[0] * _first_ct(public, vectors[2]) % nsq)
    elif attack == "swap":
        payload[0], payload[1] = payload[1], payload[0]
    elif attack == "seed":
        challenge = os.urandom(32)
    elif attack == "plain":
        n = public.n
        width = len(plain) // len(payload) if plain else (public.n.bit_length() + 7) // 8
        folded = fp.bytes_ints(plain, width, len(payload), "fold") if plain else [0] * len(payload)
        folded[0] = (folded[0] + 1) % n
        plain = fp.ints_bytes(folded, width)
    assert not public.verify_aggregate(aggregate, challenge, contributions, plain)
    assert not key.verify_aggregate(aggregate, challenge, contributions, plain)


def _first_ct(public, vector):  # noqa: ANN001, ANN202
    return gmpy2.mpz(vector.payload.ciphertexts[0] if public.scheme == "packed-paillier" else vector.payload[0])


def test_exponents_are_odd_128_bit_and_depend_on_seed_and_unit():
    seed = bytes(range(32))
    a = fp.exponents(seed, range(100))
    assert all(x.bit_length() == 128 and x % 2 == 1 for x in a)
    assert len(set(a)) == 100
    assert fp.exponents(seed, [5]) == [a[5]]
    assert fp.exponents(bytes(32), [5]) != [a[5]]
    with pytest.raises(ValueError, match="32 bytes"):
        fp.exponents(b"short", [1])


def test_ckks_is_not_verifiable_and_says_so():
    public = SCHEMES.get("ckks").generate().public_key
    assert not public.verifiable
    with pytest.raises(NotImplementedError, match="cannot be verified"):
        public.fingerprint(None, bytes(32))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**64), st.integers(0, 2**130)), min_size=0, max_size=40),
       st.integers(3, 2**70))
def test_multi_power_is_the_product_of_powers(terms, modulus):
    expected = 1
    for c, e in terms:
        expected = expected * pow(c, e, modulus) % modulus
    assert fp.multi_power([(gmpy2.mpz(c), e) for c, e in terms], gmpy2.mpz(modulus)) % modulus == expected % modulus
