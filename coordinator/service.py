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
announced again). The job's state (:class:`coordinator.state.JobState`) is saved in the
store (:mod:`coordinator.store`) after the bootstrap, every admission, and at the start and
end of every round, so a restarted coordinator resumes.

This module wires the parts to MQTT: each handler checks the sender, hands the message to a
part (:mod:`coordinator.accept` decides an update's fate; the state, :mod:`coordinator.rounds`,
:mod:`coordinator.keylink` and :mod:`coordinator.roster` keep and change the job) and sends
what the part asks for. The round's steps are the simulator's (:mod:`senseshield.rounds`),
so a run gives the simulator's result for the same config and seed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from coordinator import roster
from coordinator.accept import (
    DUPLICATE, FOLD, LATE, REFUSED, SPARE, Late, accept_decline, accept_failure, accept_metrics, accept_update,
    accept_vector, cluster_round_of,
)
from coordinator.contributions import UpdateCodec
from coordinator.drill import Drill
from coordinator.jobs import JobBook, JobRecord
from coordinator.keylink import KeyLink
from coordinator.metrics import METRICS_PORT_ENV, CoordinatorMetrics  # noqa: F401 (re-exported)
from coordinator.report import FleetReport, report, report_json, round_failure, round_line, straggling_now  # noqa: F401
from coordinator.rounds import Closed, advance, check_facts
from coordinator.sites import accept_partial, fold_partial
from coordinator.stall import STALL_S, StallWatch, progress_mark, waiting_for
from coordinator.state import JobState, take_up
from coordinator.store import MemoryStore, SqliteStore, Store
from senseshield.errors import ConfigError, ProtocolError
from senseshield.job import Job, check_job, initial_model, job_from_dict, job_shape
from senseshield.processes import release_memory
from senseshield.results import metric_line
from senseshield.runtime.files import npy_bytes, write_atomic, write_json_atomic
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.metrics import metrics_port as live_port
from senseshield.runtime.protocol.envelope import DEFAULT_MAX_FRAME_BYTES
from senseshield.runtime.protocol.messages import (
    Ack, AggregateResult, Assignment, BootstrapVector, ClusterModel, Decline, FleetConfig, Hello, JobBoard, JobCancel,
    JobReply, JobSubmit, MaskDecision, Metrics, Notice, Proposal, PublicKeyAnnouncement, RoundFailure, Status,
    SitePartial, UpdateMessage, pack_mask, unpack_mask,
)
from senseshield.runtime.service import Inbound, Service, Stopped, check_sender, writable_dir

log = logging.getLogger("senseshield.coordinator")

Progress = Callable[[str, int, int], None]


class JobCancelled(Exception):
    """The running job was cancelled (``job cancel``)."""


class JobFailed(Exception):
    """The running job cannot go on: a round in which no device delivered an update and
    devices said their round failed (the sentence names them and why)."""


def check_operator(trust: Trust, item: Inbound) -> None:
    """Jobs come from operators only (the trust file's role; the signature was checked)."""
    if trust.role(item.sender) != "operator":
        raise ProtocolError(f"{item.message.schema_name!r} from {item.sender!r}, which is not an operator of this fleet.")


def preload(service: Service) -> None:
    """What running a job needs, loaded once the coordinator is online (its first line and
    status come before), so that a job's start and rounds do not wait for imports: torch
    (the job's initial model), scikit-learn (clustering) and Opacus' accountant (DP
    figures). A stop meanwhile ends the loading at once."""
    if service.stopping.is_set():  # stopped while connecting or saying it is online
        return
    service.abandon_work = True
    try:
        import opacus.accountants  # noqa: F401
        import sklearn.cluster  # noqa: F401
        import sklearn.metrics  # noqa: F401
        import torch  # noqa: F401
    except Stopped:
        pass
    finally:
        service.abandon_work = False


class Coordinator(Service):
    """``coordinator serve``: see the module docstring."""

    STALL_S = STALL_S
    """A running job that has not progressed for this long says what it waits for (tick)."""

    SUBSCRIPTIONS = [
        "keys/public", "keyserver/results", "clusters/+/model", "fleet/config", "jobs/submit", "jobs/cancel",
        "agents/+/hello", "agents/+/decline", "agents/+/status", "agents/+/bootstrap", "agents/+/proposal",
        "agents/+/update", "agents/+/metrics", "agents/+/failure", "sites/+/partial",
    ]

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
        kill_at_message: list[int] | tuple[int, ...] = (),
        store: Store | None = None,
    ) -> None:
        """A long-running coordinator: jobs come from ``submit`` (``--job``) or ``jobs/submit``.

        ``once``: run the queued jobs, then return (``fleet up``); their reports go straight
        into ``out_dir``, else into ``out_dir/jobs/<id>/``. ``join_timeout``: with ``once``,
        how long a job may wait for its devices (None: forever). ``round_deadline``
        overrides every job's. ``join_grace``: once a job has its minimum of devices, how
        long it still waits for devices that said hello but are still bootstrapping.
        ``store``: where the job book and the running job's state are kept (default: a
        :class:`~coordinator.store.SqliteStore` in ``state_dir``, else in memory).
        ``kill_before_close``, ``kill_at_message``: fault drills (:mod:`coordinator.drill`).
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
        self.drill = Drill(self.state_dir, fleet, kill_before_close=kill_before_close, kill_at_message=kill_at_message,
                           log=log)
        if self.drill.counts:
            self.after_message = self.drill.message_handled
        if store is None:
            store = SqliteStore.open(self.state_dir, fleet, log) if self.state_dir is not None else MemoryStore()
        self.store = store
        self.book = JobBook(store)
        self.job: JobRecord | None = None  # the job running (or waiting for devices)
        self.state: JobState | None = None  # its state (kept after it ends, until the next job)
        self.job_out: Path | None = None  # where its report and models go
        self.config_frame: bytes | None = None  # its fleet/config frame (re-published after a reconnect)
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
            SitePartial: self._on_partial,
            Metrics: self._on_metrics,
            AggregateResult: self._on_result,
            ClusterModel: self._on_model,
            FleetConfig: self._on_foreign_config,
            JobSubmit: self._on_request,
            JobCancel: self._on_request,
        }.items():
            self.on(cls, handler)
        self.watch("keyserver", lambda online: online and self._resend_requests("the key server is back online"))
        self.stall = StallWatch(self.STALL_S)  # when a job's lack of progress is said (tick)
        # no job yet: announcements and verdicts are not for us
        self.keys = KeyLink("", None, sign=lambda message, r, **kw: self.frame(message, round=r, **kw),
                            publish=lambda frame: self.link.publish("keyserver/requests", frame), log=self.log)

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

    def _on_request(self, item: Inbound) -> None:
        """An operator's ``jobs/submit`` or ``jobs/cancel``, answered on ``jobs/replies/<id>``
        (a repeated request, whose answer the operator did not hear, gets the same answer)."""
        msg: JobSubmit | JobCancel = item.message  # type: ignore[assignment]
        check_operator(self.trust, item)
        reply = self.replies.get(msg.request_id)
        if reply is None and isinstance(msg, JobCancel):
            record, reason = self.book.cancel(msg.job_id)
            if record is not None and record.state != "cancelled":
                self.cancelled.add(record.id)  # the running job's loop stops at its next step
            reply = JobReply(request_id=msg.request_id, accepted=record is not None,
                             job_id=record.id if record is not None else "", reason=reason)
            if record is not None:
                self._publish_board()
        elif reply is None:
            try:
                record = self.submit(job_from_dict(msg.job, where="job"), msg.nonce or None, signed=item.frame.raw,
                                     operator=item.sender)
                reply = JobReply(request_id=msg.request_id, accepted=True, job_id=record.id)
            except ConfigError as exc:
                self.log.warning("job refused: %s", exc)
                reply = JobReply(request_id=msg.request_id, accepted=False, reason=str(exc))
        self.replies[reply.request_id] = reply
        while len(self.replies) > 1000:  # the oldest answers go
            self.replies.pop(next(iter(self.replies)))
        self.send(f"jobs/replies/{reply.request_id}", reply)

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
        """The job's state for ``record``: the one saved in the store if the job was running
        with this configuration, else a fresh one; its key link and fleet/config frame."""
        from senseshield.training import layout_of

        config = record.spec
        input_shape, num_classes = job_shape(config)
        model, initial = initial_model(config, input_shape, num_classes)
        state = JobState(record.id, config, layout_of(model).size, list(input_shape), num_classes,
                         round_deadline=self.deadline_override or config.round_deadline)
        state = take_up(state, self.store.load_state(record.id), round_deadline=self.deadline_override,
                        where=self.store.where, log=self.log)
        self.keys = self.keys.for_job(record.id, state.scheme)  # (the strategy and scheme build here)
        state.metric_name  # noqa: B018 - the job's task: a ConfigError here fails the job before it starts
        self.job, self.state = record, state
        self.job_out = (self.out_dir if self.once else self.out_dir / "jobs" / record.id) if self.out_dir is not None else None
        self.config_frame = self.frame(FleetConfig(
            run_id=record.id, config=config.model_dump(mode="json"), input_shape=state.input_shape,
            num_classes=num_classes, round_deadline=state.round_deadline, initial=initial, submission=record.signed))

    def _checkpoint(self) -> None:
        """Save the job's state (once its fleet is planned: before, a restart bootstraps anew)."""
        if self.state is not None and self.state.plan is not None:
            self.store.save_state(self.state)
            release_memory()  # a round's notes, receipts and the checkpoint's encoding are gone

    # ---- registry -----------------------------------------------------------------------
    def _on_key(self, item: Inbound) -> None:
        if self.job is None:
            if item.sender != "keyserver":
                raise ProtocolError(f"keys/public from {item.sender!r}; only the key server may announce keys.")
            return
        if not self.keys.on_key(item.sender, item.message):  # type: ignore[arg-type]
            return
        for agent_id, info in list(self.state.agents.items()):
            self._check_key(agent_id, info.hello)
        self._resend_requests("the key server announced its key")  # e.g. it restarted

    def _resend_requests(self, why: str) -> None:
        """Re-send the round's plan and every aggregate request still waiting for its verdict."""
        s = self.state
        if s is None:
            return
        if s.round_open is not None and s.round >= 1:
            self.send("keyserver/rounds", s.round_open, round=s.round)
        self.keys.resend(s.clusters, s.round, why)

    def _check_key(self, agent_id: str, hello: Hello) -> bool:
        reason = roster.key_refusal(agent_id, hello, self.keys.key_id)
        if reason is None:
            return True
        self.log.warning(reason)
        self.state.refused[agent_id] = reason
        self.state.agents.pop(agent_id, None)
        self.send(f"agents/{agent_id}/inbox", Notice(run_id=self.state.run_id, kind="refused", reason=reason))
        return False

    def _on_hello(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Hello = item.message  # type: ignore[assignment]
        self.devices[agent_id] = True
        if self.metrics_server is not None:
            self.metrics_server.device(agent_id, True)
        s = self.state
        if self.job is None or msg.run_id != s.run_id:
            return  # the agent saw an older run's retained config; it will say hello again
        if msg.agent_id != agent_id:
            raise ProtocolError(f"Hello on {item.suffix!r} names agent {msg.agent_id!r}.")
        if not self._check_key(agent_id, msg):
            return
        s.declined.pop(agent_id, None)
        joined = roster.greet(s.agents, agent_id, msg, planned=s.plan is not None)
        if self.metrics_server is not None:
            self.metrics_server.joined_job(len(s.agents))
        s.uplink(agent_id, item.received, item.frame.sent_at)
        if joined:
            late = " (after the bootstrap: it takes part from the next round)" if s.plan is not None else ""
            self.log.info("agent %s joined (%d/%d): %d samples, %.1f MB/s, cpu %.1f%s",
                          agent_id, len(s.agents), s.config.min_devices, msg.n_samples, msg.bandwidth,
                          msg.cpu_speed, late)
            if s.plan is not None:
                self._admit(agent_id)
        self._ack_ready(agent_id)
        if s.plan is not None and agent_id in s.plan.cluster_of:  # a re-sent hello: repeat the assignment
            self._assign(agent_id)
            # and the round in flight: after a broker restart the coordinator may have re-sent
            # its plans before this agent was subscribed again, so they never reached it
            for k, cr in s.clusters.items():
                if cr.phase in ("proposals", "updates") and agent_id in cr.members and agent_id not in cr.updates:
                    self.log.info("round %d cluster %d: %s said hello again; re-sending its plan", s.round, k, agent_id)
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
        info = self.state.agents.get(agent_id) if self.state is not None else None
        if info is not None and info.online != msg.online:
            info.online = msg.online
            self.log.info("agent %s is %s", agent_id, "online" if msg.online else "offline")
            for cr in self.state.clusters.values():
                if msg.online:
                    cr.offline.discard(agent_id)
                elif agent_id in cr.members:
                    cr.offline.add(agent_id)
            self._advance()  # a round waiting only for agents now offline closes now

    def _on_bootstrap(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        if accept_vector(self.state, agent_id, item.message.sensitivity):  # type: ignore[attr-defined]
            self._admit(agent_id)
        self._ack_ready(agent_id)

    def _ack_ready(self, agent_id: str) -> None:
        """Tell a device that its hello (and bootstrap vector, if the job needs one) is in:
        it stops re-sending them (every repeat is acknowledged again)."""
        s = self.state
        if roster.ready(s.agents, agent_id, needs_vector=s.strategy.needs_bootstrap_sensitivity):
            self._ack(agent_id, "hello")

    def _ack(self, agent_id: str, of: str, r: int = 0, reason: str = "") -> None:
        """An :class:`Ack` to ``agent_id`` (not waited for: one per device, a fleet's worth)."""
        if self.state is not None:
            self.send(f"agents/{agent_id}/inbox", Ack(run_id=self.state.run_id, of=of, reason=reason[:2000]),
                      round=r, wait=False)

    def _on_decline(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Decline = item.message  # type: ignore[assignment]
        if not accept_decline(self.state if self.job is not None else None, msg, agent_id=agent_id):
            return
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
        try:
            if not accept_failure(self.state if self.job is not None else None, msg, agent_id=agent_id, r=r):
                return  # said once
        except Late as late:
            self._late(late)
            raise
        if msg.phase == "round":
            self.state.idle(agent_id)  # a buffered job plans it afresh
        if self.metrics_server is not None:
            self.metrics_server.failure(agent_id, r, msg.phase)
        what = "its round" if msg.phase == "round" else "evaluating the model of the round"
        self.log.warning("round %d: agent %s failed %s: %s", r, agent_id, what, msg.reason)
        self.book.event(self.job, f"round {r}: {agent_id} failed {what}: {msg.reason}")
        self._publish_board()
        self._advance()

    def _admit(self, agent_id: str) -> None:
        """A device that joined after the bootstrap (JobState.admit): planned into a cluster
        once ready; it takes part from the next round."""
        s = self.state
        assign = s.admit(agent_id, block_size=self.keys.block_size)
        if assign is None:
            return
        for a in assign:
            self._assign(a)
        self._event(f"agent {agent_id} admitted to cluster {s.plan.cluster_of[agent_id]} with budget "
                    f"{s.plan.budget_of[agent_id]:.3f}; it takes part from round {s.round + 1}")
        self._checkpoint()

    def _on_foreign_config(self, item: Inbound) -> None:
        msg: FleetConfig = item.message  # type: ignore[assignment]
        if msg.run_id != (self.state.run_id if self.state is not None else ""):
            self.log.warning("another coordinator published run %s on this fleet", msg.run_id)

    # ---- bootstrap ----------------------------------------------------------------------
    def _bootstrap(self) -> None:
        """Wait for the key and for ``min_devices`` ready devices (hello and, if the strategy
        needs it, the bootstrap vector), then for a grace period while devices that said
        hello are still bootstrapping; then plan the fleet (clusters, budgets)."""
        s = self.state
        t = time.time()
        timeout = self.join_timeout
        end = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if end is None else max(end - time.monotonic(), 0.0)  # noqa: E731
        if not self._wait(lambda: self.keys.ready, left()):
            raise ConfigError(f"No public key from the key server within {timeout:g} s; is `keyserver serve` running for fleet {self.fleet!r}?")
        need = s.config.min_devices
        count = lambda: (len(s.ready_agents()), len(s.declined))  # noqa: E731
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
                settled = n == len(s.agents) or time.monotonic() - enough_at >= self.join_grace
                if settled:
                    break
            if end is not None and time.monotonic() >= end:
                break
            self.pump(0.2)
        ids = s.ready_agents()
        if len(ids) < need:
            raise ConfigError(f"{len(ids)} of the {need} devices job {self.job.id} needs joined fleet {self.fleet!r} within {timeout:g} s.")
        s.bootstrap(ids, block_size=self.keys.block_size)
        for a in ids:
            self._assign(a)
        s.bootstrap_seconds = time.time() - t
        self._event(f"bootstrap: {len(ids)} devices in {len(s.plan.clusters)} cluster(s) "
                    f"{ {k: s.plan.members(k) for k in s.plan.clusters} }")
        self._checkpoint()

    def _assign(self, agent_id: str) -> None:
        plan = self.state.plan
        self.send(f"agents/{agent_id}/inbox", Assignment(
            cluster=plan.cluster_of[agent_id], encryption_budget=plan.budget_of[agent_id]), wait=False)

    # ---- rounds -------------------------------------------------------------------------
    def _start_round(self, r: int) -> None:
        """Round ``r`` (JobState.open_round: who is sampled, budgets, partial work), saved as
        in flight; its plan pinned at the key server, then each member's round plan."""
        s = self.state
        s.open_round(r, block_size=self.keys.block_size, now=time.time(), log=self.log)
        self._checkpoint()
        self.send("keyserver/rounds", s.open_clusters(now=time.time()), round=r)
        for k, cr in s.clusters.items():
            for a in cr.members:
                # one frame per device: do not wait for each acknowledgement (N round trips)
                self.send(f"agents/{a}/inbox", s.round_plan(k, a, block_size=self.keys.block_size), round=r, wait=False)
                s.plan_sent(a, k, r, time.time())
        if self.metrics_server is not None:
            self.metrics_server.round_started(r, s.plan.cluster_of, s.plan.budget_of)

    def _on_proposal(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Proposal = item.message  # type: ignore[assignment]
        s = self.state
        check_facts(s.plan if s else None, s.agents if s else {}, s.size if s else 0, agent_id, "Proposal",
                    cluster=msg.cluster, size=msg.size)
        try:
            cr = cluster_round_of(s, agent_id, item.round, "proposal")
        except Late as late:
            self._late(late)
            raise
        if cr.phase != "proposals":
            self._late(Late("", agent=agent_id, r=item.round, what="proposal", when=item.received))
            return
        cr.proposals[agent_id] = unpack_mask(msg.proposal, s.size)
        self._advance()

    def _on_update(self, item: Inbound) -> None:
        """An update: coordinator.accept decides (everything is checked before the update
        touches the round), then the outcome is applied."""
        agent_id, s = check_sender(item), self.state
        try:
            out = accept_update(s, item.message, agent_id=agent_id, r=item.round, nbytes=item.nbytes,  # type: ignore[arg-type]
                                trust=self.trust, public=self.keys.public)
        except Late as late:
            self._late(late)
            self._ack(agent_id, "update", item.round, str(late))
            s.idle(agent_id)
            raise
        except ProtocolError as exc:  # the device is told why; it does not send it again
            if s is not None and agent_id in s.agents:
                self._ack(agent_id, "update", item.round, str(exc))
            raise
        k, cr, r = out.k, out.cr, item.round
        if out.kind in (REFUSED, LATE, FOLD):
            s.idle(agent_id)  # its work is over (a buffered job plans it afresh)
        self._ack(agent_id, "update", r, out.reason if out.kind == REFUSED else
                  f"round {r} closed before it arrived (late)" if out.kind == LATE else "")
        make = lambda: s.new_aggregate(k, r, self.keys.public)  # noqa: E731
        if self.keys.verifiable and cr.book.codec is None:  # kept until the verdict: on disk, not in memory
            cr.book.codec = UpdateCodec(self.keys.public, s.size)
        if out.kind == REFUSED:  # named in the report's refused, not waited for; the round goes on
            s.refused[agent_id] = out.reason
            cr.expected.discard(agent_id)
            self._advance()
            raise ProtocolError(out.reason)
        if out.kind == SPARE:  # kept aside, in case the key server finds the first one at fault
            self.log.warning("round %d: a second, different update from %s kept aside", r, agent_id)
            cr.book.spare(agent_id, out.update, out.note)
            self.keys.on_spare(k, cr, r=r, make=make)
        elif out.kind == LATE:
            self._late(Late("", agent=agent_id, r=r, what="update", when=item.received))
        elif out.kind == FOLD:
            cr.fold(agent_id, out.update, out.note, make=make, keep=self.keys.verifiable)
            s.agent_rounds[agent_id][r]["update_received"] = item.received
            self._advance()
        else:
            assert out.kind == DUPLICATE  # a re-sent duplicate: nothing to do

    def _on_partial(self, item: Inbound) -> None:
        """A site aggregator's partial sum (coordinator.sites): accepted like the updates it
        folds, then folded into the cluster's running aggregate."""
        s, msg = self.state, item.message
        if item.suffix != f"sites/{getattr(msg, 'site', '')}/partial":
            raise ProtocolError(f"A partial sum of site {getattr(msg, 'site', '')!r} on {item.suffix!r}.")
        out = accept_partial(s, msg, sender=item.sender, r=item.round, trust=self.trust,  # type: ignore[arg-type]
                             public=self.keys.public)
        if out.kind == "duplicate":
            for a in out.contributors:
                self._ack(a, "update", item.round)
            return
        k, r = out.k, item.round
        fold_partial(out.cr, msg.site, out, make=lambda: s.new_aggregate(k, r, self.keys.public),  # type: ignore[union-attr]
                     keep=self.keys.verifiable)
        for a in out.contributors:
            s.agent_rounds[a][r]["update_received"] = item.received
            self._ack(a, "update", r)
        self.log.info("round %d cluster %d: site %s folded %d update(s)", r, k, msg.site, len(out.contributors))
        self._advance()

    def _late(self, late: Late) -> None:
        """A message of a part of a round that closed: dropped, noted as straggling."""
        self.log.warning("round %d: late %s from %s dropped (straggling)", late.r, late.what, late.agent)
        if self.metrics_server is not None:
            self.metrics_server.late(late.agent, late.r, late.what)
        self.state.mark_late(late.agent, late.r, late.when)

    def _advance(self) -> None:
        """Close what is due in the round's clusters (coordinator.rounds.advance): mask
        decisions to the proposers, aggregates to the key server; give up on requests an
        online key server left unanswered."""
        s = self.state
        if s is None:
            return
        now = time.time()
        advance(s.clusters, r=s.round, now=now, round_deadline=s.round_deadline, straggling=s.straggling,
                consensus=lambda proposals: s.strategy.consensus(proposals, size=s.size,
                                                                 block_size=self.keys.block_size),
                online=s.online, then=self._closed, log=self.log)
        for k, cr in s.clusters.items():
            self.keys.expire(cr, r=s.round, now=now)
            if self.keys.give_up(cr, now=now, patience=s.round_deadline + 60,
                                 keyserver_online=self.peer_online("keyserver")):
                self.log.warning("round %d cluster %d: %s", s.round, k, cr.reason)

    def _closed(self, closed: Closed) -> None:
        s = self.state
        if closed.decision is not None:
            proposers, shared = closed.decision
            decision = MaskDecision(cluster=closed.k, size=s.size, shared_mask=pack_mask(shared))
            s.clusters[closed.k].decision = decision  # kept to re-send (a reconnect, a repeated hello)
            for a in proposers:
                self.send(f"agents/{a}/inbox", decision, round=s.round, wait=False)
        if closed.aggregate is not None:
            self.keys.request(s.clusters[closed.k], closed.aggregate, closed.started, r=s.round)

    def _on_result(self, item: Inbound) -> None:
        msg: AggregateResult = item.message  # type: ignore[assignment]
        s = self.state
        if item.sender == "keyserver" and (s is None or msg.run_id != s.run_id or item.round != s.round):
            return  # an answer to an earlier (re-sent) request
        r = s.round if s is not None else 0
        if self.keys.on_result(item.sender, msg, s.clusters.get(msg.cluster) if s is not None else None, r=r,
                               received=item.received, make=lambda: s.new_aggregate(msg.cluster, r, self.keys.public)):
            s.model_round[msg.cluster] = r

    def _on_model(self, item: Inbound) -> None:
        """A cluster model the key server announced: saved to ``OUT/.../models/`` when new."""
        msg: ClusterModel = item.message  # type: ignore[assignment]
        s = self.state
        if not self.keys.on_model(item.sender, msg, r=item.round, nbytes=item.nbytes, size=s.size if s else 0,
                                  clusters=list(s.plan.clusters) if s is not None and s.plan is not None else [],
                                  current_round=s.round if s else 0):
            return
        cr = s.clusters.get(msg.cluster)
        if cr is not None and item.round == s.round:
            cr.timestamps.setdefault("model_at", item.received)
        if self.job_out is not None:
            write_atomic(self.job_out / "models" / f"round-{item.round}" / f"cluster-{msg.cluster}.npy",
                         npy_bytes(msg.weights.astype(np.float64)))

    def _on_metrics(self, item: Inbound) -> None:
        agent_id = check_sender(item)
        msg: Metrics = item.message  # type: ignore[assignment]
        s = self.state
        if not accept_metrics(s, msg, agent_id=agent_id, r=item.round, announced=self.keys.model_round(msg.cluster)):
            return  # the first report of a round stands (agents repeat theirs after a restart)
        s.uplink(agent_id, item.received, item.frame.sent_at)
        if self.metrics_server is not None:
            self.metrics_server.agent_round(agent_id, item.round, msg.timings)
            figures = straggling_now(s)  # the latest round whose metrics are all in
            if figures is not None:
                self.metrics_server.straggling(*figures)

    # ---- a job that does not progress says why (coordinator.stall) ---------------------
    def tick(self) -> None:
        """Once the running job has not progressed for ``stall.after`` s, say what it waits
        for, in the log and as a job event (``job status``/``logs``, the board)."""
        s = self.state
        if self.job is None or s is None:
            self.stall.reset()
            return
        stalled = self.stall.check(lambda: progress_mark(s, self.keys.ready))
        if stalled is None:
            return
        if stalled == 0.0:
            if self.metrics_server is not None:
                self.metrics_server.stalled(0.0, "")
            return
        waiting = self.waiting_for()
        line = f"no progress for {stalled:.0f} s: {waiting}"
        self.log.warning("%s", line)
        self.book.event(self.job, line)
        self._publish_board()
        if self.metrics_server is not None:
            self.metrics_server.stalled(stalled, waiting)

    def waiting_for(self) -> str:
        """What the running job waits for now, in one sentence (coordinator.stall.waiting_for)."""
        return waiting_for(self.state if self.job is not None else None, key_ready=self.keys.ready,
                           link_up=self.link.connected, keyserver_online=self.peer_online("keyserver"))

    def on_reconnect(self) -> None:
        """The broker may have lost in-flight messages: re-send the round's pending parts."""
        if self.config_frame is not None:
            self.link.publish("fleet/config", self.config_frame, retain=True)
        s = self.state
        if s is None or s.plan is None:
            return
        for a in s.plan.cluster_of:
            self._assign(a)
        for k, cr in s.clusters.items():
            if cr.phase in ("proposals", "updates"):
                if cr.offline:
                    # a broker going down sends the last will of every client still connected
                    # (Mosquitto does), so a will heard before the reconnect may be of a live
                    # device that is reconnecting too: wait for it again, until it sends or
                    # the deadline (its status, if it is back, arrives on the new connection)
                    self.log.info("round %d cluster %d: waiting again for %s (their last will came with the "
                                  "broker's loss)", s.round, k, sorted(cr.offline))
                    cr.offline.clear()
                pending = [a for a in cr.members if a not in cr.updates]
                self.log.info("round %d cluster %d: re-sending plans to %s", s.round, k, pending)
                self._resend_plans(k, pending)
        self._resend_requests("reconnected")

    def _resend_plans(self, k: int, agents: list[str]) -> None:
        """Round plans (and the consensus mask, once there is one) again to ``agents`` of
        cluster ``k``: the plan is rebuilt exactly (same deadline, same everything), and an
        agent that already sent its update answers a repeated plan by re-sending it."""
        s = self.state
        cr = s.clusters[k]
        for a in agents:
            self.send(f"agents/{a}/inbox", s.round_plan(k, a, block_size=self.keys.block_size), round=s.round,
                      wait=False)
            if cr.decision is not None and a in cr.proposals:
                self.send(f"agents/{a}/inbox", cr.decision, round=s.round, wait=False)

    def _finish_round(self, r: int) -> None:
        """Round ``r`` has every verdict: its record (JobState.close_round), saved; the
        operator's line, the job list's metric column and round, the Prometheus figures."""
        s = self.state
        restarted = bool((s.in_flight or {}).get("restarted_at"))
        self.drill.before_close(r, restarted=restarted)
        record = s.close_round(r, model_bytes=self.keys.model_bytes or s.size * 4, now=time.time())
        self._checkpoint()
        if restarted:  # what devices reported of this round before the restart was lost or refused
            for a in s.plan.cluster_of:
                self.send(f"agents/{a}/inbox", Notice(run_id=s.run_id, kind="resend-metrics"))
        line, value = round_line(record, rounds=s.config.rounds, out=len(s.plan.cluster_of) - len(s.sampled),
                                 metrics=s.metrics, metric_name=s.metric_name)
        self._event(line)
        if value is not None:  # the job list's metric column
            self.book.set(self.job, metric_name=s.metric_name, metric=value,
                          accuracy=value if s.metric_name == "accuracy" else None)
        self.book.set(self.job, round=r, devices=len(s.active))
        if self.metrics_server is not None:
            self.metrics_server.round_done(
                r, record, agents={a: rr[r] for a, rr in s.agent_rounds.items() if r in rr},
                straggling=s.straggling, online=sum(i.online for i in s.agents.values()), joined=len(s.agents))

    # ---- main ---------------------------------------------------------------------------
    def serve(self) -> None:
        """Take jobs one at a time, in submission order, until SIGTERM (``once``: until the
        queue is empty). A job that fails or is cancelled does not stop the coordinator."""
        self.start(self.SUBSCRIPTIONS)
        try:
            preload(self)
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
            self.store.close()

    run = serve  # the name before jobs

    def _run_job(self, record: JobRecord) -> None:
        try:
            self._begin(record)
        except ConfigError as exc:  # e.g. the job's model no longer builds here
            self.book.set(record, state="failed", finished_at=time.time(), reason=str(exc))
            self.book.event(record, f"failed: {exc}")
            self._publish_board()
            return
        s = self.state
        resumed = s.plan is not None
        self.book.set(record, state="running" if resumed else "waiting", started_at=record.started_at or time.time())
        self._event(f"job {record.id} {'resumed after round ' + str(s.completed) if resumed else 'started'}: "
                    f"{s.config.label}")
        end, reason = "done", ""
        try:
            self.link.clear_retained("fleet/control")
            self.link.publish("fleet/config", self.config_frame, retain=True)
            if s.plan is None:
                self._bootstrap()
            else:
                self._wait(lambda: self.keys.ready or self.keys.key_id is not None, self.join_timeout)
                for a in s.plan.cluster_of:
                    self._assign(a)
                    self.send(f"agents/{a}/inbox", Notice(run_id=s.run_id, kind="resend-metrics"))
            self.book.set(record, state="running")
            self._publish_board()
            for r in range(s.completed + 1, s.config.rounds + 1):
                self._start_round(r)
                while not all(cr.phase == "done" for cr in s.clusters.values()):
                    self._check_cancelled()
                    self.pump(0.2)
                    self.guard("round step", self._advance)
                self.guard(f"closing round {r}", lambda: self._finish_round(r))
                if self.progress:
                    self.progress("round", r, s.config.rounds)
                failure = round_failure(s.records[-1]) if s.records and s.records[-1]["round"] == r else None
                if failure is not None:
                    raise JobFailed(failure)
            want = s.final_metrics_wanted()  # a moment for the devices' metrics of the final models
            self.wait_until(lambda: all((a, s.config.rounds) in s.metrics for a in want), 30.0)
            self.send("fleet/control", Notice(run_id=s.run_id, kind="done"), retain=True)
        except JobCancelled:
            end, reason = "cancelled", "cancelled by the operator"
            self.send("fleet/control", Notice(run_id=s.run_id, kind="cancelled", reason=reason), retain=True)
        except JobFailed as exc:
            end, reason = "failed", str(exc)
            self.failed_jobs.append(record.id)
            self.send("fleet/control", Notice(run_id=s.run_id, kind="cancelled", reason=reason), retain=True)
        except ConfigError as exc:
            if self.once:
                raise
            end, reason = "failed", str(exc)
            self.send("fleet/control", Notice(run_id=s.run_id, kind="cancelled", reason=reason), retain=True)
        finally:
            if self.stopping.is_set() and end == "done" and s.completed < s.config.rounds:
                end = "running"  # SIGTERM: the job resumes when the coordinator is back
        self.link.clear_retained("fleet/config")  # devices that join now wait for the next job
        result = None
        if s.plan is not None and end != "running":
            result = report(s, fleet=self.fleet, key_id=self.keys.key_id, rejected=self.rejected,
                            rejected_total=self.rejected_total).model_copy(update={"state": end, "reason": reason})
            if self.job_out is not None:
                write_json_atomic(self.job_out / "report.json", report_json(result), indent=2, mode=0o644)
                self.book.set(record, out=str(self.job_out))
        final = result.final_metric if result is not None else None
        self.book.set(record, state=end, reason=reason, metric=final if final is not None else record.metric,
                      accuracy=result.final_accuracy if result is not None and result.final_accuracy is not None
                      else record.accuracy, finished_at=time.time() if end != "running" else None)
        if end != "running":
            where = f"; report {self.job_out / 'report.json'}" if self.job_out is not None and result is not None else ""
            self._event(f"job {record.id} {end}" + (f": {reason}" if reason else "")
                        + (f"; {metric_line({k: getattr(result, k) for k in ('metric_name', 'final_metric', 'final_accuracy')})}"
                           if result is not None and result.rounds else "") + where)
            self.store.clear_state()
        self.cancelled.discard(record.id)
        self.job = None
