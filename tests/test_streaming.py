"""Streaming aggregation (the coordinator's running aggregate) equals batch aggregation:
packed Paillier's running product per block against the scheme's batch ``aggregate`` over
all parts, in random arrival orders with late updates dropped, integer for integer; the
plaintext sums do not depend on the order; a rejected update changes nothing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from senseshield.engine.aggregation import (
    ExactSum,
    StreamingAggregate,
    aggregate_updates,
    decrypt_aggregate,
    fedavg,
    protect_update,
)
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES


@pytest.fixture(scope="module")
def secret():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SCHEMES.get("packed-paillier").generate(key_bits=512)


@st.composite
def rounds(draw, block: int):
    blocks = draw(st.integers(1, 4))
    size = draw(st.integers((blocks - 1) * block + 1, blocks * block))
    clients = draw(st.integers(1, 6))
    values = st.floats(-1, 1, allow_nan=False, allow_infinity=False, width=32)  # inside the clip
    updates = []
    for i in range(clients):
        delta = np.array(draw(st.lists(values, min_size=size, max_size=size)), dtype=np.float64)
        encrypted = draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks))
        mask = np.repeat(np.array(encrypted), block)[:size]
        withheld = None
        if draw(st.booleans()):  # a personal zone of whole plaintext blocks
            keep = np.repeat(np.array(draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks))), block)[:size]
            withheld = keep & ~mask
        updates.append((f"c{i}", delta, mask, withheld, draw(st.integers(1, 300))))
    order = draw(st.permutations(range(clients)))
    late = draw(st.sets(st.sampled_from(range(clients)), max_size=clients - 1))
    return size, updates, list(order), late


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streaming_equals_batch_in_any_arrival_order_with_late_updates_dropped(secret, data):
    public = secret.public_key
    size, specs, order, late = data.draw(rounds(public.block_size))
    updates = [protect_update(d, m, public, client_id=c, round=2, cluster=1, n_samples=n, withheld=w)
               for c, d, m, w, n in specs]
    on_time = [updates[i] for i in order if i not in late]  # arrival order; the late ones are dropped
    batch = aggregate_updates(sorted(on_time, key=lambda u: u.client_id), public, round=2, cluster=1)
    running = StreamingAggregate(public, size=size, round=2, cluster=1)
    for update in on_time:
        running.add(update)
    streamed = running.result()
    assert streamed.contributors == batch.contributors and streamed.total_weight == batch.total_weight
    np.testing.assert_array_equal(streamed.union_mask, batch.union_mask)
    np.testing.assert_array_equal(streamed.plain_sum, batch.plain_sum)
    if batch.position_weight is None:
        assert streamed.position_weight is None
    else:
        np.testing.assert_array_equal(streamed.position_weight, batch.position_weight)
    if batch.ciphertext is None:
        assert streamed.ciphertext is None
    else:
        assert streamed.ciphertext.payload.ciphertexts == batch.ciphertext.payload.ciphertexts
        np.testing.assert_array_equal(streamed.ciphertext.payload.weights, batch.ciphertext.payload.weights)
        np.testing.assert_array_equal(streamed.ciphertext.positions, batch.ciphertext.positions)
        assert public.plain_fold(streamed.ciphertext) == public.plain_fold(batch.ciphertext)
    # and both are FedAvg of what was sent
    mean = decrypt_aggregate(streamed, secret)
    sent = [np.where(u.mask, d, d.astype(np.float32)) for u, (_, d, *_rest) in zip(updates, specs)]
    kept = [i for i in order if i not in late]
    if all(u.withheld is None for u in on_time):
        expected = fedavg([sent[i] for i in kept], [specs[i][4] for i in kept])
        np.testing.assert_allclose(mean, expected, atol=2 * public.layout.step * 2, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=5, max_size=5), min_size=1,
                max_size=8),
       st.lists(st.integers(1, 10_000), min_size=8, max_size=8), st.randoms(use_true_random=False))
def test_exact_sums_do_not_depend_on_the_order_and_match_exact_arithmetic(rows, weights, rnd):
    from fractions import Fraction

    terms = [w * np.array(r, dtype=np.float64) for r, w in zip(rows, weights)]
    forward, shuffled = ExactSum(5), ExactSum(5)
    for t in terms:
        forward.add(np.arange(5), t)
    for t in rnd.sample(terms, len(terms)):
        shuffled.add(np.arange(5), t)
    assert forward.value().tobytes() == shuffled.value().tobytes()
    exact = [float(sum(Fraction(float(t[i])) for t in terms)) for i in range(5)]  # correctly rounded
    np.testing.assert_allclose(forward.value(), exact, rtol=1e-15, atol=0)


def test_a_rejected_update_changes_nothing(secret):
    public = secret.public_key
    size = 3 * public.block_size
    mask = np.zeros(size, bool)
    mask[: public.block_size] = True
    rng = np.random.default_rng(0)
    good = [protect_update(rng.normal(size=size) * 0.1, mask, public, client_id=c, round=1, cluster=0, n_samples=5)
            for c in "ab"]
    running = StreamingAggregate(public, size=size, round=1, cluster=0)
    running.add(good[0])
    before = running.result()
    for bad, why in ((good[0], "two updates"),
                     (protect_update(np.zeros(size), mask, public, client_id="x", round=2, cluster=0, n_samples=1),
                      "round 2")):
        with pytest.raises(ProtocolError, match=why):
            running.add(bad)
    after = running.result()
    assert after.ciphertext.payload.ciphertexts == before.ciphertext.payload.ciphertexts
    assert after.contributors == ["a"] and after.total_weight == 5
    running.add(good[1])
    assert running.result().contributors == ["a", "b"]
