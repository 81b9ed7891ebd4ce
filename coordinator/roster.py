"""Who is in the coordinator's job: each agent's hello, whether its last will says it is
online, and its bootstrap vector (:class:`AgentInfo`); whether an agent can take part
(:func:`online`, :func:`ready`) and what the strategy is told of it (:func:`report_of`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from senseshield.runtime.protocol.messages import Hello
from senseshield.strategies import BootstrapReport
from senseshield.strategies.base import EncryptionRate, RoundCosts, measured_intervals


@dataclass
class AgentInfo:
    hello: Hello
    online: bool = True
    vector: np.ndarray | None = None
    joined_at: float = field(default_factory=time.time)


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
