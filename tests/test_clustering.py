"""Clustering of clients by sensitivity vectors (SenseCrypt sec. 3.1, Alg. 2)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score

from senseshield.engine.clustering import clip_rows, cluster_clients, noisy_mean, normalise_rows
from senseshield.errors import ConfigError


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(2, 6), st.integers(0, 10_000))
def test_recovers_well_separated_planted_clusters(k, per, seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, 50)) * 10
    labels = np.repeat(np.arange(k), per)
    vectors = centres[labels] + rng.normal(scale=0.1, size=(k * per, 50))
    found = cluster_clients(vectors, seed=seed)
    assert adjusted_rand_score(labels, found) == pytest.approx(1.0)


@settings(max_examples=40)
@given(st.floats(0.1, 10), st.integers(0, 1000))
def test_clip_rows_bounds_norm_and_keeps_short_rows(clip, seed):
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(8, 5)) * rng.uniform(0.01, 20, size=(8, 1))
    clipped = clip_rows(rows, clip_norm=clip)
    norms = np.linalg.norm(rows, axis=1)
    assert np.all(np.linalg.norm(clipped, axis=1) <= clip * (1 + 1e-9))
    short = norms <= clip
    np.testing.assert_allclose(clipped[short], rows[short])


def test_noisy_mean_has_the_gaussian_mechanism_scale():
    rng = np.random.default_rng(0)
    samples = np.stack(
        [noisy_mean(np.zeros(2000), count=10, clip_norm=2.0, noise_multiplier=3.0, rng=rng) for _ in range(5)]
    )
    assert samples.std() == pytest.approx(3.0 * 2.0 / 10, rel=0.05)
    assert np.all(noisy_mean(np.ones(3), count=2, clip_norm=1, noise_multiplier=0, rng=rng) == 0.5)


def test_single_client_and_identical_clients():
    assert cluster_clients(np.ones((1, 4))).tolist() == [0]
    assert cluster_clients(np.ones((5, 4))).tolist() == [0] * 5


def test_bad_inputs_are_named():
    with pytest.raises(ConfigError, match="NaN"):
        cluster_clients(np.array([[1.0, np.nan], [0.0, 1.0]]))
    with pytest.raises(ConfigError, match="damping"):
        cluster_clients(np.eye(3), damping=0.2)
    with pytest.raises(ConfigError, match="clip_norm"):
        clip_rows(np.eye(2), clip_norm=0)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        noisy_mean(np.ones(2), count=1, clip_norm=1, noise_multiplier=-1, rng=np.random.default_rng())


def test_normalise_rows_unit_norm_and_zero_rows():
    out = normalise_rows(np.array([[3.0, 4.0], [0.0, 0.0]]))
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0]])


def test_structureless_vectors_form_one_cluster():
    rng = np.random.default_rng(1)
    assert set(cluster_clients(rng.normal(size=(20, 50))).tolist()) == {0}



def test_output_unit_sketch_sums_rows_and_bias():
    from senseshield.engine.clustering import output_unit_sketch
    from senseshield.engine.params import ParamLayout

    layout = ParamLayout.from_shapes(
        [("w1", (2, 3), True), ("b1", (2,), True), ("w2", (3, 2), True), ("b2", (3,), True), ("rm", (3,), False)]
    )
    sens = np.arange(layout.size, dtype=float)
    sketch = output_unit_sketch(np.stack([sens, 2 * sens]), layout)
    # w2 occupies 8..13 (rows [8,9], [10,11], [12,13]), b2 occupies 14..16
    np.testing.assert_allclose(sketch[0], [8 + 9 + 14, 10 + 11 + 15, 12 + 13 + 16])
    np.testing.assert_allclose(sketch[1], 2 * sketch[0])


def test_scale_rows_bounds_contribution_exactly():
    from senseshield.engine.clustering import scale_rows

    out = scale_rows(np.array([[3.0, 4.0], [0.0, 0.0], [0.01, 0.0]]), norm=2.0)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), [2.0, 0.0, 2.0])


@pytest.mark.parametrize("seed", [0, 1])
def test_many_near_identical_members_per_cluster_still_split(seed):
    """99 devices jittered 10 % around three separated 650-D vectors (like the scale
    benchmark's fleet): AP oscillates at damping 0.5 for every preference that splits them,
    and before the retry at heavier damping the fleet silently became one cluster."""
    rng = np.random.default_rng(seed)
    centres = np.abs(rng.normal(size=(3, 650)))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.arange(99) % 3
    vectors = centres[labels] * np.abs(rng.normal(1.0, 0.1, size=(99, 650)))
    assert adjusted_rand_score(labels, cluster_clients(vectors, seed=seed)) == pytest.approx(1.0)
