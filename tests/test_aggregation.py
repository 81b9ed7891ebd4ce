"""Mixed ciphertext/plaintext FedAvg equals plaintext FedAvg (SenseCrypt sec. 3.3)."""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from senseshield.engine.aggregation import (
    aggregate_updates,
    decrypt_aggregate,
    fedavg,
    protect_update,
)
from senseshield.errors import KeyMismatchError, ProtocolError
from senseshield.he import generate_keys


@pytest.fixture(scope="module")
def keys():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate_keys("paillier", key_bits=512), generate_keys("paillier", key_bits=512)


@st.composite
def fleets(draw):
    size = draw(st.integers(1, 24))
    clients = draw(st.integers(1, 5))
    values = st.floats(-50, 50, allow_nan=False, allow_infinity=False)
    deltas = [np.array(draw(st.lists(values, min_size=size, max_size=size))) for _ in range(clients)]
    masks = [np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))) for _ in range(clients)]
    weights = draw(st.lists(st.integers(1, 500), min_size=clients, max_size=clients))
    return deltas, masks, weights


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleets())
def test_mixed_fedavg_equals_plaintext_fedavg(keys, fleet):
    secret, _ = keys
    deltas, masks, weights = fleet
    updates = [
        protect_update(d, m, secret.public_key, client_id=f"c{i}", round=3, cluster=0, n_samples=w)
        for i, (d, m, w) in enumerate(zip(deltas, masks, weights))
    ]
    aggregate = aggregate_updates(updates, secret.public_key, round=3, cluster=0)
    union = np.logical_or.reduce(masks)
    np.testing.assert_array_equal(aggregate.union_mask, union)
    mean = decrypt_aggregate(aggregate, secret)
    # plaintext parts travel as float32: compare against FedAvg of what was actually sent
    sent = [np.where(m, d, d.astype(np.float32).astype(np.float64)) for d, m in zip(deltas, masks)]
    np.testing.assert_allclose(mean, fedavg(sent, weights), rtol=1e-9, atol=1e-9)


def test_plaintext_only_needs_no_key():
    updates = [
        protect_update(np.array([1.0, 2.0]), np.zeros(2, bool), None, client_id=c, round=1, cluster=0, n_samples=n)
        for c, n in (("a", 1), ("b", 3))
    ]
    mean = decrypt_aggregate(aggregate_updates(updates, None, round=1, cluster=0), None)
    np.testing.assert_allclose(mean, [1.0, 2.0])


def test_bad_updates_are_rejected_with_reasons(keys):
    secret, other = keys
    pk = secret.public_key
    good = protect_update(np.ones(4), np.array([1, 0, 0, 1], bool), pk, client_id="a", round=2, cluster=0, n_samples=5)
    with pytest.raises(ProtocolError, match="round 1, not the current round 2"):
        aggregate_updates(
            [protect_update(np.ones(4), np.zeros(4, bool), pk, client_id="b", round=1, cluster=0, n_samples=1)],
            pk, round=2, cluster=0,
        )
    with pytest.raises(ProtocolError, match="covers 3 parameters; the model has 4"):
        short = protect_update(np.ones(3), np.zeros(3, bool), pk, client_id="b", round=2, cluster=0, n_samples=1)
        aggregate_updates([good, short], pk, round=2, cluster=0)
    with pytest.raises(ProtocolError, match="two updates"):
        aggregate_updates([good, good], pk, round=2, cluster=0)
    nan = protect_update(np.ones(4), np.zeros(4, bool), pk, client_id="c", round=2, cluster=0, n_samples=1)
    nan.plaintext[1] = np.nan
    with pytest.raises(ProtocolError, match="NaN"):
        aggregate_updates([good, nan], pk, round=2, cluster=0)
    foreign = protect_update(np.ones(4), np.ones(4, bool), other.public_key, client_id="d", round=2, cluster=0, n_samples=1)
    with pytest.raises(KeyMismatchError):
        aggregate_updates([good, foreign], pk, round=2, cluster=0)
    with pytest.raises(ValueError, match="position 2 is nan"):
        protect_update(np.array([0, 1, np.nan]), np.zeros(3, bool), pk, client_id="e", round=2, cluster=0, n_samples=1)
    with pytest.raises(ProtocolError, match="no updates"):
        aggregate_updates([], pk, round=2, cluster=0)


def test_update_bytes_count_mask_plaintext_and_ciphertext(keys):
    secret, _ = keys
    update = protect_update(np.ones(16), np.arange(16) < 4, secret.public_key, client_id="a", round=1, cluster=0, n_samples=1)
    assert update.he_ratio == 0.25
    assert update.nbytes == 2 + 12 * 4 + update.ciphertext.nbytes


def _thin_reference(deltas, masks, weights, k):
    """Brute force of the k rule: a position encrypted by 1..k-1 clients averages the
    plaintext senders alone (0 if none); every other position is FedAvg of what was sent."""
    size = deltas[0].size
    out = np.zeros(size)
    for j in range(size):
        encryptors = sum(bool(m[j]) for m in masks)
        rows = [(d[j] if m[j] else float(np.float32(d[j])), w, bool(m[j])) for d, m, w in zip(deltas, masks, weights)]
        if 0 < encryptors < k:
            rows = [r for r in rows if not r[2]]
        total = sum(w for _, w, _ in rows)
        out[j] = sum(v * w for v, w, _ in rows) / total if total else 0.0
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleets(), st.integers(1, 4), st.booleans())
def test_positions_fewer_than_k_clients_encrypted_are_never_decrypted(keys, fleet, k, packed):
    """Issue 22 item 2: the k rule against brute force, for per-value and packed Paillier;
    the encryptors' values at a thin position never reach the mean."""
    secret = keys[0] if not packed else _packed_key()
    deltas, masks, weights = fleet
    if packed:  # block-granular masks (block 4)
        B = secret.public_key.block_size
        masks = [np.repeat(m[:: B], B)[: m.size] if m.size else m for m in masks]
    updates = [
        protect_update(d, m, secret.public_key, client_id=f"c{i}", round=3, cluster=0, n_samples=w)
        for i, (d, m, w) in enumerate(zip(deltas, masks, weights))
    ]
    aggregate = aggregate_updates(updates, secret.public_key, round=3, cluster=0, min_encryptors=k)
    mean = decrypt_aggregate(aggregate, secret)
    tol = 1e-9 if not packed else 1e-2
    np.testing.assert_allclose(mean, _thin_reference(deltas, masks, weights, k), rtol=tol, atol=tol)
    counts = np.sum(masks, axis=0)
    expected_thin = (counts > 0) & (counts < k)
    got = aggregate.thin_mask if aggregate.thin_mask is not None else np.zeros(counts.size, bool)
    np.testing.assert_array_equal(got, expected_thin)
    # changing an encryptor's value at a thin position changes nothing the key server returns
    if expected_thin.any():
        j = int(np.flatnonzero(expected_thin)[0])
        i = next(i for i, m in enumerate(masks) if m[j])
        other = [d.copy() for d in deltas]
        other[i][j] += 7.0
        again = aggregate_updates(
            [protect_update(d, m, secret.public_key, client_id=f"c{n}", round=3, cluster=0, n_samples=w)
             for n, (d, m, w) in enumerate(zip(other, masks, weights))],
            secret.public_key, round=3, cluster=0, min_encryptors=k)
        assert decrypt_aggregate(again, secret)[j] == mean[j]


_PACKED = []


def _packed_key():
    if not _PACKED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _PACKED.append(generate_keys("packed-paillier", key_bits=512, clip=64.0))
    return _PACKED[0]


def test_select_refuses_partial_units_and_foreign_positions():
    secret = _packed_key()
    pk = secret.public_key
    B = pk.block_size
    values = np.linspace(-30, 30, 3 * B)
    update = protect_update(values, np.ones(3 * B, bool), pk, client_id="a", round=1, cluster=0, n_samples=1)
    vector = update.ciphertext
    part = pk.select(vector, np.arange(B, 2 * B))
    np.testing.assert_allclose(secret.decrypt(part), values[B : 2 * B], atol=1e-2)
    with pytest.raises(ProtocolError, match="whole units"):
        pk.select(vector, np.arange(B, B + 2))
    with pytest.raises(ProtocolError, match="outside"):
        pk.select(vector, np.arange(3 * B, 4 * B))
