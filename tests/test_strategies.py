"""Contract tests: every registered strategy, same checks (Flower-style)."""

import numpy as np
import pytest

from senseshield.strategies import (
    STRATEGIES,
    BootstrapReport,
    ClientContext,
    StrategyOptions,
    build_strategy,
)
from senseshield.errors import ConfigError

SIZE = 200


def _reports(rng, n=6):
    return [
        BootstrapReport(f"c{i}", 10 + i, bandwidth=50 - i, cpu_speed=24 - 2 * i, sensitivity=rng.random(SIZE))
        for i in range(n)
    ]


@pytest.mark.parametrize("name", STRATEGIES.names())
@pytest.mark.parametrize("block_size", [1, 8])
def test_every_strategy_yields_a_block_aligned_boolean_mask(name, block_size):
    rng = np.random.default_rng(0)
    strategy = build_strategy(name, StrategyOptions(he_ratio=0.25))
    reports = _reports(rng)
    plan = strategy.plan_fleet(reports, size=SIZE, block_size=block_size)
    assert set(plan.cluster_of) == {r.client_id for r in reports}
    assert all(0 < a <= 1 for a in plan.budget_of.values())
    sens = {r.client_id: rng.random(SIZE) ** 4 for r in reports}
    for k in plan.clusters:
        members = plan.members(k)
        shared = plan.fixed_masks.get(k)
        if strategy.negotiates:
            proposals = [strategy.propose(sens[c], block_size=block_size) for c in members]
            shared = strategy.consensus(proposals, size=SIZE, block_size=block_size)
        for c in members:
            ctx = ClientContext(c, 1, k, plan.budget_of[c], shared, block_size)
            mask = strategy.select_mask(ctx, sensitivity=sens[c], weights=rng.normal(size=SIZE)).mask
            assert mask.dtype == bool and mask.shape == (SIZE,)
            blocks = mask.reshape(-1, block_size)
            assert np.all(blocks.all(axis=1) | ~blocks.any(axis=1)), "mask splits a block"


def test_baselines_encrypt_nothing_or_everything():
    ctx = ClientContext("a", 1, 0, 1.0)
    w = np.zeros(10)
    assert not build_strategy("plaintext").select_mask(ctx, sensitivity=w, weights=w).mask.any()
    assert build_strategy("paillier-full").select_mask(ctx, sensitivity=w, weights=w).mask.all()


def test_maskcrypt_consensus_keeps_most_voted_positions():
    s = build_strategy("maskcrypt", StrategyOptions(he_ratio=0.2))
    proposals = [np.array([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], bool), np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 0], bool)]
    assert np.flatnonzero(s.consensus(proposals, size=10)).tolist() == [0, 1]


def test_fedml_he_fixes_top_fraction_of_mean_sensitivity():
    s = build_strategy("fedml-he", StrategyOptions(he_ratio=0.1))
    reports = [BootstrapReport(f"c{i}", 5, 1, 1, sensitivity=np.eye(20)[i] + np.eye(20)[7]) for i in range(3)]
    plan = s.plan_fleet(reports, size=20)
    assert np.flatnonzero(plan.fixed_masks[0]).tolist() == [0, 7]


def test_sensecrypt_budget_bounds_each_client_mask():
    s = build_strategy("sensecrypt", StrategyOptions(eta_mi=None))
    rng = np.random.default_rng(3)
    sens = rng.random(1000) ** 8
    for alpha in (0.05, 0.3, 1.0):
        choice = s.select_mask(ClientContext("a", 1, 0, alpha), sensitivity=sens, weights=rng.normal(size=1000))
        assert choice.mask.sum() <= int(alpha * 1000)
        assert "feasible" in choice.info


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ConfigError, match="Unknown strategy 'nope'; choose one of: .*fedml-he, maskcrypt"):
        build_strategy("nope")


def test_options_reject_bad_values():
    with pytest.raises(ValueError, match="he_ratio"):
        StrategyOptions(he_ratio=0)


def test_masks_option_names_the_bad_value():
    with pytest.raises(Exception, match="masks='prefix' is not allowed; use one of: solver, nested"):
        StrategyOptions(masks="prefix")
    with pytest.raises(Exception, match="masks='nested' with cluster_epsilon=1.0 is not allowed"):
        StrategyOptions(masks="nested", cluster_epsilon=1.0)
