"""The ChaCha20 noise generator: replayable only from its key, and the right distributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from senseshield.engine.csprng import KEY_BYTES, ChaChaGenerator


@given(seed=st.integers(0, 2**64), n=st.integers(0, 300), label=st.text(max_size=8))
@settings(max_examples=40, deadline=None)
def test_a_seed_and_label_replay_the_same_stream_and_nothing_else_does(seed, n, label):
    a = ChaChaGenerator.from_seed(seed, label).standard_normal(n)
    b = ChaChaGenerator.from_seed(seed, label).standard_normal(n)
    assert np.array_equal(a, b) and a.shape == (n,)
    if n >= 2:
        assert not np.array_equal(a, ChaChaGenerator.from_seed(seed + 1, label).standard_normal(n))
        assert not np.array_equal(a, ChaChaGenerator.from_seed(seed, label + "x").standard_normal(n))


def test_the_stream_matches_a_chacha20_keystream_read_as_64_bit_words():
    """Brute force: uniforms are the top 53 bits of each little-endian word of the keystream."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = bytes(range(KEY_BYTES))
    stream = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor().update(bytes(8 * 5))
    words = [int.from_bytes(stream[8 * i:8 * i + 8], "little") for i in range(5)]
    expected = [(w >> 11) / 2**53 for w in words]
    assert ChaChaGenerator(key).random(5).tolist() == expected


def test_fresh_generators_never_repeat():
    draws = {ChaChaGenerator.fresh().standard_normal(4).tobytes() for _ in range(50)}
    assert len(draws) == 50
    assert ChaChaGenerator.fresh().secret and not ChaChaGenerator.from_seed(1).secret


def test_draws_are_standard_normal_and_uniform():
    g = ChaChaGenerator.from_seed(2026, "distribution")
    z = g.standard_normal(200_000)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert stats.kstest(z, "norm").pvalue > 1e-3
    u = g.random(100_000)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    # pairs from Box-Muller are independent: no correlation between neighbours
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.01


@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3), loc=st.floats(-5, 5), scale=st.floats(0, 5))
@settings(max_examples=30, deadline=None)
def test_normal_has_numpys_shapes_and_scaling(shape, loc, scale):
    size = tuple(shape)
    a = ChaChaGenerator.from_seed(3).normal(loc, scale, size)
    z = ChaChaGenerator.from_seed(3).standard_normal(size)
    assert np.shape(a) == np.shape(np.random.default_rng(0).normal(loc, scale, size))
    assert np.allclose(a, loc + scale * z)


def test_per_coordinate_scales_broadcast_and_bad_values_are_refused():
    scales = np.array([0.0, 1.0, 100.0])
    draws = ChaChaGenerator.from_seed(4).normal(0.0, scales)
    assert draws.shape == (3,) and draws[0] == 0.0
    with pytest.raises(ValueError, match="scale=-1.0 is not allowed"):
        ChaChaGenerator.from_seed(4).normal(0.0, -1.0, 3)
    with pytest.raises(ValueError, match="size=-2 is not allowed"):
        ChaChaGenerator.from_seed(4).standard_normal(-2)
    with pytest.raises(ValueError, match="a ChaCha20 key is 32 bytes; got 3"):
        ChaChaGenerator(b"abc")


def test_scalars_without_a_size_and_torch_seeds_in_range():
    g = ChaChaGenerator.from_seed(5)
    assert isinstance(g.standard_normal(), float) and isinstance(g.random(), float)
    seeds = {ChaChaGenerator.from_seed(5, i).torch_seed() for i in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)
