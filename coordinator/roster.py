"""Who is in the coordinator's job: each agent's hello, whether its last will says it is
online, and its bootstrap vector (:class:`AgentInfo`); whether an agent can take part
(:func:`online`, :func:`ready`) and what the strategy is told of it (:func:`report_of`);
admission: a hello checked against the fleet's key (:func:`key_refusal`) and against the
agent's first (:func:`greet`), and a device that joins after the bootstrap planned into a
cluster (:func:`admit`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from senseshield.errors import ProtocolError
from senseshield.runtime.protocol.messages import Hello
from senseshield.strategies import BootstrapReport, FleetPlan
from senseshield.strategies.base import EncryptionRate, RoundCosts, Strategy, measured_intervals


class HelloFacts:
    """What the coordinator keeps of a device's :class:`Hello` for the whole job: its fields
    (read as the message's), with the device's profile as compact JSON, decoded when read,
    and the strings most devices share (the run, the key, a common profile) held once. A
    fleet's hellos as message objects took about 1.6 KB each."""

    __slots__ = ("run_id", "agent_id", "n_samples", "bandwidth", "cpu_speed", "packed_profile", "key_id", "index",
                 "box_key")

    def __init__(self, hello: Hello) -> None:
        self.run_id, self.agent_id = sys.intern(hello.run_id), hello.agent_id
        self.n_samples, self.bandwidth, self.cpu_speed = hello.n_samples, hello.bandwidth, hello.cpu_speed
        self.packed_profile = sys.intern(json.dumps(hello.profile, separators=(",", ":")))
        self.key_id = None if hello.key_id is None else sys.intern(hello.key_id)
        self.index, self.box_key = hello.index, hello.box_key

    @property
    def profile(self) -> dict[str, Any]:
        return json.loads(self.packed_profile)

    def _fields(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HelloFacts) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"HelloFacts({self.model_dump()!r})"

    def model_dump(self, mode: str = "json") -> dict[str, Any]:  # noqa: ARG002 - as Hello's (JSON either way)
        """The hello's fields, as :meth:`Hello.model_dump` gives them (a profile's non-finite numbers stay numbers)."""
        return {"run_id": self.run_id, "agent_id": self.agent_id, "n_samples": self.n_samples,
                "bandwidth": self.bandwidth, "cpu_speed": self.cpu_speed, "profile": self.profile,
                "key_id": self.key_id, "index": self.index, "box_key": self.box_key}


@dataclass
class AgentInfo:
    """One device in the job: its hello (kept as :class:`HelloFacts`), whether it is online,
    its bootstrap vector, when it joined."""

    hello: HelloFacts
    online: bool = True
    vector: np.ndarray | None = None
    joined_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if isinstance(self.hello, Hello):
            self.hello = HelloFacts(self.hello)


def online(agents: dict[str, AgentInfo], agent_id: str) -> bool:
    """``agent_id`` said hello in this job and its last will has not fired since."""
    info = agents.get(agent_id)
    return info is not None and info.online


def ready(agents: dict[str, AgentInfo], agent_id: str, *, needs_vector: bool) -> bool:
    """``agent_id`` said hello and, when the strategy needs it (``needs_vector``), sent its
    bootstrap vector: the strategy can plan it."""
    info = agents.get(agent_id)
    return info is not None and (not needs_vector or info.vector is not None)


def report_of(agents: dict[str, AgentInfo], agent_id: str) -> BootstrapReport:
    """What the strategy plans ``agent_id`` from: its hello's facts and profile, its vector."""
    info = agents[agent_id]
    return BootstrapReport(agent_id, info.hello.n_samples, info.hello.bandwidth, info.hello.cpu_speed, info.vector,
                           RoundCosts.from_profile(info.hello.profile), measured_intervals(info.hello.profile),
                           EncryptionRate.from_profile(info.hello.profile))


def key_refusal(agent_id: str, hello: Hello, key_id: str | None) -> str | None:
    """Why ``agent_id``, whose hello names public key ``hello.key_id``, is refused while the
    fleet's key is ``key_id`` (None: no key yet, or the same key)."""
    if key_id is None or hello.key_id == key_id:
        return None
    return (f"agent {agent_id!r} holds public key {hello.key_id!r}, not the fleet's key "
            f"{key_id!r}; it is refused (re-fetch keys/public)")


def greet(agents: dict[str, AgentInfo], agent_id: str, hello: Hello, *, planned: bool) -> bool:
    """``agent_id``'s ``hello`` in this job (its key checked): True when it joins now. A
    repeat (reconnect, restart) marks it online; before the fleet is ``planned`` the latest
    hello counts, after it the first stays and a repeat must bring the same data facts
    (ProtocolError, one sentence, otherwise)."""
    known = agents.get(agent_id)
    if known is None:
        agents[agent_id] = AgentInfo(hello)
        return True
    if planned:
        first = known.hello
        if (hello.n_samples, hello.index, hello.key_id) != (first.n_samples, first.index, first.key_id):
            raise ProtocolError(
                f"Hello of {agent_id!r} claims {hello.n_samples} samples, shard {hello.index}, key {hello.key_id!r}; "
                f"it joined with {first.n_samples}, {first.index}, {first.key_id!r}."
            )
    else:
        known.hello = HelloFacts(hello)
    known.online = True
    return False


def admit(agents: dict[str, AgentInfo], plan: FleetPlan, strategy: Strategy, agent_id: str, *, size: int,
          block_size: int) -> tuple[FleetPlan, list[str]] | None:
    """A device that joined after the bootstrap, once ready (bootstrap vector in, if the
    strategy needs it): the strategy assigns it a cluster (the nearest, for clustering
    strategies) and recomputes the cluster's budgets with it. Returns the new plan and the
    devices to send an assignment (it, and those whose budget changed); None if it is not
    ready or already planned."""
    if not ready(agents, agent_id, needs_vector=strategy.needs_bootstrap_sensitivity) or agent_id in plan.cluster_of:
        return None
    members = [a for a in sorted(plan.cluster_of) if a in agents]
    before = dict(plan.budget_of)
    plan = strategy.admit([report_of(agents, a) for a in members], plan, report_of(agents, agent_id), size=size,
                          block_size=block_size)
    return plan, [a for a in sorted(plan.cluster_of) if a == agent_id or before.get(a) != plan.budget_of[a]]
