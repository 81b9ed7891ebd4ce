"""Budget stability: the encryption budgets a fleet of identical measuring agents gets at join.

:func:`join_budgets` starts a real fleet (``keyserver serve``, ``coordinator serve`` and N
``edge-agent join --profile auto`` processes on one broker: the embedded one of ``fleet up``
or ``broker``), watches the broker for the coordinator's ``Assignment`` messages and stops
the fleet once every agent has its budget: the join and bootstrap only, no training rounds.
``probe="single"`` with ``tolerance=None`` is the old path (one short best-of-two bandwidth
probe, figures used as reported); ``probe="robust"`` with the default tolerance is the
current one. Used by ``benchmarks/bench_budgets.py`` and the integration test.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from senseshield.errors import ConfigError


def join_budgets(
    agents: int,
    out: Path,
    *,
    probe: str = "robust",
    tolerance: float | None = 0.05,
    broker: str | None = None,
    key_bits: int = 1024,
    fleet: str = "budgets",
    timeout: float = 120.0,
) -> dict[str, float]:
    """Budget per agent id of one join of ``agents`` identical agents measuring ``--profile auto``."""
    from senseshield.runtime.fleet import Fleet, FleetOptions, agent_ids
    from senseshield.runtime.protocol.messages import Assignment, from_frame
    from senseshield.job import Job
    from senseshield.strategies.base import StrategyOptions
    from senseshield.runtime.transport import Link

    config = Job(strategy="sensecrypt", model="linear", partition="iid", clients=agents, rounds=1,
                              key_bits=key_bits, options=StrategyOptions(budget_tolerance=tolerance))
    ids = agent_ids(agents)
    options = FleetOptions(
        agents=agents, out=out, broker=broker, fleet=fleet, round_deadline=60, join_timeout=timeout,
        min_contributors=1, agent_profiles={a: Path("auto") for a in ids},
        extra_agent_args={a: ["--probe", probe] for a in ids},
    )
    budgets: dict[str, float] = {}
    done = threading.Event()

    def on_frame(topic: str, frame) -> None:  # noqa: ANN001
        msg = from_frame(frame)
        if isinstance(msg, Assignment):
            budgets[topic.split("/")[-2]] = msg.encryption_budget
            if len(budgets) >= agents:
                done.set()

    with Fleet(config, options) as running:
        running.start()
        watcher = Link(running.url, client_id=f"budget-watch-{time.monotonic_ns()}", fleet=fleet,
                       on_frame=on_frame, protocol=running.mqtt)
        watcher.subscribe("agents/+/inbox")
        watcher.start()
        try:
            if not done.wait(timeout):
                raise ConfigError(f"{len(budgets)} of {agents} agents got a budget within {timeout:g} s; "
                                  f"see {out / 'logs'}.")
        finally:
            watcher.stop()
            running.stop(grace=0.0)
    return dict(sorted(budgets.items()))


def spread(budgets: dict[str, float]) -> float:
    """max / min of the budgets (1.0 = all equal)."""
    values = list(budgets.values())
    return max(values) / min(values)
