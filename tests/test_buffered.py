"""Buffered rounds' pure rules (senseshield.engine.buffered) against their definitions, and the
job options that allow them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from senseshield.engine.buffered import staleness, staleness_weight
from senseshield.errors import ConfigError
from senseshield.rounds import update_weight
from senseshield.strategies import StrategyOptions, build_strategy


@given(st.integers(1, 10_000), st.integers(0, 50), st.floats(0.0, 3.0))
def test_the_staleness_weight_is_the_rounded_polynomial_discount(weight, tau, exponent):
    got = staleness_weight(weight, tau, exponent=exponent)
    exact = weight * (1 + tau) ** -exponent
    assert isinstance(got, int) and got >= 1
    assert got == weight if tau == 0 or exponent == 0 else abs(got - exact) <= 0.5 or got == 1
    # staler never weighs more
    assert staleness_weight(weight, tau + 1, exponent=exponent) <= got


@given(st.integers(1, 200), st.data())
def test_staleness_counts_the_rounds_between_the_start_and_the_buffer(buffer, data):
    model_round = data.draw(st.integers(0, buffer - 1))
    assert staleness(buffer, model_round) == buffer - 1 - model_round
    with pytest.raises(ValueError, match="cannot start from model round"):
        staleness(buffer, buffer)


def test_bad_weights_are_refused():
    for weight, tau, exponent in ((0, 0, 0.5), (3, -1, 0.5), (3, 1, -0.1), (3, 1, math.nan)):
        with pytest.raises(ValueError):
            staleness_weight(weight, tau, exponent=exponent)


def test_a_synchronous_job_never_discounts_and_a_buffered_one_does():
    sync, buffered = build_strategy("masked"), build_strategy("masked", StrategyOptions(buffer=2))
    assert update_weight(sync, 400, 3) == 400  # synchronous: a late model is not stale
    assert update_weight(buffered, 400, 0) == 400
    assert update_weight(buffered, 400, 3) == 200  # 400 / sqrt(4)


def test_options_that_cannot_run_buffered_are_refused_in_one_sentence():
    with pytest.raises(ValidationError, match=r"buffer=1 is not allowed with min_encryptors=2"):
        StrategyOptions(buffer=1, min_encryptors=2)
    with pytest.raises(ValidationError, match=r"buffer=2 with straggle_limit=4.0 is not allowed"):
        StrategyOptions(buffer=2, straggle_limit=4.0)
    for name in ("maskcrypt", "dp-fedavg", "dpsgd"):
        with pytest.raises(ConfigError, match=rf"buffer=2 is not allowed with strategy {name!r}"):
            build_strategy(name, StrategyOptions(buffer=2))
    for name in ("masked", "sensecrypt", "paillier-full", "plaintext"):
        build_strategy(name, StrategyOptions(buffer=2))


def test_a_buffered_fleet_does_not_wait_for_its_slow_device_and_ends_with_the_replayed_model(mosquitto, tmp_path):
    """Three agents, buffers of 2, c002 six times slower than the others from its second
    round (the --slowdown drill): rounds close without it, its work lands in later rounds
    with a staleness discount, and the key server's model is the simulator's replay of the
    rounds the report records, bit for bit."""
    import json

    import numpy as np

    from senseshield.job import Job
    from senseshield.runtime.fleet import FleetOptions, fleet_up
    from senseshield.simulation import buffered_schedule, run_simulation

    config = Job(strategy="masked", model="mlp", partition="iid", clients=3, rounds=16,
                 options=StrategyOptions(buffer=2, ring_bits=64))
    report = fleet_up(config, FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="buffered",
                                           round_deadline=120, min_contributors=1,
                                           extra_agent_args={"c002": ["--slowdown", "6"]}), timeout=300)
    assert report["state"] == "done" and report["exit_codes"] == {n: 0 for n in report["exit_codes"]}
    clusters = [s["clusters"]["0"] for s in report["server"]]
    assert all(c["accepted"] for c in clusters) and all(c["buffer"] == 2 for c in clusters)
    assert any("c002" in c["carried_on"] for c in clusters)  # a round closed while it trained
    schedule = buffered_schedule(report)
    stale = [(r, t, m) for r, ks in schedule.items() for a, (t, m) in ks[0].items() if a == "c002" and r - 1 - m > 0]
    assert stale, schedule  # its work counted in a later round than it started in
    assert not any(e["agent"] == "c002" and e["missing"] == "update" for e in report["straggling_events"])
    sim = run_simulation(config, schedule=schedule)
    with np.load(tmp_path / "keys" / "models-buffered.npz") as data:
        assert json.loads(bytes(data["meta"]).decode())["rounds"] == {"0": 16}
        assert np.array_equal(data["c0"], sim.models[0])
    assert report["final_accuracy"] == pytest.approx(sim.final_accuracy, abs=0.05)
