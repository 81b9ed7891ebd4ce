"""Robust probe summaries and pooling of agreeing devices (budget inputs), checked against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.engine.measurements import agreeing_groups, pool_agreeing, summarise
from senseshield.errors import ConfigError
from senseshield.strategies.base import BootstrapReport, RoundCosts, budgets_per_cluster, measured_intervals

FAST = settings(max_examples=80, deadline=None, derandomize=True)
positive = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False)


def _quantile_by_hand(xs: list[float], q: float) -> float:
    """Linear-interpolation quantile of a sorted copy (numpy's default), written out."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    i = int(pos)
    j = min(i + 1, len(s) - 1)
    return s[i] + (pos - i) * (s[j] - s[i])


@FAST
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=30))
def test_summary_matches_brute_force(xs: list[float]) -> None:
    s = summarise(xs)
    ordered = sorted(xs)
    n = len(xs)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    assert s.median == pytest.approx(median, rel=1e-12, abs=1e-12)
    assert (s.low, s.high, s.probes) == (min(xs), max(xs), n)
    assert s.q1 == pytest.approx(_quantile_by_hand(xs, 0.25), rel=1e-12, abs=1e-9)
    assert s.q3 == pytest.approx(_quantile_by_hand(xs, 0.75), rel=1e-12, abs=1e-9)
    assert s.low <= s.q1 <= s.median <= s.q3 <= s.high
    # [min, max] misses the median only when every probe falls on one side: 2 x 0.5^n
    assert s.confidence == pytest.approx(1 - 2 * 0.5**n)


def test_summary_refuses_bad_samples() -> None:
    with pytest.raises(ConfigError, match="at least one probe"):
        summarise([])
    with pytest.raises(ConfigError, match=r"samples\[1\]=nan is not allowed"):
        summarise([1.0, float("nan")])


def _groups_by_brute_force(lo: np.ndarray, hi: np.ndarray) -> list[set[int]]:
    """Connected components of the pairwise overlap graph, by flood fill."""
    n = lo.size
    seen, groups = set(), []
    for start in range(n):
        if start in seen:
            continue
        group, todo = {start}, [start]
        while todo:
            i = todo.pop()
            for j in range(n):
                if j not in group and lo[i] <= hi[j] and lo[j] <= hi[i]:
                    group.add(j)
                    todo.append(j)
        seen |= group
        groups.append(group)
    return groups


devices = st.lists(st.tuples(positive, st.floats(min_value=1.0, max_value=3.0), st.floats(min_value=1.0, max_value=3.0)),
                   min_size=1, max_size=12)


@FAST
@given(devices, st.floats(min_value=0, max_value=0.5))
def test_groups_are_the_connected_components_of_overlapping_intervals(rows, tolerance: float) -> None:
    v = np.array([r[0] for r in rows])
    lo, hi = v / np.array([r[1] for r in rows]), v * np.array([r[2] for r in rows])
    labels = agreeing_groups(v, low=lo, high=hi, tolerance=tolerance)
    expected = _groups_by_brute_force(lo / (1 + tolerance), hi * (1 + tolerance))
    got = [set(np.flatnonzero(labels == g).tolist()) for g in np.unique(labels)]
    assert sorted(map(sorted, got)) == sorted(map(sorted, expected))
    pooled = pool_agreeing(v, low=lo, high=hi, tolerance=tolerance)
    for group in expected:
        members = sorted(group)
        assert np.all(pooled[members] == np.median(v[members]))  # one figure per group


@FAST
@given(devices, st.permutations(range(12)))
def test_pooling_is_permutation_equivariant(rows, perm) -> None:
    perm = [p for p in perm if p < len(rows)]
    v = np.array([r[0] for r in rows])
    lo, hi = v / np.array([r[1] for r in rows]), v * np.array([r[2] for r in rows])
    pooled = pool_agreeing(v, low=lo, high=hi, tolerance=0.05)
    np.testing.assert_array_equal(pool_agreeing(v[perm], low=lo[perm], high=hi[perm], tolerance=0.05), pooled[perm])


def test_exact_figures_pool_only_when_equal_and_distinct_classes_stay_apart() -> None:
    v = np.array([50.0, 49.0, 50.0, 10.0])
    np.testing.assert_array_equal(pool_agreeing(v, low=v, high=v, tolerance=0.0), v)
    # identical devices with scattered probes; a slow device whose interval is far away
    lo, hi = np.array([40.0, 30.0, 45.0, 8.0]), np.array([90.0, 60.0, 70.0, 12.0])
    np.testing.assert_array_equal(pool_agreeing(v, low=lo, high=hi, tolerance=0.05), [50.0, 50.0, 50.0, 10.0])


def test_pooling_refuses_a_value_outside_its_interval() -> None:
    with pytest.raises(ConfigError, match=r"Device 1 has value 5.0 with interval \[1.0, 2.0\]"):
        agreeing_groups(np.array([1.0, 5.0]), low=np.array([1.0, 1.0]), high=np.array([1.0, 2.0]))
    with pytest.raises(ConfigError, match="tolerance=-0.1 is not allowed"):
        agreeing_groups(np.array([1.0]), low=np.array([1.0]), high=np.array([1.0]), tolerance=-0.1)


# ---- the one place budgets are decided ----------------------------------------------------


def _profile(median: float, lo: float, hi: float, **extra) -> dict:
    return {"measurements": {"bandwidth": {"median": median, "min": lo, "max": hi}}, **extra}


def test_identical_devices_with_scattered_probes_get_equal_budgets() -> None:
    # what 3 identical agents on one machine measured (MB/s): medians 2x apart, intervals overlap
    probes = [(120.0, 60.0, 300.0), (240.0, 90.0, 420.0), (180.0, 110.0, 260.0)]
    reports = [BootstrapReport(f"a{i}", 100, m, 5.2, intervals=measured_intervals(_profile(m, lo, hi)))
               for i, (m, lo, hi) in enumerate(probes)]
    notes: dict = {}
    budgets = budgets_per_cluster(reports, {r.client_id: 0 for r in reports}, notes=notes)
    assert set(budgets.values()) == {1.0}
    assert notes["0"]["pooled"]["bandwidth"]["a0"] == [120.0, 180.0]
    # the paper's formula on the raw medians: 0.5 / 1 / 0.75
    bare = [BootstrapReport(r.client_id, 100, r.bandwidth, r.cpu_speed) for r in reports]
    assert sorted(budgets_per_cluster(bare, {r.client_id: 0 for r in bare}).values()) == [0.5, 0.75, 1.0]


def test_declared_bound_caps_the_interval_and_devices_that_differ_keep_their_budgets() -> None:
    # a device declared at 5 MB/s (auto:rpi4-like) measured 100-300 MB/s on loopback: it is 5
    capped = _profile(5.0, 100.0, 300.0, bounds={"bandwidth": 5.0, "cpu_speed": 6.0})
    assert measured_intervals(capped) == {"bandwidth": (5.0, 5.0)}
    fast = measured_intervals(_profile(180.0, 100.0, 300.0))
    reports = [BootstrapReport("pi", 100, 5.0, 5.2, intervals=measured_intervals(capped)),
               BootstrapReport("x86", 100, 180.0, 5.2, intervals=fast)]
    budgets = budgets_per_cluster(reports, {"pi": 0, "x86": 0})
    assert budgets == {"pi": pytest.approx(5 / 180), "x86": 1.0}


def test_calibrated_costs_are_pooled_too() -> None:
    profile = {"measured": {"spread": {"encrypt_per_s": [800.0, 1500.0], "train_s": [0.5, 0.9], "bogus": [1, 2]}}}
    assert measured_intervals(profile) == {"encrypt_per_s": (800.0, 1500.0), "train_s": (0.5, 0.9)}
    assert measured_intervals({"measured": {"spread": {"train_s": "x"}}, "measurements": []}) == {}
    reports = [BootstrapReport(f"a{i}", 100, 10.0, 5.2, None, RoundCosts(t, r, 300.0), measured_intervals(profile))
               for i, (t, r) in enumerate([(0.6, 1000.0), (0.8, 1400.0)])]
    budgets = budgets_per_cluster(reports, {"a0": 0, "a1": 0}, mode="calibrated", size=20_000, block_size=66)
    assert budgets["a0"] == budgets["a1"]
