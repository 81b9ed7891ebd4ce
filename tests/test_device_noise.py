"""Issue 24: the coordinator cannot replay a device's privacy noise.

Each test plays the coordinator. It holds the job file (seed), the round, the device's index
and the update the device sent, regenerates the noise the way devices drew it before this
change (``default_rng([seed, 3, round, index])``; Opacus generators seeded from
``client_seed``) and subtracts it. Against the old draws that recovers the clean update to
rounding (the control, which shows the attacker works); against the device's secret draws
the "recovered" vector is at least as far from the clean update as the noisy one.

The clean update and the noise's scale come from an oracle only the test has: the
strategy's own mechanism run with a constant source of draws (0 gives the clipped,
un-noised values; 1 gives the per-coordinate standard deviation).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from senseshield.device_noise import DEVELOPMENT_ENV, DeviceNoise, check_noise_seed
from senseshield.errors import ConfigError
from senseshield.he import generate_keys
from senseshield.models import build_model
from senseshield.rounds import ClientState, LocalData, client_seed, local_update
from senseshield.strategies import ClientContext, StrategyOptions, build_strategy
from senseshield.training import TrainConfig, get_vector
from senseshield_checks.replay import (
    DeviceRound, Replay, device_round, dpsgd_noise_delta, mechanism_oracle, old_dpsgd_generators, old_protect_draws,
    replay_plaintext,
)

SEED, ROUND, INDEX = 42, 3, 1


def _data(n: int = 96) -> LocalData:
    rng = np.random.default_rng(7)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    y = (np.arange(n) % 10).astype(np.int64)
    return LocalData(x, y, x[:16], y[:16])


def _old_protect_rng() -> np.random.Generator:
    return old_protect_draws(SEED, ROUND, INDEX)


# strategy, options, HE scheme (None: plaintext)
NOISY = {
    "dp-fedavg": ("dp-fedavg", {"sigma": 1.0, "clip": 0.05}, None),
    "selective-dp": ("selective-dp", {"sigma": 0.8, "clip": 0.05}, None),
    "selectiveshield": ("selectiveshield", {"tau": 0.3, "rho": 0.5, "sigma": 1.0, "clip": 0.05}, "ckks-sum"),
    "sensecrypt-hybrid": ("sensecrypt", {"score": "leakage", "plain_noise": 0.3}, "paillier"),
}


@pytest.fixture(scope="module")
def keys():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"ckks-sum": generate_keys("ckks-sum").public_key,
                "paillier": generate_keys("paillier", key_bits=512).public_key}


def _device_round(name: str, keys: dict, rng) -> DeviceRound:  # noqa: ANN001
    strategy_name, options, scheme = NOISY[name]
    torch.manual_seed(0)
    return device_round(build_strategy(strategy_name, StrategyOptions(**options)), build_model("mlp", (1, 8, 8), 10),
                        _data(), keys[scheme] if scheme else None, seed=SEED, round=ROUND, index=INDEX, rng=rng,
                        train=TrainConfig(epochs=1, batch_size=16, lr=0.1))


def _replay(name: str, keys: dict, rng) -> Replay:  # noqa: ANN001
    """The coordinator's replay of the old draws on the plaintext values a device sent."""
    return _device_round(name, keys, rng).replay(_old_protect_rng())


@pytest.mark.parametrize("name", sorted(NOISY))
def test_the_coordinator_cannot_remove_a_devices_noise(name, keys):
    # control: with the old, public draws the coordinator removes the noise exactly
    before = _replay(name, keys, _old_protect_rng())
    assert before.noisy > 0 and before.relative_error <= 1e-6, f"{name}: the replaying attacker is broken"  # float32 on the wire
    # the device's draws (DeviceNoise(): secret, as an agent draws them): nothing comes off
    after = _replay(name, keys, DeviceNoise().generator("protect", round=ROUND, index=INDEX))
    assert after.relative_error >= 0.9, f"{name}: replaying removed noise ({after})"


def test_two_devices_with_the_same_job_index_and_round_draw_different_noise(keys):
    draws = []
    for _ in range(2):
        rng = DeviceNoise().generator("protect", round=ROUND, index=INDEX)
        draws.append(_device_round("dp-fedavg", keys, rng).update.plaintext)
    assert not np.array_equal(draws[0], draws[1])
    # a replayed seed (tests only) repeats itself, which is what makes sim = fleet checkable
    replay = [_device_round("dp-fedavg", keys, DeviceNoise(7).generator("protect", round=ROUND, index=INDEX)).update.plaintext
              for _ in range(2)]
    assert np.array_equal(replay[0], replay[1])


# ---- DP-SGD: Opacus' Poisson sampling and gradient noise --------------------------------

class Recording(DeviceNoise):
    """The device's secret DP-SGD generators, with a copy of their state for the oracle."""

    def torch_generators(self, purpose, *, round, index, count=2):  # noqa: ANN001, ANN201
        made = super().torch_generators(purpose, round=round, index=index, count=count)
        self.states = [g.get_state() for g in made]
        return made


def _restore(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _dpsgd_round(noise: DeviceNoise, sigma: float = 1.0, clip: float = 1.0) -> tuple[np.ndarray, torch.nn.Module]:
    strategy = build_strategy("dpsgd", StrategyOptions(sigma=sigma, clip=clip))
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = local_update(strategy, model, get_vector(model).astype(np.float64), _data(),
                             train=TrainConfig(epochs=1, batch_size=16, lr=0.1),
                             seed=client_seed(SEED, ROUND, INDEX), round=ROUND, state=ClientState(),
                             noise=noise, index=INDEX)
    return local.delta, model


def test_dpsgd_noise_cannot_be_replayed_by_the_coordinator():
    shape = {"n": 96, "batch_size": 16, "lr": 0.1, "std": 1.0}

    def replayed(model, generators) -> np.ndarray:  # noqa: ANN001
        return dpsgd_noise_delta(model, **shape, sampling=generators[0], noise=generators[1])

    class Old(DeviceNoise):  # DP-SGD's draws before issue 24: seeds the coordinator knows
        def torch_generators(self, purpose, *, round, index, count=2):  # noqa: ANN001, ANN201
            return old_dpsgd_generators(SEED, round, index)

    # control: gradients clipped to 1e-8 with noise std 1 (sigma 1e8): the update is all noise,
    # and with the old generators the coordinator's replay is that update to float32 rounding
    delta, model = _dpsgd_round(Old(), sigma=1e8, clip=1e-8)
    replay = replayed(model, old_dpsgd_generators(SEED, ROUND, INDEX))
    assert np.linalg.norm(delta - replay) <= 1e-5 * np.linalg.norm(delta), "the replaying attacker is broken"
    device = Recording()
    # with the device's secret generators, the coordinator's replay is someone else's noise
    delta, model = _dpsgd_round(device)
    true_noise = replayed(model, [_restore(s) for s in device.states])  # the oracle's truth
    clean = delta - true_noise
    recovered = delta - replayed(model, old_dpsgd_generators(SEED, ROUND, INDEX))
    assert float(np.linalg.norm(recovered - clean)) >= 0.9 * float(np.linalg.norm(true_noise))
    # and two devices with the same job, index and round train with different noise
    assert not np.array_equal(_dpsgd_round(DeviceNoise())[0], _dpsgd_round(DeviceNoise())[0])


def test_the_test_only_seed_is_refused_outside_development_mode(monkeypatch):
    monkeypatch.delenv(DEVELOPMENT_ENV, raising=False)
    assert check_noise_seed(None).secret
    with pytest.raises(ConfigError, match=r"--dev-noise-seed 5 is not allowed outside development mode"):
        check_noise_seed(5)
    monkeypatch.setenv(DEVELOPMENT_ENV, "1")
    assert check_noise_seed(5) == DeviceNoise(5) and not DeviceNoise(5).secret
    with pytest.raises(ConfigError, match=r"--dev-noise-seed -1 is not allowed; use 0 or more"):
        check_noise_seed(-1)


def test_an_agent_started_with_the_test_seed_outside_development_mode_stops_with_one_sentence(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != DEVELOPMENT_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent.cli", "join", "--broker", "mqtt://127.0.0.1:1", "--profile", "rpi4",
         "--dev-noise-seed", "5", "--model-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--dev-noise-seed 5 is not allowed outside development mode" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_the_draws_of_different_purposes_rounds_and_devices_are_independent():
    noise = DeviceNoise(11)
    streams = [noise.generator(p, round=r, index=i).standard_normal(8).tobytes()
               for p in ("protect", "bootstrap-sketch") for r in (1, 2) for i in (0, 1)]
    assert len(set(streams)) == len(streams)
    with pytest.raises(ValueError, match="purpose='training' is not a privacy draw"):
        noise.generator("training", round=1, index=0)


@pytest.mark.slow  # ~17 s; the in-process tests above show the same without a fleet (make test-slow)
def test_a_fleets_coordinator_cannot_replay_the_agents_noise(mosquitto, tmp_path):
    """Real agent processes on a real broker: the coordinator's view (every update frame)
    replayed with the old draws; the clean clipped update comes from the oracle, the same
    client's deterministic training and clipping run here."""
    from senseshield.data import load_dataset
    from senseshield.data.shards import shards
    from senseshield.job import Job, initial_model, train_config
    from senseshield.runtime.fleet import FleetOptions, fleet_up
    from senseshield.runtime.protocol import decode_frame
    from senseshield.runtime.protocol.messages import UpdateMessage, from_frame

    from tests.test_fleet import Capture

    config = Job(strategy="dp-fedavg", model="linear", clients=2, rounds=1, seed=SEED,
                 options=StrategyOptions(sigma=1.0, clip=0.05))
    capture = Capture(mosquitto.url, "noise")
    fleet_up(config, FleetOptions(agents=2, out=tmp_path, broker=mosquitto.url, fleet="noise",
                                  round_deadline=120, min_contributors=1), timeout=300)
    capture.stop()
    sent = {}
    for topic, payload in capture.payloads:
        if topic.endswith("/update"):
            frame = decode_frame(payload)
            msg = from_frame(frame)
            assert isinstance(msg, UpdateMessage)
            sent[frame.sender] = np.asarray(msg.plaintext, dtype=np.float64)
    assert sorted(sent) == ["c000", "c001"]
    dataset = load_dataset(config.dataset, seed=config.seed)
    strategy = build_strategy(config.strategy, config.options)
    for client in shards(config, dataset):
        model, initial = initial_model(config, dataset.input_shape, dataset.num_classes)
        local = local_update(strategy, model, initial, client.data, train=train_config(config),
                             seed=client_seed(config.seed, 1, client.index), round=1)
        context = ClientContext(client.id, 1, 0, 0.0, None, 1, participants=2, noise_multiplier=1.0)
        choice = strategy.select_mask(context, sensitivity=local.sensitivity, weights=local.weights)
        clean, std = mechanism_oracle(strategy, context, local.delta, choice, local.sensitivity,
                                      np.arange(local.delta.size))
        replay = replay_plaintext(sent[client.id], clean, std, old_protect_draws(config.seed, 1, client.index))
        # the oracle is right (what was sent is clean + noise of the job's scale) ...
        assert replay.noisy == pytest.approx(float(np.linalg.norm(std)), rel=0.1)
        # ... and the old draws take nothing off
        assert replay.relative_error >= 0.9, f"{client.id}: {replay}"
