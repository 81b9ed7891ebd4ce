"""The coordinator's job state (coordinator.state.JobState) as it is saved: every kept field
survives to_json / from_json exactly (a field added without being saved fails here), the
transient ones are this process's and start afresh, and a restarted coordinator takes up a
saved state only for the same job and configuration. No broker: the state is built by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import json
import logging

import numpy as np
import pytest

from coordinator.history import RoundBook
from coordinator.roster import AgentInfo
from coordinator.rounds import ClusterRound
from coordinator.state import KEPT, JobState, take_up
from senseshield.accounting import Accountant
from senseshield.job import Job, with_shape
from senseshield.results import RoundTally
from senseshield.runtime.protocol.messages import Hello, Metrics, RoundOpen
from senseshield.strategies.base import FleetPlan

SIZE = 12
JOB = with_shape(Job(strategy="plaintext", model="linear", clients=3, rounds=3, seed=7))
# the fields of this process, each with its reason in the field's metadata (a new one is a
# decision: add it here)
TRANSIENT = {"round_deadline", "started", "round", "clusters", "round_open", "steps_of", "sampled", "joined", "left",
             "notes", "round_started"}
REQUIRED = {"run_id", "config", "size", "input_shape", "num_classes"}  # no default: always given


def full_state() -> JobState:
    """A state whose every field differs from a fresh state's."""
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
    agents = {a: AgentInfo(Hello(run_id="j-1", agent_id=a, n_samples=100 + i, bandwidth=2.0, cpu_speed=1.5, index=i,
                                 key_id="k1", profile={"gflops": 3.0}), online=i != 1, joined_at=1e9 + i)
              for i, a in enumerate(["a0", "a1", "a2"])}
    return JobState(
        run_id="j-1", config=JOB, size=SIZE, input_shape=[1, 2, 3], num_classes=4, plan=plan, agents=agents,
        refused={"a9": "holds another key"}, declined={"a8": "no data"}, admitted={"a2": 2}, active={"a0", "a1"},
        bootstrap_seconds=1.5, sigma_user=0.9, sigma_record={"a0": 1.2}, completed=1, model_round={0: 1, 1: 0},
        in_flight={"round": 2, "started_at": 1e9}, sampler=sampler, user_accountant=accountant,
        participations={"a0": 1},
        busy={"a1": [2, 1]},
        records=[{"round": 1, "tally": tally, "seconds": 2.5, "joined": [], "left": ["a2"],
                  "clusters": {0: {"accepted": True, "updates": ["a0"], "timings": {"decrypt": 0.1}}}}],
        metrics={("a0", 1): Metrics(cluster=0, metric=0.75, n_test=40, timings={"train": 0.5},
                                    dp_history=[(1.1, 0.01, 10)])},
        agent_rounds={"a0": {1: {"cluster": 0, "budget": 0.25, "he_ratio": 0.25, "failed": {"evaluation": "x"}}}},
        straggling=[{"round": 1, "cluster": 1, "agent": "a2", "missing": "update"}],
        uplink_delays={"a0": [0.01, 0.02]},
        # this process's
        round_deadline=12.0, started=5.0, round=2, clusters={0: ClusterRound(["a0"], 3.0, "updates")},
        round_open=RoundOpen(run_id="j-1", clusters={"0": ["a0"]}), steps_of={"a0": 3}, sampled={"a0"},
        joined=["a2"], left=["a1"], notes=["a note"], round_started=4.0,
    )


def same(a, b) -> bool:  # noqa: ANN001
    """Equal values, looking into arrays, generators, accountants, plans and agents."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, np.random.Generator):
        return isinstance(b, np.random.Generator) and a.bit_generator.state == b.bit_generator.state
    if isinstance(a, Accountant):
        return isinstance(b, Accountant) and a.history == b.history
    if isinstance(a, Job):
        return isinstance(b, Job) and a.model_dump(mode="json") == b.model_dump(mode="json")
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, Mapping):  # a dict, or the packed history's mappings
        return isinstance(b, Mapping) and set(a.keys()) == set(b.keys()) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, RoundBook)):  # a list, or the closed rounds' records
        return isinstance(b, (list, tuple, RoundBook)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_every_field_is_kept_or_transient_with_its_reason():
    names = {f.name for f in dataclasses.fields(JobState)}
    transient = {f.name for f in dataclasses.fields(JobState) if "transient" in f.metadata}
    assert transient == TRANSIENT, "a new transient field: add it to TRANSIENT"
    assert all(f.metadata["transient"] for f in dataclasses.fields(JobState) if f.name in transient)
    assert set(KEPT) == names - transient
    assert full_state().to_json().keys() == set(KEPT)  # to_json writes exactly the kept fields


def test_every_kept_field_survives_a_save_and_a_load_exactly():
    state = full_state()
    fresh = JobState("j-1", JOB, SIZE, [1, 2, 3], 4)
    for f in dataclasses.fields(JobState):  # the sample exercises every field: a new one must be added to it
        if f.name not in REQUIRED:
            assert not same(getattr(state, f.name), getattr(fresh, f.name)), f"full_state() leaves {f.name} default"
    text = json.dumps(state.to_json())  # what a store keeps
    back = JobState.from_json(json.loads(text))
    for name in KEPT:
        assert same(getattr(back, name), getattr(state, name)), name
    assert json.dumps(back.to_json()) == text  # saving the loaded state writes the same
    rng = np.random.default_rng([7, 5])
    rng.random()
    assert back.sampler.random() == rng.random()  # the sampler goes on where it stopped
    assert back.user_accountant.history == [(1.1, 0.5, 1)]
    # the transient fields start afresh: the round under way is the last closed one
    assert (back.round, back.clusters, back.round_open, back.sampled, back.notes) == (1, {}, None, set(), [])
    assert back.round_deadline == JOB.round_deadline and back.started > 5.0
    # the bootstrap vectors are not kept (the plan holds what the bootstrap made of them)
    state.agents["a0"].vector = np.ones(SIZE)
    assert JobState.from_json(state.to_json()).agents["a0"].vector is None


def test_a_state_without_a_kept_field_is_not_read():
    raw = full_state().to_json()
    del raw["agents"]
    with pytest.raises(KeyError, match="agents"):
        JobState.from_json(raw)


def test_a_restarted_coordinator_takes_up_only_the_same_job_and_configuration(caplog):
    fresh = JobState("j-1", JOB, SIZE, [1, 2, 3], 4)
    assert take_up(fresh, None) is fresh
    assert take_up(fresh, JobState.from_json({**full_state().to_json(), "run_id": "j-2"})) is fresh
    other = JobState.from_json({**full_state().to_json(), "config": {**JOB.model_dump(mode="json"), "rounds": 4}})
    with caplog.at_level(logging.INFO, "senseshield.coordinator"):
        assert take_up(fresh, other, where="STORE") is fresh
        assert "state in STORE is for another configuration of job j-1; starting it anew" in caplog.text
        saved = JobState.from_json(full_state().to_json())
        taken = take_up(fresh, saved, round_deadline=33.0)
        assert "resuming run j-1 after round 1" in caplog.text
    assert taken is saved and taken.round_deadline == 33.0
    # round 2 was in flight: it is noted as restarted (its start time kept)
    assert taken.in_flight["round"] == 2 and taken.in_flight["started_at"] == 1e9 and "restarted_at" in taken.in_flight
    # a note of a round that is not the next one is dropped
    stale = JobState.from_json({**full_state().to_json(), "in_flight": {"round": 5, "started_at": 1.0}})
    assert take_up(fresh, stale).in_flight is None


def test_a_restarted_round_samples_the_devices_its_first_start_sampled():
    """A coordinator saved with round 1 in flight and taken up again opens round 1 with the
    draw of its first start (not the sampler's next one), and round 2 as without a restart."""
    from senseshield.strategies import StrategyOptions

    job = with_shape(Job(strategy="plaintext", model="linear", clients=6, rounds=3,
                         options=StrategyOptions(sample_rate=0.5)))
    ids = [f"a{i}" for i in range(6)]

    def planned() -> JobState:
        s = JobState("j-1", job, SIZE, [1], 2)
        s.agents = {a: AgentInfo(Hello(run_id="j-1", agent_id=a, n_samples=50, bandwidth=1.0, cpu_speed=1.0, index=i))
                    for i, a in enumerate(ids)}
        s.plan = FleetPlan(dict.fromkeys(ids, 0), dict.fromkeys(ids, 1.0))
        return s

    log = logging.getLogger("test")
    first = planned()
    first.open_round(1, block_size=1, now=1.0, log=log)
    saved = JobState.from_json(json.loads(json.dumps(first.to_json())))  # killed with round 1 in flight
    again = take_up(planned(), saved)
    again.open_round(1, block_size=1, now=2.0, log=log)
    assert again.sampled == first.sampled and 0 < len(first.sampled) < 6
    assert any("the coordinator restarted during this round" in n for n in again.notes)
    first.open_round(2, block_size=1, now=3.0, log=log)
    again.open_round(2, block_size=1, now=3.0, log=log)
    assert again.sampled == first.sampled
