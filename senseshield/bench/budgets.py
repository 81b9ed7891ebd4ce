"""Budget stability: the encryption budgets a fleet of identical measuring agents gets at join.

:func:`join` starts a real fleet (``keyserver serve``, ``coordinator serve`` and N
``edge-agent join --profile auto`` processes on one broker: the embedded one of ``fleet up``
or ``broker``), watches the broker for the coordinator's ``Assignment`` messages and stops
the fleet once every agent has its budget: the join and bootstrap only, no training rounds.
It returns the budgets, what every agent measured (its Hello) and what the coordinator
decided (:class:`Join`); :func:`join_budgets` returns the budgets only.
``probe="single"`` with ``tolerance=None`` is the old bandwidth path (one short best-of-two
probe, figures used as reported); ``probe="robust"`` with the default tolerance is the
current one. :func:`cpu_hog` runs a busy-looping neighbour on one CPU. Used by
``benchmarks/bench_budgets.py`` and the integration tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from senseshield.errors import ConfigError


@dataclass(frozen=True)
class Join:
    """One join of identical agents: budget per agent id (the coordinator's Assignments), the
    encryption rate every agent measured (``he_encryptions_per_s`` of the profile in its
    Hello) and that figure's probe summary, and the coordinator's budget notes (``budgets`` of
    its report: mode, pooled figures; empty unless :func:`join` was asked for them)."""

    budgets: dict[str, float]
    rates: dict[str, float] = field(default_factory=dict)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


def join(
    agents: int,
    out: Path,
    *,
    probe: str = "robust",
    tolerance: float | None = 0.05,
    budget_mode: str = "measured",
    broker: str | None = None,
    key_bits: int = 1024,
    fleet: str = "budgets",
    timeout: float = 120.0,
    profiles: dict[str, str] | None = None,
    wrap: Callable[[str, list[str]], list[str]] | None = None,
    notes: bool = False,
) -> Join:
    """One join of ``agents`` agents measuring ``--profile auto`` (``profiles``: another
    ``--profile`` spec for some agent ids; ``wrap``: :class:`FleetOptions` ``wrap``, e.g. an
    agent in a cgroup), SenseCrypt with ``budget_mode``; waits for every agent's Assignment
    (at most ``timeout`` seconds, else :class:`ConfigError`). With ``notes`` it then lets the
    one-round job end, for the coordinator's budget notes in its report (else they are empty:
    the fleet stops as soon as every agent has its budget)."""
    from senseshield.job import Job
    from senseshield.runtime.fleet import Fleet, FleetOptions, agent_ids
    from senseshield.runtime.protocol.messages import Assignment, Hello, from_frame
    from senseshield.runtime.transport import Link
    from senseshield.strategies.base import StrategyOptions

    config = Job(strategy="sensecrypt", model="linear", partition="iid", clients=agents, rounds=1, key_bits=key_bits,
                 options=StrategyOptions(budget_tolerance=tolerance, budget_mode=budget_mode))
    ids = agent_ids(agents)
    specs = {a: Path((profiles or {}).get(a, "auto")) for a in ids}
    options = FleetOptions(
        agents=agents, out=out, broker=broker, fleet=fleet, round_deadline=60, join_timeout=timeout,
        min_contributors=1, agent_profiles=specs, extra_agent_args={a: ["--probe", probe] for a in ids}, wrap=wrap,
    )
    budgets: dict[str, float] = {}
    profiles: dict[str, dict[str, Any]] = {}
    done = threading.Event()

    def on_frame(topic: str, frame) -> None:  # noqa: ANN001
        msg = from_frame(frame)
        if isinstance(msg, Hello):
            profiles[topic.split("/")[-2]] = msg.profile
        elif isinstance(msg, Assignment):
            budgets[topic.split("/")[-2]] = msg.encryption_budget
            if len(budgets) >= agents:
                done.set()

    report: dict[str, Any] = {}
    with Fleet(config, options) as running:
        running.start()
        watcher = Link(running.url, client_id=f"budget-watch-{time.monotonic_ns()}", fleet=fleet,
                       on_frame=on_frame, protocol=running.mqtt)
        watcher.subscribe("agents/+/inbox")
        watcher.subscribe("agents/+/hello")
        watcher.start()
        try:
            if not done.wait(timeout):
                raise ConfigError(f"{len(budgets)} of {agents} agents got a budget within {timeout:g} s; "
                                  f"see {out / 'logs'}.")
            if notes:
                report = running.wait(timeout)
        finally:
            watcher.stop()
            running.stop(grace=0.0)
    rates, summaries = {}, {}
    for agent, profile in sorted(profiles.items()):
        if isinstance(profile.get("he_encryptions_per_s"), (int, float)):
            rates[agent] = float(profile["he_encryptions_per_s"])
        summary = (profile.get("measurements") or {}).get("he_encryptions_per_s")
        if isinstance(summary, dict):
            summaries[agent] = summary
    return Join(dict(sorted(budgets.items())), rates, summaries, report.get("budgets") or {})


def join_budgets(agents: int, out: Path, **options: Any) -> dict[str, float]:
    """Budget per agent id of one :func:`join` of ``agents`` identical agents measuring ``--profile auto``."""
    return join(agents, out, **options).budgets


def spread(budgets: dict[str, float]) -> float:
    """max / min of the budgets (1.0 = all equal)."""
    values = list(budgets.values())
    return max(values) / min(values)


_HOG = """
import os, sys
cpu = int(sys.argv[1])
if cpu >= 0 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {cpu})
print("spinning", flush=True)
while True:
    pass
"""


@contextmanager
def cpu_hog(cpu: int | None = 0) -> Iterator[subprocess.Popen]:
    """A busy-looping Python process for the duration of the block, pinned to ``cpu`` (None:
    wherever the scheduler puts it; ignored where affinity cannot be set). Returns once the
    child says it is spinning; the child is killed on exit."""
    if cpu is not None and hasattr(os, "sched_getaffinity") and cpu not in os.sched_getaffinity(0):
        raise ConfigError(f"CPU {cpu} is not one this process may run on ({sorted(os.sched_getaffinity(0))}).")
    hog = subprocess.Popen([sys.executable, "-c", _HOG, str(-1 if cpu is None else cpu)],
                           stdout=subprocess.PIPE, text=True)
    try:
        if hog.stdout is None or hog.stdout.readline().strip() != "spinning":
            raise ConfigError(f"The CPU hog did not start (exit code {hog.poll()}).")
        yield hog
    finally:
        hog.kill()
        hog.wait()
        if hog.stdout is not None:
            hog.stdout.close()
