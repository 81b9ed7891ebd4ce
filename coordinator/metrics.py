"""The coordinator's optional Prometheus endpoint (``prometheus-client``): gauges of the latest
round, fed by the coordinator after each round and each agent's metrics."""

from __future__ import annotations

METRICS_PORT_ENV = "SENSESHIELD_METRICS_PORT"
"""Prometheus port when the coordinator's ``metrics_port`` is None (lets launchers such as
``senseshield trial run --metrics-port`` switch the endpoint on)."""


class CoordinatorMetrics:
    """Optional Prometheus endpoint of a live fleet (``prometheus-client``), on ``port``
    (0: a free port, see :attr:`port`), all interfaces. Its own registry, so several
    coordinators in one process do not collide. Gauges describe the latest round:

    * ``senseshield_round``, ``senseshield_round_seconds``, ``senseshield_agents_joined``,
      ``senseshield_agents_online``;
    * ``senseshield_agent_phase_seconds{agent,phase}`` (train, encrypt, upload, wait, ...),
      ``senseshield_agent_bytes_up_total{agent}``;
    * ``senseshield_server_phase_seconds{cluster,phase}`` (aggregate, decrypt);
    * ``senseshield_straggling_ratio``, ``senseshield_straggling_idle_seconds``,
      ``senseshield_straggling_median_ratio``, ``senseshield_slowest_agent_seconds{agent}``;
    * ``senseshield_straggling_events``, ``senseshield_rejected_messages``.
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = registry = CollectorRegistry()
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=registry)  # noqa: E731
        self.round = g("senseshield_round", "Last completed round.")
        self.round_seconds = g("senseshield_round_seconds", "Seconds of the last completed round.")
        self.joined = g("senseshield_agents_joined", "Agents that said hello in this run.")
        self.online = g("senseshield_agents_online", "Agents online (last will not fired).")
        self.phase = g("senseshield_agent_phase_seconds", "Seconds of an agent's phase in its latest reported round.",
                       ("agent", "phase"))
        self.bytes_up = Counter("senseshield_agent_bytes_up", "Bytes of updates an agent delivered.", ("agent",),
                                registry=registry)
        self.server = g("senseshield_server_phase_seconds", "Aggregate/decrypt seconds of a cluster, last round.",
                        ("cluster", "phase"))
        self.ratio = g("senseshield_straggling_ratio", "Slowest/fastest agent time, latest complete round.")
        self.idle = g("senseshield_straggling_idle_seconds", "Seconds agents waited for the slowest, latest round.")
        self.median = g("senseshield_straggling_median_ratio", "Median straggling ratio over the rounds so far.")
        self.slowest = g("senseshield_slowest_agent_seconds", "Busy seconds of the slowest agent, latest round.",
                         ("agent",))
        self.events = g("senseshield_straggling_events", "Agents a round closed without (so far).")
        self.rejected = g("senseshield_rejected_messages", "Messages rejected so far.")
        self.server_handle, self.thread = start_http_server(port, addr=host, registry=registry)
        self.port = self.server_handle.server_port

    def agent_round(self, agent: str, round: int, timings: dict[str, float]) -> None:
        for name, value in timings.items():
            if not name.endswith("_at") and not name.startswith("bytes_"):
                self.phase.labels(agent, name).set(value)

    def round_done(self, r: int, record: dict, bytes_up: dict, events: int, rejected: int, online: int,
                   joined: int) -> None:
        self.round.set(r)
        self.round_seconds.set(record["seconds"])
        for k, c in record["clusters"].items():
            for name in ("aggregate", "decrypt"):
                if name in c["timings"]:
                    self.server.labels(str(k), name).set(c["timings"][name])
        for agent, n in bytes_up.items():
            if n:
                self.bytes_up.labels(agent).inc(n)
        self.events.set(events)
        self.rejected.set(rejected)
        self.online.set(online)
        self.joined.set(joined)

    def straggling(self, last: dict, median: float | None) -> None:
        if last.get("ratio") is not None:
            self.ratio.set(last["ratio"])
        self.idle.set(last["idle_s"])
        self.slowest.clear()
        self.slowest.labels(last["slowest_agent"]).set(last["slowest_s"])
        if median is not None:
            self.median.set(median)

    def close(self) -> None:
        self.server_handle.shutdown()
        self.server_handle.server_close()
