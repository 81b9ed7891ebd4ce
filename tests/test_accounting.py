"""Against whom epsilon holds (issue 16): the outside observer's figure keeps the client
sampling amplification, the server's does not. Checked against brute-force formulas
(integer-order RDP of the sampled Gaussian, its defining integral at fractional orders, the
exact epsilon of a Gaussian) and against two independent libraries: Google's dp-accounting
(RDP and PLD) and Microsoft's prv_accountant."""

from __future__ import annotations

import logging
import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from opacus.accountants.rdp import RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from senseshield.accounting import ADJACENCY, Accountant, epsilons
from senseshield.errors import ConfigError

DELTA = 1e-5
INTEGER_ORDERS = list(range(2, 64))
# Opacus' PRV reports the upper end of its eps_error = 0.01 bracket: 0.0100-0.0113 above
# dp-accounting's PLD over 40 random (sigma, q, steps); the rest is slack for its grid
PRV_ERROR = 0.015


def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))


def brute_rdp_sampled_gaussian(q: float, sigma: float, order: int) -> float:
    """Mironov, Talwar, Zhang 2019, integer orders: (1/(a-1)) log sum_k C(a,k) (1-q)^(a-k) q^k
    exp((k^2 - k) / (2 sigma^2))."""
    total = -math.inf
    for k in range(order + 1):
        if q < 1:
            term = (math.lgamma(order + 1) - math.lgamma(k + 1) - math.lgamma(order - k + 1)
                    + (order - k) * math.log1p(-q) + k * math.log(q))
        else:
            term = 0.0 if k == order else -math.inf
        if term > -math.inf:
            total = _log_add(total, term + (k * k - k) / (2 * sigma * sigma))
    return total / (order - 1)


def integral_rdp_sampled_gaussian(q: float, sigma: float, order: float) -> float:
    """Any order, from the definition: (1/(a-1)) log E_{z ~ N(0, sigma^2)}[((1-q) + q
    exp((2z - 1) / (2 sigma^2)))^a], by quadrature at 30 digits."""
    mpmath.mp.dps = 30
    s = mpmath.mpf(sigma)
    f = lambda z: mpmath.npdf(z, 0, s) * ((1 - q) + q * mpmath.e ** ((2 * z - 1) / (2 * s * s))) ** order  # noqa: E731
    return float(mpmath.log(mpmath.quad(f, [-mpmath.inf, -10 * s, 0, 1, 10 * s, mpmath.inf])) / (order - 1))


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of a Gaussian mechanism with sensitivity / sigma = mu (Balle and Wang
    2018): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). k compositions at
    sigma are one Gaussian at mu = sqrt(k) / sigma."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 500)


def _released(sigma: float, q: float, rounds: int) -> Accountant:
    acc = Accountant()
    acc.step(noise_multiplier=sigma, sample_rate=q, steps=rounds)
    return acc


def test_the_issue_s_dp_fedavg_figures():
    """dp-fedavg, q = 0.3, sigma 3.32, 5 rounds, delta 1e-5: 1.00 for an observer, 2.27
    against the server for a client sampled in 3 of the rounds, 3.02 in all 5 (RDP); by PLD
    0.90, 2.10 and 2.80."""
    acc = _released(3.32, 0.3, 5)
    three, five = epsilons(DELTA, user=acc, participations=3, pld=True), epsilons(DELTA, user=acc, participations=5)
    assert three.observer == pytest.approx(1.00, abs=0.005) and three.server == pytest.approx(2.27, abs=0.005)
    assert five.server == pytest.approx(3.02, abs=0.005) and three.server_rounds == 3
    assert three.observer_pld == pytest.approx(0.90, abs=0.005) and three.server_pld == pytest.approx(2.10, abs=0.005)
    assert three.observer_pld < 0.92 * three.observer and three.server_pld < 0.94 * three.server  # PLD is tighter


@settings(max_examples=25, deadline=None)
@given(q=st.floats(0.01, 0.9), sigma=st.floats(0.8, 6.0), rounds=st.integers(1, 20))
def test_integer_order_rdp_of_both_figures_matches_the_formula(q, sigma, rounds):
    acc = _released(sigma, q, rounds)
    ours = RDPAccountant()
    ours.history = acc.history
    brute = [rounds * brute_rdp_sampled_gaussian(q, sigma, a) for a in INTEGER_ORDERS]
    assert ours.get_privacy_spent(delta=DELTA, alphas=INTEGER_ORDERS)[0] == pytest.approx(
        get_privacy_spent(orders=INTEGER_ORDERS, rdp=np.array(brute), delta=DELTA)[0], rel=1e-9)
    # against the server: no amplification, a Gaussian's RDP a / (2 sigma^2) per release
    server = RDPAccountant()
    server.history = acc.unamplified(rounds).history
    closed = [rounds * a / (2 * sigma * sigma) for a in INTEGER_ORDERS]
    assert server.get_privacy_spent(delta=DELTA, alphas=INTEGER_ORDERS)[0] == pytest.approx(
        get_privacy_spent(orders=INTEGER_ORDERS, rdp=np.array(closed), delta=DELTA)[0], rel=1e-9)


@pytest.mark.parametrize(("q", "sigma", "order"), [(0.05, 1.0, 4.6), (0.2, 0.8, 2.1), (0.3, 3.32, 1.3), (0.5, 2.0, 5.1)])
def test_fractional_order_rdp_matches_the_defining_integral(q, sigma, order):
    """The default orders are mostly fractional (1.1 ... 10.9); there Opacus' series must
    match the integral that defines the sampled Gaussian's RDP."""
    ours = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[order])[0]
    assert ours == pytest.approx(integral_rdp_sampled_gaussian(q, sigma, order), rel=1e-8)


@settings(max_examples=10, deadline=None)
@given(q=st.floats(0.05, 0.95), sigma=st.floats(0.8, 6.0), rounds=st.integers(1, 12), data=st.data())
def test_the_server_figure_is_never_below_the_observers_and_behaves(q, sigma, rounds, data):
    acc = _released(sigma, q, rounds)
    k = data.draw(st.integers(1, rounds))
    got = epsilons(DELTA, user=acc, participations=k)
    worst = epsilons(DELTA, user=acc, participations=rounds)
    # whatever the sampling (a client sampled every round), the server knows at least as much
    assert worst.server >= worst.observer - 1e-12 and worst.observer == got.observer
    # more participations or more rounds: more epsilon; more noise: less
    assert got.server >= epsilons(DELTA, user=acc, participations=k - 1).server
    assert worst.server >= got.server
    longer = epsilons(DELTA, user=_released(sigma, q, rounds + 1), participations=k + 1)
    assert longer.observer >= got.observer and longer.server > got.server
    noisier = epsilons(DELTA, user=_released(sigma * 1.5, q, rounds), participations=k)
    assert noisier.observer < got.observer and noisier.server < got.server
    # everyone sampled every round (q = 1): the server learns nothing the observer does not
    full = epsilons(DELTA, user=_released(sigma, 1.0, rounds), participations=rounds)
    assert full.server == full.observer == worst.server


@settings(max_examples=5, deadline=None)
@given(q=st.floats(0.05, 0.95), sigma=st.floats(0.8, 6.0), rounds=st.integers(1, 12))
def test_the_pld_figures_behave_too(q, sigma, rounds):
    got = epsilons(DELTA, user=_released(sigma, q, rounds), participations=rounds, pld=True)
    assert got.server_pld >= got.observer_pld and got.observer_pld <= got.observer and got.server_pld <= got.server
    noisier = epsilons(DELTA, user=_released(sigma * 1.5, q, rounds), participations=rounds, pld=True)
    assert noisier.observer_pld < got.observer_pld and noisier.server_pld < got.server_pld
    full = epsilons(DELTA, user=_released(sigma, 1.0, rounds), participations=rounds, pld=True)
    assert full.server_pld == full.observer_pld


@settings(max_examples=15, deadline=None)
@given(sigma=st.floats(0.8, 8.0), k=st.integers(1, 30))
def test_the_server_pld_figure_is_the_exact_gaussian_one_within_the_prv_error(sigma, k):
    """Against the server a client's k participations are k Gaussians: their exact epsilon
    is known in closed form; Opacus' PRV reports an upper bound within its error."""
    got = epsilons(DELTA, user=_released(sigma, 1.0, k), participations=k, pld=True).server_pld
    exact = exact_gaussian_epsilon(math.sqrt(k) / sigma, DELTA)
    assert exact - 1e-6 <= got <= exact + PRV_ERROR


def test_record_level_figures_are_the_same_against_both_and_the_worst_client_counts():
    """DP-SGD: the batch sampling happens on the device, out of the server's sight."""
    a, b = [(1.1, 0.05, 40)], [(1.1, 0.05, 60)]
    got = epsilons(DELTA, records=[a, [], b], pld=True)
    assert got.server == got.observer == Accountant(b).epsilon(DELTA) and got.server_rounds is None
    assert got.server_pld == got.observer_pld == Accountant(b).epsilon(DELTA, accountant="pld")
    assert epsilons(DELTA) == epsilons(DELTA, user=Accountant(), records=[[]]) == epsilons(DELTA, records=[])
    assert epsilons(DELTA).observer == 0.0 and set(ADJACENCY) == {"user", "record", "distributed"}


@pytest.mark.parametrize(("sigma", "q", "rounds"), [(3.32, 0.3, 5), (1.0, 0.05, 100), (6.0, 0.9, 20), (1.1, 0.01, 500)])
def test_google_dp_accounting_recomputes_both_figures(sigma, q, rounds):
    """An independent recomputation with Google's dp-accounting: RDP at the integer orders
    (the same method: equal to 1e-9), RDP at Opacus' default orders (dp-accounting's series
    at fractional orders is more conservative than the defining integral, so never below
    ours), and PLD (its connect-the-dots grid against Opacus' PRV error)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)  # its fractional-order series warns where it gives up
    k = max(1, round(q * rounds))
    acc = _released(sigma, q, rounds)
    ours = epsilons(DELTA, user=acc, participations=k, pld=True)
    observer = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), rounds)
    server = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), k)
    for event, rdp_accountant, figure, pld in ((observer, acc, ours.observer, ours.observer_pld),
                                               (server, acc.unamplified(k), ours.server, ours.server_pld)):
        google = RdpAccountant(orders=INTEGER_ORDERS)
        google.compose(event)
        opacus = RDPAccountant()
        opacus.history = rdp_accountant.history
        assert opacus.get_privacy_spent(delta=DELTA, alphas=INTEGER_ORDERS)[0] == pytest.approx(
            google.get_epsilon(DELTA), rel=1e-9)
        google = RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS)
        google.compose(event)
        assert figure <= google.get_epsilon(DELTA) * (1 + 1e-9) and google.get_epsilon(DELTA) <= figure * 1.01
        google = PLDAccountant()
        google.compose(event)
        assert google.get_epsilon(DELTA) - 1e-4 <= pld <= google.get_epsilon(DELTA) + PRV_ERROR


def test_microsoft_prv_accountant_brackets_the_pld_figures():
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    eps = epsilons(DELTA, user=_released(3.32, 0.3, 5), participations=3, pld=True)
    for q, steps, ours in ((0.3, 5, eps.observer_pld), (1.0, 3, eps.server_pld)):
        prv = PoissonSubsampledGaussianMechanism(noise_multiplier=3.32, sampling_probability=q)
        low, estimate, high = PRVAccountant(prvs=prv, max_self_compositions=steps, eps_error=0.01,
                                            delta_error=1e-9).compute_epsilon(delta=DELTA, num_self_compositions=steps)
        # Opacus reports about the upper end of the bracket (its own discretisation: 7e-5 apart)
        assert high - low <= 0.021 and low <= ours <= high + 1e-3, (low, estimate, high, ours)


def test_bad_inputs_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="accountant 'gdp' is not allowed; use rdp or pld"):
        Accountant().epsilon(DELTA, accountant="gdp")
    with pytest.raises(ConfigError, match="participations 6 is not allowed; use 0 to the 5 user-level releases"):
        epsilons(DELTA, user=_released(1.0, 0.5, 5), participations=6)
