"""The coordinator's state of the running job (:class:`JobState`): every per-job thing it
keeps, in one object, and what changes it without the transport.

A :class:`JobState` is what the coordinator knows of its job: the job and its model's shape,
the fleet plan, the agents (hellos, online), who refused, declined or was admitted, the DP
noise and accountant, the sampler, the round records, the agents' metrics and per-round
records, straggling events, clock samples, and the round under way (its cluster rounds,
who was sampled, their partial work).

Its fields are of two kinds. The *kept* ones are what a restarted coordinator needs to
resume the job after its last closed round: :meth:`JobState.to_json` writes every one of
them and :meth:`JobState.from_json` reads every one back (:data:`KEPT` lists them; writing
a state checks that it wrote exactly these). The *transient* ones (marked
with :func:`transient`, each with why) belong to this process: the round under way is
started again by a restarted coordinator, and the round deadline and the job's start time
are this coordinator's. A store (:mod:`coordinator.store`) saves and loads the whole object.

The methods are the steps of a job that need no broker: the bootstrap plan, admitting a
late device, opening a round (who is online, sampled, their partial work), a device's round
plan, closing a round (its tally and record, the accountant), and the report's inputs.
The report itself is :mod:`coordinator.report`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from coordinator import budgets, roster
from coordinator.history import DeviceRounds, MetricsBook, RoundBook, record_from_json, record_json
from coordinator.roster import AgentInfo
from coordinator.rounds import ClusterRound, round_tally
from senseshield.accounting import Accountant, Epsilons
from senseshield.engine.buffered import staleness
from senseshield.engine.aggregation import StreamingAggregate
from senseshield.he.base import job_key
from senseshield.job import Job, effective_scheme, noise_multipliers, train_config
from senseshield.runtime.protocol.messages import Hello, Metrics, RoundOpen, RoundPlan, pack_mask
from senseshield.runtime.files import View
from senseshield.strategies import FleetPlan
from senseshield.strategies.base import Strategy


def transient(why: str, **kwargs: Any) -> Any:  # noqa: ANN401 - a dataclass field
    """A field of this process, not written by :meth:`JobState.to_json` (``why``: the reason,
    kept in the field's metadata); it gets its default when a state is loaded."""
    return field(metadata={"transient": why}, **kwargs)


@dataclass(eq=False)
class JobState:
    """The running job's state (see the module docstring)."""

    # ---- the job ------------------------------------------------------------------------
    run_id: str  # the job's id (the book's record id)
    config: Job
    size: int  # parameters of the job's model
    input_shape: list[int]
    num_classes: int
    # ---- the fleet ----------------------------------------------------------------------
    plan: FleetPlan | None = None  # clusters and budgets (None: not bootstrapped yet)
    agents: dict[str, AgentInfo] = field(default_factory=dict)  # agents that said hello to the job
    refused: dict[str, str] = field(default_factory=dict)  # agent -> why it (or its update) was refused
    declined: dict[str, str] = field(default_factory=dict)  # devices that did not take the job, and why
    admitted: dict[str, int] = field(default_factory=dict)  # agent -> round it was admitted after the bootstrap
    active: set[str] = field(default_factory=set)  # agents sample-able in the latest round (joins and leaves)
    bootstrap_seconds: float = 0.0
    sigma_user: float | None = None  # user-level DP noise multiplier
    sigma_record: dict[str, float] = field(default_factory=dict)  # agent -> its DP-SGD noise multiplier
    # ---- progress -----------------------------------------------------------------------
    completed: int = 0  # rounds closed
    model_round: dict[int, int] = field(default_factory=dict)  # cluster -> round of its latest model
    # the round under way when last saved: its number, start (and restart) time, and the sampler
    # before its draw (a restarted coordinator samples the round as it first did)
    in_flight: dict | None = None
    sampler: np.random.Generator | None = None  # who is sampled each round (None: seeded from the job)
    user_accountant: Accountant = field(default_factory=Accountant)
    participations: dict[str, int] = field(default_factory=dict)  # user-DP rounds each agent was sampled in
    # a buffered job: agents training now -> [round they train in, model round they started from]
    busy: dict[str, list[int]] = field(default_factory=dict)
    # ---- what the rounds recorded -------------------------------------------------------
    # per closed round, with its RoundTally under "tally" (a RoundBook: earlier rounds on disk)
    records: RoundBook = field(default_factory=RoundBook)
    # (agent, round) -> its evaluation, and agent -> round -> its round record (timings etc.);
    # closed rounds are kept packed (coordinator.history)
    metrics: MetricsBook = field(default_factory=MetricsBook)
    agent_rounds: dict[str, DeviceRounds] = field(default_factory=dict)
    straggling: list[dict] = field(default_factory=list)  # agents a round closed without
    uplink_delays: dict[str, list[float]] = field(default_factory=dict)  # received - sent_at of small frames
    # ---- this process -------------------------------------------------------------------
    round_deadline: float = transient("this coordinator's --round-deadline, else the job's", default=0.0)
    started: float = transient("when this process took the job up (the report's seconds_total)",
                               default_factory=time.time)
    round: int = transient("the round under way; a loaded state is at its last closed round", default=0)
    clusters: dict[int, ClusterRound] = transient(
        "the cluster rounds under way (running aggregates): a restarted coordinator starts the round again",
        default_factory=dict)
    round_open: RoundOpen | None = transient("the round's plan pinned at the key server", default=None)
    steps_of: dict[str, int] = transient("partial work of the round under way", default_factory=dict)
    sampled: set[str] = transient("agents of the round under way", default_factory=set)
    joined: list[str] = transient("agents back or admitted since the last round", default_factory=list)
    left: list[str] = transient("agents gone since the last round", default_factory=list)
    notes: list[str] = transient("notes of the round under way", default_factory=list)
    round_started: float = transient("start of the round under way", default=0.0)

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = np.random.default_rng([self.config.seed, 5])
        if not self.round_deadline:
            self.round_deadline = self.config.round_deadline
        if not self.round:
            self.round = self.completed
        self._books()

    # ---- what follows from the job ------------------------------------------------------
    @cached_property
    def strategy(self) -> Strategy:
        from senseshield.strategies import build_strategy

        return build_strategy(self.config.strategy, self.config.options)

    @cached_property
    def scheme(self) -> str | None:
        return effective_scheme(self.config, self.strategy)

    @cached_property
    def metric_name(self) -> str:
        """The job's metric (accuracy, mse, ...: its task's)."""
        return train_config(self.config).metric_name

    def online(self, agent_id: str) -> bool:
        return roster.online(self.agents, agent_id)

    def ready_agents(self) -> list[str]:
        """The agents the strategy can plan: hello in and, if it needs one, the bootstrap vector."""
        needs = self.strategy.needs_bootstrap_sensitivity
        return sorted(a for a in self.agents if roster.ready(self.agents, a, needs_vector=needs))

    def full_steps_of(self, agent: str) -> int:
        """Local steps of full work of ``agent`` (its sample count, the job's epochs and batch)."""
        return budgets.full_steps_of(self, agent)

    # ---- the fleet ----------------------------------------------------------------------
    def bootstrap(self, ids: list[str], *, block_size: int) -> None:
        """Plan the fleet of the ready agents ``ids`` (clusters, budgets) and the DP noise."""
        self.strategy.fleet_context.round_deadline = self.round_deadline
        self.plan = self.strategy.plan_fleet([roster.report_of(self.agents, a) for a in ids], size=self.size,
                                             block_size=block_size)
        self.sigma_user, self.sigma_record = noise_multipliers(
            self.config, self.strategy, {a: self.agents[a].hello.n_samples for a in ids})
        self.model_round = {k: 0 for k in self.plan.clusters}

    def admit(self, agent_id: str, *, block_size: int) -> list[str] | None:
        """A device that joined after the bootstrap (:func:`coordinator.roster.admit`), once
        ready: planned into a cluster, taking part from the next round. Returns the agents to
        send an assignment (None: not admitted now)."""
        assert self.plan is not None
        admitted = roster.admit(self.agents, self.plan, self.strategy, agent_id, size=self.size, block_size=block_size)
        if admitted is None:
            return None
        self.plan, assign = admitted
        _, record = noise_multipliers(self.config, self.strategy, {agent_id: self.agents[agent_id].hello.n_samples})
        self.sigma_record.update(record)
        self.model_round.setdefault(self.plan.cluster_of[agent_id], 0)
        self.admitted[agent_id] = self.round + 1
        return assign

    def uplink(self, agent_id: str, received: float, sent_at: float) -> None:
        """One clock sample: arrival (our clock) - send time (the agent's) of a small frame."""
        self.uplink_delays.setdefault(agent_id, []).append(received - sent_at)

    def mark_late(self, agent_id: str, r: int, when: float) -> None:
        """A message of ``agent_id`` for round ``r`` arrived at ``when``, after its part of the
        round closed: its straggling events say so."""
        for s in self.straggling:
            if s["agent"] == agent_id and s["round"] == r:
                s["arrived_late"] = True
                s["late_seconds"] = round(when - s["deadline"], 3)

    def has_model(self, k: int, r: int, *, announced: int = 0) -> bool:
        """Whether cluster ``k`` got a new model in round ``r`` (so far; ``announced``: the
        round of the key server's latest model of ``k``)."""
        if not 1 <= r <= self.round:
            return False
        if self.model_round.get(k) == r or announced == r:
            return True
        return k in self.records.accepted(r)  # a closed round (its record is not decoded)

    # ---- rounds -------------------------------------------------------------------------
    def open_round(self, r: int, *, block_size: int, now: float, log: logging.Logger) -> None:
        """Round ``r`` begins: devices offline now (last will) are not sampled until they are
        back; who joined (admitted after the bootstrap, or back online) and who left since the
        last round; budgets refined (:mod:`coordinator.budgets`), partial work planned, and the
        round noted as in flight (after a restart: the time it first started, a note, and the
        sampler as it was before the round's first draw, so the same devices are sampled)."""
        assert self.plan is not None
        o = self.config.options
        ids = sorted(self.plan.cluster_of)
        online = {a for a in ids if self.online(a)}
        self.joined, self.left = sorted(online - self.active) if r > 1 else [], sorted(self.active - online)
        self.active = online
        flight = self.in_flight if self.in_flight and self.in_flight["round"] == r else None
        if flight is not None and "sampler" in flight:  # the round again: the draw of its first start
            self.sampler.bit_generator.state = flight["sampler"]
        before = self.sampler.bit_generator.state
        sampled = set(ids) if o.sample_rate >= 1.0 else {a for a in ids if self.sampler.random() < o.sample_rate}
        if o.buffer is not None:  # buffered: who still trains is carried, not sampled afresh
            self.busy = {a: w for a, w in self.busy.items() if a in online}
            sampled |= self.busy.keys()
        self.round, self.clusters, self.notes = r, {}, []
        self.settle(r)
        budgets.recalibrate(self, r, block_size=block_size, log=log)
        budgets.refresh_measured(self, r, block_size=block_size, log=log)
        self.steps_of = budgets.local_steps(self, r, sorted(sampled & online), log=log) if o.buffer is None else {}
        self.round_started = now
        restarted = flight.get("restarted_at") if flight is not None else None
        if restarted is not None:
            self.round_started = flight["started_at"]
            self.notes.append(
                f"round {r}: the coordinator restarted during this round "
                f"({time.strftime('%H:%M:%S', time.localtime(restarted))}, {restarted - self.round_started:.1f} s "
                "after it started) and resumed it from the previous round's checkpoint")
        self.in_flight = {"round": r, "started_at": self.round_started, "sampler": before,
                          **({"restarted_at": restarted} if restarted is not None else {})}
        offline = sorted(sampled - online)
        if offline:  # known gone (last will): not sampled until they are back
            self.notes.append(f"round {r}: {', '.join(offline)} offline, not sampled")
        self.sampled = sampled & online

    def _books(self) -> None:
        """The records, evaluations and devices' round records as :mod:`coordinator.history`
        keeps them (a state built or changed with plain lists and dicts, as tests do, is
        taken over)."""
        if not isinstance(self.records, RoundBook):
            self.records = RoundBook(self.records)
        if not isinstance(self.metrics, MetricsBook):
            self.metrics = MetricsBook(self.metrics)
        for a, rounds in self.agent_rounds.items():
            if not isinstance(rounds, DeviceRounds):
                self.agent_rounds[a] = DeviceRounds(rounds)

    def settle(self, before: int) -> None:
        """Pack the devices' round records and evaluations of the rounds before ``before``
        (:mod:`coordinator.history`; a round opening packs every closed one)."""
        self._books()
        self.metrics.settle(before)
        for rounds in self.agent_rounds.values():
            rounds.settle(before)

    def open_clusters(self, *, now: float) -> RoundOpen:
        """The round's cluster rounds (the sampled members of each cluster, the deadline) and
        its plan for the key server, pinned before any agent hears of the round: it seals the
        round's challenge to these agents and decrypts aggregates of these clusters only."""
        assert self.plan is not None
        members_of = {k: [a for a in self.plan.members(k) if a in self.sampled] for k in self.plan.clusters}
        self.round_open = RoundOpen(
            run_id=self.run_id, clusters={str(k): m for k, m in members_of.items() if m},
            box_keys={a: self.agents[a].hello.box_key for m in members_of.values() for a in m
                      if a in self.agents and self.agents[a].hello.box_key})
        negotiating = self.strategy.negotiates
        for k, members in members_of.items():
            if not members:
                continue
            cr = ClusterRound(members, now + self.round_deadline, "proposals" if negotiating else "updates",
                              ring_bits=self.strategy.ring_bits(self.agents[a].hello.n_samples for a in members))
            if self.config.options.buffer is not None:
                cr.buffer = min(self.config.options.buffer, len(members))
                cr.carried = {a: list(self.busy[a]) for a in members if a in self.busy}
            if not negotiating:
                cr.expected = set(members)
            self.clusters[k] = cr
        return self.round_open

    def plan_sent(self, agent: str, k: int, r: int, when: float) -> None:
        """``agent``'s plan of round ``r`` (cluster ``k``) went out at ``when``: its round record."""
        assert self.plan is not None
        carried = self.clusters[k].carried.get(agent) if k in self.clusters else None
        start = carried[1] if carried is not None else self.model_round[k]
        self.agent_rounds.setdefault(agent, DeviceRounds())[r] = {
            "cluster": k, "plan_sent": when, "budget": self.plan.budget_of[agent],
            "steps": self.steps_of.get(agent, self.full_steps_of(agent)), "full_steps": self.full_steps_of(agent),
            **({"model_round": start, "trained_in": carried[0] if carried is not None else r}
               if self.config.options.buffer is not None else {})}
        if self.config.options.buffer is not None and carried is None:
            self.busy[agent] = [r, start]

    def idle(self, agent: str) -> None:
        """``agent``'s work is over (its update arrived, late or not, or its round failed):
        a buffered job samples it afresh from the next round."""
        self.busy.pop(agent, None)

    def staleness_of(self, agent: str, r: int) -> int:
        """Rounds of staleness of ``agent``'s update of round ``r`` (a buffered job's plan
        records the model round it started from; 0 otherwise)."""
        record = self.agent_rounds.get(agent, {}).get(r, {})
        return staleness(r, record["model_round"]) if "model_round" in record else 0

    def round_plan(self, k: int, agent: str, *, block_size: int) -> RoundPlan:
        """``agent``'s plan for cluster ``k`` in the round under way (rebuilt exactly when re-sent)."""
        assert self.plan is not None
        cr = self.clusters[k]
        shared = self.strategy.planned_mask(self.plan, agent, sorted(cr.members), size=self.size, block_size=block_size)
        carried = cr.carried.get(agent)  # buffered: still training from the model it started from
        return RoundPlan(
            cluster=k, encryption_budget=self.plan.budget_of[agent], deadline=cr.deadline, block_size=block_size,
            size=self.size, model_round=carried[1] if carried is not None else self.model_round[k],
            negotiate=self.strategy.negotiates,
            participants=len(cr.members), noise_multiplier=self.sigma_user, record_noise=self.sigma_record.get(agent),
            local_steps=self.steps_of.get(agent), ring_bits=cr.ring_bits, has_shared_mask=shared is not None,
            shared_mask=pack_mask(shared) if shared is not None else np.zeros(0, np.uint8),
        )

    def new_aggregate(self, k: int, r: int, public) -> StreamingAggregate:  # noqa: ANN001 - a PublicKey
        """Cluster ``k``'s running aggregate of round ``r`` under ``public`` (the job's
        k-encryptors rule)."""
        return StreamingAggregate(job_key(public, per_client_masks=self.strategy.per_client_masks),
                                  size=self.size, round=r, cluster=k, min_encryptors=self.config.options.min_encryptors)

    def close_round(self, r: int, *, model_bytes: int, now: float) -> dict:
        """Round ``r``'s cluster rounds are done: its tally and record (appended to
        :attr:`records`), each update's facts in its agent's round record, the user-level
        accountant's step; the round is completed and no longer in flight. Returns the record."""
        o = self.config.options
        tally = round_tally(r, self.clusters, work={a: self.agent_rounds.get(a, {}).get(r, {}) for a in sorted(self.sampled)},
                            plan=self.plan, model_bytes=model_bytes, min_encryptors=o.min_encryptors, notes=self.notes)
        for cr in self.clusters.values():
            for a, note in cr.updates.items():
                self.agent_rounds[a][r].update(note.facts())
        if self.strategy.user_dp_round(r) and self.sampled:
            cohorts = [(len(cr.members), len(cr.updates)) for cr in self.clusters.values() if cr.accepted]
            sigma = self.strategy.release_sigma(self.sigma_user or 0.0, cohorts)
            if sigma < (self.sigma_user or 0.0):
                tally.notes.append(f"round {r}: fewer agents contributed than the noise was sized for; the round is "
                                   f"charged at noise multiplier {sigma:.3g}, not {self.sigma_user:.3g}")
            self.user_accountant.step(noise_multiplier=sigma, sample_rate=o.sample_rate)
            for a in self.sampled:  # the server knows who was sampled: no amplification against it
                self.participations[a] = self.participations.get(a, 0) + 1
        spent = self.user_epsilons() if self.strategy.dp_level else None
        record = {
            "tally": tally,
            "round": r,
            "joined": self.joined,
            "left": self.left,
            "seconds": now - self.round_started,
            # contributors: agents whose update entered an aggregate the key server accepted
            "participants": sum(len(cr.updates) for cr in self.clusters.values() if cr.accepted),
            "sampled": len(self.sampled),
            "user_epsilon": spent.observer if spent else None,
            "user_epsilon_server": spent.server if spent else None,
            "started_at": self.round_started,
            "finished_at": time.time(),
            "clusters": {k: cr.record() for k, cr in self.clusters.items()},
        }
        self.records.append(record)
        self.completed = r
        self.in_flight = None
        return record

    def final_metrics_wanted(self) -> set[str]:
        """The devices online whose cluster got a model in the job's last round: their
        metrics of it are waited for (a moment) before the job ends; not a buffered job's
        devices still training (their work will not count: they evaluate once it is done)."""
        last = self.config.rounds
        updated = {k for k, r in self.model_round.items() if r == last}
        return {a for a, k in self.plan.cluster_of.items() if k in updated and self.online(a) and a not in self.busy}

    def user_epsilons(self, *, records: list | None = None, pld: bool = False) -> Epsilons:
        """The run's epsilons so far (:func:`coordinator.report.user_epsilons`)."""
        from coordinator.report import user_epsilons

        return user_epsilons(self.config.options.delta, self.user_accountant, self.participations,
                             records=records, pld=pld)

    # ---- saving -------------------------------------------------------------------------
    def to_json(self, *, lazy: bool = False) -> dict[str, Any]:
        """Every kept field (:data:`KEPT`) as JSON (keys of rounds and clusters are strings).
        ``lazy``: the devices' round records and evaluations as mappings and a generator that
        decode one at a time (for :func:`senseshield.runtime.files.json_pieces`, which writes
        int keys as strings), not as one object holding them all."""
        plan = self.plan
        out = {
            "run_id": self.run_id,
            "config": self.config.model_dump(mode="json"),
            "size": self.size,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "plan": None if plan is None else {
                "cluster_of": plan.cluster_of,
                "budget_of": plan.budget_of,
                "budget_notes": plan.budget_notes,
                "fixed_masks": {str(k): np.flatnonzero(m).tolist() for k, m in plan.fixed_masks.items()},
                "rankings": {str(k): v.tolist() for k, v in plan.rankings.items()},
            },
            # the bootstrap vectors are not kept (a model's size per agent; the plan holds what
            # the bootstrap made of them)
            "agents": View(self.agents, value=_agent_json) if lazy else
                      {a: _agent_json(i) for a, i in self.agents.items()},
            "refused": self.refused,
            "declined": self.declined,
            "admitted": self.admitted,
            "active": sorted(self.active),
            "bootstrap_seconds": self.bootstrap_seconds,
            "sigma_user": self.sigma_user,
            "sigma_record": self.sigma_record,
            "completed": self.completed,
            "model_round": {str(k): r for k, r in self.model_round.items()},
            "in_flight": self.in_flight,
            "sampler": self.sampler.bit_generator.state,
            "user_accountant": self.user_accountant.history,
            "participations": self.participations,
            "busy": self.busy,
            "records": (record_json(rec) for rec in self.records) if lazy else
                       [record_json(rec) for rec in self.records],
            "metrics": ([a, r, m.model_dump(mode="json")] for (a, r), m in self.metrics.items()) if lazy else
                       [[a, r, m.model_dump(mode="json")] for (a, r), m in self.metrics.items()],
            "agent_rounds": self.agent_rounds if lazy else
                            {a: {str(r): v for r, v in rounds.items()} for a, rounds in self.agent_rounds.items()},
            "straggling": self.straggling,
            "uplink_delays": self.uplink_delays,
        }
        assert out.keys() == set(KEPT), set(KEPT) ^ out.keys()
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "JobState":
        """The state :meth:`to_json` wrote; its transient fields get their defaults (the round
        under way is its last closed one). KeyError, ValueError or TypeError if ``raw`` is not one."""
        missing = set(KEPT) - raw.keys()
        if missing:
            raise KeyError(sorted(missing)[0])
        size = int(raw["size"])
        plan = None
        if raw["plan"] is not None:
            p = raw["plan"]
            fixed = {}
            for k, idx in p["fixed_masks"].items():
                m = np.zeros(size, dtype=bool)
                m[idx] = True
                fixed[int(k)] = m
            plan = FleetPlan(dict(p["cluster_of"]), dict(p["budget_of"]), fixed, p["budget_notes"],
                             {int(k): np.asarray(v, dtype=np.float64) for k, v in p["rankings"].items()})
        sampler = np.random.default_rng()
        sampler.bit_generator.state = raw["sampler"]
        return cls(
            run_id=raw["run_id"],
            config=Job(**raw["config"]),
            size=size,
            input_shape=list(raw["input_shape"]),
            num_classes=int(raw["num_classes"]),
            plan=plan,
            agents={a: AgentInfo(Hello(**i["hello"]), online=bool(i["online"]), joined_at=float(i["joined_at"]))
                    for a, i in raw["agents"].items()},
            refused=dict(raw["refused"]),
            declined=dict(raw["declined"]),
            admitted=dict(raw["admitted"]),
            active=set(raw["active"]),
            bootstrap_seconds=float(raw["bootstrap_seconds"]),
            sigma_user=raw["sigma_user"],
            sigma_record=dict(raw["sigma_record"]),
            completed=int(raw["completed"]),
            model_round={int(k): r for k, r in raw["model_round"].items()},
            in_flight=raw["in_flight"],
            sampler=sampler,
            user_accountant=Accountant([tuple(h) for h in raw["user_accountant"]]),
            participations=dict(raw["participations"]),
            busy={a: list(w) for a, w in raw["busy"].items()},
            records=RoundBook(record_from_json(rec) for rec in raw["records"]),
            metrics=MetricsBook({(a, int(r)): Metrics(**m) for a, r, m in raw["metrics"]}),
            agent_rounds={a: DeviceRounds({int(r): v for r, v in rounds.items()})
                          for a, rounds in raw["agent_rounds"].items()},
            straggling=list(raw["straggling"]),
            uplink_delays={a: list(v) for a, v in raw["uplink_delays"].items()},
        )


def take_up(fresh: JobState, saved: JobState | None, *, round_deadline: float | None = None, where: str = "memory",
            log: logging.Logger | None = None) -> JobState:
    """The state a coordinator runs job ``fresh.run_id`` with: ``saved`` (what its store holds
    of the job) when it is of the same configuration, else ``fresh`` (a warning if ``saved``
    is of another configuration: the job starts anew). A saved state is taken up with this
    coordinator's ``round_deadline`` (its override, if any), and the round it had in flight,
    if any, noted as restarted now (the round keeps the time it first started and says so)."""
    log = log or logging.getLogger("senseshield.coordinator")
    if saved is None or saved.run_id != fresh.run_id:
        return fresh
    if saved.config.model_dump(mode="json") != fresh.config.model_dump(mode="json"):
        log.warning("state in %s is for another configuration of job %s; starting it anew", where, fresh.run_id)
        return fresh
    if round_deadline:
        saved.round_deadline = round_deadline
    flight, saved.in_flight = saved.in_flight, None
    if flight and flight.get("round") == saved.completed + 1:  # the round in flight when it stopped
        saved.in_flight = {**flight, "restarted_at": time.time()}
    log.info("resuming run %s after round %d", saved.run_id, saved.completed)
    return saved


KEPT: tuple[str, ...] = tuple(f.name for f in fields(JobState) if "transient" not in f.metadata)
"""The fields a saved state holds (every field not marked :func:`transient`)."""


def _agent_json(info: AgentInfo) -> dict:
    """What a checkpoint keeps of a device that said hello."""
    return {"hello": info.hello.model_dump(mode="json"), "online": info.online, "joined_at": info.joined_at}
