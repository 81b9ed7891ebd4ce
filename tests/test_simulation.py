"""End-to-end simulations: every strategy, real training, real encryption, few rounds."""

import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from senseshield.data import load_dataset
from senseshield.models import build_model
from senseshield.device_noise import DeviceNoise
from senseshield.simulation import Job, bootstrap_reports, build_clients, run_simulation
from senseshield.strategies import STRATEGIES, StrategyOptions, build_strategy
from senseshield.training import get_vector

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _quick(strategy: str, **overrides) -> Job:
    base = dict(
        strategy=strategy,
        dataset="synthetic",
        model="linear",
        clients=4,
        rounds=2,
        partition="categories:2",
        key_bits=512,
        bandwidth=[50, 30],
        cpu=[24, 8],
        options=StrategyOptions(he_ratio=0.2),
    )
    base.update(overrides)
    return Job(**base)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_strategy_runs_end_to_end(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_simulation(_quick(name), noise_seed=0)  # noisy strategies replay one noise seed
    data = result.model_dump()
    for key in ("strategy", "final_accuracy", "rounds", "clients"):
        assert key in data
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    for r in data["rounds"]:
        assert {"round", "accuracy", "he_ratio_mean", "bytes_up", "bytes_down", "seconds"} <= set(r)
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
    for c in data["clients"]:
        assert {"id", "cluster", "encryption_budget", "he_ratio", "accuracy"} <= set(c)
    if STRATEGIES.get(name).dp_level is None:
        assert result.final_accuracy > 0.3  # 10 classes: well above chance after 2 rounds
    else:  # DP strategies trade accuracy for a reported epsilon (tests/test_dp*.py)
        assert result.epsilon is not None and result.epsilon > 0
    expected_ratio = {"plaintext": 0.0, "paillier-full": 1.0}.get(name)
    if expected_ratio is not None:
        assert all(c.he_ratio == expected_ratio for c in result.clients)


def test_paillier_full_is_exactly_plaintext_fedavg():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = run_simulation(_quick("plaintext"))
        full = run_simulation(_quick("paillier-full"))
    assert [r.accuracy for r in plain.rounds] == [r.accuracy for r in full.rounds]
    assert [c.accuracy for c in plain.clients] == [c.accuracy for c in full.clients]
    assert full.rounds[0].bytes_up > 20 * plain.rounds[0].bytes_up
    # 512-bit key as configured: every parameter is one 128-byte ciphertext (mod n^2)
    size = full.num_params
    assert full.rounds[0].bytes_up == 4 * (-(-size // 8) + size * 128)


def test_same_seed_same_result_and_other_seed_differs():
    def strip(result):
        d = result.model_dump()
        d.pop("seconds_total")
        for r in d["rounds"]:
            r.pop("seconds"), r.pop("phase_seconds")
        return d

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = run_simulation(_quick("sensecrypt"))
        b = run_simulation(_quick("sensecrypt"))
        c = run_simulation(_quick("sensecrypt", seed=1))
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_sensecrypt_per_client_budgets_follow_profiles():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_simulation(_quick("sensecrypt", clients=6, partition="iid", bandwidth=[50, 40, 30], cpu=[24, 12, 8]))
    budgets = {c.id: c.encryption_budget for c in result.clients}
    assert max(budgets.values()) == 1.0
    assert min(budgets.values()) < 1.0
    for c in result.clients:
        assert c.he_ratio <= c.encryption_budget + 1e-9


@pytest.mark.parametrize("epsilon", [None, 1.0])
def test_clustering_recovers_planted_categories_on_digits(epsilon):
    """SenseCrypt sec. 3.1 / App. G: 20 clients, categories:4, ARI >= 0.9 (with and without DP)."""
    config = Job(
        strategy="sensecrypt",
        dataset="digits",
        model="mlp",
        clients=20,
        partition="categories:4",
        options=StrategyOptions(cluster_epsilon=epsilon),
    )
    dataset = load_dataset("digits")
    for seed in (0, 1):
        config = config.model_copy(update={"seed": seed})
        torch.manual_seed(seed)
        clients = build_clients(config, dataset)
        model = build_model("mlp", dataset.input_shape, dataset.num_classes)
        initial = get_vector(model).astype(np.float64)
        strategy = build_strategy("sensecrypt", config.options)
        # the DP sketch's noise replayed from the seed (devices draw it secretly): a deterministic test
        reports = bootstrap_reports(config, strategy, clients, model, initial, noise=DeviceNoise(seed))
        plan = strategy.plan_fleet(reports, size=initial.size)
        labels = [plan.cluster_of[c.id] for c in clients]
        assert adjusted_rand_score([c.category for c in clients], labels) >= 0.9


def test_infeasible_masks_are_reported_and_fall_back_to_the_budget():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_simulation(
            _quick("sensecrypt", rounds=1, partition="iid", bandwidth=[50, 5], cpu=[10, 10])
        )
    slow = [c for c in result.clients if c.encryption_budget < 0.5]
    assert slow and all(c.he_ratio <= c.encryption_budget for c in slow)
    assert result.rounds[0].infeasible_masks >= len(slow)
    assert "budget allows" in result.rounds[0].violations[0]


def test_sensecrypt_on_packed_paillier_matches_per_value_paillier_accuracy():
    """HE issue: the packed scheme (15-bit fixed point) loses no accuracy (within 0.5 points)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_value = run_simulation(_quick("sensecrypt", rounds=3, scheme="paillier"))
        packed = run_simulation(_quick("sensecrypt", rounds=3, key_bits=1024, scheme="packed-paillier"))
    assert packed.scheme == "packed-paillier" and per_value.scheme == "paillier"
    for a, b in zip(per_value.rounds, packed.rounds):
        assert abs(a.accuracy - b.accuracy) <= 0.005
    # packed ciphertexts are ~66 values each: far fewer bytes up for a larger encrypted share
    assert packed.rounds[0].bytes_up < per_value.rounds[0].bytes_up


def test_diverged_local_training_is_a_clear_error_not_a_traceback():
    from senseshield.errors import ConfigError
    from senseshield.rounds import LocalData, local_update
    from senseshield.training import TrainConfig

    torch.manual_seed(0)
    model = build_model("linear", (1, 8, 8), 10)
    x = np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32)
    y = np.arange(8) % 10
    blown_up = np.full(get_vector(model).size, np.inf)  # e.g. after huge DP noise
    with pytest.raises(ConfigError, match="Local training diverged in round 4"):
        local_update(
            build_strategy("plaintext"), model, blown_up, LocalData(x, y, x, y),
            train=TrainConfig(), seed=0, round=4,
        )
