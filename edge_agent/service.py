"""The edge agent: one device's side of the round, over MQTT.

``edge-agent join``: connect, wait for the run (``fleet/config``) and the key server's
public key, load the local data, say hello with the device profile, send the bootstrap
vector, then for every round plan: start from the cluster model the plan names, train,
score, [propose and wait for the consensus mask], choose the mask, add DP noise, encrypt,
upload; on every new model of its cluster: merge its personalised zone, evaluate on its
local test split, report accuracy and phase timings. The steps are the simulator's
(:mod:`senseshield.rounds`), with the simulator's seeds, so a device computes what the
simulator computes for the client with the same index, except for its privacy noise: every
privacy draw comes from secret OS entropy (:mod:`senseshield.device_noise`), unless a
development-mode test hands the agent a replayable noise seed (``--dev-noise-seed``).

paho reconnects after a broker or network loss; the agent then says hello again and
re-sends its last update (the coordinator drops duplicates). A message the broker lost
while the link stayed up (a full queue) is re-sent too (docs/protocol.md, "Re-sending"):
the hello (and bootstrap vector) until the coordinator acknowledges it, the hello again
when the next round's plan is overdue (the coordinator answers with the plan), and the
update until it is acknowledged or its round's deadline passes; each on a backoff with
jitter (:class:`~senseshield.runtime.service.Backoff`), so a fleet does not repeat in step,
that starts at a share of the job's round deadline (:func:`repeat_delays`). A coordinator that comes back
online (restarted, perhaps before it saved the job's bootstrap) hears its hello again, and
its bootstrap vector until the agent has a cluster. SIGTERM ends it cleanly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Generator
from typing import TYPE_CHECKING

import numpy as np

from senseshield import defaults
from senseshield.errors import ConfigError, ProtocolError
from senseshield.device_noise import SECRET, DeviceNoise
from senseshield.he import SCHEMES, PublicKey
from senseshield.runtime.protocol.messages import (
    Ack,
    Decline,
    RoundFailure,
    Assignment,
    BootstrapVector,
    Challenge,
    ClusterModel,
    UpdateMessage,
    FleetConfig,
    Hello,
    MaskDecision,
    Metrics,
    Notice,
    Proposal,
    PublicKeyAnnouncement,
    RoundPlan,
    pack_mask,
    unpack_mask,
)
from senseshield.rounds import (
    ClientState,
    LocalData,
    client_bootstrap,
    fit_synthetic,
    merge_personal,
)
from senseshield.runtime.identity import SEALED_SEED_BYTES, Identity, Trust, b64, unb64
from senseshield.runtime.sites import SITE_PREFIX
from senseshield.runtime.service import Backoff, Inbound, Service, Stopped, WaitNote
from edge_agent.dataspec import DataSpec  # noqa: F401 (re-exported: edge_agent.cli, callers)
from edge_agent.costs import inference_latency, measure_costs, warm_inference
from edge_agent.evaluate import Applied, apply_and_evaluate, round_metrics
from edge_agent.prepare import PreparedRun, prepare
from edge_agent.padlog import ALREADY_SENT, PadLog, file_name, slot_of
from edge_agent.round import (
    DeviceRound,
    expected_noise,
    needs_fingerprint,
    pad_context,
    plan_refusal,
    receipt,
    round_key,
)
from senseshield.development import development_mode
from senseshield.runtime.jobsig import job_refusal, signed_initial
from senseshield.data.local import check_source
from senseshield.job import Job, announced_run

if TYPE_CHECKING:  # torch loads with the first job (_torch): an idle agent does not hold it
    import torch

log = logging.getLogger("senseshield.agent")

REPEATS = {"hello": (15.0, 120.0, 1 / 20), "plan": (30.0, 300.0, 1 / 10), "update": (20.0, 120.0, 1 / 10)}
"""What an agent re-sends and when (:func:`repeat_delays`): kind -> (first delay, most delay
apart, share of the job's round deadline). A hello not acknowledged is said again; a round
plan overdue (past the last round's deadline, or since the hello was acknowledged) is asked
for again with a hello; an update not acknowledged is sent again until its round's deadline."""


def repeat_delays(kind: str, round_deadline: float) -> tuple[float, float]:
    """(first delay, most delay apart) of the repeats of ``kind`` in a job whose round deadline
    is ``round_deadline`` s: at least the fixed floors of :data:`REPEATS`, and a share of the
    deadline, which the operator sizes to the fleet (a coordinator that takes a fleet of
    thousands needs longer to answer each device; repeating sooner only adds to its work)."""
    first, cap, share = REPEATS[kind]
    first = max(first, share * round_deadline)
    return first, max(cap, 4 * first)


def failure_sentence(exc: BaseException) -> str:
    """The one sentence a failed step of a round says: a user's mistake (:class:`ConfigError`)
    or a refused message (:class:`ProtocolError`) is already one; anything else is its type
    and message."""
    if isinstance(exc, (ConfigError, ProtocolError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


ROUND_START = ("plan_frame_sent_at", "plan_received_at", "wait_model", "ready_at")
"""A round's timings taken before its training (a carried round's work takes them along)."""


class AgentExit(Exception):
    """The agent stops: ``code`` 0 (run done) or 3 (refused by the coordinator)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class RunState:
    """What the agent knows about the current run."""

    run_id: str
    config: Job
    initial: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    index: int = 0
    data: LocalData | None = None
    model: torch.nn.Module | None = None
    client: ClientState = field(default_factory=ClientState)
    cluster: int | None = None
    budget: float | None = None
    models: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # cluster -> (round, w)
    evaluated: int = -1
    last_update: tuple[int, bytes] | None = None  # (round, frame) to re-send after a reconnect
    done_rounds: set[int] = field(default_factory=set)
    # a buffered job: the last work sent, (cluster, model round, round sent in, start model,
    # local update or None when it had a plaintext part), for a carried plan that crosses it
    last_work: tuple | None = None
    warmed: bool = False  # it trained once in this job (the slowdown drill skips torch's warm-up)
    timings: dict[int, dict[str, float]] = field(default_factory=dict)
    hello: Hello | None = None
    vector: np.ndarray | None = None  # the bootstrap vector sent (again to a restarted coordinator)
    sent_metrics: dict[int, Metrics] = field(default_factory=dict)
    inference: dict[str, float] = field(default_factory=dict)  # onnxruntime latency of the model
    partial: bool = False  # its last round plan cut its local steps (see EdgeAgent._evaluate_new_model)
    noise: tuple[float | None, float | None] | None = None  # the job's (user, record) sigma for this device


@dataclass
class Applying:
    """A model being applied and evaluated between rounds (:meth:`EdgeAgent._evaluate_new_model`)."""

    run: RunState
    r: int
    cluster: int
    steps: Generator[None, None, Applied]


class EdgeAgent(Service):
    """``edge-agent join``: see the module docstring."""

    def __init__(
        self,
        broker: str,
        *,
        fleet: str,
        agent_id: str,
        bandwidth: float,
        cpu_speed: float,
        profile: dict | None = None,
        data: DataSpec = DataSpec(),
        threads: int | None = None,
        protocol: str = "5",
        kill_at_round: int | None = None,
        fail_at_round: int | None = None,
        lose_plan_at_round: int | None = None,
        slowdown: float = 1.0,
        model_dir: Path | None = None,
        latency_repeats: int = 20,
        once: bool = False,
        device_class: str | None = None,
        labels: dict[str, str] | None = None,
        identity: Identity | None = None,
        trust: Trust | None = None,
        min_he_ratio: float = 0.0,
        require_he: bool = False,
        allow_plaintext: bool = False,
        noise: DeviceNoise = SECRET,
        allow_unsigned_jobs: bool = False,
        pad_log: Path | None = None,
    ) -> None:
        """``min_he_ratio``: in a job that encrypts, this agent encrypts at least this fraction
        of its parameters whatever budget the coordinator assigns (the budget is raised to it)
        and never sends an update that encrypts less, and declines jobs that encrypt nothing
        unless ``allow_plaintext`` (then it takes them with a warning); ``require_he``: decline
        jobs that encrypt nothing whatever the floor. ``once``: exit when the first job ends (``fleet up``); otherwise the agent stays
        connected and takes every job the coordinator runs. ``device_class`` and ``labels``
        are what a job's ``select`` matches. ``noise``: where this device's privacy draws come
        from (secret; a replayable seed only in development mode, see
        :func:`senseshield.device_noise.check_noise_seed`). ``allow_unsigned_jobs``: take jobs
        no operator signed (otherwise only in development mode or without a trust file).
        ``pad_log``: the file of the rounds this device has masked in (:mod:`edge_agent.padlog`;
        default: in ``model_dir``; ``edge-agent join`` keeps it beside the identity)."""
        if not agent_id or any(c in agent_id for c in "/+#"):
            raise ConfigError(f"Agent id {agent_id!r} is not allowed; use letters, digits, '-' or '_'.")
        if not 0.0 <= min_he_ratio <= 1.0:
            raise ConfigError(f"--min-he-ratio {min_he_ratio} is not allowed; give a fraction of the parameters in 0..1.")
        super().__init__(
            broker, fleet=fleet, client_id=agent_id, logger=log, protocol=protocol,
            status_topic=f"agents/{agent_id}/status", identity=identity, trust=trust, role="agent",
        )
        self.agent_id = agent_id
        self.noise = noise
        if not noise.secret:
            log.warning("privacy noise %s: the DP guarantees of this device's updates do not hold against "
                        "anyone who knows it (development mode)", noise.describe())
        self.min_he_ratio, self.require_he, self.allow_plaintext = float(min_he_ratio), require_he, allow_plaintext
        self.model_dir = Path(model_dir) if model_dir is not None else Path.home() / ".senseshield" / fleet / agent_id
        self.model_dir.mkdir(parents=True, exist_ok=True)
        # a device masks one vector per round of a job, ever (across cancels, jobs and restarts)
        self.pad_log = PadLog(pad_log if pad_log is not None else self.model_dir / file_name(agent_id))
        # every job config must be one an operator signed, unless told otherwise (as the key server)
        self.require_signed_jobs = not (allow_unsigned_jobs or development_mode() or self.trust.tofu)
        self.refused_configs: set[tuple[str, str]] = set()  # (run id, reason) already logged
        if model_dir is None:
            log.info("keeping this device's models in %s (--model-dir to change)", self.model_dir)
        self.once = once
        self.device_class = device_class or (profile or {}).get("board")
        self.labels = dict(labels or {})
        self.declined: set[str] = set()  # jobs this device said no to
        self.latency_repeats = latency_repeats
        self.kill_at_round = kill_at_round  # fault drills: SIGKILL itself when this round's plan arrives
        self.fail_at_round = fail_at_round  # ... or its training raises in this round
        self.lose_plan_at_round = lose_plan_at_round  # ... or it loses this round's first plan
        self.slowdown = slowdown  # ... or it trains this many times slower than the machine does
        self.bandwidth, self.cpu_speed = bandwidth, cpu_speed
        self.profile = profile or {}
        self.data_spec = data
        for name, source in sorted(data.sources.items()):  # a broken file stops the agent now, not at a job
            log.info("data %s: %s (%s)", name, source, check_source(source))
        self.threads = threads if threads is not None else defaults.shared_threads()
        self._torch_threads_set = False
        self.run: RunState | None = None
        self.pending_config: PreparedRun | None = None
        self.newest_plan = 0  # highest round a plan arrived for
        self.key: PublicKeyAnnouncement | None = None
        self.public: PublicKey | None = None
        self.plans: list[tuple[int, RoundPlan]] = []
        self.plan_sent_at: dict[int, float] = {}  # round -> the plan frame's sent_at (coordinator clock)
        self.plan_arrived_at: dict[int, float] = {}  # round -> when the plan arrived (this clock)
        self.decisions: dict[int, MaskDecision] = {}
        self.exit: AgentExit | None = None
        self.pool = None  # the public key's obfuscator pool, when its scheme has one
        self.applying: Applying | None = None  # a model applied between rounds, in steps
        for cls, handler in {
            FleetConfig: self._on_config,
            PublicKeyAnnouncement: self._on_key,
            Assignment: self._on_assignment,
            RoundPlan: self._on_plan,
            MaskDecision: self._on_decision,
            ClusterModel: self._on_model,
            Notice: self._on_notice,
            Challenge: self._on_challenge,
        }.items():
            self.on(cls, handler)
        # re-sending what the broker may have lost (tick): the hello until acknowledged, the
        # hello again while a round plan is overdue, the update until acknowledged
        self.hello_repeat = Backoff(*REPEATS["hello"][:2])  # re-timed for each job (_join)
        self.plan_repeat = Backoff(*REPEATS["plan"][:2])
        self.update_repeat = Backoff(*REPEATS["update"][:2])
        self.update_until = 0.0  # the deadline (time.time()) of the round of the update re-sent
        self.on(Ack, self._on_ack)
        self.seeds: dict[tuple[str, int], bytes] = {}  # (run, round) -> the key server's challenge seed
        self.plan_cluster: dict[tuple[str, int], int] = {}  # (run, round) -> the cluster of its first plan
        # says so in the log when it is gone, and keeps waiting; says hello again when it is back
        self.watch("coordinator", self._on_coordinator_status)

    # ---- handlers (they only record; the main loop acts) --------------------------------
    def _on_config(self, item: Inbound) -> None:
        if item.sender != "coordinator":
            raise ProtocolError(f"fleet/config from {item.sender!r}; only the coordinator may set it.")
        msg: FleetConfig = item.message
        announced_run(msg.config)  # a forged or broken config is rejected here
        # every config, whatever its run id: a config under a known run id must still be the
        # job an operator signed, with the nonce and initial model it signed
        refusal = job_refusal(msg.run_id, msg.config, msg.submission, self.trust, fleet=self.fleet,
                              required=self.require_signed_jobs, initial=msg.initial)
        if refusal is not None:
            if (msg.run_id, refusal) not in self.refused_configs:
                self.refused_configs.add((msg.run_id, refusal))
                self.log.error("not taking it: %s", refusal)
            return
        if self.run is not None and msg.run_id == self.run.run_id:
            return
        if msg.run_id in self.declined or (self.pending_config is not None and self.pending_config.msg.run_id == msg.run_id):
            return
        config, _, scheme = announced_run(msg.config)  # a forged or broken config is rejected here
        if scheme is None and (self.min_he_ratio > 0 or self.require_he) and msg.run_id not in self.declined:
            if self.require_he or not self.allow_plaintext:
                self.declined.add(msg.run_id)
                why = ("requires encryption (--require-he)" if self.require_he else
                       f"encrypts at least {self.min_he_ratio:g} of its parameters (--min-he-ratio; "
                       "--allow-plaintext takes such jobs)")
                reason = f"job {msg.run_id} ({config.strategy}) encrypts nothing and this device {why}"
                self.log.warning("not taking %s", reason)
                self.send(f"agents/{self.agent_id}/decline", Decline(run_id=msg.run_id, reason=reason, selected=True))
                return
            self.log.warning("job %s (%s) encrypts nothing: this device's updates leave it unencrypted "
                             "(--allow-plaintext)", msg.run_id, config.strategy)
        if self.run is not None:
            self.log.info("job %s replaces job %s", msg.run_id, self.run.run_id)
            self._leave_run()
        unselected = config.select.refusal(self.device_class, self.labels)
        try:
            if unselected is not None:
                raise ConfigError(unselected)
            self.pending_config = self._prepare(msg)
        except ConfigError as exc:  # this device cannot take the job: say so, wait for the next
            self.declined.add(msg.run_id)
            (self.log.warning if unselected is None else self.log.info)("not taking job %s: %s", msg.run_id, exc)
            self.send(f"agents/{self.agent_id}/decline",
                      Decline(run_id=msg.run_id, reason=str(exc)[:2000], selected=unselected is None))

    def _on_key(self, item: Inbound) -> None:
        if item.sender != "keyserver":
            raise ProtocolError(f"keys/public from {item.sender!r}; only the key server may announce keys.")
        msg: PublicKeyAnnouncement = item.message  # type: ignore[assignment]
        if msg.refused:  # the key server will not serve that job (the coordinator cancels it)
            self.log.warning("the key server refuses job %s: %s", msg.run_id, msg.refused)
            return
        if self.key is not None and msg.key_id == self.key.key_id:
            self.key = msg  # the same key (perhaps for the next job): keep the key object and its pool
            return
        public = SCHEMES.get(msg.scheme).public_key_from_bytes(msg.key) if msg.scheme else None
        if public is not None and public.key_id != msg.key_id:
            raise ProtocolError(f"The announced key id {msg.key_id!r} is not the key's id {public.key_id!r}.")
        self.key, self.public = msg, public

    def _inbox(self, item: Inbound) -> None:
        if item.suffix != f"agents/{self.agent_id}/inbox" or item.sender != "coordinator":
            raise ProtocolError(f"{item.message.schema_name!r} from {item.sender!r} on {item.suffix!r} is not for this agent.")

    def _on_assignment(self, item: Inbound) -> None:
        self._inbox(item)
        self.hello_repeat.disarm()  # the coordinator has it
        if self.run is not None:
            msg: Assignment = item.message
            if self.run.cluster != msg.cluster:
                self.link.subscribe(f"clusters/{msg.cluster}/model")
            self.run.cluster, self.run.budget = msg.cluster, msg.encryption_budget

    def _on_plan(self, item: Inbound) -> None:
        self._inbox(item)
        msg: RoundPlan = item.message
        if self.run is None:
            raise ProtocolError("A round plan arrived before the agent joined a run.")
        if msg.size != self.run.initial.size:
            raise ProtocolError(f"Round plan for {msg.size} parameters; the model has {self.run.initial.size}.")
        if item.round < 1 or msg.model_round >= item.round:
            raise ProtocolError(f"Round plan for round {item.round} starts from model round {msg.model_round}; "
                                "rounds start at 1 from an earlier model.")
        if item.round > self.run.config.rounds:  # one more sum than the operator signed for
            raise ProtocolError(f"Round plan for round {item.round}; job {self.run.run_id} has "
                                f"{self.run.config.rounds} rounds (the operator signed them).")
        if item.round < self.newest_plan:
            raise ProtocolError(f"Round plan for round {item.round}; round {self.newest_plan} has begun.")
        # one cluster per round: a second plan that moves this agent to another cluster would
        # let a coordinator put its contribution into two aggregates
        first = self.plan_cluster.setdefault((self.run.run_id, item.round), msg.cluster)
        if first != msg.cluster:
            raise ProtocolError(f"Round plan puts this agent in cluster {msg.cluster} in round {item.round}; "
                                f"an earlier plan of that round said cluster {first}.")
        if self.lose_plan_at_round == item.round:
            self.lose_plan_at_round = None
            self.log.warning("fault drill: dropping the plan of round %d and saying hello again", item.round)
            self.on_reconnect()
            return
        self.newest_plan = item.round
        self.hello_repeat.disarm()
        self.plan_repeat.disarm()
        self.plans.append((item.round, msg))
        self.plan_sent_at.setdefault(item.round, item.frame.sent_at)
        self.plan_arrived_at.setdefault(item.round, item.received)

    def _on_decision(self, item: Inbound) -> None:
        self._inbox(item)
        msg: MaskDecision = item.message  # type: ignore[assignment]
        if self.run is None or msg.size != self.run.initial.size:
            raise ProtocolError(f"Mask decision for {msg.size} parameters does not fit this agent's run.")
        self.decisions[item.round] = msg

    def _on_challenge(self, item: Inbound) -> None:
        """The round's challenge seed, sealed to this agent by the key server."""
        if item.sender != "keyserver":
            raise ProtocolError(f"Challenge from {item.sender!r}; only the key server sets challenges.")
        msg: Challenge = item.message  # type: ignore[assignment]
        if self.run is None or msg.run_id != self.run.run_id or self.agent_id not in msg.sealed:
            return  # another job's round, or this agent is not in it
        context = f"{self.fleet}/{msg.run_id}/{item.round}".encode()
        sealed = unb64(msg.sealed[self.agent_id], "the sealed challenge", size=SEALED_SEED_BYTES)
        box = unb64(msg.box_key, "the key server's box key")
        self.seeds[(msg.run_id, item.round)] = self.identity.open(sealed, box, context)

    def _receipt(self, r: int, plan: RoundPlan, update, message: UpdateMessage, start: np.ndarray) -> bytes:  # noqa: ANN001
        """This update's signed receipt (its fingerprint under round ``r``'s sealed challenge,
        and the digest of the cluster model ``start`` it was trained from)."""
        run = self.run
        assert run is not None
        fp = b""
        if needs_fingerprint(update, self.public):
            waiting = (f"round {r}: the key server's challenge for this round (the receipt's fingerprint "
                       "needs it; the key server seals it to the round's agents when the round opens)")
            if not self.wait_until(lambda: (run.run_id, r) in self.seeds, max(plan.deadline - time.time(), 1.0),
                                   waiting=waiting):
                raise ProtocolError(f"Round {r}: no challenge from the key server before the deadline; update not sent.")
            fp = self.public.fingerprint(update.ciphertext, self.seeds[(run.run_id, r)])
        return self.frame(receipt(run.run_id, plan, update, message, start, self.public, fp), round=r)

    def _on_model(self, item: Inbound) -> None:
        msg: ClusterModel = item.message
        if item.sender != "keyserver":
            raise ProtocolError(f"Cluster model from {item.sender!r}; only the key server publishes models.")
        run = self.run
        if run is None or msg.run_id != run.run_id:
            return
        if msg.weights.size != run.initial.size or item.round < 1:
            raise ProtocolError(f"Cluster model of {msg.weights.size} parameters for round {item.round}; "
                                f"the model has {run.initial.size} and rounds start at 1.")
        known = run.models.get(msg.cluster)
        if known is None or item.round > known[0]:
            run.models[msg.cluster] = (item.round, msg.weights.astype(np.float64))
            if msg.cluster == run.cluster:
                tm = run.timings.setdefault(item.round, {})
                tm["model_received_at"] = item.received
                tm["bytes_down"] = float(item.nbytes)

    def _on_notice(self, item: Inbound) -> None:
        msg: Notice = item.message
        if item.sender != "coordinator" or self.run is None or msg.run_id != self.run.run_id:
            return
        if msg.kind in ("refused", "done", "cancelled"):
            said = {"refused": f"the coordinator refused this agent: {msg.reason}", "done": "the job is done",
                    "cancelled": f"the job was cancelled{': ' + msg.reason if msg.reason else ''}"}[msg.kind]
            if self.once:
                self.exit = AgentExit(3 if msg.kind == "refused" else 0, said)
            else:
                (self.log.error if msg.kind == "refused" else self.log.info)(
                    "job %s: %s; waiting for the next job", msg.run_id, said)
                self._leave_run()
        elif msg.kind == "resend-metrics":
            for r, metrics in sorted(self.run.sent_metrics.items()):
                self.send(f"agents/{self.agent_id}/metrics", metrics, round=r)

    def _on_ack(self, item: Inbound) -> None:
        """The coordinator has this agent's hello or update: no more repeats of it. On a site's
        broker the site aggregator acknowledges the updates it folded (docs/sites.md)."""
        msg: Ack = item.message  # type: ignore[assignment]
        if msg.of == "update" and item.sender.startswith(SITE_PREFIX) and item.suffix == f"agents/{self.agent_id}/inbox":
            pass  # a site's aggregator speaks only on its own broker: the bridge never carries it out
        else:
            self._inbox(item)
        run = self.run
        if run is None or msg.run_id != run.run_id:
            return
        if msg.of == "hello":
            if self.hello_repeat.armed:
                self.hello_repeat.disarm()
                if self.newest_plan == 0 and not self.plans and not self.plan_repeat.armed:
                    self._await_plan()  # round 1's plan comes once the job has its devices
            return
        if run.last_update is None or run.last_update[0] != item.round or not self.update_repeat.armed:
            return
        self.update_repeat.disarm()
        if msg.reason:
            self.log.warning("round %d: the coordinator does not count this device's update: %s", item.round, msg.reason)
        self._await_plan()

    def _await_plan(self, after: float = 0.0) -> None:
        """Ask for the next round's plan again if it is not here ``after`` s (the current
        round's time left) plus the first repeat's delay from now."""
        run = self.run
        if run is not None and self.newest_plan < run.config.rounds:
            self.plan_repeat.arm(first=max(after, 0.0) + self.plan_repeat.first)

    def tick(self) -> None:
        """Re-send what the coordinator has not acknowledged (see the module docstring)."""
        run = self.run
        if run is None or run.hello is None:
            return
        if self.hello_repeat.due():
            self.log.info("no acknowledgement of this device's hello to job %s yet; saying it again (repeat %d)",
                          run.run_id, self.hello_repeat.repeats)
            self._say_hello(run)
        if self.update_repeat.armed:
            r, frame = run.last_update if run.last_update is not None else (0, b"")
            if time.time() > self.update_until or not frame:
                self.update_repeat.disarm()  # its round is over: the next plan is awaited
                self._await_plan()
            elif self.update_repeat.due():
                self.log.info("round %d: no acknowledgement of this device's update yet; sending it again (repeat %d)",
                              r, self.update_repeat.repeats)
                self.link.publish(f"agents/{self.agent_id}/update", frame, wait=False)
        if self.plan_repeat.due():
            if self.newest_plan >= run.config.rounds:
                self.plan_repeat.disarm()
                return
            self.log.info("job %s: no plan for round %d yet; asking the coordinator again (repeat %d)",
                          run.run_id, self.newest_plan + 1, self.plan_repeat.repeats)
            self._say_hello(run)

    def _say_hello(self, run: RunState) -> None:
        """The hello again (and the bootstrap vector until the agent has a cluster), not
        waiting for the broker: the coordinator acknowledges it, and repeats the assignment
        and a plan in flight."""
        self.send(f"agents/{self.agent_id}/hello", run.hello, wait=False)
        if run.vector is not None and run.cluster is None:
            self.send(f"agents/{self.agent_id}/bootstrap", BootstrapVector(sensitivity=run.vector), wait=False)

    def on_reconnect(self) -> None:
        if self.run is not None and self.run.hello is not None:
            self.send(f"agents/{self.agent_id}/hello", self.run.hello)
            if self.run.last_update is not None:
                r, frame = self.run.last_update
                self.link.publish(f"agents/{self.agent_id}/update", frame)

    def _on_coordinator_status(self, online: bool) -> None:
        """The coordinator is (back) online: a restarted one resumes from what it saved, which
        may be from before this agent's hello, so it hears the hello again, and the bootstrap
        vector until the agent has a cluster (a repeat of either changes nothing there)."""
        run = self.run
        if not online or run is None or run.hello is None:
            return
        self.send(f"agents/{self.agent_id}/hello", run.hello)
        if run.vector is not None and run.cluster is None:
            self.send(f"agents/{self.agent_id}/bootstrap", BootstrapVector(sensitivity=run.vector))

    def _leave_run(self) -> None:
        """Forget the current job (the key, its randomness pool and the data stay)."""
        if self.run is not None and self.run.cluster is not None:
            self.link.unsubscribe(f"clusters/{self.run.cluster}/model")
        self.run, self.plans, self.decisions, self.newest_plan = None, [], {}, 0
        self.applying = None
        for repeat in (self.hello_repeat, self.plan_repeat, self.update_repeat):
            repeat.disarm()

    # ---- joining ------------------------------------------------------------------------
    def _torch(self):  # noqa: ANN202
        """torch, on this agent's threads (imported when the agent takes its first job: an idle
        agent does not hold it)."""
        import torch

        if not self._torch_threads_set:
            torch.set_num_threads(self.threads)
            self._torch_threads_set = True
        return torch

    def _prepare(self, msg: FleetConfig) -> PreparedRun:
        """The job checked against this device, its data loaded (:func:`edge_agent.prepare.prepare`),
        on this agent's torch threads."""
        self._torch()
        # a signed job without an initial digest: the device rebuilds the model from its seed
        rebuild = self.require_signed_jobs and not signed_initial(msg.submission)
        return prepare(msg, self.data_spec, self.agent_id, rebuild_initial=rebuild)

    def _join(self, prepared: PreparedRun) -> None:
        """Set up for a new run: data, model, hello, bootstrap vector, synthetic data."""
        msg, config, strategy = prepared.msg, prepared.config, prepared.strategy
        data, model, index, count = prepared.data, prepared.model, prepared.index, prepared.count
        run = RunState(msg.run_id, config, msg.initial.astype(np.float64), tuple(msg.input_shape), msg.num_classes,
                       index=index, data=data, model=model)
        self.run, self.plans, self.decisions, self.newest_plan = run, [], {}, 0
        self.plan_sent_at, self.plan_arrived_at = {}, {}
        self.deadline_s = msg.round_deadline
        calibrate = config.options.budget_mode == "calibrated" and self.public is not None
        vector = None
        if calibrate and strategy.needs_bootstrap_sensitivity:
            # calibrated budgets: the hello carries what this device measured of its own round
            # (the bootstrap's training time, the encryption rate), so the bootstrap runs first
            vector = self._bootstrap(run, strategy, model, data, index)
        profile = dict(self.profile)
        if calibrate:
            profile["measured"] = measure_costs(config, model, data, self.public, self.profile)
        # one-off work before the device announces itself (round 1 starts once every device
        # sent its bootstrap): the key's fixed-base table and the pool, onnxruntime and the
        # run's inference latency; done later, it lands in the first rounds' critical path
        self._start_pool(run)
        self.guard("inference warm-up", lambda: self._warm_inference(run))
        hello = Hello(
            run_id=run.run_id, agent_id=self.agent_id, n_samples=data.n_train, bandwidth=self.bandwidth,
            cpu_speed=self.cpu_speed, profile=profile, key_id=self.key.key_id if self.key else None, index=index,
            box_key=b64(self.identity.box_key),
        )
        run.hello = hello
        self.send(f"agents/{self.agent_id}/hello", hello)
        where = "own data" if self.data_spec.sources else f"shard {index}/{count}"
        self.log.info("%s joined job %s (%s, %d samples, %s, key %s)", self.agent_id, run.run_id, config.strategy,
                      data.n_train, where, self.key.key_id if self.key else "none")
        if strategy.needs_bootstrap_sensitivity:
            if vector is None:
                vector = self._bootstrap(run, strategy, model, data, index)
            run.vector = vector
            self.send(f"agents/{self.agent_id}/bootstrap", BootstrapVector(sensitivity=vector))
        for kind, repeat in (("hello", self.hello_repeat), ("plan", self.plan_repeat), ("update", self.update_repeat)):
            repeat.disarm()
            repeat.first, repeat.cap = repeat_delays(kind, msg.round_deadline)
        self.hello_repeat.arm()  # until the coordinator acknowledges hello and vector
        if strategy.needs_synthetic:
            fit_synthetic(run.client, data, num_classes=msg.num_classes, epsilon=config.options.synthetic_epsilon,
                          delta=config.options.delta,
                          rng=self.noise.generator("synthetic-fit", round=0, index=index))
        self.strategy = strategy
        self.accountant_delta = config.options.delta
        run.noise = expected_noise(config, strategy, data.n_train)  # what every plan of this job must carry

    def _warm_inference(self, run: RunState) -> None:
        """onnxruntime loaded and the run's inference latency measured (:func:`edge_agent.costs.warm_inference`)."""
        run.inference = warm_inference(run.config, run.input_shape, run.num_classes, run.initial, fleet=self.fleet,
                                       threads=self._torch().get_num_threads(), repeats=self.latency_repeats)

    def _bootstrap(self, run: RunState, strategy, model, data, index: int) -> np.ndarray:  # noqa: ANN001
        t = time.perf_counter()
        vector = client_bootstrap(run.config, strategy, model, run.initial, data, index, noise=self.noise)
        run.timings.setdefault(0, {})["bootstrap"] = time.perf_counter() - t
        return vector

    def _start_pool(self, run: RunState) -> None:
        """Precompute encryption randomness while the device waits (packed Paillier's
        obfuscator pool: one obfuscator per ciphertext block, refilled in the background),
        so most of the expensive exponentiations leave the round's critical path."""
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        make_pool = getattr(self.public, "make_pool", None)
        if make_pool is None:
            return
        blocks = -(-run.initial.size // self.public.block_size)
        self.pool = make_pool(capacity=blocks, start=True, attach=True)

    # ---- one round ----------------------------------------------------------------------
    def _global(self, cluster: int, model_round: int) -> np.ndarray | None:
        run = self.run
        assert run is not None
        if model_round == 0:
            return run.initial
        known = run.models.get(cluster)
        return known[1] if known is not None and known[0] == model_round else None

    def _round_or_failure(self, r: int, plan: RoundPlan) -> None:
        """Round ``r``; if a step of it raises (training included), the coordinator is told at
        once (:meth:`_failed`) so that it closes the round without this device instead of
        waiting for its deadline; the agent stays in the job. A stop (SIGTERM) or a crash of
        the process is seen by its last will instead."""
        try:
            self._do_round(r, plan)
        except Exception as exc:  # noqa: BLE001 - one round never stops the agent
            self._failed(r, "round", exc)
        finally:
            if self.pool is not None:
                self.pool.resume()  # paused while the round ran (see _do_round)
            if not self.update_repeat.armed and not self.plans and not self.plan_repeat.armed:
                self._await_plan(plan.deadline - time.time())  # no update in flight: the next plan

    def _failed(self, r: int, phase: str, exc: Exception, *, quiet: bool = False) -> None:
        """Round ``r``'s ``phase`` (``round`` or ``evaluation``) raised ``exc``: said in this
        agent's log and to the coordinator (:class:`RoundFailure`), which shows the operator
        the sentence; a user's mistake (ConfigError) is its own sentence, anything else
        names its type (and its traceback goes to this log); ``quiet``: an expected one, logged
        as information."""
        reason = failure_sentence(exc)
        what = "round" if phase == "round" else "evaluation of the model of round"
        if quiet:  # expected (a buffered job's crossed plan): said, not an error
            self.log.info("%s %d: not taken: %s", what, r, reason)
        elif isinstance(exc, (ConfigError, ProtocolError)):
            self.log.error("%s %d failed on this device: %s", what, r, reason)
        else:
            self.log.exception("%s %d failed on this device: %s", what, r, reason)
        if self.run is not None:
            run_id = self.run.run_id
            self.guard("round failure", lambda: self.send(
                f"agents/{self.agent_id}/failure", RoundFailure(run_id=run_id, reason=reason[:2000], phase=phase),
                round=r))

    def _do_round(self, r: int, plan: RoundPlan) -> None:
        run = self.run
        assert run is not None and run.data is not None and run.model is not None
        if r in run.done_rounds:  # a re-sent plan: re-send the update
            if run.last_update is not None and run.last_update[0] == r:
                self.link.publish(f"agents/{self.agent_id}/update", run.last_update[1])
                self.update_until = plan.deadline
                self.update_repeat.arm()
            else:
                self._await_plan(plan.deadline - time.time())
            return
        slot = slot_of(self.fleet, run.run_id, r, self.agent_id)
        if self.public is not None and slot in self.pad_log.used:  # sent before (another run of the job, a restart)
            run.done_rounds.add(r)
            self.log.error("round %d of job %s: %s", r, run.run_id, ALREADY_SENT)
            return
        refusal = plan_refusal(self.strategy, self.public, plan, run.data.n_train, noise=run.noise)
        if refusal is not None:
            run.done_rounds.add(r)
            self.log.error("round %d of job %s: refusing the coordinator's plan: %s; the round is skipped", r,
                           run.run_id, refusal)
            return
        reuse = self._crossed(r, plan)  # a buffered job's carried plan that crossed its update
        if reuse is False:
            return
        if self.kill_at_round == r:
            import os
            import signal

            self.log.warning("fault drill: killing myself (SIGKILL) in round %d", r)
            os.kill(os.getpid(), signal.SIGKILL)
        t_plan = time.time()
        tm = run.timings.setdefault(r, {})
        tm["plan_received_at"] = t_plan
        if r in self.plan_sent_at:
            tm["plan_frame_sent_at"] = self.plan_sent_at[r]
        if run.cluster != plan.cluster:
            self.link.subscribe(f"clusters/{plan.cluster}/model")
            run.cluster = plan.cluster
        left = max(plan.deadline - time.time(), 1.0)
        waiting = (f"round {r}: the model of round {plan.model_round} of cluster {plan.cluster}, which this round "
                   "starts from (the key server publishes it once it has decrypted that round's aggregate)")
        if reuse is None and not self.wait_until(lambda: self._global(plan.cluster, plan.model_round) is not None,
                                                 left, waiting=waiting):
            self.log.warning("round %d: model %d of cluster %d never arrived; skipping the round", r, plan.model_round, plan.cluster)
            return
        tm["wait_model"] = time.time() - t_plan
        if self.pool is not None:
            # from plan and model in hand to the update sent, the round has the device's CPU:
            # the encryption randomness is precomputed while the device waits, not during its
            # round (under a CPU quota the filling thread would take the round's share)
            self.pool.pause()
        # ready: plan and model both here (the agent may still have been busy with the last one)
        model_at = run.timings.get(plan.model_round, {}).get("model_received_at") if plan.model_round else None
        tm["ready_at"] = max(self.plan_arrived_at.get(r, t_plan), model_at or 0.0)
        start = self._global(plan.cluster, plan.model_round) if reuse is None else reuse[0]
        config, strategy = run.config, self.strategy
        if self.fail_at_round == r:
            raise RuntimeError(f"fault drill: training raised in round {r}")
        run.partial = plan.local_steps is not None
        device = DeviceRound(strategy, config, plan, r, run.index, self.agent_id, run.client, run.data, self.noise,
                             public=self.public, min_he_ratio=self.min_he_ratio)
        if reuse is not None:  # the work it sent too late, protected afresh for this round
            local = reuse[1]
        else:
            t_train = time.perf_counter()
            local = device.train(run.model, start)
            if self.slowdown > 1.0 and self.stopping.wait(self._slowdown_s(time.perf_counter() - t_train)):
                return  # stopped while it played a slower board
            if config.options.buffer is not None:  # buffered: the newest round this work is carried into
                r, plan, device, slot = self._carried(r, plan, device, slot)
                tm = run.timings.setdefault(r, {})
        shared = plan.mask()
        if plan.negotiate:
            t = time.time()
            proposal = strategy.propose(local.sensitivity, block_size=plan.block_size)
            self.send(f"agents/{self.agent_id}/proposal",
                      Proposal(cluster=plan.cluster, size=plan.size, proposal=pack_mask(proposal)), round=r)
            waiting = (f"round {r}: the consensus mask of cluster {plan.cluster} (the coordinator sends it when "
                       "every device of the cluster has proposed, or at half the round's deadline)")
            if not self.wait_until(lambda: r in self.decisions, max(plan.deadline - time.time(), 1.0),
                                   waiting=waiting):
                self.log.warning("round %d: no consensus mask before the deadline; skipping the round", r)
                return
            decision = self.decisions.pop(r)
            shared = unpack_mask(decision.shared_mask, decision.size)
            tm["negotiate"] = time.time() - t
        key = round_key(self.public, self.identity.exchange, self.fleet, run.run_id, r, plan)
        protected = device.protect(local, shared, key)
        if protected is None:  # below this device's encryption floor: not sent
            run.done_rounds.add(r)
            return
        update, message, t_serialize = protected.update, protected.message, protected.serialize_s
        t = time.perf_counter()
        signed = self._receipt(r, plan, update, message, start)
        t_receipt = time.perf_counter() - t
        t = time.perf_counter()
        # the round's timestamps and training metrics travel with the update they describe: the
        # coordinator's straggling figures and its plan of this device's work need them before
        # the model's metrics (which a busy device sends rounds later, see _evaluate_new_model),
        # and the report gives each round its own training figures
        stamps = {k: tm[k] for k in ("plan_received_at", "ready_at")}
        trained = {f"training_{k}": float(v) for k, v in local.metrics.items()}
        frame = self.frame(message.model_copy(update={"receipt": signed, "timings": {**message.timings, **stamps},
                                                      "training": trained}), round=r)
        t_serialize += time.perf_counter() - t
        t = time.perf_counter()
        if message.ciphertext:  # the pads of this round are used now: recorded (fsynced) before they leave
            context = pad_context(self.fleet, run.run_id, r, plan)
            refused = self.pad_log.refusal(slot, context, message.ciphertext)
            if refused is not None:
                run.done_rounds.add(r)
                self.log.error("round %d of job %s: %s", r, run.run_id, refused)
                return
            self.pad_log.record(slot, context, message.ciphertext)
        self.link.publish(f"agents/{self.agent_id}/update", frame)
        t_upload = time.perf_counter() - t
        run.last_update = (r, frame)
        if config.options.buffer is not None:  # what a carried plan that crosses it may send again
            run.last_work = (plan.cluster, plan.model_round, r, start, None if message.plaintext.size else local)
        self.update_until = plan.deadline
        self.update_repeat.arm()  # until the coordinator acknowledges it, or the deadline
        run.done_rounds.add(r)
        tm.update({k: v for k, v in update.timings.items()})
        tm.update({"serialize": t_serialize, "receipt": t_receipt, "upload": t_upload, "uploaded_at": time.time(),
                   "bytes_up": float(len(frame))})

    def _slowdown_s(self, trained_s: float) -> float:
        """The fault drill's wait after a training of ``trained_s`` s: ``slowdown`` - 1 times as
        long, from the job's second training on (the first includes torch's one-time warm-up,
        which a slower board does not repeat every round)."""
        warmed, self.run.warmed = self.run.warmed, True
        return (self.slowdown - 1.0) * trained_s if warmed else 0.0

    def _crossed(self, r: int, plan: RoundPlan):  # noqa: ANN202
        """A buffered job: round ``r``'s plan starts from a model this device already sent its
        work from, in a round that closed before the update arrived (the coordinator carried
        it on before it heard of that update). None: not such a plan, the round goes on. If
        the work travelled fully masked (no plaintext part), ``(start model, local update)``
        to protect afresh for this round (new pads: the key server decrypts a device's work
        from one model in one aggregate only, so the late copy can never be unmasked beside
        it); otherwise False: the plan is declined (the coordinator plans it afresh)."""
        run = self.run
        newest = run.models.get(plan.cluster, (0, None))[0]
        if run.last_work is None or run.last_work[:2] != (plan.cluster, plan.model_round) or plan.model_round >= newest:
            return None
        _, _, sent, start, local = run.last_work
        if local is not None:
            self.log.info("round %d: its work from model %d reached round %d after it closed; sent again, protected "
                          "for round %d", r, plan.model_round, sent, r)
            return start, local
        run.done_rounds.add(r)
        self._failed(r, "round", ProtocolError(
            f"this device sent its work from model {plan.model_round} of cluster {plan.cluster} in round {sent} "
            f"(after that round closed); it starts afresh from model {newest} in a later round"), quiet=True)
        return False

    def _carried(self, r: int, plan: RoundPlan, device: DeviceRound, slot):  # noqa: ANN001, ANN202
        """A buffered job: the round this device's work of round ``r`` goes to. Round ``r``
        may have closed while it trained (its buffer filled); the coordinator then plans it
        into later rounds from the same model (carried plans). The newest such plan that came
        while it trained is taken: its round's pads, challenge and staleness (the plan's round
        against its model round) protect the update, the rounds before it are answered by it.
        ``slot``: round ``r``'s pad slot; returns (round, plan, device round, pad slot)."""
        run = self.run
        self.drain()  # the plans that came while it trained
        later = [(q, p) for q, p in self.plans if q > r and p.cluster == plan.cluster and p.model_round == plan.model_round]
        if not later:
            return r, plan, device, slot
        q, carried = max(later, key=lambda item: item[0])
        refusal = plan_refusal(self.strategy, self.public, carried, run.data.n_train, noise=run.noise)
        if refusal is not None:
            self.log.error("round %d of job %s: refusing the coordinator's carried plan: %s; sending for round %d",
                           q, run.run_id, refusal, r)
            return r, plan, device, slot
        self.plans = [(x, p) for x, p in self.plans if x > q]
        run.done_rounds.update(x for x, _ in later if x <= q)
        run.done_rounds.add(r)
        self.log.info("round %d: trained from model %d, which round %d closed without; carried into round %d",
                      r, plan.model_round, r, q)
        # the round's start goes with its work (round r's model arrival stays round r's)
        started = run.timings.get(r, {})
        run.timings.setdefault(q, {}).update({k: started.pop(k) for k in ROUND_START if k in started})
        return q, carried, replace(device, plan=carried, r=q), slot_of(self.fleet, run.run_id, q, self.agent_id)

    def _evaluate_new_model(self) -> None:
        """Apply and evaluate the newest model of the device's cluster, in steps of a few ms of
        CPU (:func:`edge_agent.evaluate.apply_and_evaluate`). While the coordinator cuts this
        device's local steps (partial work: it is the one the others wait for), a round plan
        that arrives meanwhile is taken at the next step boundary and the model's remaining
        steps run when the device waits again; they go on with the same model, so a device that
        is always busy still applies and reports every few rounds, the models in between are
        not evaluated (the report takes its latest metrics for them), and the job's last model
        replaces one in progress so its metrics arrive at once. Otherwise every model is
        applied and evaluated in one go, as it was before the round that starts from it was
        sent (every model's metrics: the fleet's report equals the simulator's)."""
        run = self.run
        if run is None or run.cluster is None or run.cluster not in run.models:
            return
        r, weights = run.models[run.cluster]
        applying = self.applying
        if applying is not None and (applying.run is not run or (r == run.config.rounds and applying.r < r)):
            applying = self.applying = None
        if applying is None:
            if r <= run.evaluated:
                return
            if r < run.config.rounds and run.config.options.sample_rate >= 1.0 and r + 1 not in run.done_rounds:
                # every device is in every round: the round that starts from this model comes
                # first, the model is applied and evaluated once its update is sent (while the
                # device waits for the round's end); applied now, a slow device would start that
                # round late whenever the model arrives before its plan. A newer model (this
                # device missed the round) replaces this one.
                return
            merged = merge_personal(weights, run.client)  # the device's own (personalised) model
            assert run.data is not None and run.model is not None
            run.timings.setdefault(r, {})["apply_at"] = time.time()
            applying = self.applying = Applying(run, r, run.cluster, apply_and_evaluate(
                run.config, run.input_shape, run.num_classes, merged, self.model_dir / "model.onnx",
                data=run.data, model=run.model, fleet=self.fleet, cluster=run.cluster, r=r,
                threads=self._torch().get_num_threads()))
        while True:
            try:
                next(applying.steps)
            except StopIteration as done:
                self.applying = None
                self._report_model(applying, done.value)
                return
            except Exception as exc:  # noqa: BLE001 - said to the coordinator; the next model is tried
                self.applying = None
                run.evaluated = max(run.evaluated, applying.r)  # not again (it would fail again)
                self._failed(applying.r, "evaluation", exc)
                return
            except BaseException:
                self.applying = None
                raise
            if not run.partial:
                continue
            self.drain()  # what arrived during the step: a round plan comes first
            if self.plans or self.run is not run or self.exit is not None or self.stopping.is_set():
                return

    def _report_model(self, applying: Applying, applied: Applied) -> None:
        """The round's metrics of a model applied and evaluated (:meth:`_evaluate_new_model`)."""
        run, r = applying.run, applying.r
        tm = run.timings.setdefault(r, {})
        tm.update({"apply": applied.apply_s, "evaluate": applied.evaluate_s})
        if not run.inference:  # the architecture is the run's: measure its latency once (at join)
            run.inference = inference_latency(applied.session, run.input_shape, self.latency_repeats)
        if "uploaded_at" in tm and "model_received_at" in tm:
            tm["wait"] = tm["model_received_at"] - tm["uploaded_at"]
        run.evaluated = max(run.evaluated, r)
        assert run.data is not None
        metrics = round_metrics(run.config, applying.cluster, applied.values,
                                len(run.data.y_test), tm, run.client.dp_history, run.inference)
        run.sent_metrics[r] = metrics
        self.send(f"agents/{self.agent_id}/metrics", metrics, round=r)

    # ---- main ---------------------------------------------------------------------------
    def _key_for(self, run_id: str) -> bool:
        """Whether the key server has announced its key for job ``run_id`` (a new job may
        bring a new scheme or key size: the agent joins with that job's key, never an old one)."""
        return self.key is not None and (not self.key.run_id or self.key.run_id == run_id)

    def _plan_wait(self, waits: dict[object, WaitNote]) -> WaitNote:
        """The note of the wait for the current job's next round plan."""
        run = self.run
        assert run is not None
        r = self.newest_plan + 1
        if (run.run_id, r) not in waits:
            if r > run.config.rounds:
                what = f"job {run.run_id}: its end (round {r - 1} of {run.config.rounds} was the last)"
            elif r == 1:
                what = (f"job {run.run_id}: the plan of round 1 (the coordinator starts when the job's "
                        f"{run.config.min_devices} device(s) have joined and sent their bootstrap)")
            else:
                what = (f"job {run.run_id}: the plan of round {r} (sent when the coordinator closes round "
                        f"{r - 1}; a device not sampled in a round waits for the next)")
            waits[(run.run_id, r)] = WaitNote(self.log, what)
        return waits[(run.run_id, r)]

    def serve(self) -> int:
        """Take jobs until SIGTERM (``once``: until the first job ends or refuses this
        agent); returns the exit code (0, or 3 if refused)."""
        waits: dict[object, WaitNote] = {}  # what this agent waits for, each said once
        try:
            # a stop ends whatever the agent is doing (starting, joining, training a round,
            # evaluating): the coordinator sees it leave, as it sees a device that loses power
            self.abandon_work = True
            # nothing heavy is loaded before a job needs it: torch, local training and the
            # dataset loaders load when the first job is checked (_prepare, ~2.5 s on an x86
            # core, before the job's first round), Opacus with a DP job, TenSEAL with CKKS,
            # onnxruntime when it joins a job (the inference warm-up); an idle agent holds none of them
            self.start([
                "fleet/config", "keys/public", "fleet/control", f"agents/{self.agent_id}/inbox", "keyserver/challenges",
            ])
            self.log.info("%s: connected to fleet %r; waiting for a job", self.agent_id, self.fleet)
            while not self.stopping.is_set() and self.exit is None:
                # a model applied in steps goes on at once when nothing is queued
                self.pump(0.0 if self.plans or self.applying is not None else 0.5)
                # every step under the guard: a bad message or a failing step is logged and
                # rejected, the agent keeps serving
                if self.pending_config is not None:
                    run_id = self.pending_config.msg.run_id
                    if self._key_for(run_id):
                        prepared, self.pending_config = self.pending_config, None
                        self.guard("fleet/config", lambda: self._join(prepared))
                    else:
                        if ("key", run_id) not in waits:
                            waits[("key", run_id)] = WaitNote(
                                self.log, f"job {run_id}: the key server's public key for this job (updates are "
                                "encrypted with it; it announces one per job)")
                        waits[("key", run_id)].check()
                if self.run is not None and not self.plans:
                    self._plan_wait(waits).check()
                while self.plans and self.exit is None and not self.stopping.is_set():
                    r, plan = self.plans.pop(0)
                    self.guard(f"round {r}", lambda: self._round_or_failure(r, plan))
                self.guard("evaluation", self._evaluate_new_model)
            if self.exit is not None:
                (log.info if self.exit.code == 0 else log.error)("%s: %s", self.agent_id, self.exit)
                return self.exit.code
            return 0
        except Stopped:
            self.log.info("%s: stopped%s", self.agent_id, "" if self.run is None else f" in the middle of job {self.run.run_id}")
            return 0
        finally:
            self.abandon_work = False
            if self.pool is not None:
                self.pool.stop(timeout=1.0)  # a daemon thread: not waited for beyond that
            self.stop()
