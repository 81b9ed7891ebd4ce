"""The coordinator's optional Prometheus endpoint (``prometheus-client``): the fleet's devices,
the job and its rounds, every device's budget, cluster, rounds, phases, bytes, straggling and
failures, and the server's side. The coordinator feeds it through the hooks below, each called
on the coordinator's thread when the event happens (``grep -n metrics_server coordinator/``);
``senseshield fleet top`` reads it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from senseshield.runtime.metrics import count_rejections, refusal_kind, serve

METRICS_PORT_ENV = "SENSESHIELD_METRICS_PORT"
"""Prometheus port when the coordinator's ``metrics_port`` is None (lets launchers such as
``senseshield trial run --metrics-port`` switch the endpoint on)."""

NOT_PHASES = ("bytes_",)  # timings entries that are not phases (``*_at`` are timestamps)


class CoordinatorMetrics:
    """Optional Prometheus endpoint of a live fleet (``prometheus-client``), on ``port``
    (0: a free port, see :attr:`port`), ``host`` (default: localhost only; the metrics name
    every device). Its own registry, so several coordinators in one process do not collide.

    * the fleet: ``senseshield_devices_online``, ``senseshield_devices_seen``,
      ``senseshield_agent_online{agent}``;
    * the job: ``senseshield_jobs{state}``, ``senseshield_job_info{job,name,strategy,state}``,
      ``senseshield_job_rounds``, ``senseshield_round_current`` (under way),
      ``senseshield_round`` (last completed), ``senseshield_round_seconds``,
      ``senseshield_agents_joined``, ``senseshield_agents_online`` (the job's devices);
    * every device: ``senseshield_agent_budget{agent}`` (encryption budget),
      ``senseshield_agent_cluster{agent}``, ``senseshield_agent_last_round{agent}`` (latest
      round delivered), ``senseshield_agent_round_seconds{agent}`` (that round, plan sent to
      update received), ``senseshield_agent_phase_seconds{agent,phase}`` (train, encrypt,
      upload, wait, ... of its latest round), ``senseshield_agent_bytes_up_total{agent}``,
      ``senseshield_agent_bytes_down_total{agent}``,
      ``senseshield_agent_straggling_total{agent,missing}`` (rounds closed without it:
      ``update``/``proposal`` by the deadline, ``offline``, ``failed``),
      ``senseshield_agent_late_total{agent}`` (late messages dropped),
      ``senseshield_agent_failures_total{agent,phase}`` (failures it reported: ``round``, ``evaluation``),
      ``senseshield_agent_refused_updates_total{agent}`` (updates the key server found at fault);
    * the server: ``senseshield_server_phase_seconds{cluster,phase}`` (aggregate, verify, decrypt),
      ``senseshield_aggregates_total{result}`` (accepted, refused),
      ``senseshield_refusals_total{kind}`` (why refused), ``senseshield_rejected_messages_total{kind}``
      (messages rejected, by message kind);
    * straggling: ``senseshield_straggling_ratio``, ``senseshield_straggling_idle_seconds``,
      ``senseshield_straggling_median_ratio``, ``senseshield_slowest_agent_seconds{agent}``,
      ``senseshield_straggling_events`` (agents a round closed without, so far);
    * a job that does not progress: ``senseshield_job_stalled_seconds``,
      ``senseshield_job_waiting_info{waiting_for}`` (the coordinator's sentence of what it waits for).
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry = CollectorRegistry()
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=registry)  # noqa: E731
        c = lambda name, doc, labels=(): Counter(name, doc, labels, registry=registry)  # noqa: E731
        # the fleet
        self.devices_online = g("senseshield_devices_online", "Devices of the fleet online (last will not fired).")
        self.devices_seen = g("senseshield_devices_seen", "Devices seen on the fleet since the coordinator started.")
        self.agent_online = g("senseshield_agent_online", "1 while the device is online, else 0.", ("agent",))
        # the job
        self.jobs_by_state = g("senseshield_jobs", "Jobs in the coordinator's book, by state.", ("state",))
        self.job_info = g("senseshield_job_info", "1 for the running job (else the latest started), with its id, "
                          "name, strategy and state.", ("job", "name", "strategy", "state"))
        self.job_rounds = g("senseshield_job_rounds", "Rounds of the running (else the latest started) job.")
        self.round_current = g("senseshield_round_current", "Round under way (the latest started) of the job.")
        self.round = g("senseshield_round", "Last completed round.")
        self.round_seconds = g("senseshield_round_seconds", "Seconds of the last completed round.")
        self.joined = g("senseshield_agents_joined", "Agents that said hello to the job.")
        self.online = g("senseshield_agents_online", "The job's planned agents online (last will not fired).")
        # every device
        self.budget = g("senseshield_agent_budget", "Encryption budget assigned to the agent (latest round plan).",
                        ("agent",))
        self.cluster = g("senseshield_agent_cluster", "Cluster of the agent.", ("agent",))
        self.last_round = g("senseshield_agent_last_round", "Latest round whose update the agent delivered.",
                            ("agent",))
        self.agent_seconds = g("senseshield_agent_round_seconds", "Seconds from the round plan sent to the update "
                               "received, the agent's latest delivered round.", ("agent",))
        self.phase = g("senseshield_agent_phase_seconds", "Seconds of an agent's phase in its latest reported round.",
                       ("agent", "phase"))
        self.bytes_up = c("senseshield_agent_bytes_up", "Bytes of updates an agent delivered.", ("agent",))
        self.bytes_down = c("senseshield_agent_bytes_down", "Bytes of cluster models an agent received.", ("agent",))
        self.straggled = c("senseshield_agent_straggling", "Rounds closed without the agent, by what was missing "
                           "(update/proposal: deadline; offline; failed).", ("agent", "missing"))
        self.late_total = c("senseshield_agent_late", "Messages of the agent that arrived after their round closed.",
                      ("agent",))
        self.failures_total = c("senseshield_agent_failures", "Failures the agent reported (its round, or its "
                                "evaluation of a round's model).", ("agent", "phase"))
        self.refused_updates = c("senseshield_agent_refused_updates", "Updates of the agent the key server found at "
                                 "fault (left out of the aggregate).", ("agent",))
        # the server
        self.server = g("senseshield_server_phase_seconds", "Aggregate/verify/decrypt seconds of a cluster, last round.",
                        ("cluster", "phase"))
        self.aggregates = c("senseshield_aggregates", "Cluster rounds closed, by the key server's verdict.",
                            ("result",))
        self.refusals = c("senseshield_refusals", "Cluster rounds refused, by kind of reason.", ("kind",))
        self.rejected = c("senseshield_rejected_messages", "Messages rejected, by message kind.", ("kind",))
        # straggling
        self.ratio = g("senseshield_straggling_ratio", "Slowest/fastest agent time, latest complete round.")
        self.idle = g("senseshield_straggling_idle_seconds", "Seconds agents waited for the slowest, latest round.")
        self.median = g("senseshield_straggling_median_ratio", "Median straggling ratio over the rounds so far.")
        self.slowest = g("senseshield_slowest_agent_seconds", "Busy seconds of the slowest agent, latest round.",
                         ("agent",))
        self.events = g("senseshield_straggling_events", "Agents a round closed without (so far).")
        # a job that does not progress
        self.stalled_seconds = g("senseshield_job_stalled_seconds", "Seconds the running job has not progressed "
                                 "(0 while it does; set once it has stalled for a minute).")
        self.waiting = g("senseshield_job_waiting_info", "1 while the running job has stalled, with what it waits for.",
                         ("waiting_for",))
        self._online: dict[str, bool] = {}
        self._members: set[str] = set()  # the job's planned agents
        self._job: str | None = None
        self.server_handle, self.thread, self.port = serve(registry, port, host)

    # ---- hooks (the coordinator's thread) ----------------------------------------------
    def watch(self, link: Any) -> None:
        """Count the messages the coordinator's link rejects (``senseshield_rejected_messages_total``)."""
        count_rejections(link, self.rejected)

    def device(self, agent: str, online: bool) -> None:
        """A device's hello (online) or status (its last will: offline)."""
        self._online[agent] = online
        self.agent_online.labels(agent).set(1 if online else 0)
        self.devices_online.set(sum(self._online.values()))
        self.devices_seen.set(len(self._online))
        self._members_online()

    def stalled(self, seconds: float, waiting_for: str) -> None:
        """The running job has not progressed for ``seconds`` (0: it progresses again) and
        waits for ``waiting_for`` (one sentence, the coordinator's)."""
        self.stalled_seconds.set(seconds)
        self.waiting.clear()
        if seconds > 0 and waiting_for:
            self.waiting.labels(waiting_for[:500]).set(1)

    def joined_job(self, n: int) -> None:
        """``n`` agents said hello to the job so far."""
        self.joined.set(n)

    def jobs(self, records: Iterable[Any], current: Any | None) -> None:
        """The job book changed (``records``: its JobRecords; ``current``: the job running or
        waiting, None between jobs). A new job starts the per-job gauges afresh."""
        records = list(records)
        states: dict[str, int] = {}
        for r in records:
            states[r.state] = states.get(r.state, 0) + 1
        for state in ("queued", "waiting", "running", "done", "failed", "cancelled", *states):
            self.jobs_by_state.labels(state).set(states.get(state, 0))
        started = [r for r in records if r.started_at]
        shown = current or (max(started, key=lambda r: r.started_at) if started else None)
        if shown is None:
            return
        if current is not None and current.id != self._job:
            self._new_job(current.id)
        self.job_info.clear()
        self.job_info.labels(shown.id, shown.name, shown.job.get("strategy", ""), shown.state).set(1)
        self.job_rounds.set(shown.rounds)

    def _new_job(self, job_id: str) -> None:
        self._job = job_id
        self._members = set()
        for gauge in (self.budget, self.cluster, self.last_round, self.agent_seconds, self.phase, self.server,
                      self.slowest):
            gauge.clear()
        for gauge in (self.round_current, self.round, self.round_seconds, self.joined, self.online):
            gauge.set(0)

    def round_started(self, r: int, cluster_of: dict[str, int], budget_of: dict[str, float]) -> None:
        """Round ``r``'s plans are out: every planned agent's cluster and budget."""
        self.round_current.set(r)
        self._members = set(cluster_of)
        for agent, k in cluster_of.items():
            self.cluster.labels(agent).set(k)
            if agent in budget_of:
                self.budget.labels(agent).set(budget_of[agent])
        self._members_online()

    def _members_online(self) -> None:
        if self._members:
            self.online.set(sum(self._online.get(a, False) for a in self._members))

    def failure(self, agent: str, r: int, phase: str = "round") -> None:
        """``agent`` reported that its round ``r`` (``phase`` round) or its evaluation of the
        round's model (``phase`` evaluation) failed."""
        self.failures_total.labels(agent, phase).inc()

    def late(self, agent: str, r: int, what: str) -> None:
        """A ``what`` (update, proposal) of ``agent`` for closed round ``r`` arrived, dropped."""
        self.late_total.labels(agent).inc()

    def agent_round(self, agent: str, round: int, timings: dict[str, float]) -> None:
        """``agent``'s metrics of ``round`` (once per agent and round): its phase seconds and the
        bytes of the model it received."""
        self._phases(agent, timings)
        if timings.get("bytes_down"):
            self.bytes_down.labels(agent).inc(timings["bytes_down"])

    def _phases(self, agent: str, timings: dict[str, float]) -> None:
        for name, value in timings.items():
            if not name.endswith("_at") and not name.startswith(NOT_PHASES):
                self.phase.labels(agent, name).set(value)

    def round_done(self, r: int, record: dict, *, agents: dict[str, dict], straggling: list[dict], online: int,
                   joined: int) -> None:
        """Round ``r`` closed: ``record`` (the round's record: seconds, clusters), ``agents``
        (agent -> its record of the round: plan_sent, update_received, bytes_up, agent_timings),
        ``straggling`` (every straggling event so far)."""
        self.round.set(r)
        self.round_seconds.set(record["seconds"])
        for k, cl in record["clusters"].items():
            for name in ("aggregate", "verify", "decrypt"):
                if name in cl["timings"]:
                    self.server.labels(str(k), name).set(cl["timings"][name])
            if cl.get("accepted") is not None:
                self.aggregates.labels("accepted" if cl["accepted"] else "refused").inc()
                if not cl["accepted"]:
                    self.refusals.labels(refusal_kind(cl.get("reason", ""))).inc()
            for agent in cl.get("refused", {}):
                self.refused_updates.labels(agent).inc()
        for agent, rec in agents.items():
            if rec.get("bytes_up"):
                self.bytes_up.labels(agent).inc(rec["bytes_up"])
            if "update_received" in rec:
                self.last_round.labels(agent).set(r)
                self.agent_seconds.labels(agent).set(rec["update_received"] - rec.get("plan_sent", rec["update_received"]))
                self._phases(agent, rec.get("agent_timings") or {})
        for event in straggling:
            if event["round"] == r:
                self.straggled.labels(event["agent"], event["missing"]).inc()
        self.events.set(len(straggling))
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
