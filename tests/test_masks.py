"""SenseCrypt mask solver (eqs. 4-9) against brute force, plus the mask helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.engine.masks import (
    nested_block_masks,
    DEFAULT_B,
    DEFAULT_C,
    SECURITY_RTOL,
    block_scores,
    budget_count,
    expand_block_mask,
    required_security,
    scalarised_objective,
    security_met,
    solve_mask,
    top_fraction_mask,
    top_k_mask,
)
from senseshield.engine.mutual_info import masked_mi_curve, masked_mutual_information
from senseshield.errors import ConfigError

FAST = settings(max_examples=150, deadline=None, derandomize=True)

# Integers make ties (equal sensitivities, zero-cost items) likely; floats cover the rest.
sens_value = st.one_of(
    st.integers(min_value=0, max_value=4).map(float),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False, allow_infinity=False),
)
weight_value = st.one_of(
    st.integers(min_value=-2, max_value=2).map(lambda i: i / 2),
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False, allow_infinity=False),
)
params = st.fixed_dictionaries(
    {
        "alpha": st.floats(min_value=0.0, max_value=1.0),
        "c": st.floats(min_value=0.0, max_value=1.5),
        "b": st.floats(min_value=0.0, max_value=5.0),
        "beta1": st.floats(min_value=0.1, max_value=10.0),
        "beta2": st.floats(min_value=0.1, max_value=10.0),
    }
)


def all_masks(n: int) -> np.ndarray:
    return ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).astype(bool)


def canonical_order(g: np.ndarray) -> np.ndarray:
    """Sensitivity descending, ties by lower index first."""
    return np.lexsort((np.arange(g.size), -g))


def prefix(g: np.ndarray, k: int) -> np.ndarray:
    mask = np.zeros(g.size, dtype=bool)
    mask[canonical_order(g)[:k]] = True
    return mask


def objective(masks: np.ndarray, g: np.ndarray, beta1: float, beta2: float) -> np.ndarray:
    total = g.sum()
    share = masks.astype(float) @ g / total if total > 0 else np.zeros(len(masks))
    return beta1 * masks.sum(axis=1) / g.size - beta2 * share


def sec_ok(masks: np.ndarray, g: np.ndarray, level: float) -> np.ndarray:
    covered = masks.astype(float) @ g
    return np.array([security_met(covered=c, total=g.sum(), level=level) for c in covered])


# --------------------------------------------------------------------------- eqs. 4-7


@FAST
@given(st.lists(sens_value, min_size=1, max_size=10), params)
def test_matches_exhaustive_search_over_all_masks(values: list[float], p: dict) -> None:
    g = np.array(values)
    n = g.size
    sol = solve_mask(g, eta_mi=None, **p)
    budget = budget_count(alpha=p["alpha"], n=n)
    level = required_security(alpha=p["alpha"], c=p["c"], b=p["b"])
    masks = all_masks(n)
    feasible = (masks.sum(axis=1) <= budget) & sec_ok(masks, g, level)
    assert sol.budget == budget and sol.required_security == level
    assert sol.mutual_information is None
    assert sol.mask.dtype == bool and sol.mask.shape == (n,)
    assert sol.count == int(sol.mask.sum()) and sol.he_ratio == sol.count / n
    # The solver's mask is always a canonical top-sensitivity prefix.
    np.testing.assert_array_equal(sol.mask, prefix(g, sol.count))
    if feasible.any():
        obj = objective(masks, g, p["beta1"], p["beta2"])
        best = obj[feasible].min()
        assert sol.feasible and sol.violations == []
        # Fewest positions among the optimal masks (zero-cost items are left out).
        assert sol.count == masks[feasible & (obj <= best + 1e-12)].sum(axis=1).min()
        assert sol.count <= budget
        assert sec_ok(sol.mask[None, :], g, level)[0]
        assert sol.objective == pytest.approx(best, abs=1e-9)
        assert sol.objective == pytest.approx(
            scalarised_objective(sol.mask, g, beta1=p["beta1"], beta2=p["beta2"]), abs=1e-12
        )
    else:
        assert not sol.feasible
        assert sol.count == budget
        np.testing.assert_array_equal(sol.mask, top_k_mask(g, k=budget))
        assert len(sol.violations) == 1 and "security constraint" in sol.violations[0]


def test_all_zero_sensitivity_means_nothing_to_encrypt() -> None:
    sol = solve_mask(np.zeros(50), alpha=0.5, eta_mi=None)
    assert sol.feasible and sol.count == 0 and sol.security_level == 1.0


def test_all_zero_sensitivity_still_obeys_mi() -> None:
    w = np.linspace(-1.0, 1.0, 64)
    sol = solve_mask(np.zeros(64), alpha=1.0, weights=w, eta_mi=1.0)
    assert sol.feasible and sol.count > 0
    assert sol.mutual_information is not None and sol.mutual_information <= 1.0
    np.testing.assert_array_equal(sol.mask, np.arange(64) < sol.count)  # ties: lowest index


def test_violation_message_names_constraint_and_shortfall() -> None:
    g = np.ones(10_000)  # every parameter carries the same sensitivity
    sol = solve_mask(g, alpha=0.1, eta_mi=None)
    level = 1 - DEFAULT_C * math.exp(-DEFAULT_B * 0.1)
    needed = math.ceil(level * 10_000 - SECURITY_RTOL * 10_000)
    assert not sol.feasible and sol.count == sol.budget == 1_000
    (message,) = sol.violations
    assert message.startswith("security constraint (eq. 7) needs ")
    assert f"{needed:,} parameters" in message
    assert "the budget allows 1,000 (alpha=0.1)" in message
    assert message.endswith(f"short by {needed - 1_000:,}.")
    assert sol.security_level == pytest.approx(0.1)


def test_unit_word_in_messages() -> None:
    sol = solve_mask(np.ones(100), alpha=0.1, eta_mi=None, unit="blocks")
    assert "blocks" in sol.violations[0]


def test_c_zero_requires_everything_and_is_reachable() -> None:
    # L = 1 must be reachable although sums in another order may differ in the last ulp.
    g = np.array([0.2, 0.9, 0.5, 0.3, 0.4, 0.0])
    assert np.cumsum(np.sort(g)[::-1])[-1] < g.sum()  # 2.3 < 2.3000000000000003
    sol = solve_mask(g, alpha=1.0, c=0.0, eta_mi=None)
    assert sol.feasible and sol.count == 5 and not sol.mask[5]


def test_zero_cost_items_are_left_out() -> None:
    # beta1 = beta2 = 1: gamma_k / sum > 1 / N  <=>  gamma_k > mean = 2. The item equal to the
    # mean has zero scalarised cost: including it does not change the objective, so the
    # solver takes the smallest optimal count.
    g = np.array([4.0, 2.0, 2.0, 0.0])
    sol = solve_mask(g, alpha=1.0, c=1.0, b=0.0, eta_mi=None)  # security level 0
    assert sol.feasible and sol.count == 1 and sol.mask.tolist() == [True, False, False, False]
    assert sol.objective == pytest.approx(1 / 4 - 4 / 8)


# --------------------------------------------------------------------------- eq. 8


@FAST
@given(
    st.integers(min_value=1, max_value=10).flatmap(
        lambda n: st.tuples(
            st.lists(sens_value, min_size=n, max_size=n),
            st.lists(weight_value, min_size=n, max_size=n),
        )
    ),
    params,
    st.floats(min_value=0.0, max_value=2.5),
    st.sampled_from([2, 4, 16]),
)
def test_with_mi_returns_best_feasible_prefix(
    gw: tuple[list[float], list[float]], p: dict, eta: float, bins: int
) -> None:
    """Claim: the solver returns the canonical top-sensitivity prefix that minimises the
    scalarised objective (ties: fewest positions) among prefixes meeting eqs. 6, 7 and 8;
    if no prefix meets them it returns the top K with feasible=False."""
    g, w = np.array(gw[0]), np.array(gw[1])
    n = g.size
    sol = solve_mask(g, weights=w, eta_mi=eta, bins=bins, **p)
    budget = budget_count(alpha=p["alpha"], n=n)
    level = required_security(alpha=p["alpha"], c=p["c"], b=p["b"])
    prefixes = np.array([prefix(g, k) for k in range(n + 1)])
    mi = np.array([masked_mutual_information(w, m, bins=bins) for m in prefixes])
    np.testing.assert_allclose(  # the curve helper agrees on the same prefixes
        masked_mi_curve(w, canonical_order(g), np.arange(n + 1), bins=bins), mi, atol=1e-12
    )
    assert np.all(np.diff(mi) <= 1e-12)  # MI is non-increasing along prefixes
    ok_sec = sec_ok(prefixes, g, level)
    feasible = (np.arange(n + 1) <= budget) & ok_sec & (mi <= eta)
    np.testing.assert_array_equal(sol.mask, prefix(g, sol.count))
    assert sol.mutual_information == pytest.approx(mi[sol.count], abs=1e-12)
    if feasible.any():
        obj = objective(prefixes, g, p["beta1"], p["beta2"])
        best = obj[feasible].min()
        assert sol.feasible and sol.violations == []
        assert sol.mutual_information <= eta
        assert sol.objective == pytest.approx(best, abs=1e-9)
        assert feasible[sol.count]
        # Fewest positions among the (numerically) optimal feasible prefixes.
        optimal = np.flatnonzero(feasible & (obj <= best + 1e-12))
        assert sol.count == optimal.min()
    else:
        assert not sol.feasible and sol.count == budget
        text = " ".join(sol.violations)
        assert ("security constraint" in text) == (not ok_sec[budget])
        assert ("MI constraint" in text) == (mi[budget] > eta)
        if mi[budget] > eta:
            k_mi = int(np.flatnonzero(mi <= eta)[0])
            assert f"needs {k_mi:,} parameters" in text


def test_mi_binding_then_infeasible_messages() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(4000)
    g = rng.random(4000)
    free = solve_mask(g, alpha=1.0, weights=w, eta_mi=None)
    tight = solve_mask(g, alpha=1.0, weights=w, eta_mi=0.5)
    assert tight.feasible and tight.count > free.count
    assert tight.mutual_information is not None and tight.mutual_information <= 0.5
    # The same MI threshold with a small budget cannot be met: fallback to the top-K.
    small = solve_mask(g, alpha=0.3, weights=w, eta_mi=0.5, c=0.0, b=0.0)
    assert not small.feasible and small.count == small.budget == 1200
    assert any(v.startswith("MI constraint (eq. 8) needs ") for v in small.violations)
    assert any("security constraint" in v for v in small.violations)


# --------------------------------------------------------------------------- large N


def sort_reference(g, w, *, alpha, eta, c=DEFAULT_C, b=DEFAULT_B, beta1=1.0, beta2=1.0):
    """The solver's claim computed the slow way: full sort, all prefixes."""
    n = g.size
    order = canonical_order(g)
    covered = np.concatenate([[0.0], np.cumsum(g[order])])
    total = g.sum()
    budget = budget_count(alpha=alpha, n=n)
    level = required_security(alpha=alpha, c=c, b=b)
    ks = np.arange(n + 1)
    ok = covered >= level * total - SECURITY_RTOL * total if total > 0 else np.ones(n + 1, bool)
    ok &= ks <= budget
    if eta is not None:
        ok &= masked_mi_curve(w, order, ks) <= eta
    if not ok.any():
        return None
    obj = beta1 * ks / n - (beta2 * covered / total if total > 0 else 0.0)
    cand = np.flatnonzero(ok)
    return int(cand[np.argmin(obj[cand])])


def distributions(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    w = rng.standard_normal(n) * 0.05
    return {
        "model-like": np.abs(w * rng.standard_t(3, n)),
        "uniform": rng.random(n),
        "constant": np.ones(n),
        "70% zeros": np.where(rng.random(n) < 0.7, 0.0, rng.random(n)),
        "4 values": rng.integers(0, 4, n).astype(float),
        "wide range": rng.lognormal(0.0, 30.0, n),
        "subnormal+huge": np.where(rng.random(n) < 0.5, 5e-324 * rng.integers(1, 9, n), 1e300),
    }


@pytest.mark.parametrize("name", list(distributions(10, np.random.default_rng(0))))
def test_large_n_matches_sort_reference(name: str) -> None:
    """N = 30,000 exercises the radix levels (brute force above stays below their size)."""
    rng = np.random.default_rng(7)
    n = 30_000
    g = distributions(n, rng)[name]
    w = rng.standard_normal(n) * 0.05
    for alpha in (0.05, 0.3, 1.0):
        for eta in (None, 2.0, 0.8, 0.2):
            sol = solve_mask(g, alpha=alpha, weights=w, eta_mi=eta)
            k = sort_reference(g, w, alpha=alpha, eta=eta)
            if k is None:
                assert not sol.feasible and sol.count == sol.budget
                np.testing.assert_array_equal(sol.mask, top_k_mask(g, k=sol.budget))
            else:
                assert sol.feasible, (name, alpha, eta, sol.violations)
                ref = prefix(g, k)
                assert sol.objective == pytest.approx(
                    scalarised_objective(ref, g), abs=1e-9
                ), (name, alpha, eta)
                np.testing.assert_array_equal(sol.mask, prefix(g, sol.count))


def test_large_n_violation_counts_match_reference() -> None:
    rng = np.random.default_rng(11)
    n = 20_000
    g = np.where(rng.random(n) < 0.6, 0.0, rng.random(n))
    w = rng.standard_normal(n)
    sol = solve_mask(g, alpha=0.05, weights=w, eta_mi=0.7)
    order = canonical_order(g)
    covered = np.cumsum(g[order])
    level = required_security(alpha=0.05, c=DEFAULT_C, b=DEFAULT_B)
    m = int(np.searchsorted(covered, level * g.sum() - SECURITY_RTOL * g.sum())) + 1
    curve = masked_mi_curve(w, order, np.arange(n + 1))
    k_mi = int(np.flatnonzero(curve <= 0.7)[0])
    assert not sol.feasible
    assert f"needs {m:,} parameters" in sol.violations[0]
    assert f"needs {k_mi:,} parameters" in sol.violations[1]


# --------------------------------------------------------------------------- helpers


def test_budget_count_forgives_float_artefacts() -> None:
    assert 0.29 * 100 < 29
    assert budget_count(alpha=0.29, n=100) == 29
    assert budget_count(alpha=0.1, n=10) == 1
    assert budget_count(alpha=1.0, n=7) == 7
    assert budget_count(alpha=0.0, n=7) == 0
    assert budget_count(alpha=0.999, n=10) == 9


@FAST
@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-3, max_value=3).map(float),
            st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
        ),
        max_size=30,
    ),
    st.floats(min_value=0.0, max_value=1.0),
)
def test_top_fraction_mask(values: list[float], ratio: float) -> None:
    s = np.array(values, dtype=float)
    mask = top_fraction_mask(s, ratio=ratio)
    k = budget_count(alpha=ratio, n=s.size)
    assert mask.dtype == bool and int(mask.sum()) == k
    expected = np.zeros(s.size, dtype=bool)
    expected[np.lexsort((np.arange(s.size), -s))[:k]] = True
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_mask_large_signed_and_tied(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 50_000
    s = np.concatenate(
        [rng.standard_normal(n // 2) * 10.0 ** rng.integers(-300, 300, n // 2).astype(float),
         rng.integers(-2, 3, n // 2).astype(float), [-0.0, 0.0, 1e308, -1e308]]
    )
    rng.shuffle(s)
    order = np.lexsort((np.arange(s.size), -s))
    for k in (0, 1, 17, 2048, 2049, s.size // 3, s.size - 1, s.size):
        expected = np.zeros(s.size, dtype=bool)
        expected[order[:k]] = True
        np.testing.assert_array_equal(top_k_mask(s, k=k), expected)


def test_negative_zero_ties_with_zero() -> None:
    s = np.array([-0.0, 0.0, -0.0, 1.0])
    np.testing.assert_array_equal(top_k_mask(s, k=2), [True, False, False, True])
    g = np.array([-0.0, 0.0, 2.0, 0.0])
    sol = solve_mask(g, alpha=1.0, eta_mi=None)
    np.testing.assert_array_equal(sol.mask, [False, False, True, False])


def test_block_scores_and_expand() -> None:
    s = np.arange(10, dtype=float)
    np.testing.assert_array_equal(block_scores(s, block_size=4), [6.0, 22.0, 17.0])
    np.testing.assert_array_equal(block_scores(s, block_size=1), s)
    assert block_scores(np.zeros(0), block_size=3).size == 0
    mask = expand_block_mask(np.array([True, False, True]), block_size=4, n=10)
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 0, 0, 0, 0, 1, 1])
    # Round trip through the solver on blocks: N is the number of blocks.
    rng = np.random.default_rng(5)
    g = rng.random(1000)
    blocks = block_scores(g, block_size=64)
    sol = solve_mask(blocks, alpha=0.5, eta_mi=None, unit="blocks")
    assert sol.budget == budget_count(alpha=0.5, n=16)
    full = expand_block_mask(sol.mask, block_size=64, n=1000)
    assert full.shape == (1000,) and g[full].sum() == pytest.approx(blocks[sol.mask].sum())


@given(st.integers(min_value=0, max_value=50), st.integers(min_value=1, max_value=9))
@FAST
def test_block_roundtrip_property(n: int, size: int) -> None:
    s = np.ones(n)
    blocks = block_scores(s, block_size=size)
    assert blocks.size == -(-n // size) and blocks.sum() == n
    assert expand_block_mask(np.ones(blocks.size, bool), block_size=size, n=n).all()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sensitivity": [1.0, np.nan], "alpha": 0.5}, "sensitivity[1]=nan"),
        ({"sensitivity": [1.0, np.inf], "alpha": 0.5}, "sensitivity[1]=inf"),
        ({"sensitivity": [1.0, -2.0], "alpha": 0.5}, "sensitivity[1]=-2.0"),
        ({"sensitivity": [[1.0]], "alpha": 0.5}, "1-D"),
        ({"sensitivity": [1.0], "alpha": 1.5}, "alpha=1.5"),
        ({"sensitivity": [1.0], "alpha": -0.1}, "alpha=-0.1"),
        ({"sensitivity": [1.0], "alpha": float("nan")}, "alpha=nan"),
        ({"sensitivity": [1.0], "alpha": 0.5, "c": -1.0}, "c=-1.0"),
        ({"sensitivity": [1.0], "alpha": 0.5, "b": -0.5}, "b=-0.5"),
        ({"sensitivity": [1.0], "alpha": 0.5, "beta1": 0.0}, "beta1=0.0"),
        ({"sensitivity": [1.0], "alpha": 0.5, "beta2": -1.0}, "beta2=-1.0"),
        ({"sensitivity": [1.0], "alpha": 0.5, "bins": 0, "weights": [1.0]}, "bins=0"),
        ({"sensitivity": [1.0], "alpha": 0.5}, "weights=None"),
        ({"sensitivity": [1.0], "alpha": 0.5, "weights": [1.0, 2.0]}, "weights has 2"),
        ({"sensitivity": [1.0], "alpha": 0.5, "weights": [np.nan]}, "weights[0]=nan"),
        ({"sensitivity": [1.0], "alpha": 0.5, "weights": [1.0], "eta_mi": -1.0}, "eta_mi=-1.0"),
    ],
)
def test_bad_input_raises_config_error(kwargs: dict, needle: str) -> None:
    sensitivity = kwargs.pop("sensitivity")
    with pytest.raises(ConfigError) as info:
        solve_mask(sensitivity, **kwargs)
    message = str(info.value)
    assert needle in message
    assert message.endswith(".") and "\n" not in message


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: top_fraction_mask([1.0, 2.0], ratio=1.2), "ratio=1.2"),
        (lambda: top_fraction_mask([1.0, np.nan], ratio=0.5), "scores[1]=nan"),
        (lambda: top_k_mask([1.0, 2.0], k=3), "k=3"),
        (lambda: block_scores([1.0], block_size=0), "block_size=0"),
        (lambda: expand_block_mask(np.ones(2, bool), block_size=4, n=10), "3 blocks"),
        (lambda: expand_block_mask(np.ones(3), block_size=4, n=10), "boolean"),
        (lambda: budget_count(alpha=0.5, n=-1), "n=-1"),
    ],
)
def test_helpers_bad_input(call, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert needle in str(info.value)


def test_empty_sensitivity() -> None:
    sol = solve_mask(np.zeros(0), alpha=0.5, weights=np.zeros(0))
    assert sol.feasible and sol.count == 0 and sol.mask.size == 0


def test_huge_values_do_not_overflow() -> None:
    g = np.array([1e308, 1e308, 1.0, 0.0])
    sol = solve_mask(g, alpha=1.0, eta_mi=None)
    assert sol.feasible and sol.count == 2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 9), st.floats(0, 1), st.integers(0, 2**31))
def test_top_up_mask_adds_the_most_sensitive_whole_blocks_until_the_floor(n, block, fraction, seed):
    from senseshield.engine.masks import top_up_mask

    rng = np.random.default_rng(seed)
    scores = rng.random(n)
    blocks = [np.arange(s, min(s + block, n)) for s in range(0, n, block)]
    mask = np.zeros(n, bool)
    for b in blocks:
        if rng.random() < 0.3:
            mask[b] = True
    exclude = np.zeros(n, bool)
    exclude[blocks[-1]] = rng.random() < 0.3
    out = top_up_mask(mask, scores, fraction=fraction, block_size=block, exclude=exclude)
    assert np.all(out[mask])  # nothing removed
    added = [b for b in blocks if out[b].all() and not mask[b].any()]
    assert all(out[b].all() or not out[b].any() for b in blocks if not mask[b].any())  # whole blocks
    assert not any(exclude[b].any() for b in added)
    allowed = [b for b in blocks if not mask[b].any() and not exclude[b].any()]
    if out.sum() < np.ceil(fraction * n - 1e-9):
        assert len(added) == len(allowed)  # only short when every allowed block is taken
    if added and mask.sum() < fraction * n:
        # brute force: the added blocks are the best-scoring allowed ones, and the last was needed
        best = sorted(allowed, key=lambda b: (-scores[b].sum(), b[0]))[: len(added)]
        assert sorted(b[0] for b in best) == sorted(b[0] for b in added)
        weakest = min(added, key=lambda b: (scores[b].sum(), -b[0]))
        assert out.sum() - weakest.size < np.ceil(fraction * n - 1e-9)
    if mask.sum() >= fraction * n:
        assert np.array_equal(out, mask)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40),
    alphas=st.lists(st.floats(0, 1), min_size=1, max_size=6),
    block=st.integers(1, 4),
    k=st.integers(1, 3),
)
def test_nested_masks_are_prefixes_of_one_ranking_with_k_encryptors(values, alphas, block, k) -> None:
    """Issue 22: the nested masks of a cluster are prefixes of one ranking (block sums, ties
    lower index first), each the solver's count at that budget (at least one block for a
    positive budget), the k-1 largest capped at the k-th, so every encrypted block has at
    least k encryptors."""
    g = np.array(values)
    masks = nested_block_masks(g, alphas, block_size=block, min_encryptors=k)
    blocks = block_scores(g, block_size=block)
    order = sorted(range(blocks.size), key=lambda j: (-blocks[j], j))
    solved = [max(int(solve_mask(blocks, alpha=a, eta_mi=None).count), int(a > 0)) for a in alphas]
    cap = sorted(solved, reverse=True)[k - 1] if len(solved) >= k else None
    cap = cap or None  # fewer than k members with a budget: counts as solved (sealed by the k rule)
    per_block = []
    for m, n in zip(masks, solved):
        assert np.array_equal(m, expand_block_mask(m[::block].copy(), block_size=block, n=g.size))
        chosen = set(np.flatnonzero(m[::block]).tolist())
        want = n if cap is None else min(n, cap)
        assert chosen == set(order[:want])  # the prefix of the one ranking
        per_block.append(m[::block])
    encryptors = np.sum(per_block, axis=0)
    if cap is not None:
        assert np.all((encryptors == 0) | (encryptors >= k))  # nothing sealed
    assert all(m.any() for m, a in zip(masks, alphas) if a > 0)  # a budget never encrypts nothing
