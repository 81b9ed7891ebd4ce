"""SelectiveShield / Alt-FL / DP strategies end to end (short runs; slow ones are marked)."""

import pickle
import warnings

import numpy as np
import pytest

from senseshield.engine.zones import client_zones, consensus_zone, local_mask
from senseshield.he import generate_keys
from senseshield.rounds import ClientState, LocalUpdate, keep_personal, merge_personal, protect_local
from senseshield.job import Job
from senseshield.simulation import run_simulation
from senseshield.strategies import ClientContext, StrategyOptions, build_strategy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(strategy, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_simulation(
            Job(
                strategy=strategy, dataset="synthetic", model="linear", clients=3, rounds=2, batch_size=32,
                partition="dirichlet:0.5", local_epochs=1, options=StrategyOptions(**options),
            ),
            noise_seed=0,  # the clients' noise replayed: a deterministic test
        )


def test_personalised_zone_never_leaves_the_client():
    strategy = build_strategy("selectiveshield", StrategyOptions(tau=0.3, rho=0.5, sigma=0.0))
    secret = generate_keys("ckks-sum")
    rng = np.random.default_rng(0)
    size = 400
    scores = [rng.random(size) for _ in range(3)]
    enc = consensus_zone([local_mask(s, tau=0.3) for s in scores], rho=0.5)
    zones = client_zones(local_mask(scores[0], tau=0.3), enc)
    assert zones.personalised.any() and zones.encrypted.any() and zones.noise.any()
    canary = 1234.5
    delta = rng.normal(scale=1e-3, size=size)
    delta[zones.personalised] = canary
    local = LocalUpdate(weights=delta + 1.0, delta=delta, sensitivity=scores[0])
    ctx = ClientContext("c0", 1, 0, 1.0, enc, participants=3)
    update, choice = protect_local(strategy, ctx, local, secret.public_key, n_samples=10, rng=rng)
    assert np.array_equal(update.withheld, zones.personalised)
    assert not np.any(np.isin(update.ciphertext.positions, np.flatnonzero(zones.personalised)))
    assert update.plaintext.size == zones.noise.sum()
    wire = pickle.dumps((update.mask, update.withheld, update.plaintext, secret.public_key.ciphertext_bytes(update.ciphertext)))
    assert np.float32(canary).tobytes() not in wire and np.float64(canary).tobytes() not in wire
    # decrypting what was sent gives back no canary anywhere
    assert not np.any(np.isclose(secret.decrypt(update.ciphertext), canary))
    # selective merge (eq. 27): the client keeps its personalised values
    state = ClientState()
    keep_personal(state, local, choice.withheld)
    merged = merge_personal(np.zeros(size), state)
    assert np.all(merged[zones.personalised] == canary + 1.0)
    assert np.all(merged[~zones.personalised] == 0.0)


@pytest.mark.parametrize("name", ["selectiveshield", "dp-fedavg", "selective-dp", "dpsgd", "alt-pi", "alt-si-dp", "alt-si-he", "alt-mp"])
def test_each_hybrid_strategy_completes_and_reports_privacy(name):
    result = _run(name, he_ratio=0.2, tau=0.2, sigma=0.5, clip=1.0, sample_rate=1.0)
    data = result.model_dump()
    assert len(data["rounds"]) == 2 and {"epsilon", "delta"} <= set(data)
    dp = build_strategy(name).dp_level is not None
    if dp:
        eps = [r["epsilon"] for r in data["rounds"]]
        assert result.epsilon == eps[-1] and eps[-1] > 0 and result.delta == 1e-5
        assert eps == sorted(eps)  # epsilon only grows
        # every client sampled every round (q = 1): the server learns nothing the observer does not
        assert result.epsilon_server == pytest.approx(result.epsilon, rel=1e-12)
        if build_strategy(name).dp_level == "user":
            assert result.epsilon_pld == pytest.approx(result.epsilon_server_pld, rel=1e-9)
            assert result.epsilon_pld < result.epsilon
    else:
        assert result.epsilon is None
    if name == "selectiveshield":
        for r in result.rounds:
            assert abs(sum(r.zone_ratios.values()) - 1.0) < 1e-9
    if name.startswith("alt-si"):
        assert 0 < result.synthetic_epsilon <= 1.0 + 1e-6
        assert [r.round_type for r in result.rounds] == (["synthetic", "dpsgd"] if name == "alt-si-dp" else ["synthetic", "s-he"])


def test_target_epsilon_is_met_and_unreachable_one_is_refused():
    result = _run("dp-fedavg", target_epsilon=2.0)
    assert 1.8 < result.epsilon <= 2.0 + 1e-9
    from senseshield.errors import ConfigError

    with pytest.raises(ConfigError, match="unreachable"):
        _run("dp-fedavg", target_epsilon=1e-9)


def test_poisson_sampling_and_empty_round_are_reported():
    result = _run("dp-fedavg", sample_rate=0.3, sigma=1.0)
    assert all(r.participants <= 3 for r in result.rounds)
    # the sampling amplification holds against an outside observer only: the server knows
    # who was sampled (a client sampled in every round gets no amplification against it)
    if any(r.participants for r in result.rounds):
        assert result.epsilon_server > result.epsilon and result.epsilon_server_pld > result.epsilon_pld
    for r in result.rounds:
        if r.participants == 0:
            assert any("no client was sampled" in n for n in r.notes)


def test_empty_zone_is_reported_and_run_proceeds():
    result = _run("selectiveshield", tau=1.0, rho=0.5)  # Ĩ > 1 never: no local masks
    assert all(r.zone_ratios["enc"] == 0.0 and r.zone_ratios["noise"] == 1.0 for r in result.rounds)
    assert any("enc zone is empty" in n for r in result.rounds for n in r.notes)
