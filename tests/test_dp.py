"""Privacy accounting, calibration and the client-side Gaussian mechanisms."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from senseshield.accounting import Accountant, calibrate_sigma
from senseshield.engine.dp import gaussian_noise, relative_noise, sensitivity_schedule
from senseshield.errors import ConfigError
from senseshield.strategies import StrategyOptions
from senseshield.strategies.base import ClientContext, MaskChoice
from senseshield.strategies.hybrid import DPFedAvg, SelectiveDP
from senseshield.strategies.sensecrypt import SenseCrypt


@pytest.mark.parametrize("q,sigma,steps", [(1.0, 1.0, 5), (0.3, 1.5, 20), (0.05, 0.8, 200)])
def test_accountant_epsilon_matches_opacus(q, sigma, steps):
    ours = Accountant()
    ours.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    ref = RDPAccountant()
    for _ in range(steps):
        ref.step(noise_multiplier=sigma, sample_rate=q)
    assert ours.epsilon(1e-5) == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-12)
    assert Accountant(ours.history).epsilon(1e-5) == ours.epsilon(1e-5)  # history round-trips


def test_calibrated_sigma_reaches_the_target_epsilon():
    sigma = calibrate_sigma(target_epsilon=1.0, delta=1e-5, sample_rate=0.5, steps=10)
    assert sigma == get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.5, steps=10)
    acc = Accountant()
    acc.step(noise_multiplier=sigma, sample_rate=0.5, steps=10)
    assert 0.9 < acc.epsilon(1e-5) <= 1.0 + 1e-9


def test_unreachable_target_epsilon_and_negative_sigma_are_refused():
    with pytest.raises(ConfigError, match="unreachable in 50"):
        calibrate_sigma(target_epsilon=1e-9, delta=1e-5, sample_rate=1.0, steps=50)
    with pytest.raises(Exception, match="sigma=-1"):
        StrategyOptions(sigma=-1.0)
    with pytest.raises(Exception, match="target_epsilon=0"):
        StrategyOptions(target_epsilon=0.0)


def test_gaussian_noise_clips_and_touches_only_the_given_positions():
    rng = np.random.default_rng(0)
    delta = np.arange(1, 101, dtype=float)
    pos = np.array([3, 10, 50])
    out, report = gaussian_noise(delta, pos, clip=1.0, sigma=0.0, rng=rng)
    mask = np.zeros(100, bool)
    mask[pos] = True
    assert np.array_equal(out[~mask], delta[~mask])
    assert np.linalg.norm(out[pos]) == pytest.approx(1.0)  # clipped, no noise at sigma 0
    assert report.clipped and report.count == 3
    noisy, _ = gaussian_noise(np.zeros(20000), np.arange(20000), clip=2.0, sigma=1.5, rng=rng)
    assert np.std(noisy) == pytest.approx(3.0, rel=0.03)


def test_selective_dp_noises_only_the_top_k_and_more_where_more_sensitive():
    strategy = SelectiveDP(StrategyOptions(dp_ratio=0.1, sigma=1.0, clip=1.0, budget_skew=2.0))
    rng = np.random.default_rng(1)
    size = 1000
    sensitivity = rng.random(size)
    delta = rng.normal(scale=1e-3, size=size)
    ctx = ClientContext("c0", 1, 0, 1.0)
    out, info = strategy.privatise(ctx, delta, MaskChoice(np.zeros(size, bool)), sensitivity=sensitivity, rng=rng)
    top = np.argsort(sensitivity)[-100:]
    changed = np.flatnonzero(out != delta)
    assert set(changed) == set(top) and info["noised"] == 100
    scale = sensitivity_schedule(sensitivity[top], skew=2.0)
    assert scale.min() == 1.0 and scale.max() == 3.0
    assert np.corrcoef(sensitivity[top], scale)[0, 1] > 0.99


def test_dp_fedavg_noise_covers_every_coordinate():
    strategy = DPFedAvg(StrategyOptions(sigma=0.5, clip=0.1))
    delta = np.ones(50)
    out, info = strategy.privatise(ClientContext("c", 1, 0, 1.0), delta, MaskChoice(np.zeros(50, bool)), sensitivity=delta, rng=np.random.default_rng(2))
    assert info["noised"] == 50 and np.all(out != delta)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 400), ratio=st.floats(0.0, 5.0), seed=st.integers(0, 2**32 - 1))
def test_relative_noise_has_the_asked_ratio_and_touches_only_the_given_positions(size, ratio, seed):
    rng = np.random.default_rng(seed)
    delta = rng.normal(size=size) * rng.uniform(1e-6, 10)
    pos = np.flatnonzero(rng.random(size) < 0.5)
    out, report = relative_noise(delta, pos, ratio=ratio, rng=np.random.default_rng(seed))
    rest = np.setdiff1d(np.arange(size), pos)
    assert np.array_equal(out[rest], delta[rest])
    # brute force: the same draws, scaled by ratio * |delta[pos]| / sqrt(k)
    if pos.size and ratio:
        draws = np.random.default_rng(seed).standard_normal(pos.size)
        expected = delta[pos] + draws * ratio * np.linalg.norm(delta[pos]) / np.sqrt(pos.size)
        np.testing.assert_allclose(out[pos], expected, rtol=1e-12, atol=0)
    else:
        assert np.array_equal(out, delta)
    assert report.count == pos.size


def test_relative_noise_norm_is_the_ratio_of_the_signal_on_average():
    delta = np.random.default_rng(0).normal(size=20000) * 3e-4
    out, _ = relative_noise(delta, np.arange(delta.size), ratio=0.5, rng=np.random.default_rng(1))
    assert np.linalg.norm(out - delta) / np.linalg.norm(delta) == pytest.approx(0.5, rel=0.02)
    with pytest.raises(ConfigError, match="Noise ratio -1"):
        relative_noise(delta, np.arange(3), ratio=-1.0, rng=np.random.default_rng(1))


def test_sensecrypt_hybrid_noises_the_plaintext_part_only_and_is_off_by_default():
    size = 300
    rng = np.random.default_rng(3)
    delta = rng.normal(size=size)
    mask = np.zeros(size, bool)
    mask[:40] = True
    ctx = ClientContext("c", 1, 0, 1.0)
    plain = SenseCrypt(StrategyOptions())
    same, info = plain.privatise(ctx, delta, MaskChoice(mask), sensitivity=delta, rng=rng)
    assert same is delta and info == {}
    hybrid = SenseCrypt(StrategyOptions(plain_noise=1.0))
    out, info = hybrid.privatise(ctx, delta, MaskChoice(mask), sensitivity=delta, rng=rng)
    assert np.array_equal(out[mask], delta[mask]) and np.all(out[~mask] != delta[~mask])
    assert info["noised"] == size - 40
    with pytest.raises(Exception, match=r"plain_noise=-0.5 is not allowed; use a noise-to-signal ratio in \[0, 10\]"):
        StrategyOptions(plain_noise=-0.5)
