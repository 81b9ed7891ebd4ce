"""The coordinator: registry, bootstrap clustering, rounds with deadlines, blind aggregation.

It publishes the run (``fleet/config``), registers agents from their hello (their public
key id must match the key server's) and status (last will), collects bootstrap vectors,
plans the fleet through the strategy (clusters, budgets, fixed masks), and runs each round
for all clusters in parallel: round plans out, [proposals in, consensus mask out],
protected updates in until every member delivered or the deadline passed (late updates are
recorded as straggling and dropped; a member whose last will says offline is not waited
for), aggregation of ciphertext + plaintext parts with the union mask (it holds the public
key only), the aggregate to the key server, the new cluster model back. A pending aggregate
request is re-sent as soon as the key server is back (its status, or its public key
announced again). State is checkpointed after every round so a restart resumes.

The round's steps are the simulator's (:mod:`senseshield.rounds`), so a run gives the
simulator's result for the same config and seed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from senseshield.engine.aggregation import StreamingAggregate
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import PublicKey
from senseshield.he.base import job_key
from senseshield.runtime.protocol.envelope import DEFAULT_MAX_FRAME_BYTES
from senseshield.runtime.protocol.messages import (
    Decline,
    RoundFailure,
    JobBoard,
    JobCancel,
    JobReply,
    JobSubmit,
    AggregateResult,
    Assignment,
    BootstrapVector,
    ClusterModel,
    RoundOpen,
    FleetConfig,
    Hello,
    MaskDecision,
    Metrics,
    Notice,
    Proposal,
    PublicKeyAnnouncement,
    RoundPlan,
    Status,
    UpdateMessage,
    pack_mask,
    plain_part,
    unpack_mask,
    update_from_message,
)
from senseshield.accounting import Accountant, Epsilons
from senseshield.runtime.files import npy_bytes, write_atomic
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.jobsig import check_signed_job
from senseshield.runtime.service import Inbound, Service, Stopped, check_sender, writable_dir
from coordinator.checkpoint import Checkpoint, RunState
from coordinator import roster
from coordinator.roster import AgentInfo
from coordinator.report import (  # noqa: F401 (FleetReport re-exported)
    FleetReport, RunView, agent_round_records, clock_offset, round_failure, round_line, user_epsilons,
)
from coordinator.keylink import KeyLink
from coordinator.rounds import (
    Closed, ClusterRound, UpdateNote, advance, check_facts, check_receipt, floor_refusal, note_of, round_tally,
)
from coordinator.jobs import OPEN, JobBook, JobRecord
from coordinator.metrics import METRICS_PORT_ENV, CoordinatorMetrics  # noqa: F401 (re-exported)
from senseshield.runtime.metrics import metrics_port as live_port
from senseshield.job import (
    Job, check_job, effective_scheme, initial_model, job_from_dict, job_shape, noise_multipliers, train_config,
)
from senseshield.results import RoundRecord, metric_line
from senseshield.strategies import BootstrapReport, FleetPlan
from senseshield.strategies.base import RoundCosts, measured_intervals
from senseshield.engine.work import device_work, full_steps, recent_median
from senseshield.rounds import plan_local_steps

MEASURED_MARGIN = 0.8
"""Partial work from measured round times plans to this fraction of the straggle limit (never
below the quickest device's own round): measured on the 20x-slower-device benchmark
(benchmarks/bench_straggle.py), planning at the limit itself left half the rounds above it."""

log = logging.getLogger("senseshield.coordinator")

Progress = Callable[[str, int, int], None]


class JobCancelled(Exception):
    """The running job was cancelled (``job cancel``)."""


class JobFailed(Exception):
    """The running job cannot go on: a round in which no device delivered an update and
    devices said their round failed (the sentence names them and why)."""


class Coordinator(Service):
    """``coordinator serve``: see the module docstring."""

    def __init__(
        self,
        broker: str,
        *,
        fleet: str,
        state_dir: Path | None = None,
        out_dir: Path | None = None,
        once: bool = False,
        join_timeout: float | None = None,
        join_grace: float = 3.0,
        round_deadline: float | None = None,
        protocol: str = "5",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        progress: Progress | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        identity: Identity | None = None,
        trust: Trust | None = None,
        kill_before_close: int | None = None,
    ) -> None:
        """A long-running coordinator: jobs come from ``submit`` (``--job``) or ``jobs/submit``.

        ``once``: run the queued jobs, then return (``fleet up``); their reports go straight
        into ``out_dir``, else into ``out_dir/jobs/<id>/``. ``join_timeout``: with ``once``,
        how long a job may wait for its devices (None: forever). ``round_deadline``
        overrides every job's. ``join_grace``: once a job has its minimum of devices, how
        long it still waits for devices that said hello but are still bootstrapping.
        """
        if round_deadline is not None and round_deadline <= 0:
            raise ConfigError(f"--round-deadline {round_deadline} is not allowed; it must be > 0 seconds.")
        super().__init__(broker, fleet=fleet, client_id="coordinator", logger=log, protocol=protocol,
                         max_frame_bytes=max_frame_bytes, status_topic="coordinator/status",
                         identity=identity, trust=trust, role="coordinator")
        # checked now: a bad directory stops the coordinator before any job, not after one
        self.state_dir = writable_dir(state_dir, "--state-dir") if state_dir is not None else None
        self.out_dir = writable_dir(out_dir, "--out") if out_dir is not None else None
        self.once = once
        self.join_timeout = join_timeout
        self.join_grace = join_grace
        self.deadline_override = round_deadline
        self.progress = progress
        self.kill_before_close = kill_before_close  # fault drill: SIGKILL itself before closing this round
        self.checkpoints = Checkpoint.of_fleet(self.state_dir, fleet, log)
        self.book = JobBook(self.state_dir / f"jobs-{fleet}.json" if self.state_dir is not None else None)
        self.job: JobRecord | None = None
        self.cancelled: set[str] = set()
        self.failed_jobs: list[str] = []  # jobs that ended failed (a --once coordinator exits 1)
        self.devices: dict[str, bool] = {}  # every agent seen on the fleet -> online
        self.replies: dict[str, JobReply] = {}  # request id -> answer (a repeated request gets the same)
        metrics_port = live_port(metrics_port, METRICS_PORT_ENV)
        # localhost unless told otherwise: the metrics name every agent and its timings
        self.metrics_server = CoordinatorMetrics(metrics_port, metrics_host) if metrics_port is not None else None
        if self.metrics_server is not None:
            self.metrics_server.watch(self.link)  # rejected messages, by kind
        for cls, handler in {
            PublicKeyAnnouncement: self._on_key,
            Hello: self._on_hello,
            Decline: self._on_decline,
            RoundFailure: self._on_failure,
            Status: self._on_status,
            BootstrapVector: self._on_bootstrap,
            Proposal: self._on_proposal,
            UpdateMessage: self._on_update,
            Metrics: self._on_metrics,
            AggregateResult: self._on_result,
            ClusterModel: self._on_model,
            FleetConfig: self._on_foreign_config,
            JobSubmit: self._on_submit,
            JobCancel: self._on_cancel,
        }.items():
            self.on(cls, handler)
        self.watch("keyserver", self._on_keyserver_status)
        self.run_id = ""
        self.keys = self._key_link(None)  # no job yet: announcements and verdicts are not for us
        self.plan: FleetPlan | None = None
        self.agents: dict[str, AgentInfo] = {}
        self.clusters: dict[int, ClusterRound] = {}

    # ---- jobs ---------------------------------------------------------------------------
    def submit(self, job: Job, job_id: str | None = None, *, signed: bytes = b"", operator: str = "") -> JobRecord:
        """Queue ``job`` after checking it as the fleet will run it (strategy, scheme, shape,
        the model builds here); ConfigError naming what is wrong. ``signed``: the frame
        ``operator`` signed it in, forwarded to the key server (b"": an unsigned job, which a
        key server refuses outside development mode or --allow-unsigned-jobs)."""
        if job_id is not None and (job_id in self.book.records or not job_id.replace("-", "").isalnum()):
            raise ConfigError(f"Job id {job_id!r} is not allowed; it is taken or not of letters, digits and '-'.")
        check_job(job)
        record = self.book.add(job, job_id, signed=signed, operator=operator)
        self.log.info("job %s queued: %s", record.id, job.label)
        self._publish_board()
        return record

    def open_signed(self, data: bytes, where: str) -> tuple[Job, bytes, str]:
        """(job, frame, operator) of a signed job file (``senseshield job sign``), checked as
        the key server will check it; ConfigError naming ``where`` and what is wrong. It runs
        under the nonce it was signed with (:func:`signed_nonce`)."""
        operator, job = check_signed_job(data, self.trust, fleet=self.fleet, where=where)
        return job, data, operator

    def _reply(self, reply: JobReply) -> None:
        self.replies[reply.request_id] = reply
        while len(self.replies) > 1000:
            self.replies.pop(next(iter(self.replies)))
        self.send(f"jobs/replies/{reply.request_id}", reply)

    def _check_operator(self, item: Inbound) -> None:
        """Jobs come from operators only (the trust file's role; the signature was checked)."""
        if self.trust.role(item.sender) != "operator":
            raise ProtocolError(f"{item.message.schema_name!r} from {item.sender!r}, which is not an operator of this fleet.")

    def _on_submit(self, item: Inbound) -> None:
        msg: JobSubmit = item.message  # type: ignore[assignment]
        self._check_operator(item)
        if msg.request_id in self.replies:  # a repeat (the operator did not hear the answer)
            self._reply(self.replies[msg.request_id])
            return
        try:
            record = self.submit(job_from_dict(msg.job, where="job"), msg.nonce or None, signed=item.frame.raw,
                                 operator=item.sender)
            reply = JobReply(request_id=msg.request_id, accepted=True, job_id=record.id)
        except ConfigError as exc:
            self.log.warning("job refused: %s", exc)
            reply = JobReply(request_id=msg.request_id, accepted=False, reason=str(exc))
        self._reply(reply)

    def _on_cancel(self, item: Inbound) -> None:
        msg: JobCancel = item.message  # type: ignore[assignment]
        self._check_operator(item)
        if msg.request_id in self.replies:
            self._reply(self.replies[msg.request_id])
            return
        record = self.book.get(msg.job_id)
        if record is None or record.state not in OPEN:
            reason = f"job {msg.job_id!r} is not queued or running" + ("" if record is None else f" (it is {record.state})")
            self._reply(JobReply(request_id=msg.request_id, accepted=False, reason=reason))
            return
        if record.state == "queued":
            self.book.set(record, state="cancelled", finished_at=time.time(), reason="cancelled before it started")
            self.book.event(record, "cancelled before it started")
        else:
            self.cancelled.add(record.id)  # the running job's loop stops at its next step
        self._reply(JobReply(request_id=msg.request_id, accepted=True, job_id=record.id))
        self._publish_board()

    def _check_cancelled(self) -> None:
        if self.stopping.is_set():
            raise KeyboardInterrupt
        if self.job is not None and self.job.id in self.cancelled:
            raise JobCancelled(self.job.id)
        if self.job is not None and self.keys.refused:  # the key server will not serve this job
            raise ConfigError(self.keys.refused)

    def _publish_board(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.jobs(self.book.records.values(), self.job)
        if self.link.connected:
            self.send("jobs/board", JobBoard(jobs=self.book.board()), retain=True)

    def _event(self, line: str) -> None:
        """One line for the operator: the coordinator's log and the job's events."""
        self.log.info("%s", line)
        if self.job is not None:
            self.book.event(self.job, line)
            self._publish_board()

    def _wait(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Handle messages until ``predicate()`` (True) or ``timeout`` (False); a cancelled
        job or a stop raises."""
        end = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            self._check_cancelled()
            if end is not None and time.monotonic() >= end:
                return False
            self.pump(0.2)
        return True

    def _begin(self, record: JobRecord) -> None:
        """Fresh per-job state for ``record`` (resumed from the checkpoint if it was running)."""
        from senseshield.strategies import build_strategy
        from senseshield.training import layout_of

        config = record.spec
        self.job, self.config = record, config
        self.metric_name = train_config(config).metric_name  # accuracy, mse, ... (the job's task)
        self.strategy = build_strategy(config.strategy, config.options)
        self.scheme = effective_scheme(config, self.strategy)
        self.round_deadline = self.deadline_override or config.round_deadline
        self.steps_of: dict[str, int] = {}  # partial work of the current round (agent -> local steps)
        input_shape, num_classes = job_shape(config)
        model, self.initial = initial_model(config, input_shape, num_classes)
        self.size = layout_of(model).size
        self.input_shape, self.num_classes = list(input_shape), num_classes
        self.run_id = record.id
        self.job_out = (self.out_dir if self.once else self.out_dir / "jobs" / record.id) if self.out_dir is not None else None
        self.keys = self._key_link(self.scheme)
        self.agents = {}
        self.refused: dict[str, str] = {}
        self.declined: dict[str, str] = {}
        self.plan = None
        self.sigma_user: float | None = None
        self.sigma_record: dict[str, float] = {}
        self.model_round: dict[int, int] = {}
        self.round = 0
        self.round_open: RoundOpen | None = None
        self.completed = 0
        self.clusters = {}
        self.records: list[dict] = []  # per round, before accuracy is known
        self.metrics: dict[tuple[str, int], Metrics] = {}
        self.agent_rounds: dict[str, dict[int, dict]] = {}  # per agent per round: timings etc.
        self.straggling: list[dict] = []
        self.user_accountant = Accountant()
        self.participations: dict[str, int] = {}  # user-DP rounds each agent was sampled in
        self.sampler = np.random.default_rng([config.seed, 5])
        self.started = time.time()
        self.bootstrap_seconds = 0.0
        self.uplink_delays: dict[str, list[float]] = {}  # received - sent_at of small agent frames
        self.active: set[str] = set()  # agents sampled-able last round (joins and leaves)
        self.admitted: dict[str, int] = {}  # agent -> round it was admitted after the bootstrap
        self.in_flight: dict | None = None  # the round under way: its number, start (and restart) time
        self._resume()

    # ---- registry -----------------------------------------------------------------------
    def _key_link(self, scheme: str | None) -> KeyLink:
        return KeyLink(self.run_id, scheme, sign=lambda message, r: self.frame(message, round=r),
                       publish=lambda frame: self.link.publish("keyserver/requests", frame), log=self.log)

    @property
    def public(self) -> PublicKey | None:
        return self.keys.public

    @property
    def key_id(self) -> str | None:
        return self.keys.key_id

    def _on_key(self, item: Inbound) -> None:
        if self.job is None:
            if item.sender != "keyserver":
                raise ProtocolError(f"keys/public from {item.sender!r}; only the key server may announce keys.")
            return
        if not self.keys.on_key(item.sender, item.message):  # type: ignore[arg-type]
            return
        for agent_id, info in list(self.agents.items()):
            self._check_key(agent_id, info.hello)
        self._resend_requests("the key server announced its key")  # e.g. it restarted

    def _on_keyserver_status(self, online: bool) -> None:
        if online:
            self._resend_requests("the key server is back online")

    def _resend_requests(self, why: str) -> None:
        """Re-send the round's plan and every aggregate request still waiting for its verdict."""
        if getattr(self, "round_open", None) is not None and self.round >= 1:
            self.send("keyserver/rounds", self.round_open, round=self.round)
        self.keys.resend(self.clusters, getattr(self, "round", 0), why)

    def _check_key(self, agent_id: str, hello: Hello) -> bool:
        reason = roster.key_refusal(agent_id, hello, self.key_id)
        if reason is None:
            return True
        self.log.warning(reason)
        self.refused[agent_id] = reason
        self.agents.pop(agent_id, None)
        self.send(f"agents/{agent_id}/inbox", Notice(run_id=self.run_id, kind="refused", reason=reason))
        return False

    def _on_hello(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Hello = item.message  # type: ignore[assignment]
        self.devices[agent_id] = True
        if self.metrics_server is not None:
            self.metrics_server.device(agent_id, True)
        if self.job is None or msg.run_id != self.run_id:
            return  # the agent saw an older run's retained config; it will say hello again
        if msg.agent_id != agent_id:
            raise ProtocolError(f"Hello on {item.suffix!r} names agent {msg.agent_id!r}.")
        if not self._check_key(agent_id, msg):
            return
        self.declined.pop(agent_id, None)
        joined = roster.greet(self.agents, agent_id, msg, planned=self.plan is not None)
        if self.metrics_server is not None:
            self.metrics_server.joined_job(len(self.agents))
        self._uplink(agent_id, item)
        if joined:
            late = " (after the bootstrap: it takes part from the next round)" if self.plan is not None else ""
            self.log.info("agent %s joined (%d/%d): %d samples, %.1f MB/s, cpu %.1f%s",
                          agent_id, len(self.agents), self.config.min_devices, msg.n_samples, msg.bandwidth,
                          msg.cpu_speed, late)
            if self.plan is not None:
                self._admit(agent_id)
        if self.plan is not None and agent_id in self.plan.cluster_of:  # a re-sent hello: repeat the assignment
            self._assign(agent_id)
            # and the round in flight: after a broker restart the coordinator may have re-sent
            # its plans before this agent was subscribed again, so they never reached it
            for k, cr in self.clusters.items():
                if cr.phase in ("proposals", "updates") and agent_id in cr.members and agent_id not in cr.updates:
                    self.log.info("round %d cluster %d: %s said hello again; re-sending its plan", self.round, k, agent_id)
                    self._resend_plans(k, [agent_id])

    def _on_status(self, item: Inbound) -> None:
        agent_id = check_sender(item)  # the last will is the agent's own frame, too
        msg: Status = item.message  # type: ignore[assignment]
        if not msg.online and self.link.connects > 1 and item.received < self.link.connected_at:
            # a last will that came over the connection before our latest reconnect: a broker
            # going down sends the will of every client still connected, live devices too; the
            # device's own status on the new connection says whether it is back
            self.log.info("agent %s: its last will came before the broker connection was restored; waiting for "
                          "its status", agent_id)
            return
        self.devices[agent_id] = msg.online
        if self.metrics_server is not None:
            self.metrics_server.device(agent_id, msg.online)
        info = self.agents.get(agent_id)
        if info is not None and info.online != msg.online:
            info.online = msg.online
            self.log.info("agent %s is %s", agent_id, "online" if msg.online else "offline")
            for cr in self.clusters.values():
                if msg.online:
                    cr.offline.discard(agent_id)
                elif agent_id in cr.members:
                    cr.offline.add(agent_id)
            self._advance()  # a round waiting only for agents now offline closes now

    def _on_bootstrap(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        info = self.agents.get(agent_id)
        if info is None:
            raise ProtocolError(f"Bootstrap vector from {agent_id!r}, which has not said hello in this run.")
        vector = item.message.sensitivity  # type: ignore[attr-defined]
        if vector.size != self.size:
            raise ProtocolError(f"Bootstrap vector of {agent_id!r} has {vector.size} values; the model has {self.size}.")
        if self.plan is not None and info.vector is not None:
            return  # the fleet is planned: a repeated vector changes nothing
        info.vector = vector
        if self.plan is not None and agent_id not in self.plan.cluster_of:
            self._admit(agent_id)

    def _on_decline(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Decline = item.message  # type: ignore[assignment]
        if self.job is None or msg.run_id != self.run_id or agent_id in self.declined:
            return
        if agent_id in self.agents:  # it said hello to this job: it takes part, whatever it says now
            raise ProtocolError(f"Decline of job {msg.run_id} from {agent_id!r}, which takes part in it; ignored.")
        self.declined[agent_id] = msg.reason
        if msg.selected:
            self._event(f"agent {agent_id} refused the job: {msg.reason}")
        else:
            self.log.info("agent %s is not selected: %s", agent_id, msg.reason)

    def _on_failure(self, item: Inbound) -> None:
        """An agent's round failed (its training raised): the round closes without it now,
        as for an agent gone offline, not at the deadline; or its evaluation of a round's model
        failed. Either is kept in its round record (the report's ``failures``) and is a line of
        the job's events (``job logs``, ``--follow``)."""
        agent_id = check_sender(item)
        msg: RoundFailure = item.message  # type: ignore[assignment]
        r = item.round
        if self.job is None or msg.run_id != self.run_id:
            raise ProtocolError(f"Round failure of job {msg.run_id} from {agent_id!r}; the current job is {self.run_id}.")
        if msg.phase == "evaluation":
            if r not in self.agent_rounds.get(agent_id, {}):
                raise ProtocolError(f"Evaluation failure of {agent_id!r} for round {r}, which it was not in.")
        else:
            cr = self._cluster_round_of(agent_id, r, "round failure")
            if agent_id in cr.updates:
                raise ProtocolError(f"Round failure of {agent_id!r} for round {r}, whose update arrived; ignored.")
            cr.failed[agent_id] = msg.reason
        failed = self.agent_rounds[agent_id][r].setdefault("failed", {})
        if msg.phase in failed:
            return  # said once
        failed[msg.phase] = msg.reason
        if self.metrics_server is not None:
            self.metrics_server.failure(agent_id, r, msg.phase)
        what = "its round" if msg.phase == "round" else "evaluating the model of the round"
        self.log.warning("round %d: agent %s failed %s: %s", r, agent_id, what, msg.reason)
        self.book.event(self.job, f"round {r}: {agent_id} failed {what}: {msg.reason}")
        self._publish_board()
        self._advance()

    def _report_of(self, agent_id: str) -> BootstrapReport:
        return roster.report_of(self.agents, agent_id)

    def _admit(self, agent_id: str) -> None:
        """A device that joined after the bootstrap (coordinator.roster.admit): planned into a
        cluster once ready; it takes part from the next round."""
        assert self.plan is not None
        admitted = roster.admit(self.agents, self.plan, self.strategy, agent_id, size=self.size,
                                block_size=self.block_size)
        if admitted is None:
            return
        self.plan, assign = admitted
        _, record = noise_multipliers(self.config, self.strategy, {agent_id: self.agents[agent_id].hello.n_samples})
        self.sigma_record.update(record)
        k = self.plan.cluster_of[agent_id]
        self.model_round.setdefault(k, 0)
        self.admitted[agent_id] = self.round + 1
        for a in assign:
            self._assign(a)
        self._event(f"agent {agent_id} admitted to cluster {k} with budget {self.plan.budget_of[agent_id]:.3f}; "
                    f"it takes part from round {self.round + 1}")
        self._checkpoint()

    def _on_foreign_config(self, item: Inbound) -> None:
        msg: FleetConfig = item.message  # type: ignore[assignment]
        if msg.run_id != self.run_id:
            self.log.warning("another coordinator published run %s on this fleet", msg.run_id)

    @property
    def block_size(self) -> int:
        """Mask granularity of the fleet's HE scheme (1 without HE)."""
        return self.keys.block_size

    def _online(self, agent_id: str) -> bool:
        return roster.online(self.agents, agent_id)

    def _ready(self, agent_id: str) -> bool:
        return roster.ready(self.agents, agent_id, needs_vector=self.strategy.needs_bootstrap_sensitivity)

    # ---- bootstrap ----------------------------------------------------------------------
    def _bootstrap(self) -> None:
        """Wait for the key and for ``min_devices`` ready devices (hello and, if the strategy
        needs it, the bootstrap vector), then for a grace period while devices that said
        hello are still bootstrapping; then plan the fleet (clusters, budgets)."""
        t = time.time()
        timeout = self.join_timeout
        end = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if end is None else max(end - time.monotonic(), 0.0)  # noqa: E731
        if not self._wait(lambda: self.keys.ready, left()):
            raise ConfigError(f"No public key from the key server within {timeout:g} s; is `keyserver serve` running for fleet {self.fleet!r}?")
        need = self.config.min_devices
        count = lambda: (sum(self._ready(a) for a in self.agents), len(self.declined))  # noqa: E731
        last, enough_at = None, None
        self.book.set(self.job, state="waiting")
        while True:
            self._check_cancelled()
            n, declined = now = count()
            if now != last:
                if self.progress:
                    self.progress("join", n, need)
                if n < need:
                    self._event(f"waiting for devices: {n}/{need} ready"
                                + (f", {declined} declined (job status shows why)" if declined else ""))
                last = now
            if n >= need:
                enough_at = enough_at or time.monotonic()
                settled = n == len(self.agents) or time.monotonic() - enough_at >= self.join_grace
                if settled:
                    break
            if end is not None and time.monotonic() >= end:
                break
            self.pump(0.2)
        ids = sorted(a for a in self.agents if self._ready(a))
        if len(ids) < need:
            raise ConfigError(f"{len(ids)} of the {need} devices job {self.job.id} needs joined fleet {self.fleet!r} within {timeout:g} s.")
        reports = [self._report_of(a) for a in ids]
        block = self.block_size
        self.strategy.fleet_context.round_deadline = self.round_deadline
        self.plan = self.strategy.plan_fleet(reports, size=self.size, block_size=block)
        self.sigma_user, self.sigma_record = noise_multipliers(
            self.config, self.strategy, {a: self.agents[a].hello.n_samples for a in ids}
        )
        self.model_round = {k: 0 for k in self.plan.clusters}
        for a in ids:
            self._assign(a)
        self.bootstrap_seconds = time.time() - t
        self._event(f"bootstrap: {len(ids)} devices in {len(self.plan.clusters)} cluster(s) "
                    f"{ {k: self.plan.members(k) for k in self.plan.clusters} }")
        self._checkpoint()

    def _assign(self, agent_id: str) -> None:
        assert self.plan is not None
        self.send(f"agents/{agent_id}/inbox", Assignment(
            cluster=self.plan.cluster_of[agent_id], encryption_budget=self.plan.budget_of[agent_id]))

    # ---- rounds -------------------------------------------------------------------------
    def _start_round(self, r: int) -> None:
        """Plans out for round ``r``. Devices offline now (last will) are not sampled until
        they are back; the round records who joined (admitted after the bootstrap, or back
        online) and who left since the last round."""
        assert self.plan is not None
        o = self.config.options
        ids = sorted(self.plan.cluster_of)
        online = {a for a in ids if self._online(a)}
        self.joined, self.left = sorted(online - self.active) if r > 1 else [], sorted(self.active - online)
        self.active = online
        sampled = set(ids) if o.sample_rate >= 1.0 else {a for a in ids if self.sampler.random() < o.sample_rate}
        self.round, self.clusters, self.offline_notes = r, {}, []
        self._recalibrate(r)
        self._refresh_measured(r)
        self.steps_of = self._local_steps(r, sorted(sampled & online))
        self.round_started = time.time()
        self._note_restart(r)
        offline = sorted(sampled - online)
        if offline:  # known gone (last will): not sampled until they are back
            self.offline_notes.append(f"round {r}: {', '.join(offline)} offline, not sampled")
        self.sampled = sampled & online
        # the round's plan, pinned at the key server before any agent hears of it: it seals
        # the round's challenge to these agents and decrypts aggregates of these clusters only
        members_of = {k: [a for a in self.plan.members(k) if a in self.sampled] for k in self.plan.clusters}
        self.round_open = RoundOpen(
            run_id=self.run_id, clusters={str(k): m for k, m in members_of.items() if m},
            box_keys={a: self.agents[a].hello.box_key for m in members_of.values() for a in m
                      if a in self.agents and self.agents[a].hello.box_key})
        self.send("keyserver/rounds", self.round_open, round=r)
        for k in self.plan.clusters:
            members = [a for a in self.plan.members(k) if a in self.sampled]
            if not members:
                continue
            deadline = time.time() + self.round_deadline
            negotiating = self.strategy.negotiates
            cr = ClusterRound(members, deadline, "proposals" if negotiating else "updates",
                              ring_bits=self.strategy.ring_bits(self.agents[a].hello.n_samples for a in members))
            if not negotiating:
                cr.expected = set(members)
            self.clusters[k] = cr
            for a in members:
                plan = self._round_plan(k, a)
                # one frame per device: do not wait for each acknowledgement (N round trips)
                self.send(f"agents/{a}/inbox", plan, round=r, wait=False)
                self.agent_rounds.setdefault(a, {})[r] = {"cluster": k, "plan_sent": time.time(),
                                                          "budget": self.plan.budget_of[a],
                                                          "steps": self.steps_of.get(a, self.full_steps_of(a)),
                                                          "full_steps": self.full_steps_of(a)}
        if self.metrics_server is not None:
            self.metrics_server.round_started(r, self.plan.cluster_of, self.plan.budget_of)

    def full_steps_of(self, agent: str) -> int:
        """Local steps of full work of ``agent`` (its sample count, the job's epochs and batch)."""
        c = self.config
        return full_steps(self.agents[agent].hello.n_samples, batch_size=c.batch_size, epochs=c.local_epochs)

    def _local_steps(self, r: int, ids: list[str]) -> dict[str, int]:
        """Partial work before round ``r`` (:func:`senseshield.rounds.plan_local_steps`): each
        device's seconds per step, and its other round work, from its last 5 delivered rounds
        (:func:`senseshield.engine.work.device_work`: training and scoring sensitivity grow with
        the steps; the rest is what its round took beyond them, plan in hand to update received
        as the straggling figure counts it); before every device delivered one, relative speeds
        from the join (1 / measured GFLOPS when all measured it, else 1 / cpu_speed, as in the
        simulator). From measured seconds it plans to :data:`MEASURED_MARGIN` x the limit: a
        round's straggling compares its slowest round to that round's quickest, and both
        scatter around the medians the prediction uses. Devices with partial work get
        ``local_steps`` in their round plan; the others train in full."""
        o = self.config.options
        ids = [a for a in ids if a in self.agents]
        if not ids or self.strategy.round_plan(r).dpsgd:
            return {}
        per_step, other = {}, {}
        for a in ids:
            records = self._agent_round_records(a, self._clock_offset(a))
            work = device_work([(rr, x["agent_timings"], x.get("steps"), (records.get(str(rr)) or {}).get("busy_s"))
                                for rr, x in sorted(self.agent_rounds.get(a, {}).items()) if x.get("agent_timings")])
            per_step[a], other[a] = (None, 0.0) if work is None else work
        margin = 1.0
        if all(v is not None for v in per_step.values()):
            step_s, deadline, margin = per_step, self.round_deadline, MEASURED_MARGIN
        else:  # relative speeds only (no seconds): no deadline term, no other work
            profiles = {a: self.agents[a].hello.profile or {} for a in ids}
            gflops = {a: p.get("gflops") for a, p in profiles.items()}
            if all(isinstance(g, (int, float)) and g > 0 for g in gflops.values()):
                step_s = {a: 1.0 / float(g) for a, g in gflops.items()}
            else:
                step_s = {a: 1.0 / self.agents[a].hello.cpu_speed for a in ids}
            other, deadline = {}, None
        if o.straggle_limit is None and deadline is None:
            return {}
        n_train = {a: self.agents[a].hello.n_samples for a in ids}
        cut_before = {a for a in ids if self.steps_of.get(a, self.full_steps_of(a)) < self.full_steps_of(a)}
        steps = plan_local_steps(n_train, train_config(self.config), step_s=step_s, other_s=other,
                                 limit=o.straggle_limit, deadline_s=deadline, margin=margin, cut=cut_before)
        full = {a: self.full_steps_of(a) for a in ids}
        cut = {a: s for a, s in steps.items() if s < full[a]}
        if cut:
            self.log.info("round %d: partial work %s", r, {a: f"{s}/{full[a]} steps" for a, s in sorted(cut.items())})
        return cut

    def _note_restart(self, r: int) -> None:
        """Round ``r`` is the round a restarted coordinator had in flight: it keeps the time the
        round first started (its seconds include the restart) and its notes say so. Then the
        round is checkpointed as in flight."""
        restarted = self.in_flight.get("restarted_at") if self.in_flight and self.in_flight["round"] == r else None
        if restarted is not None:
            self.round_started = self.in_flight["started_at"]
            self.offline_notes.append(
                f"round {r}: the coordinator restarted during this round "
                f"({time.strftime('%H:%M:%S', time.localtime(restarted))}, {restarted - self.round_started:.1f} s "
                "after it started) and resumed it from the previous round's checkpoint")
        self.in_flight = {"round": r, "started_at": self.round_started,
                          **({"restarted_at": restarted} if restarted is not None else {})}
        self._checkpoint()

    def _recalibrate(self, r: int) -> None:
        """Calibrated budgets, before round ``r``: refine every device's costs from what its
        rounds since round 2 showed (round 1 warms torch and the HE tables up) -- medians of
        the encryption rate (encrypted values / encrypt seconds), of the budget-independent
        work (train, sensitivity, mask, noise) plus what the delivered round took beyond the
        model (busy time - those phases - encryption - bytes / bandwidth), with their min/max
        over the rounds as intervals (devices that agree within them are pooled) -- and let the
        strategy recompute the budgets (:meth:`Strategy.rebudget`)."""
        if self.plan is None or self.config.options.budget_mode != "calibrated" or r < 3:
            return
        reports, observed = [], {}
        for a in sorted(self.plan.cluster_of):
            info = self.agents.get(a)
            if info is None:
                continue
            base = RoundCosts.from_profile(info.hello.profile)
            offset = self._clock_offset(a)
            rounds = self._agent_round_records(a, offset)
            rates, fixed = [], []
            for rr, rec in rounds.items():
                raw = self.agent_rounds[a].get(int(rr), {})
                tm, f = raw.get("agent_timings") or {}, raw.get("he_ratio")
                if int(rr) < 2 or not tm or f is None:
                    continue
                enc = tm.get("encrypt", 0.0)
                if enc > 0.005 and f > 0:
                    rates.append(f * self.size / enc)
                work = sum(tm.get(k, 0.0) for k in ("train", "sensitivity", "mask", "noise"))
                if rec.get("busy_s") is not None and raw.get("bytes_up"):
                    transfer = raw["bytes_up"] / (info.hello.bandwidth * 1e6)
                    work += max(rec["busy_s"] - work - enc - transfer, 0.0)
                fixed.append(work)
                observed[a] = (raw.get("budget", self.plan.budget_of[a]), f)
            if base is None and not rates:
                continue
            rate = float(np.median(rates)) if rates else base.encrypt_per_s  # type: ignore[union-attr]
            train = float(np.median(fixed)) if fixed else base.train_s  # type: ignore[union-attr]
            costs = RoundCosts(train, rate, base.bytes_per_encrypted if base else 8.0, base.latency_s if base else 0.0)
            intervals = measured_intervals(info.hello.profile)  # the rounds' spread replaces the join's
            for name, seen in (("encrypt_per_s", rates), ("train_s", fixed)):
                if len(seen) >= 2:
                    intervals[name] = (min(seen), max(seen))
            reports.append(BootstrapReport(a, info.hello.n_samples, info.hello.bandwidth, info.hello.cpu_speed,
                                           info.vector, costs, intervals))
        if not reports:
            return
        block = self.block_size
        cluster_of = {rep.client_id: self.plan.cluster_of[rep.client_id] for rep in reports}
        result = self.strategy.rebudget(reports, cluster_of, size=self.size, block_size=block, observed=observed)
        if result is None:
            return
        budgets, notes = result
        self.plan.budget_of.update(budgets)
        self.plan.budget_notes.setdefault("rounds", {})[str(r)] = notes["clusters"]
        self.log.info("round %d: calibrated budgets %s", r, {a: round(b, 3) for a, b in sorted(budgets.items())})

    def round_encryption_rates(self, agent: str) -> list[float]:
        """Values ``agent`` encrypted per second in each of its delivered rounds since round 2
        (round 1 warms torch and the HE tables up), oldest first: encrypted share x model size
        over its encrypt seconds (rounds encrypting under 5 ms are left out: too short to time)."""
        rates = []
        for rr, raw in sorted(self.agent_rounds.get(agent, {}).items()):
            enc, f = (raw.get("agent_timings") or {}).get("encrypt", 0.0), raw.get("he_ratio")
            if int(rr) >= 2 and f and enc > 0.005:
                rates.append(f * self.size / enc)
        return rates

    def _refresh_measured(self, r: int, window: int = 5, least: int = 3) -> None:
        """Measured budgets, before round ``r``: in a cluster whose members all measured their
        encryption rate at join and all delivered ``least`` timed rounds since round 2, a device
        whose rounds show it slower than it measured -- the median rate of its last ``window``
        rounds (:func:`senseshield.engine.work.recent_median`: one busy round does not move it)
        below its join rate (a CPU quota set after the join or not visible to it, throttling) --
        gets that median as its rate, with [the rounds' min, the median] as its interval; the others keep
        their join figures. Rounds never raise a rate above the join's: a round encrypts with
        randomness the device precomputed while it waited, so a round's rate depends on how
        long it waited and how few values its budget asked for (measured: a device under a 5 %
        quota with budget 0.04 timed 11,000-23,000 values/s in rounds against 4,400 at join,
        and identical fast devices scattered 0.3-1.1 M values/s), and raising budgets on it made
        the slow device's budget climb to 1.0."""
        if self.plan is None or self.config.options.budget_mode != "measured" or r < 3:
            return
        from dataclasses import replace

        reports = {a: self._report_of(a) for a in sorted(self.plan.cluster_of) if a in self.agents}
        refreshed = []
        for k in self.plan.clusters:
            members = [a for a in self.plan.members(k) if a in reports]
            seen = {a: self.round_encryption_rates(a)[-window:] for a in members}
            if not members or any(reports[a].encryption is None or len(seen[a]) < least for a in members):
                continue
            for a in members:
                rep, median = reports[a], recent_median(seen[a], k=window)
                if median is not None and median < rep.encryption.per_s:
                    # a round's fast outlier (a full pool) must not pool it with faster devices
                    intervals = dict(rep.intervals, he_encryptions_per_s=(min(seen[a]), median))
                    reports[a] = replace(rep, intervals=intervals, encryption=replace(rep.encryption, per_s=median))
            refreshed.append(k)
        if not refreshed:
            return
        cluster_of = {a: self.plan.cluster_of[a] for a in reports}
        result = self.strategy.rebudget(list(reports.values()), cluster_of, size=self.size, block_size=self.block_size)
        if result is None:
            return
        budgets, notes = result
        changed = {a: b for a, b in budgets.items() if self.plan.cluster_of[a] in refreshed}
        self.plan.budget_of.update(changed)
        self.plan.budget_notes.setdefault("rounds", {})[str(r)] = {
            str(k): v for k, v in notes.get("clusters", {}).items() if int(k) in refreshed}
        self.log.info("round %d: budgets from round timings %s", r, {a: round(b, 3) for a, b in sorted(changed.items())})

    def _on_proposal(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Proposal = item.message  # type: ignore[assignment]
        self._check_facts(agent_id, "Proposal", cluster=msg.cluster, size=msg.size)
        cr = self._cluster_round_of(agent_id, item.round, "proposal")
        if cr.phase != "proposals":
            self._late(agent_id, item.round, "proposal", item.received)
            return
        cr.proposals[agent_id] = unpack_mask(msg.proposal, self.size)
        self._advance()

    def _on_update(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: UpdateMessage = item.message  # type: ignore[assignment]
        # everything is checked before the update touches the round (a bad one would fail
        # the cluster's aggregation later)
        if not 1 <= item.round <= self.round:
            raise ProtocolError(f"Update of {agent_id!r} is for round {item.round}; the current round is {self.round}.")
        hello = self._check_facts(agent_id, "Update", cluster=msg.cluster, size=msg.size)
        if msg.n_samples != self.strategy.sample_weight(hello.n_samples):
            raise ProtocolError(f"Update of {agent_id!r} claims {msg.n_samples} samples; it joined with {hello.n_samples}, "
                                f"which {self.strategy.name} weighs {self.strategy.sample_weight(hello.n_samples)}.")
        update = update_from_message(msg, self.public, client_id=agent_id, round=item.round, size=self.size)
        self._check_receipt(agent_id, item.round, msg)
        cr = self._cluster_round_of(agent_id, item.round, "update")
        ring = update.ciphertext.meta.get("ring_bits") if update.ciphertext is not None else None
        if ring is not None and ring != cr.ring_bits:
            raise ProtocolError(f"Update of {agent_id!r} is masked modulo 2^{ring}; the round's plan asks for "
                                f"2^{cr.ring_bits}.")
        first = cr.book.first(agent_id) or cr.updates.get(agent_id)  # (an attempt in flight may leave it out)
        if first is not None:
            if (msg.receipt != first.receipt and cr.phase in ("updates", "decrypting")
                    and self.keys.verifiable):
                # another update of the same device: kept aside, in case the key server finds
                # the first one at fault (coordinator.contributions)
                self.log.warning("round %d: a second, different update from %s kept aside", item.round, agent_id)
                cr.book.spare(agent_id, update, self._note(update, item, msg))
                self.keys.on_spare(self.plan.cluster_of[agent_id], cr, r=item.round,
                                   make=lambda: self._new_aggregate(self.plan.cluster_of[agent_id], item.round))
            return  # else a re-sent duplicate
        self._check_floor(agent_id, item.round, update.he_ratio, cr)
        if cr.phase != "updates" or agent_id not in cr.expected:
            self._late(agent_id, item.round, "update", item.received)
            return
        if cr.running is None:
            cr.running = self._new_aggregate(self.plan.cluster_of[agent_id], item.round)
        t = time.perf_counter()
        cr.running.add(update)  # a bad update is rejected here and changes nothing
        cr.timings["aggregate_streamed"] = cr.timings.get("aggregate_streamed", 0.0) + time.perf_counter() - t
        cr.updates[agent_id] = self._note(update, item, msg)
        if self.keys.verifiable:  # a fingerprint refusal can be retried without it
            cr.book.keep(agent_id, update, cr.updates[agent_id])
        self.agent_rounds[agent_id][item.round]["update_received"] = item.received
        self._advance()

    def _new_aggregate(self, k: int, r: int) -> StreamingAggregate:
        """Cluster ``k``'s running aggregate of round ``r`` (the job's k-encryptors rule)."""
        return StreamingAggregate(job_key(self.public, per_client_masks=self.strategy.per_client_masks),
                                  size=self.size, round=r, cluster=k,
                                  min_encryptors=self.config.options.min_encryptors)

    @staticmethod
    def _note(update, item: Inbound, msg: UpdateMessage) -> UpdateNote:  # noqa: ANN001
        return note_of(update, item.nbytes, msg.report, msg.receipt, msg.training)

    def _check_receipt(self, agent_id: str, r: int, msg: UpdateMessage) -> None:
        """The update's receipt must be the agent's own signed statement about this update
        (coordinator.rounds.check_receipt)."""
        check_receipt(self.trust, msg.receipt, agent_id=agent_id, r=r, run_id=self.run_id, cluster=msg.cluster,
                      n_samples=msg.n_samples, ciphertext=msg.ciphertext,
                      verifiable=self.keys.verifiable, plain=plain_part(msg.withheld, msg.plaintext))

    def _check_floor(self, agent_id: str, r: int, he_ratio: float, cr: ClusterRound) -> None:
        """An update must encrypt what the device's budget asks for (coordinator.rounds.floor_refusal):
        one below it is refused, named in the report's ``refused``, and not waited for; the round goes on."""
        if self.public is None or self.plan is None:
            return
        reason = floor_refusal(self.strategy, self.plan.budget_of.get(agent_id, 0.0), he_ratio, agent_id=agent_id,
                               r=r, size=self.size, block_size=self.block_size)
        if reason is None:
            return
        self.refused[agent_id] = reason
        cr.expected.discard(agent_id)
        self._advance()
        raise ProtocolError(reason)

    def _check_facts(self, agent_id: str, what: str, *, cluster: int, size: int) -> Hello:
        """An agent's message must name its cluster and the model's size; returns its hello."""
        return check_facts(self.plan, self.agents, self.size, agent_id, what, cluster=cluster, size=size)

    def _cluster_round_of(self, agent_id: str, r: int, what: str) -> ClusterRound:
        if self.plan is None or agent_id not in self.plan.cluster_of:
            raise ProtocolError(f"{what.capitalize()} from {agent_id!r}, which is not in this run.")
        if r != self.round:
            if 0 < r < self.round:
                self._late(agent_id, r, what, time.time())
                raise ProtocolError(f"{what.capitalize()} of {agent_id!r} is for round {r}, which is closed (now {self.round}).")
            raise ProtocolError(f"{what.capitalize()} of {agent_id!r} is for round {r}; the current round is {self.round}.")
        cr = self.clusters.get(self.plan.cluster_of[agent_id])
        if cr is None or agent_id not in cr.members:
            raise ProtocolError(f"{what.capitalize()} from {agent_id!r}, which was not sampled in round {r}.")
        return cr

    def _late(self, agent_id: str, r: int, what: str, when: float) -> None:
        self.log.warning("round %d: late %s from %s dropped (straggling)", r, what, agent_id)
        if self.metrics_server is not None:
            self.metrics_server.late(agent_id, r, what)
        for s in self.straggling:
            if s["agent"] == agent_id and s["round"] == r:
                s["arrived_late"] = True
                s["late_seconds"] = round(when - s["deadline"], 3)

    def _advance(self) -> None:
        """Close what is due in the round's clusters (coordinator.rounds.advance): mask
        decisions to the proposers, aggregates to the key server; give up on requests an
        online key server left unanswered."""
        now = time.time()
        advance(self.clusters, r=self.round, now=now, round_deadline=self.round_deadline, straggling=self.straggling,
                consensus=lambda proposals: self.strategy.consensus(proposals, size=self.size,
                                                                    block_size=self.block_size),
                online=self._online, then=self._closed, log=self.log)
        for k, cr in self.clusters.items():
            self.keys.expire(cr, r=self.round, now=now)
            if self.keys.give_up(cr, now=now, patience=self.round_deadline + 60,
                                 keyserver_online=self.peer_online("keyserver")):
                self.log.warning("round %d cluster %d: %s", self.round, k, cr.reason)

    def _closed(self, closed: Closed) -> None:
        if closed.decision is not None:
            proposers, shared = closed.decision
            decision = MaskDecision(cluster=closed.k, size=self.size, shared_mask=pack_mask(shared))
            self.clusters[closed.k].decision = decision  # kept to re-send (a reconnect, a repeated hello)
            for a in proposers:
                self.send(f"agents/{a}/inbox", decision, round=self.round)
        if closed.aggregate is not None:
            self.keys.request(self.clusters[closed.k], closed.aggregate, closed.started, r=self.round)

    def _on_result(self, item: Inbound) -> None:
        msg: AggregateResult = item.message  # type: ignore[assignment]
        if item.sender == "keyserver" and (msg.run_id != self.run_id or item.round != self.round):
            return  # an answer to an earlier (re-sent) request
        if self.keys.on_result(item.sender, msg, self.clusters.get(msg.cluster), r=self.round, received=item.received,
                               make=lambda: self._new_aggregate(msg.cluster, self.round)):
            self.model_round[msg.cluster] = self.round

    def _on_model(self, item: Inbound) -> None:
        msg: ClusterModel = item.message  # type: ignore[assignment]
        if not self.keys.on_model(item.sender, msg, r=item.round, nbytes=item.nbytes, size=self.size,
                                  clusters=list(self.plan.clusters) if self.plan is not None else [],
                                  current_round=self.round):
            return
        cr = self.clusters.get(msg.cluster)
        if cr is not None and item.round == self.round:
            cr.timestamps.setdefault("model_at", item.received)
        self._save_model(item.round, msg.cluster, msg.weights)

    def _on_metrics(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Metrics = item.message  # type: ignore[assignment]
        if self.plan is None or agent_id not in self.plan.cluster_of:
            raise ProtocolError(f"Metrics from {agent_id!r}, which is not in this run.")
        r, k = item.round, self.plan.cluster_of[agent_id]
        if msg.cluster != k:
            raise ProtocolError(f"Metrics of {agent_id!r} are for cluster {msg.cluster}; it belongs to {k}.")
        if not self._has_model(k, r):
            raise ProtocolError(f"Metrics of {agent_id!r} for round {r}, in which cluster {k} got no model (now round {self.round}).")
        if (agent_id, r) in self.metrics:
            return  # the first report of a round stands (agents repeat theirs after a restart)
        self.metrics[(agent_id, r)] = msg
        self._uplink(agent_id, item)
        if self.metrics_server is not None:
            self.metrics_server.agent_round(agent_id, item.round, msg.timings)
            self._publish_straggling()

    def _has_model(self, k: int, r: int) -> bool:
        """Whether cluster ``k`` got a new model in round ``r`` (so far)."""
        if not 1 <= r <= self.round:
            return False
        if self.model_round.get(k) == r or self.keys.model_round(k) == r:
            return True
        for rec in self.records:  # closed rounds (cluster keys are strings after a resume)
            if rec["round"] == r:
                cluster = rec["clusters"].get(k) or rec["clusters"].get(str(k)) or {}
                return bool(cluster.get("accepted"))
        return False

    def _uplink(self, agent_id: str, item: Inbound) -> None:
        """One clock sample: arrival (our clock) - send time (the agent's) of a small frame."""
        self.uplink_delays.setdefault(agent_id, []).append(item.received - item.frame.sent_at)

    def on_reconnect(self) -> None:
        """The broker may have lost in-flight messages: re-send the round's pending parts."""
        self.link.publish("fleet/config", self._config_frame, retain=True)
        if self.plan is None:
            return
        for a in self.plan.cluster_of:
            self._assign(a)
        for k, cr in self.clusters.items():
            if cr.phase in ("proposals", "updates"):
                if cr.offline:
                    # a broker going down sends the last will of every client still connected
                    # (Mosquitto does), so a will heard before the reconnect may be of a live
                    # device that is reconnecting too: wait for it again, until it sends or
                    # the deadline (its status, if it is back, arrives on the new connection)
                    self.log.info("round %d cluster %d: waiting again for %s (their last will came with the "
                                  "broker's loss)", self.round, k, sorted(cr.offline))
                    cr.offline.clear()
                pending = [a for a in cr.members if a not in cr.updates]
                self.log.info("round %d cluster %d: re-sending plans to %s", self.round, k, pending)
                self._resend_plans(k, pending)
        self._resend_requests("reconnected")

    def _resend_plans(self, k: int, agents: list[str]) -> None:
        """Round plans (and the consensus mask, once there is one) again to ``agents`` of
        cluster ``k``: the plan is rebuilt exactly (same deadline, same everything), and an
        agent that already sent its update answers a repeated plan by re-sending it."""
        cr = self.clusters[k]
        for a in agents:
            self.send(f"agents/{a}/inbox", self._round_plan(k, a), round=self.round)
            if cr.decision is not None and a in cr.proposals:
                self.send(f"agents/{a}/inbox", cr.decision, round=self.round)

    def _round_plan(self, k: int, agent: str) -> RoundPlan:
        """Agent ``agent``'s plan for cluster ``k`` in the current round."""
        assert self.plan is not None
        cr = self.clusters[k]
        shared = self.strategy.planned_mask(self.plan, agent, sorted(cr.members), size=self.size,
                                            block_size=self.block_size)
        return RoundPlan(
            cluster=k,
            encryption_budget=self.plan.budget_of[agent],
            deadline=cr.deadline,
            block_size=self.block_size,
            size=self.size,
            model_round=self.model_round[k],
            negotiate=self.strategy.negotiates,
            participants=len(cr.members),
            noise_multiplier=self.sigma_user,
            record_noise=self.sigma_record.get(agent),
            local_steps=self.steps_of.get(agent),
            ring_bits=cr.ring_bits,
            has_shared_mask=shared is not None,
            shared_mask=pack_mask(shared) if shared is not None else np.zeros(0, np.uint8),
        )

    def _finish_round(self, r: int) -> None:
        if self.kill_before_close == r and not (self.in_flight or {}).get("restarted_at"):
            import signal

            self.log.warning("fault drill: killing myself (SIGKILL) before closing round %d", r)
            os.kill(os.getpid(), signal.SIGKILL)
        o = self.config.options
        tally = round_tally(r, self.clusters, work={a: self.agent_rounds.get(a, {}).get(r, {}) for a in sorted(self.sampled)},
                            plan=self.plan, model_bytes=self.keys.model_bytes or self.size * 4,
                            min_encryptors=o.min_encryptors, notes=self.offline_notes)
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
        spent = self._user_epsilons() if self.strategy.dp_level else None
        self.records.append({
            "tally": tally,
            "round": r,
            "joined": self.joined,
            "left": self.left,
            "seconds": time.time() - self.round_started,
            # contributors: agents whose update entered an aggregate the key server accepted
            "participants": sum(len(cr.updates) for cr in self.clusters.values() if cr.accepted),
            "sampled": len(self.sampled),
            "user_epsilon": spent.observer if spent else None,
            "user_epsilon_server": spent.server if spent else None,
            "started_at": self.round_started,
            "finished_at": time.time(),
            "clusters": {k: cr.record() for k, cr in self.clusters.items()},
        })
        self.completed = r
        resumed = bool((self.in_flight or {}).get("restarted_at"))
        self.in_flight = None
        self._checkpoint()
        if resumed:  # what devices reported of this round before the restart was lost or refused
            for a in self.plan.cluster_of:
                self.send(f"agents/{a}/inbox", Notice(run_id=self.run_id, kind="resend-metrics"))
        self._round_line(r)
        if self.metrics_server is not None:
            self.metrics_server.round_done(
                r, self.records[-1], agents={a: rr[r] for a, rr in self.agent_rounds.items() if r in rr},
                straggling=self.straggling, online=sum(i.online for i in self.agents.values()), joined=len(self.agents))

    def _round_line(self, r: int) -> None:
        """The operator's line for a closed round (coordinator.report.round_line); the job
        list's metric column and round."""
        out = len(self.plan.cluster_of) - len(self.sampled) if self.plan is not None else 0
        line, value = round_line(self.records[-1], rounds=self.config.rounds, out=out, metrics=self.metrics,
                                 metric_name=self.metric_name)
        self._event(line)
        if value is not None:  # the job list's metric column
            self.book.set(self.job, metric_name=self.metric_name, metric=value,
                          accuracy=value if self.metric_name == "accuracy" else None)
        self.book.set(self.job, round=r, devices=len(self.active))

    # ---- results (coordinator.report) ---------------------------------------------------
    def _view(self) -> RunView:
        """The job's state as the report reads it (by reference)."""
        assert self.plan is not None
        return RunView(
            fleet=self.fleet, run_id=self.run_id, config=self.config, strategy=self.strategy, scheme=self.scheme,
            metric_name=self.metric_name, size=self.size, input_shape=self.input_shape,
            num_classes=self.num_classes, round_deadline=self.round_deadline, plan=self.plan, agents=self.agents,
            records=self.records, metrics=self.metrics, agent_rounds=self.agent_rounds,
            uplink_delays=self.uplink_delays, user_accountant=self.user_accountant,
            participations=self.participations, started=self.started, bootstrap_seconds=self.bootstrap_seconds,
            key_id=self.key_id, sigma_user=self.sigma_user, sigma_record=self.sigma_record,
            straggling=self.straggling, refused=self.refused, declined=self.declined, rejected=self.rejected,
            rejected_total=self.rejected_total,
        )

    def round_records(self) -> list[RoundRecord]:
        """Per round: the tally plus accuracy from the agents' metrics (latest at or before r)."""
        return self._view().round_records()

    def report(self) -> FleetReport:
        """The run's report: the simulator's fields plus per-agent phase timings and straggling."""
        return self._view().report()

    def _user_epsilons(self, *, records: list | None = None, pld: bool = False) -> Epsilons:
        return user_epsilons(self.config.options.delta, self.user_accountant, self.participations,
                             records=records, pld=pld)

    def _clock_offset(self, agent_id: str) -> float:
        return clock_offset(self.metrics, self.uplink_delays, agent_id)

    def _agent_round_records(self, agent_id: str, offset: float) -> dict[str, dict]:
        return agent_round_records(self.agent_rounds, self.metrics, agent_id, offset)

    def _publish_straggling(self) -> None:
        """Prometheus: the straggling figures of the latest round whose metrics are all in."""
        if self.metrics_server is None or self.plan is None:
            return
        figures = self._view().straggling_now()
        if figures is not None:
            self.metrics_server.straggling(*figures)

    def _save_model(self, r: int, k: int, weights: np.ndarray) -> None:
        if self.job_out is None:
            return
        write_atomic(self.job_out / "models" / f"round-{r}" / f"cluster-{k}.npy", npy_bytes(weights.astype(np.float64)))

    # ---- checkpoint (coordinator.checkpoint) --------------------------------------------
    def _checkpoint(self) -> None:
        if self.checkpoints.path is None or self.plan is None:
            return
        self.checkpoints.save(RunState(
            run_id=self.run_id, config=self.config.model_dump(mode="json"), completed=self.completed,
            plan=self.plan, hellos={a: i.hello for a, i in self.agents.items()},
            sampler=self.sampler.bit_generator.state, accountant=self.user_accountant.history,
            model_round=self.model_round, sigma_user=self.sigma_user, sigma_record=self.sigma_record,
            uplink_delays=self.uplink_delays, participations=self.participations, records=self.records,
            metrics=self.metrics, agent_rounds=self.agent_rounds, straggling=self.straggling,
            refused=self.refused, declined=self.declined, admitted=self.admitted, active=self.active,
            bootstrap_seconds=self.bootstrap_seconds, in_flight=self.in_flight,
        ))

    def _resume(self) -> None:
        state = self.checkpoints.load(self.run_id, self.config.model_dump(mode="json"), self.size)
        if state is None:
            return
        self.completed = self.round = state.completed
        self.plan = state.plan
        self.uplink_delays = state.uplink_delays
        self.model_round = state.model_round
        self.sigma_user, self.sigma_record = state.sigma_user, state.sigma_record
        self.agents = {a: AgentInfo(h) for a, h in state.hellos.items()}
        self.sampler.bit_generator.state = state.sampler
        self.user_accountant = Accountant(state.accountant)
        self.participations = state.participations
        self.records = state.records
        self.metrics = state.metrics
        self.agent_rounds = state.agent_rounds
        self.straggling, self.refused = state.straggling, state.refused
        self.declined = state.declined
        self.admitted = state.admitted
        self.active = state.active
        self.bootstrap_seconds = state.bootstrap_seconds
        flight = state.in_flight
        if flight and flight.get("round") == self.completed + 1:  # the round in flight when it stopped
            self.in_flight = {**flight, "restarted_at": time.time()}
        self.log.info("resuming run %s after round %d", self.run_id, self.completed)

    # ---- main ---------------------------------------------------------------------------
    SUBSCRIPTIONS = [
        "keys/public", "keyserver/results", "clusters/+/model", "fleet/config", "jobs/submit", "jobs/cancel",
        "agents/+/hello", "agents/+/decline", "agents/+/status", "agents/+/bootstrap", "agents/+/proposal",
        "agents/+/update", "agents/+/metrics", "agents/+/failure",
    ]

    def serve(self) -> None:
        """Take jobs one at a time, in submission order, until SIGTERM (``once``: until the
        queue is empty). A job that fails or is cancelled does not stop the coordinator."""
        self.start(self.SUBSCRIPTIONS)
        try:
            self._preload()
            self._publish_board()
            idle_logged = False
            while not self.stopping.is_set():
                record = self.book.next_open()
                if record is None:
                    if self.once:
                        break
                    if not idle_logged:
                        self.log.info("no job queued; waiting for `senseshield job submit` on fleet %r", self.fleet)
                        idle_logged = True
                    self.pump(0.5)
                    continue
                idle_logged = False
                self._run_job(record)
        finally:
            self.stop()
            if self.metrics_server is not None:
                self.metrics_server.close()

    run = serve  # the name before jobs

    def _preload(self) -> None:
        """What running a job needs, loaded once the coordinator is online (its first line and
        status come before), so that a job's start and rounds do not wait for imports: torch
        (the job's initial model), scikit-learn (clustering) and Opacus' accountant (DP
        figures). A stop meanwhile ends the loading at once."""
        self.abandon_work = True
        try:
            import opacus.accountants  # noqa: F401
            import sklearn.cluster  # noqa: F401
            import sklearn.metrics  # noqa: F401
            import torch  # noqa: F401
        except Stopped:
            pass
        finally:
            self.abandon_work = False

    def _run_job(self, record: JobRecord) -> None:
        try:
            self._begin(record)
        except ConfigError as exc:  # e.g. the job's model no longer builds here
            self.book.set(record, state="failed", finished_at=time.time(), reason=str(exc))
            self.book.event(record, f"failed: {exc}")
            self._publish_board()
            return
        resumed = self.plan is not None
        self.book.set(record, state="running" if resumed else "waiting", started_at=record.started_at or time.time())
        self._event(f"job {record.id} {'resumed after round ' + str(self.completed) if resumed else 'started'}: "
                    f"{self.config.label}")
        config_msg = FleetConfig(
            run_id=self.run_id, config=self.config.model_dump(mode="json"), input_shape=self.input_shape,
            num_classes=self.num_classes, round_deadline=self.round_deadline, initial=self.initial,
            submission=record.signed,
        )
        self._config_frame = self.frame(config_msg)
        state, reason = "done", ""
        try:
            self.link.clear_retained("fleet/control")
            self.link.publish("fleet/config", self._config_frame, retain=True)
            if self.plan is None:
                self._bootstrap()
            else:
                self._wait(lambda: self.keys.ready or self.keys.key_id is not None, self.join_timeout)
                for a in self.plan.cluster_of:
                    self._assign(a)
                    self.send(f"agents/{a}/inbox", Notice(run_id=self.run_id, kind="resend-metrics"))
            self.book.set(record, state="running")
            self._publish_board()
            for r in range(self.completed + 1, self.config.rounds + 1):
                self._start_round(r)
                while not all(cr.phase == "done" for cr in self.clusters.values()):
                    self._check_cancelled()
                    self.pump(0.2)
                    self.guard("round step", self._advance)
                self.guard(f"closing round {r}", lambda: self._finish_round(r))
                if self.progress:
                    self.progress("round", r, self.config.rounds)
                failure = round_failure(self.records[-1]) if self.records and self.records[-1]["round"] == r else None
                if failure is not None:
                    raise JobFailed(failure)
            self._wait_final_metrics()
            self.send("fleet/control", Notice(run_id=self.run_id, kind="done"), retain=True)
        except JobCancelled:
            state, reason = "cancelled", "cancelled by the operator"
            self.send("fleet/control", Notice(run_id=self.run_id, kind="cancelled", reason=reason), retain=True)
        except JobFailed as exc:
            state, reason = "failed", str(exc)
            self.failed_jobs.append(record.id)
            self.send("fleet/control", Notice(run_id=self.run_id, kind="cancelled", reason=reason), retain=True)
        except ConfigError as exc:
            if self.once:
                raise
            state, reason = "failed", str(exc)
            self.send("fleet/control", Notice(run_id=self.run_id, kind="cancelled", reason=reason), retain=True)
        finally:
            if self.stopping.is_set() and state == "done" and self.completed < self.config.rounds:
                state = "running"  # SIGTERM: the job resumes when the coordinator is back
        self.link.clear_retained("fleet/config")  # devices that join now wait for the next job
        report = None
        if self.plan is not None and state != "running":
            report = self.report().model_copy(update={"state": state, "reason": reason})
            if self.job_out is not None:
                write_atomic(self.job_out / "report.json", json.dumps(report.model_dump(mode="json"), indent=2), mode=0o644)
                self.book.set(record, out=str(self.job_out))
        final = report.final_metric if report is not None else None
        self.book.set(record, state=state, reason=reason, metric=final if final is not None else record.metric,
                      accuracy=report.final_accuracy if report is not None and report.final_accuracy is not None
                      else record.accuracy, finished_at=time.time() if state != "running" else None)
        if state != "running":
            where = f"; report {self.job_out / 'report.json'}" if self.job_out is not None and report is not None else ""
            self._event(f"job {record.id} {state}" + (f": {reason}" if reason else "")
                        + (f"; {metric_line(report.model_dump())}" if report is not None and report.rounds else "") + where)
            self._clear_checkpoint()
        self.cancelled.discard(record.id)
        self.job = None

    def _clear_checkpoint(self) -> None:
        self.checkpoints.clear()

    def _wait_final_metrics(self, timeout: float = 30.0) -> None:
        """Give agents a moment to report their accuracy on the final models."""
        assert self.plan is not None
        last = self.config.rounds
        updated = {k for k, r in self.model_round.items() if r == last}
        want = {a for a, k in self.plan.cluster_of.items() if k in updated and self._online(a)}
        self.wait_until(lambda: all((a, last) in self.metrics for a in want), timeout)
