"""Admission at the coordinator (coordinator.roster), no broker: a hello checked against the
fleet's key and against the agent's first, and a device joining after the bootstrap planned
into a cluster by a real strategy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import roster
from coordinator.roster import AgentInfo, HelloFacts
from senseshield.errors import ProtocolError
from senseshield.runtime.protocol.messages import Hello
from senseshield.strategies import build_strategy
from senseshield.strategies.base import StrategyOptions

RUN = "j-1"


def _hello(agent: str, **over) -> Hello:
    return Hello(**{"run_id": RUN, "agent_id": agent, "n_samples": 100, "bandwidth": 1.0, "cpu_speed": 1.0,
                    "key_id": "k1", **over})


def test_a_hello_under_another_key_is_refused_naming_both_keys():
    assert roster.key_refusal("a0", _hello("a0"), None) is None  # no key yet
    assert roster.key_refusal("a0", _hello("a0"), "k1") is None
    assert roster.key_refusal("a0", _hello("a0", key_id="k0"), "k1") == (
        "agent 'a0' holds public key 'k0', not the fleet's key 'k1'; it is refused (re-fetch keys/public)")


def test_a_repeated_hello_keeps_the_planned_facts():
    agents: dict[str, AgentInfo] = {}
    assert roster.greet(agents, "a0", _hello("a0"), planned=False)
    agents["a0"].online = False
    assert not roster.greet(agents, "a0", _hello("a0", n_samples=120), planned=False)  # before the plan: the latest
    assert agents["a0"].online and agents["a0"].hello.n_samples == 120
    agents["a0"].online = False
    assert not roster.greet(agents, "a0", _hello("a0", n_samples=120, bandwidth=5.0), planned=True)
    assert agents["a0"].online and agents["a0"].hello.bandwidth == 1.0  # after it: the first stays
    with pytest.raises(ProtocolError, match="^Hello of 'a0' claims 99 samples, shard 0, key 'k1'; it joined with "
                                            "120, 0, 'k1'.$"):
        roster.greet(agents, "a0", _hello("a0", n_samples=99), planned=True)


def test_a_late_device_is_admitted_once_ready_and_the_changed_budgets_are_reassigned():
    strategy = build_strategy("sensecrypt", StrategyOptions())
    assert strategy.needs_bootstrap_sensitivity
    rng = np.random.default_rng(3)
    agents = {a: AgentInfo(_hello(a, cpu_speed=s), vector=rng.random(20)) for a, s in (("a0", 1.0), ("a1", 2.0))}
    plan = strategy.plan_fleet([roster.report_of(agents, a) for a in sorted(agents)], size=20, block_size=1)
    agents["a2"] = AgentInfo(_hello("a2", cpu_speed=4.0))  # said hello, no bootstrap vector yet
    assert roster.admit(agents, plan, strategy, "a2", size=20, block_size=1) is None
    agents["a2"].vector = rng.random(20)
    new, assign = roster.admit(agents, plan, strategy, "a2", size=20, block_size=1)
    assert "a2" in new.cluster_of and "a2" in assign and "a2" not in plan.cluster_of
    assert assign == sorted(a for a in new.cluster_of if a == "a2" or plan.budget_of.get(a) != new.budget_of[a])
    assert roster.admit(agents, new, strategy, "a2", size=20, block_size=1) is None  # planned already


def test_a_last_will_from_before_the_latest_reconnect_does_not_take_a_device_out(tmp_path):
    """A broker going down sends the last will of every client still connected, live devices
    too. A will that came over the connection before the coordinator's latest reconnect (the
    service thread may only reach it after the reconnect) is not the device leaving: the round
    keeps waiting for it; a will over the current connection takes it out."""
    import time as _time

    import numpy as np

    from coordinator.roster import AgentInfo
    from coordinator.service import Coordinator
    from coordinator.state import JobState
    from senseshield.job import Job
    from senseshield.runtime.identity import Identity
    from senseshield.runtime.protocol.envelope import decode_frame
    from senseshield.runtime.protocol.messages import Hello, Status, to_frame
    from senseshield.runtime.service import Inbound

    coordinator = Coordinator("mqtt://127.0.0.1:1", fleet="wills", state_dir=tmp_path, identity=Identity.generate("coordinator"))
    agent = Identity.generate("c000")
    coordinator.state = JobState("j", Job(strategy="plaintext", model="linear"), 1, [1], 2, round_deadline=60.0,
                                 completed=1)  # no round open
    coordinator.state.agents = {"c000": AgentInfo(Hello(run_id="j", agent_id="c000", n_samples=10, bandwidth=1.0,
                                                        cpu_speed=1.0), vector=np.zeros(1))}
    frame = decode_frame(to_frame(Status(online=False), fleet="wills", sender="c000", round=0, signer=agent))
    before = _time.time()
    coordinator.link.connects, coordinator.link.connected_at = 2, before + 1.0  # reconnected after the will came
    coordinator._on_status(Inbound("agents/c000/status", frame, Status(online=False), received=before))
    assert coordinator.state.agents["c000"].online
    coordinator._on_status(Inbound("agents/c000/status", frame, Status(online=False), received=before + 2.0))
    assert not coordinator.state.agents["c000"].online


@settings(max_examples=40, deadline=None)
@given(profile=st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6) | st.booleans(),
                               max_size=4),
       key_id=st.none() | st.text(min_size=1, max_size=8), n=st.integers(1, 10**6), index=st.integers(0, 10**6))
def test_what_is_kept_of_a_hello_reads_as_the_hello(profile, key_id, n, index):  # noqa: ANN001
    """The coordinator keeps a device's hello compactly for the whole job: every field reads
    back as the message's, its dump is the message's, and a checkpoint's hello comes back equal."""
    hello = Hello(run_id="j-1", agent_id="dev-1", n_samples=n, bandwidth=2.5, cpu_speed=1.5, profile=profile,
                  key_id=key_id, index=index, box_key="Ym94")
    facts = HelloFacts(hello)
    assert facts.model_dump() == hello.model_dump(mode="json")
    assert all(getattr(facts, name) == value for name, value in hello.model_dump().items())
    assert HelloFacts(Hello(**facts.model_dump())) == facts and AgentInfo(hello).hello == facts
