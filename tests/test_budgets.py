"""Encryption budgets (SenseCrypt sec. 3.2) and the Gaussian-mechanism noise scale."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.engine.budgets import encryption_budgets, sigma_for_epsilon
from senseshield.errors import ConfigError

FAST = settings(max_examples=60, deadline=None, derandomize=True)


def test_hand_computed_five_clients() -> None:
    # r̄ = r / 50 = [1, .9, .8, .7, .6]; v̄ = v / 24 = [1, 16/24, 12/24, 10/24, 8/24];
    # the CPU is every client's bottleneck, so c = v̄, and max c = 1 so alpha = c.
    alpha = encryption_budgets(
        bandwidth=np.array([50, 45, 40, 35, 30]), cpu_speed=np.array([24, 16, 12, 10, 8])
    )
    np.testing.assert_allclose(alpha, [1.0, 2 / 3, 1 / 2, 5 / 12, 1 / 3], rtol=1e-15)
    assert alpha[0] == 1.0  # the fastest client gets 1


def test_hand_computed_mixed_bottlenecks() -> None:
    # r̄ = [1, .5, .8], v̄ = [.5, 1, .75] -> c = [.5, .5, .75] -> alpha = c / .75.
    alpha = encryption_budgets(bandwidth=[100.0, 50.0, 80.0], cpu_speed=[2.0, 4.0, 3.0])
    np.testing.assert_allclose(alpha, [2 / 3, 2 / 3, 1.0], rtol=1e-15)


def test_single_client_gets_one() -> None:
    assert encryption_budgets(bandwidth=[3.0], cpu_speed=[7.0]).tolist() == [1.0]


positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@FAST
@given(
    st.integers(min_value=1, max_value=12).flatmap(
        lambda n: st.tuples(st.lists(positive, min_size=n, max_size=n),
                            st.lists(positive, min_size=n, max_size=n))
    ),
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_properties(pair: tuple[list[float], list[float]], sr: float, sv: float) -> None:
    r, v = np.array(pair[0]), np.array(pair[1])
    alpha = encryption_budgets(bandwidth=r, cpu_speed=v)
    assert alpha.shape == r.shape
    assert np.all(alpha > 0) and np.all(alpha <= 1.0)
    assert alpha.max() == 1.0
    scaled = encryption_budgets(bandwidth=r * sr, cpu_speed=v * sv)
    np.testing.assert_allclose(scaled, alpha, rtol=1e-12)
    # A client that is at least as fast in both resources gets at least the same budget.
    i, j = int(np.argmax(r)), int(np.argmax(v))
    if i == j:
        assert alpha[i] == 1.0


@pytest.mark.parametrize(
    ("bandwidth", "cpu", "needle"),
    [
        ([1.0, float("nan")], [1.0, 1.0], "bandwidth[1]=nan"),
        ([1.0, 2.0], [1.0, float("inf")], "cpu_speed[1]=inf"),
        ([1.0, 0.0], [1.0, 1.0], "bandwidth[1]=0.0"),
        ([1.0, 2.0], [-1.0, 1.0], "cpu_speed[0]=-1.0"),
        ([1.0, 2.0], [1.0], "bandwidth has 2 values but cpu_speed has 1"),
        ([], [], "empty"),
        ([[1.0, 2.0]], [[1.0, 2.0]], "1-D"),
        (["a"], [1.0], "bandwidth"),
    ],
)
def test_bad_input_names_the_value(bandwidth: list, cpu: list, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        encryption_budgets(bandwidth=bandwidth, cpu_speed=cpu)
    assert needle in str(info.value)


def test_sigma_for_epsilon() -> None:
    assert sigma_for_epsilon(epsilon=1.0, delta=1e-5) == pytest.approx(
        math.sqrt(2 * math.log(1.25e5))
    )
    assert sigma_for_epsilon(epsilon=0.1, delta=1e-5) == pytest.approx(
        10 * sigma_for_epsilon(epsilon=1.0, delta=1e-5)
    )


@pytest.mark.parametrize(
    ("epsilon", "delta", "needle"),
    [
        (0.0, 1e-5, "epsilon=0.0"),
        (-1.0, 1e-5, "epsilon=-1.0"),
        (float("inf"), 1e-5, "epsilon=inf"),
        (1.0, 0.0, "delta=0.0"),
        (1.0, 1.0, "delta=1.0"),
        (1.0, float("nan"), "delta=nan"),
        ("x", 1e-5, "epsilon='x'"),
    ],
)
def test_sigma_bad_input(epsilon: float, delta: float, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        sigma_for_epsilon(epsilon=epsilon, delta=delta)
    assert needle in str(info.value)


# ---- calibrated budgets -------------------------------------------------------------------------

from senseshield.engine.budgets import calibrated_budgets, predicted_round_seconds  # noqa: E402

BYTES_ENC = 7.76  # packed Paillier, 2048-bit: 512 B per 66 values


def test_calibrated_hand_example_lines_up_and_the_quickest_gets_one() -> None:
    # two devices, 1000 parameters, no transfer cost (bytes 0): t_i(a) = fixed_i + 1000 a / rate_i
    # device 0: 0.1 + a (rate 1000/s) -> t(1) = 1.1; device 1: 0.3 + 2a (rate 500/s) -> 2.3
    # T = 1.1; device 1: 0.3 + 2 a = 1.1 -> a = 0.4
    res = calibrated_budgets(fixed_s=[0.1, 0.3], encrypt_per_s=[1000, 500], bandwidth=[1, 1], size=1000,
                             bytes_per_encrypted=0, bytes_per_plain=0)
    np.testing.assert_allclose(res.alphas, [1.0, 0.4], atol=1e-9)
    assert res.target_s == pytest.approx(1.1)
    np.testing.assert_allclose(res.predicted_s, [1.1, 1.1], atol=1e-9)
    np.testing.assert_allclose(res.full_s, [1.1, 2.3])
    assert not res.deadline_capped


def test_calibrated_deadline_caps_the_target() -> None:
    res = calibrated_budgets(fixed_s=[0.1, 0.3], encrypt_per_s=[1000, 500], bandwidth=[1, 1], size=1000,
                             bytes_per_encrypted=0, bytes_per_plain=0, deadline_s=1.0, headroom=0.7)
    assert res.deadline_capped and res.target_s == pytest.approx(0.7)
    np.testing.assert_allclose(res.alphas, [0.6, 0.2], atol=1e-9)


def test_calibrated_a_device_too_slow_to_line_up_gets_the_floor() -> None:
    res = calibrated_budgets(fixed_s=[0.1, 5.0], encrypt_per_s=[1000, 1000], bandwidth=[1, 1], size=1000,
                             bytes_per_encrypted=0, bytes_per_plain=0, floor=0.05)
    assert res.alphas.tolist() == [1.0, 0.05]
    assert res.predicted_s[1] > res.target_s  # it straggles whatever it encrypts


def test_calibrated_fraction_curve_the_solver_plateau_is_used() -> None:
    # the solver never encrypts more than 40 % of device 0's model: its time plateaus at a = 0.4
    fraction = np.array([[0.0, 0.4, 0.4], [0.0, 0.5, 1.0]])
    res = calibrated_budgets(fixed_s=[0.0, 0.0], encrypt_per_s=[1000, 1000], bandwidth=[1, 1], size=1000,
                             bytes_per_encrypted=0, bytes_per_plain=0, fraction=fraction)
    # t_0(1) = 0.4 s; device 1 needs f = 0.4 -> a = 0.4
    assert res.target_s == pytest.approx(0.4)
    np.testing.assert_allclose(res.alphas, [1.0, 0.4], atol=1e-9)


cost = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)
rate = st.floats(min_value=1e2, max_value=1e6, allow_nan=False)
band = st.floats(min_value=0.05, max_value=100.0, allow_nan=False)


@FAST
@given(
    st.integers(min_value=1, max_value=6).flatmap(
        lambda n: st.tuples(st.lists(cost, min_size=n, max_size=n), st.lists(rate, min_size=n, max_size=n),
                            st.lists(band, min_size=n, max_size=n))
    ),
    st.integers(min_value=100, max_value=200_000),
    st.one_of(st.none(), st.floats(min_value=0.05, max_value=50.0)),
    st.sampled_from([0.0, 0.05, 0.3]),
)
def test_calibrated_matches_brute_force(devices, size, deadline, slack) -> None:  # noqa: ANN001
    """Brute force: for each device, the largest budget on a 0.001 grid whose predicted time
    is <= T (1 + slack), with T = min(min_i t_i(1), 0.8 x deadline); budgets agree within one
    step and the predicted times line up at T (1 + slack) (except devices that cannot reach it
    at budget 0)."""
    fixed, rates, bws = (np.array(v) for v in devices)
    kw = dict(fixed_s=fixed, encrypt_per_s=rates, bandwidth=bws, size=size, bytes_per_encrypted=BYTES_ENC)
    res = calibrated_budgets(**kw, deadline_s=deadline, slack=slack)
    grid = np.round(np.arange(0, 1001) / 1000, 3)
    table = np.stack([predicted_round_seconds(np.full(fixed.size, a), **kw) for a in grid], axis=1)
    target = min(table[:, -1].min(), 0.8 * deadline if deadline is not None else np.inf)
    assert res.target_s == pytest.approx(target, rel=1e-9)
    limit = target * (1 + slack)
    for i in range(fixed.size):
        ok = np.flatnonzero(table[i] <= limit * (1 + 1e-9))
        brute = grid[ok[-1]] if ok.size else 0.0
        assert brute - 1e-9 <= res.alphas[i] <= brute + 1e-3 + 1e-9
        assert 0.0 <= res.alphas[i] <= 1.0
        if ok.size:  # reachable: lined up at T (1 + slack) (or budget 1 below it)
            assert res.predicted_s[i] <= limit * (1 + 1e-6)
            if res.alphas[i] < 1.0:
                assert res.predicted_s[i] == pytest.approx(limit, rel=1e-6)
    np.testing.assert_allclose(res.predicted_s, predicted_round_seconds(res.alphas, **kw), rtol=1e-9)
    if deadline is None:
        assert res.alphas.max() == 1.0  # the quickest device gets the whole budget, as in max-abs
    # faster in every resource, at least the same budget
    for i in range(fixed.size):
        for j in range(fixed.size):
            if fixed[i] <= fixed[j] and rates[i] >= rates[j] and bws[i] >= bws[j]:
                assert res.alphas[i] >= res.alphas[j] - 1e-9


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(fixed_s=[0.1, 0.2], encrypt_per_s=[1.0], bandwidth=[1, 1]), "each needs one value per device"),
        (dict(fixed_s=[0.1], encrypt_per_s=[0.0], bandwidth=[1]), "encrypt_per_s[0]=0.0 is not allowed"),
        (dict(fixed_s=[-1.0], encrypt_per_s=[1.0], bandwidth=[1]), "fixed_s must be"),
        (dict(fixed_s=[0.1], encrypt_per_s=[1.0], bandwidth=[float("nan")]), "bandwidth[0]=nan"),
        (dict(fixed_s=[0.1], encrypt_per_s=[1.0], bandwidth=[1], headroom=1.5), "headroom=1.5"),
        (dict(fixed_s=[0.1], encrypt_per_s=[1.0], bandwidth=[1], fraction=[[0, 2]]), "fraction values"),
        (dict(fixed_s=[0.1], encrypt_per_s=[1.0], bandwidth=[1], deadline_s=0.0), "deadline_s=0.0"),
        (dict(fixed_s=[0.1], encrypt_per_s=[1.0], bandwidth=[1], slack=-0.1), "slack=-0.1 is not allowed"),
    ],
)
def test_calibrated_bad_input_is_one_sentence(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        calibrated_budgets(size=100, bytes_per_encrypted=7.76, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_sensecrypt_budget_modes_paper_and_calibrated() -> None:
    from senseshield.strategies import StrategyOptions, build_strategy
    from senseshield.strategies.base import BootstrapReport, RoundCosts

    rng = np.random.default_rng(0)
    size = 660
    vectors = [np.abs(rng.normal(size=size)) for _ in range(3)]
    speeds = [24.0, 12.0, 8.0]
    costs = [RoundCosts(train_s=0.005 * 24 / v, encrypt_per_s=100.0 * v, bytes_per_encrypted=7.76) for v in speeds]
    reports = [BootstrapReport(f"c{i}", 100, 1.0, v, vectors[i], costs[i]) for i, v in enumerate(speeds)]
    paper = build_strategy("sensecrypt", StrategyOptions(budget_mode="paper")).plan_fleet(reports, size=size, block_size=66)
    assert paper.budget_notes["mode"] == "paper"
    # the default (measured) mode without measured encryption rates: the paper's formula, noted
    default = build_strategy("sensecrypt", StrategyOptions()).plan_fleet(reports, size=size, block_size=66)
    assert default.budget_of == paper.budget_of
    assert [n["mode"] for n in default.budget_notes["clusters"].values()] == ["paper"] * len(default.clusters)
    assert max(paper.budget_of.values()) == 1.0
    for tolerance, lined_up in ((0.0, 1.0), (0.05, 1.05)):  # predicted times within the tolerance count as on time
        strategy = build_strategy("sensecrypt", StrategyOptions(budget_mode="calibrated", budget_tolerance=tolerance))
        strategy.fleet_context.round_deadline = 60.0
        plan = strategy.plan_fleet(reports, size=size, block_size=66)
        (note,) = plan.budget_notes["clusters"].values()
        assert note["mode"] == "calibrated" and note["solver_fractions"]
        times = list(note["predicted_s"].values())
        assert max(times) / min(times) == pytest.approx(lined_up, abs=1e-3)  # lined up
        assert plan.budget_of["c0"] == 1.0 and plan.budget_of["c0"] > plan.budget_of["c1"] > plan.budget_of["c2"]
    # without measurements the calibrated mode falls back to the paper's formula, and says so
    bare = [BootstrapReport(r.client_id, r.n_samples, r.bandwidth, r.cpu_speed, r.sensitivity) for r in reports]
    fallback = strategy.plan_fleet(bare, size=size, block_size=66)
    assert fallback.budget_of == paper.budget_of
    assert "fallback" in next(iter(fallback.budget_notes["clusters"].values()))


def test_budget_mode_option_is_checked() -> None:
    from senseshield.strategies import StrategyOptions

    with pytest.raises(Exception, match=r"budget_mode='fast' is not allowed; use one of: measured, paper, calibrated"):
        StrategyOptions(budget_mode="fast")


def test_round_costs_from_an_agent_profile() -> None:
    from senseshield.strategies.base import RoundCosts

    got = RoundCosts.from_profile({"measured": {"train_s": 0.2, "encrypt_per_s": 1e4, "bytes_per_encrypted": 7.8}})
    assert got == RoundCosts(0.2, 1e4, 7.8, 0.0)
    assert RoundCosts.from_profile({}) is None
    assert RoundCosts.from_profile({"measured": {"train_s": 0.2, "encrypt_per_s": 0}}) is None


def test_measured_encryption_rates_decide_the_budgets_when_every_member_measured() -> None:
    """A board 20x slower at encryption gets about a 20th of the budget, whatever the spec sheet
    says; one device without a measured rate (or rates measured with different keys) falls back
    to the paper's formula, and the note says why."""
    from senseshield.strategies.base import BootstrapReport, EncryptionRate, budgets_per_cluster

    def report(cid: str, bandwidth: float, rate: float | None, method: str = "packed-paillier/2048") -> BootstrapReport:
        measured = None if rate is None else EncryptionRate(rate, method, 7.76)
        return BootstrapReport(cid, 100, bandwidth, 8.0, encryption=measured)  # same spec sheet: 2 GHz x 4 cores

    fleet = [report("fast1", 450.0, 42_000.0), report("fast2", 45.0, 41_000.0), report("slow", 90.0, 2_100.0)]
    one = {r.client_id: 0 for r in fleet}
    notes: dict = {}
    budgets = budgets_per_cluster(fleet, one, notes=notes, tolerance=None)
    assert notes["0"]["mode"] == "measured"
    assert budgets["fast1"] == 1.0 and budgets["fast2"] > 0.95  # a 10x slower loopback probe barely matters
    assert 0.04 < budgets["slow"] < 0.06
    paper = budgets_per_cluster(fleet, one, mode="paper", tolerance=None)
    assert paper["slow"] > 3 * budgets["slow"]  # the spec sheet does not see the slow board (only its probe)
    for odd, why in ((report("slow", 90.0, None), "slow did not measure"),
                     (report("slow", 90.0, 2_100.0, "paillier/1024"), "measured with")):
        notes = {}
        fallback = budgets_per_cluster([*fleet[:2], odd], one, notes=notes, tolerance=None)
        assert notes["0"]["mode"] == "paper" and why in notes["0"]["fallback"]
        assert fallback == budgets_per_cluster([*fleet[:2], odd], one, mode="paper", tolerance=None)


def test_encryption_rate_from_a_hello_profile() -> None:
    from senseshield.strategies.base import EncryptionRate

    rate = EncryptionRate.from_profile({"he_encryptions_per_s": 4e4, "he_scheme": "packed-paillier", "he_key_bits": 2048,
                                        "he_bytes_per_value": 7.76})
    assert rate == EncryptionRate(4e4, "packed-paillier/2048", 7.76)
    for bad in ({}, {"he_encryptions_per_s": -1.0, "he_scheme": "x"}, {"he_encryptions_per_s": "fast", "he_scheme": "x"},
                {"he_encryptions_per_s": 1e4}):
        assert EncryptionRate.from_profile(bad) is None


# ---- snapping measured budgets to a grid -------------------------------------------------------

from senseshield.engine.budgets import measured_budgets, snap_budgets  # noqa: E402

budget = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False, allow_infinity=False, exclude_min=False)


def _snap_brute(alpha: float, tolerance: float) -> float:
    """The grid level s^-k (s = (1 + t)^2) nearest to ``alpha`` in ratio, ties to the larger,
    by trying every k from 0 past ``alpha``."""
    s = (1.0 + tolerance) ** 2
    levels, k = [], 0
    while True:
        levels.append(s ** -k)
        if s ** -k < alpha / s:
            break
        k += 1
    distance = [abs(math.log(level / alpha)) for level in levels]
    best = min(distance)
    return next(level for level, d in zip(levels, distance) if d <= best + 1e-9)  # ties: the larger level


@FAST
@given(st.lists(budget, min_size=1, max_size=12), st.floats(0.005, 0.5))
def test_snap_budgets_is_the_nearest_grid_level(alphas, tolerance) -> None:
    got = snap_budgets(np.array(alphas), tolerance=tolerance)
    s = (1.0 + tolerance) ** 2
    for a, g in zip(alphas, got):
        want = _snap_brute(a, tolerance)
        k = math.log(1.0 / g) / math.log(s)
        assert abs(k - round(k)) < 1e-6 and round(k) >= 0  # a grid level
        # the nearest level (up to rounding where the budget sits on a midpoint)
        assert abs(math.log(g / a)) <= abs(math.log(want / a)) + 1e-9
        assert abs(math.log(g / a)) <= math.log1p(tolerance) + 1e-9  # moves at most a factor 1 + t
        if a * (1.0 + tolerance) >= 1.0:
            assert g == 1.0  # within 1 + t of the top: 1
    order = np.argsort(alphas, kind="stable")
    assert np.all(np.diff(got[order]) >= 0)  # order kept: a larger budget never snaps below a smaller one


@FAST
@given(st.lists(budget, min_size=1, max_size=8))
def test_snap_budgets_with_tolerance_zero_changes_nothing(alphas) -> None:
    assert snap_budgets(np.array(alphas), tolerance=0.0).tolist() == alphas


@FAST
@given(st.floats(10_000.0, 1e6), st.lists(st.floats(0.0, 0.045), min_size=2, max_size=6), st.floats(0.3, 0.7))
def test_identical_devices_within_the_tolerance_get_one_a_device_half_as_fast_about_half(rate, noise, slow) -> None:
    """Identical devices whose measured rates scatter within the tolerance below the best (4.5 % < 1 - 1/1.05)
    all get 1 after snapping; a device half as fast (or anywhere in 0.3-0.7 of the rate) gets
    the level nearest its share, within 1.05 of it."""
    rates = np.array([rate, *(rate * (1 - n) for n in noise), rate * slow])
    alpha = snap_budgets(measured_budgets(encrypt_per_s=rates, bandwidth=np.full(rates.size, 1000.0),
                                          bytes_per_encrypted=8.0), tolerance=0.05)
    assert np.all(alpha[:-1] == 1.0)
    assert abs(math.log(alpha[-1] / slow)) <= math.log(1.05) + 1e-3


def test_snap_budgets_hand_computed_levels_and_mistakes() -> None:
    # s = 1.05^2 = 1.1025: 0.96 -> 1, 0.9 -> 1/1.1025, 0.5 -> 1.1025^-7 (log 0.5 / log s = 6.98)
    np.testing.assert_allclose(snap_budgets(np.array([1.0, 0.96, 0.9, 0.5]), tolerance=0.05),
                               [1.0, 1.0, 1 / 1.1025, 1.1025 ** -7], rtol=1e-12)
    for alphas, tolerance, fragment in (([0.5, 1.2], 0.05, "alphas[1]=1.2"), ([0.0, 1.0], 0.05, "alphas[0]=0.0"),
                                        ([0.5], -0.1, "tolerance=-0.1"), ([0.5], math.nan, "tolerance=nan"),
                                        ([0.5], True, "tolerance=True")):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            snap_budgets(np.array(alphas), tolerance=tolerance)


def test_measured_budgets_of_a_cluster_are_snapped_and_the_note_keeps_what_moved() -> None:
    from senseshield.strategies.base import BootstrapReport, EncryptionRate, budgets_per_cluster

    def report(cid: str, rate: float) -> BootstrapReport:
        return BootstrapReport(cid, 100, 1000.0, 8.0, encryption=EncryptionRate(rate, "packed-paillier/2048", 7.9))

    fleet = [report("a", 90_000.0), report("b", 87_000.0), report("c", 45_000.0)]  # exact figures: no pooling
    one = {r.client_id: 0 for r in fleet}
    notes: dict = {}
    budgets = budgets_per_cluster(fleet, one, notes=notes)  # the default tolerance, 5 %
    assert budgets["a"] == budgets["b"] == 1.0 and budgets["c"] == pytest.approx(1.1025 ** -7)
    assert notes["0"]["step"] == 1.1025 and set(notes["0"]["unsnapped"]) == {"b", "c"}
    assert budgets_per_cluster(fleet, one, tolerance=None)["b"] < 1.0  # as reported: not snapped
