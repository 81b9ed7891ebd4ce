"""The coordinator's checkpoint (coordinator.checkpoint): a job's state survives a save and a
load exactly, another job's or configuration's checkpoint is not resumed, and an unreadable
file is one sentence naming it. No broker: the state is built by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.checkpoint import Checkpoint, RunState
from senseshield.accounting import Accountant
from senseshield.errors import ConfigError
from senseshield.results import RoundTally
from senseshield.runtime.protocol.messages import Hello, Metrics
from senseshield.strategies.base import FleetPlan

SIZE = 12


def _state() -> RunState:
    mask = np.zeros(SIZE, dtype=bool)
    mask[[1, 4, 7]] = True
    plan = FleetPlan({"a0": 0, "a1": 0, "a2": 1}, {"a0": 0.25, "a1": 0.5, "a2": 1.0}, {0: mask},
                     {"mode": "calibrated", "rounds": {"3": {"0": "pooled"}}}, {1: np.linspace(0.0, 0.3, SIZE)})
    tally = RoundTally()
    tally.add_work("a0", steps=3, full_steps=5, budget=0.25)
    tally.add_update("a0", {"train": 0.5, "encrypt": 0.25}, 0.25, 1000, {})
    tally.notes.append("round 1 cluster 1: model unchanged (no update arrived before the deadline)")
    sampler = np.random.default_rng([7, 5])
    sampler.random()
    accountant = Accountant()
    accountant.step(noise_multiplier=1.1, sample_rate=0.5)
    hellos = {a: Hello(run_id="j-1", agent_id=a, n_samples=100 + i, bandwidth=2.0, cpu_speed=1.5, index=i,
                       key_id="k1", profile={"gflops": 3.0})
              for i, a in enumerate(["a0", "a1", "a2"])}
    return RunState(
        run_id="j-1", config={"strategy": "sensecrypt", "rounds": 3}, completed=1, plan=plan, hellos=hellos,
        sampler=sampler.bit_generator.state, accountant=accountant.history, model_round={0: 1, 1: 0},
        sigma_user=None, sigma_record={"a0": 1.2}, uplink_delays={"a0": [0.01, 0.02]}, participations={"a0": 1},
        records=[{"round": 1, "tally": tally, "seconds": 2.5, "clusters": {0: {"accepted": True}}}],
        metrics={("a0", 1): Metrics(cluster=0, metric=0.75, n_test=40, timings={"train": 0.5},
                                    dp_history=[(1.1, 0.01, 10)])},
        agent_rounds={"a0": {1: {"cluster": 0, "budget": 0.25, "he_ratio": 0.25}}},
        straggling=[{"round": 1, "cluster": 1, "agent": "a2", "missing": "update"}],
        refused={"a9": "holds another key"}, declined={"a8": "no data"}, admitted={"a2": 2},
        active={"a0", "a1"}, bootstrap_seconds=1.5, in_flight={"round": 2, "started_at": 1e9},
    )


def test_a_saved_state_loads_back_exactly(tmp_path):
    state = _state()
    store = Checkpoint.of_fleet(tmp_path, "f1")
    store.save(state)
    assert store.path == tmp_path / "coordinator-f1.json" and store.path.exists()
    back = store.load("j-1", state.config, SIZE)
    assert back is not None
    assert np.array_equal(back.plan.fixed_masks[0], state.plan.fixed_masks[0]) and list(back.plan.fixed_masks) == [0]
    assert list(back.plan.rankings) == [1] and np.array_equal(back.plan.rankings[1], state.plan.rankings[1])
    assert (back.plan.cluster_of, back.plan.budget_of, back.plan.budget_notes) == (
        state.plan.cluster_of, state.plan.budget_of, state.plan.budget_notes)
    assert back.hellos == state.hellos and back.metrics == state.metrics
    assert back.records[0]["tally"] == state.records[0]["tally"]
    assert back.agent_rounds == state.agent_rounds and back.model_round == state.model_round
    assert back.accountant == [tuple(h) for h in state.accountant]
    assert Accountant(back.accountant).history == Accountant(state.accountant).history
    rng = np.random.default_rng()
    rng.bit_generator.state = back.sampler
    again = np.random.default_rng([7, 5])
    again.random()
    assert rng.random() == again.random()  # the sampler goes on where it stopped
    for name in ("completed", "sigma_user", "sigma_record", "uplink_delays", "participations", "straggling",
                 "refused", "declined", "admitted", "active", "bootstrap_seconds", "in_flight"):
        assert getattr(back, name) == getattr(state, name), name
    # the format is JSON with string keys (what earlier versions wrote, and a resumed coordinator reads)
    raw = json.loads(store.path.read_text())
    assert raw["fixed_masks"] == {"0": [1, 4, 7]} and raw["model_round"] == {"0": 1, "1": 0}
    assert raw["records"][0]["clusters"] == {"0": {"accepted": True}}
    # saving the loaded state writes the same file
    before = store.path.read_text()
    store.save(back)
    assert store.path.read_text() == before
    store.clear()
    assert not store.path.exists()
    store.clear()  # nothing to clear: no error


def test_another_job_or_configuration_is_not_resumed(tmp_path, caplog):
    state = _state()
    store = Checkpoint.of_fleet(tmp_path, "f1")
    assert store.load("j-1", state.config, SIZE) is None  # no file yet
    store.save(state)
    assert store.load("j-2", state.config, SIZE) is None
    assert store.load("j-1", {**state.config, "rounds": 4}, SIZE) is None
    assert "another configuration of job j-1" in caplog.text
    assert Checkpoint.of_fleet(None, "f1").load("j-1", state.config, SIZE) is None  # no --state-dir
    Checkpoint(None).save(state)  # nothing kept, no error


@pytest.mark.parametrize("content", ["{\"run_id\": \"j-1\", \"config\"", "[1, 2]", "{\"run_id\": \"j-1\"}", "\xff\xfe"])
def test_an_unreadable_checkpoint_is_one_sentence(tmp_path, content):
    state = _state()
    store = Checkpoint.of_fleet(tmp_path, "f1")
    store.save(state)
    if content == "{\"run_id\": \"j-1\"}":  # a checkpoint of this job with fields missing
        raw = json.loads(store.path.read_text())
        del raw["hellos"]
        content = json.dumps(raw)
    store.path.write_bytes(content.encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        store.load("j-1", state.config, SIZE)
    message = str(err.value)
    assert message.startswith(f"The coordinator's checkpoint '{store.path}' cannot be read (")
    assert message.endswith("move it away to start job j-1 anew.") and "\n" not in message
