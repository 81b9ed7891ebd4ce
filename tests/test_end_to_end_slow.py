"""Long end-to-end runs (`make test-slow`): the papers' headline claims at demo scale."""

import warnings

import numpy as np
import pytest

from senseshield.job import Job
from senseshield.simulation import run_simulation

pytestmark = pytest.mark.slow


def test_sensecrypt_clustering_restores_accuracy_on_non_iid_digits():
    """SenseCrypt sec. 4.2: with 4 disjoint label groups, one global model fails some clients;
    clustering by sensitivity gives every cluster its own model and every client high accuracy."""
    base = dict(
        dataset="digits", model="mlp", clients=20, rounds=5, partition="categories:4",
        bandwidth=[50, 45, 40, 35, 30], cpu=[24, 16, 12, 10, 8],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sense = run_simulation(Job(strategy="sensecrypt", **base))
        plain = run_simulation(Job(strategy="plaintext", **base))
    assert sense.num_clusters == 4 and sense.cluster_ari == pytest.approx(1.0)
    sense_acc = np.array([c.accuracy for c in sense.clients])
    plain_acc = np.array([c.accuracy for c in plain.clients])
    assert sense_acc.mean() > plain_acc.mean() + 0.15
    assert sense_acc.min() > 0.7
    for c in sense.clients:  # nobody encrypts beyond its straggler-free budget
        assert c.he_ratio <= c.encryption_budget + 1e-9
