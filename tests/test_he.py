"""Homomorphic-encryption schemes: the aggregation invariant and the safety rails.

Paillier tests use 512-bit keys (insecure, fast; the warning is silenced here); one test
generates a default 2048-bit key. CKKS uses the default 8192-degree context.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.errors import KeyMismatchError, ProtocolError, SecretKeyExportError
from senseshield.he import SCHEMES, CipherPart, PlainPart, PublicKey, generate_keys
from senseshield.he.ckks import CKKSPublicKey, CKKSSecretKey
from senseshield.he.paillier import (
    InsecureKeyWarning,
    PaillierPublicKey,
    PaillierSecretKey,
)

pytestmark = pytest.mark.filterwarnings("ignore::senseshield.he.paillier.InsecureKeyWarning")

TEST_KEY_BITS = 512


@pytest.fixture(scope="module")
def paillier() -> PaillierSecretKey:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)
        return generate_keys("paillier", key_bits=TEST_KEY_BITS)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def paillier_other() -> PaillierSecretKey:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)
        return generate_keys("paillier", key_bits=TEST_KEY_BITS)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def ckks() -> CKKSSecretKey:
    return generate_keys("ckks")  # type: ignore[return-value]


# -- the aggregation invariant --------------------------------------------------------


Fleet = tuple[int, list[tuple[np.ndarray, np.ndarray, int]]]


@st.composite
def fleets(draw: st.DrawFn, shared_mask: bool) -> Fleet:
    """(size, [(values, mask, weight)]) for 2-5 clients over a vector of <= 30 values."""
    size = draw(st.integers(1, 30))
    n_clients = draw(st.integers(2, 5))
    value = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
    mask_strategy = st.lists(st.booleans(), min_size=size, max_size=size)
    shared = np.array(draw(mask_strategy), dtype=bool)
    clients = []
    for _ in range(n_clients):
        values = np.array(draw(st.lists(value, min_size=size, max_size=size)), dtype=np.float64)
        mask = shared if shared_mask else np.array(draw(mask_strategy), dtype=bool)
        clients.append((values, mask, draw(st.integers(1, 1000))))
    return size, clients


def _parts_and_expectation(
    public_key: PublicKey, clients: list[tuple[np.ndarray, np.ndarray, int]]
) -> tuple[list[CipherPart | PlainPart], np.ndarray, np.ndarray, np.ndarray]:
    union = np.zeros(clients[0][0].size, dtype=bool)
    for _, mask, _ in clients:
        union |= mask
    positions = np.flatnonzero(union)
    parts: list[CipherPart | PlainPart] = []
    for values, mask, weight in clients:
        enc = np.flatnonzero(mask)
        plain = np.flatnonzero(~mask)
        parts.append(CipherPart(public_key.encrypt(values[enc], enc), weight))
        parts.append(PlainPart(plain, values[plain], weight))
    expected = sum(w * v[positions] for v, _, w in clients)
    magnitude = sum(w * np.abs(v[positions]) for v, _, w in clients)
    return parts, positions, np.asarray(expected, dtype=np.float64), magnitude


@settings(max_examples=60, deadline=None)
@given(fleet=fleets(shared_mask=False))
def test_paillier_aggregate_is_weighted_sum(paillier: PaillierSecretKey, fleet: Fleet) -> None:
    _, clients = fleet
    public = paillier.public_key
    parts, positions, expected, magnitude = _parts_and_expectation(public, clients)
    aggregate = public.aggregate(parts, positions)
    assert np.array_equal(aggregate.positions, positions)
    assert aggregate.nbytes == positions.size * 2 * (TEST_KEY_BITS // 8)
    got = paillier.decrypt(aggregate)
    assert got.dtype == np.float64
    # 1e-9 relative to the magnitude of the summed terms, plus the fixed-point quantisation
    # (each value is rounded to a multiple of 2**-40, so at most total_weight * 2**-41).
    quantum = sum(w for _, _, w in clients) * 2.0**-40
    assert np.all(np.abs(got - expected) <= 1e-9 * magnitude + quantum)


@settings(max_examples=25, deadline=None)
@given(fleet=fleets(shared_mask=True))
def test_ckks_aggregate_is_weighted_sum(ckks: CKKSSecretKey, fleet: Fleet) -> None:
    _, clients = fleet
    public = ckks.public_key
    parts, positions, expected, magnitude = _parts_and_expectation(public, clients)
    aggregate = public.aggregate(parts, positions)
    got = ckks.decrypt(aggregate)
    assert got.dtype == np.float64 and got.shape == expected.shape
    assert np.all(np.abs(got - expected) <= 1e-3 * np.maximum(magnitude, 1.0))


def test_paillier_invariants_by_hand(paillier: PaillierSecretKey) -> None:
    pk = paillier.public_key
    a = pk.encrypt(np.array([1.5, -2.25, 3.0]), np.array([1, 4, 7]))
    b = pk.encrypt(np.array([0.5, 0.25]), np.array([4, 9]))
    assert np.array_equal(paillier.decrypt(a), [1.5, -2.25, 3.0])
    agg = pk.aggregate(
        [CipherPart(a, 2), CipherPart(b, 3), PlainPart(np.arange(12), np.arange(12.0), 5)],
        np.array([1, 4, 7, 9]),
    )
    assert np.array_equal(paillier.decrypt(agg), [2 * 1.5 + 5, -4.5 + 1.5 + 20, 6 + 35, 0.75 + 45])


def test_ckks_chunks_beyond_slot_count(ckks: CKKSSecretKey) -> None:
    pk = ckks.public_key
    n = pk.slots + 10
    x = np.random.default_rng(0).normal(size=n)
    enc = pk.encrypt(x, np.arange(n))
    assert len(enc.payload) == 2
    agg = pk.aggregate([CipherPart(enc, 3), CipherPart(enc, 1)], np.arange(n))
    np.testing.assert_allclose(ckks.decrypt(agg), 4 * x, atol=1e-4)


def test_empty_vectors(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    for secret in (paillier, ckks):
        pk = secret.public_key
        enc = pk.encrypt(np.empty(0), np.empty(0, np.int64))
        agg = pk.aggregate([CipherPart(enc, 1)], np.empty(0, np.int64))
        assert secret.decrypt(agg).shape == (0,)


# -- refusals --------------------------------------------------------------------------


def test_other_key_is_refused(
    paillier: PaillierSecretKey, paillier_other: PaillierSecretKey, ckks: CKKSSecretKey
) -> None:
    pos = np.array([0, 1])
    mine = paillier.public_key.encrypt(np.array([1.0, 2.0]), pos)
    theirs = paillier_other.public_key.encrypt(np.array([1.0, 2.0]), pos)
    with pytest.raises(KeyMismatchError):
        paillier.public_key.aggregate([CipherPart(mine, 1), CipherPart(theirs, 1)], pos)
    with pytest.raises(KeyMismatchError):
        paillier.decrypt(theirs)
    with pytest.raises(KeyMismatchError):
        paillier.public_key.vector_from_bytes(paillier_other.public_key.ciphertext_bytes(theirs))
    with pytest.raises(ProtocolError):  # other scheme
        ckks.public_key.aggregate([CipherPart(mine, 1)], pos)


def test_ckks_other_key_is_refused(ckks: CKKSSecretKey) -> None:
    other = generate_keys("ckks")
    pos = np.arange(3)
    theirs = other.public_key.encrypt(np.ones(3), pos)
    with pytest.raises(KeyMismatchError):
        ckks.public_key.aggregate([CipherPart(theirs, 1)], pos)
    with pytest.raises(KeyMismatchError):
        ckks.decrypt(theirs)


def test_ckks_refuses_ragged_masks(ckks: CKKSSecretKey) -> None:
    pk = ckks.public_key
    a = pk.encrypt(np.ones(3), np.array([0, 1, 2]))
    b = pk.encrypt(np.ones(3), np.array([0, 1, 5]))
    with pytest.raises(ProtocolError, match="position 2"):
        pk.aggregate([CipherPart(a, 1), CipherPart(b, 1)], np.array([0, 1, 2]))
    with pytest.raises(ProtocolError, match="same positions"):
        pk.aggregate([CipherPart(a, 1), CipherPart(b, 1)], np.array([0, 1, 2, 5]))
    with pytest.raises(ProtocolError, match="position 1"):
        pk.aggregate([CipherPart(a, 1), PlainPart(np.array([1, 7]), np.ones(2), 1)], np.arange(3))
    # plaintext outside the union is ignored
    agg = pk.aggregate([CipherPart(a, 2), PlainPart(np.array([7]), np.ones(1), 1)], np.arange(3))
    np.testing.assert_allclose(ckks.decrypt(agg), 2.0, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(
    paillier: PaillierSecretKey, ckks: CKKSSecretKey, bad: float
) -> None:
    for secret in (paillier, ckks):
        with pytest.raises(ValueError, match="position 12"):
            secret.public_key.encrypt(np.array([1.0, bad]), np.array([3, 12]))
    pk = paillier.public_key
    enc = pk.encrypt(np.array([1.0, 2.0]), np.array([3, 12]))
    with pytest.raises(ProtocolError, match="position 12"):
        pk.aggregate(
            [CipherPart(enc, 1), PlainPart(np.array([3, 12]), np.array([0.0, bad]), 1)],
            np.array([3, 12]),
        )


def test_uncovered_position_is_refused(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    pk = paillier.public_key
    enc = pk.encrypt(np.array([1.0]), np.array([3]))
    with pytest.raises(ProtocolError, match="Position 5"):
        pk.aggregate(
            [CipherPart(enc, 1), PlainPart(np.array([5]), np.array([1.0]), 1)], np.array([3, 5])
        )
    with pytest.raises(ProtocolError, match="position 3"):
        pk.aggregate([CipherPart(enc, 1)], np.array([4]))
    with pytest.raises(ProtocolError, match="Position 0"):
        ckks.public_key.aggregate([PlainPart(np.array([9]), np.ones(1), 1)], np.array([0]))


@pytest.mark.parametrize("weight", [0, -1, 1.5, True])
def test_bad_weights_are_refused(
    paillier: PaillierSecretKey, ckks: CKKSSecretKey, weight: object
) -> None:
    for secret in (paillier, ckks):
        enc = secret.public_key.encrypt(np.array([1.0]), np.array([0]))
        with pytest.raises(ProtocolError, match="weight"):
            secret.public_key.aggregate([CipherPart(enc, weight)], np.array([0]))


def test_paillier_plaintext_overflow_is_refused(paillier: PaillierSecretKey) -> None:
    pk = paillier.public_key
    enc = pk.encrypt(np.array([1.0]), np.array([0]))
    with pytest.raises(ProtocolError, match="overflow"):
        pk.aggregate(
            [CipherPart(enc, 1), PlainPart(np.array([0]), np.array([1e150]), 2)], np.array([0])
        )
    with pytest.raises(ValueError, match="position 4"):
        pk.encrypt(np.array([1.0, 1e200]), np.array([0, 4]))


def test_paillier_large_and_tiny_values_round_trip(paillier: PaillierSecretKey) -> None:
    values = np.array([1e60, -3.5e40, 2.0**-41, -(2.0**-39), 123456.789])
    enc = paillier.public_key.encrypt(values, np.arange(values.size))
    got = paillier.decrypt(enc)
    np.testing.assert_allclose(got, np.round(values * 2.0**40) / 2.0**40, rtol=1e-15, atol=0)


# -- keys --------------------------------------------------------------------------------


def test_secret_keys_never_pickle(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    for secret in (paillier, ckks):
        with pytest.raises(SecretKeyExportError):
            pickle.dumps(secret)
        with pytest.raises(SecretKeyExportError):
            copy.deepcopy(secret)
        with pytest.raises(SecretKeyExportError):
            secret.to_bytes()
        assert "key_id" in repr(secret)
    private = [v for v in vars(paillier).values() if type(v).__name__ == "_GuardedPrivateKey"]
    assert len(private) == 1
    with pytest.raises(SecretKeyExportError):
        pickle.dumps(private[0])
    text = repr(paillier) + str(paillier) + repr(private[0])
    assert str(private[0].p) not in text and format(private[0].p, "x") not in text


def test_secret_key_round_trip(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    for secret in (paillier, ckks):
        data = secret.to_bytes(include_secret=True)
        loaded = SCHEMES.get(secret.scheme).secret_key_from_bytes(data)
        assert loaded.public_key.key_id == secret.public_key.key_id
        enc = secret.public_key.encrypt(np.array([0.75, -1.5]), np.array([2, 3]))
        np.testing.assert_allclose(loaded.decrypt(enc), [0.75, -1.5], atol=1e-6)
    with pytest.raises(ProtocolError):
        PaillierSecretKey.from_bytes(b"{not json")
    with pytest.raises(ProtocolError):
        CKKSSecretKey.from_bytes(ckks.public_key.to_bytes())


def test_public_key_round_trip(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    for secret in (paillier, ckks):
        pk = secret.public_key
        loaded = SCHEMES.get(pk.scheme).public_key_from_bytes(pk.to_bytes())
        assert loaded.key_id == pk.key_id
        enc = loaded.encrypt(np.array([2.5]), np.array([0]))
        np.testing.assert_allclose(secret.decrypt(enc), [2.5], atol=1e-6)
        assert pickle.loads(pickle.dumps(pk)).key_id == pk.key_id
    with pytest.raises(ProtocolError):
        PaillierPublicKey.from_bytes(b'{"scheme": "paillier", "n": "zz"}')
    with pytest.raises(ProtocolError):
        CKKSPublicKey.from_bytes(b"garbage")
    with pytest.raises(ProtocolError, match="secret key"):
        CKKSPublicKey.from_bytes(ckks.to_bytes(include_secret=True))


def test_ciphertext_serialisation(paillier: PaillierSecretKey, ckks: CKKSSecretKey) -> None:
    for secret in (paillier, ckks):
        pk = secret.public_key
        values = np.array([0.5, -7.25, 3.0])
        enc = pk.encrypt(values, np.array([1, 5, 8]))
        data = pk.ciphertext_bytes(enc)
        back = pk.vector_from_bytes(data)
        assert np.array_equal(back.positions, enc.positions)
        assert back.nbytes == enc.nbytes and back.key_id == pk.key_id
        np.testing.assert_allclose(secret.decrypt(back), values, atol=1e-6)
        for broken in (data[:-1], data[:10], data + b"\x00", b""):
            with pytest.raises(ProtocolError):
                pk.vector_from_bytes(broken)
    # a ciphertext >= n^2 is refused
    pk = paillier.public_key
    data = bytearray(pk.ciphertext_bytes(pk.encrypt(np.array([1.0]), np.array([0]))))
    data[-pk.ciphertext_nbytes :] = b"\xff" * pk.ciphertext_nbytes
    with pytest.raises(ProtocolError, match="Z_"):
        pk.vector_from_bytes(bytes(data))


def test_small_keys_warn() -> None:
    with pytest.warns(InsecureKeyWarning, match="insecure"):
        generate_keys("paillier", key_bits=TEST_KEY_BITS)


def test_default_paillier_key_is_2048_bits() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", InsecureKeyWarning)
        secret = generate_keys("paillier")
    pk = secret.public_key
    assert pk.key_bits == 2048 and pk.precision_bits == 40
    enc = pk.encrypt(np.array([0.125, -3.0]), np.array([0, 1]))
    assert enc.nbytes == 2 * 512
    aggregate = pk.aggregate([CipherPart(enc, 4)], np.array([0, 1]))
    assert np.array_equal(secret.decrypt(aggregate), [0.5, -12.0])


def test_bad_parameters_are_config_errors() -> None:
    from senseshield.errors import ConfigError

    with pytest.raises(ConfigError):
        generate_keys("paillier", key_bits=256)
    with pytest.raises(ConfigError):
        generate_keys("paillier", bits=2048)
    with pytest.raises(ConfigError):
        generate_keys("ckks", coeff_mod_bit_sizes=[60, 60, 60, 60])  # 240 > 218 bits
    with pytest.raises(ConfigError):
        generate_keys("ckks", poly_modulus_degree=1000)
    assert SCHEMES.get("paillier").ragged_masks and not SCHEMES.get("ckks").ragged_masks


@pytest.mark.parametrize("scheme", ["paillier", "packed-paillier", "ckks"])
def test_the_public_key_parser_refuses_a_secret_key(scheme):
    """A secret key published by mistake is never taken for a public key (issue 14)."""
    import warnings

    from senseshield.errors import ProtocolError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        factory = SCHEMES.get(scheme)
        secret = factory.generate(key_bits=1024) if "key_bits" in factory.info().params else factory.generate()
        with pytest.raises(ProtocolError, match="secret"):
            factory.public_key_from_bytes(secret.to_bytes(include_secret=True))
        assert factory.public_key_from_bytes(secret.public_key.to_bytes()).key_id == secret.public_key.key_id
    if scheme != "ckks":
        import json

        extra = dict(json.loads(secret.public_key.to_bytes()), comment="hi")
        with pytest.raises(ProtocolError, match=r"unknown field\(s\) \['comment'\]"):
            factory.public_key_from_bytes(json.dumps(extra).encode())
