"""Contract tests: every registered strategy, same checks (Flower-style)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.strategies import (
    STRATEGIES,
    BootstrapReport,
    ClientContext,
    StrategyOptions,
    build_strategy,
)
from senseshield.engine.masks import budget_count, solve_mask
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


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    data=st.data(),
    block=st.integers(1, 5),
    blocks=st.integers(1, 30),
    alpha=st.floats(0, 1),
    floor=st.one_of(st.just(0.0), st.floats(0, 1)),
)
def test_nested_masks_never_replace_the_devices_own_top_blocks(data, block, blocks, alpha, floor):
    """Whatever nested mask the coordinator sends (any positions, its least sensitive blocks
    included), the device encrypts that mask and its own top blocks: the prefix of its own
    ranking (block sums, ties lower index first) as long as its solver picks at its budget
    (eqs. 4-7), raised to its floor (--min-he-ratio) and to one block for a positive budget;
    nothing else. info says how many blocks it added."""
    size = data.draw(st.integers((blocks - 1) * block + 1, blocks * block), label="size")
    sens = np.array(data.draw(st.lists(st.one_of(st.integers(0, 3).map(float), st.floats(0, 100)),
                                       min_size=size, max_size=size), label="sensitivity"))
    given_mask = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size), label="mask"))
    s = build_strategy("sensecrypt", StrategyOptions(masks="nested", eta_mi=None))
    ctx = ClientContext("a", 1, 0, alpha, given_mask, block, min_encrypted=floor)
    choice = s.select_mask(ctx, sensitivity=sens, weights=np.zeros(size))
    spans = [(j, min(j + block, size)) for j in range(0, size, block)]
    per_block = np.array([sens[lo:hi].sum() for lo, hi in spans])
    order = sorted(range(len(spans)), key=lambda j: (-per_block[j], j))
    solved = solve_mask(per_block, alpha=alpha, eta_mi=None).count  # what solver mode encrypts
    assert solved <= budget_count(alpha=alpha, n=len(spans))
    need, covered, floor_blocks = int(np.ceil(floor * size - 1e-9)), 0, 0
    while covered < need:
        lo, hi = spans[order[floor_blocks]]
        covered, floor_blocks = covered + hi - lo, floor_blocks + 1
    want = max(solved, floor_blocks, int(alpha > 0))
    own = np.zeros(size, bool)
    for j in order[:want]:
        own[slice(*spans[j])] = True
    assert np.all(choice.mask[given_mask])  # the coordinator's mask is kept
    assert np.all(choice.mask[own])  # and never replaces the device's own top blocks
    assert np.array_equal(choice.mask, given_mask | own)  # nothing else
    added = {j for j in order[:want] if not given_mask[slice(*spans[j])].all()}
    assert choice.info.get("own_blocks_added", [0])[0] == len(added)
    assert np.array_equal(ctx.shared_mask, given_mask)  # the plan's mask is not modified in place


def test_a_mask_of_the_least_sensitive_blocks_leaves_the_most_sensitive_encrypted():
    """The measured attack: the coordinator writes the device's least sensitive 5 % of blocks
    as its nested mask. The device still encrypts what its own solver picks, its most
    sensitive blocks, exactly as under its own masks (masks=solver)."""
    rng = np.random.default_rng(4)
    block, size, alpha = 8, 50_826, 0.3
    sens = rng.random(size) ** 6
    weights = rng.normal(size=size)
    per_block = np.add.reduceat(sens, np.arange(0, size, block))
    worst = np.argsort(per_block, kind="stable")[:int(0.05 * per_block.size)]
    given_mask = np.repeat(np.isin(np.arange(per_block.size), worst), block)[:size]
    nested = build_strategy("sensecrypt", StrategyOptions(masks="nested"))
    choice = nested.select_mask(ClientContext("a", 1, 0, alpha, given_mask, block), sensitivity=sens, weights=weights)
    own = build_strategy("sensecrypt").select_mask(ClientContext("a", 1, 0, alpha, None, block), sensitivity=sens,
                                                   weights=weights).mask
    assert own.sum() > 0.2 * size and np.array_equal(choice.mask, own | given_mask)
    assert choice.info["own_blocks_added"][0] == int(own[::block].sum())
    assert np.dot(sens, choice.mask) / sens.sum() > np.dot(sens, given_mask) / sens.sum() + 0.5
