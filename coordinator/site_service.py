"""``coordinator serve --site NAME``: the site aggregator, on a site's own broker.

It follows the job the hub's coordinator announces (``fleet/config`` and ``keys/public``,
bridged in), learns its site's devices from their hellos (a site's broker carries only its
own devices' hellos: the bridge sends them out but brings none in), reads the round plans
the coordinator sends them (``agents/<id>/inbox``, bridged in), folds their updates
(``agents/<id>/update``, which the bridge never carries) into one running aggregate per
cluster and sends one partial sum per cluster on ``sites/<site>/partial`` (bridged out), see
:mod:`coordinator.sites`. It keeps no update and no state on disk: restarted mid-round, it
has lost that round's updates of its site (they are late at the coordinator) and takes part
again from the next round's plans.
"""

from __future__ import annotations

import logging
import time

from coordinator.rounds import check_receipt, floor_refusal, note_of
from coordinator.sites import SiteRound, partial_message
from senseshield.runtime.sites import SITE_PREFIX
from senseshield.engine.aggregation import StreamingAggregate
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES
from senseshield.he.base import job_key
from senseshield.job import announced_run
from senseshield.processes import release_memory
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.protocol.envelope import DEFAULT_MAX_FRAME_BYTES
from senseshield.runtime.protocol.messages import (
    Ack, Assignment, FleetConfig, Hello, MaskDecision, Notice, PublicKeyAnnouncement, RoundFailure, RoundPlan, Status,
    UpdateMessage, plain_part, update_from_message,
)
from senseshield.runtime.service import Inbound, Service, agent_of, check_sender

SCHEMES_FOLDED = (None, "masked", "packed-paillier")
"""The HE schemes whose updates a site folds (None: plaintext jobs)."""

MARGIN_S = 1.0
"""A site sends what it folded this long before the round's deadline (coordinator clock), if
members are still missing then."""


class SiteAggregator(Service):
    """The aggregator of one site (see the module docstring)."""

    SUBSCRIPTIONS = ["fleet/config", "fleet/control", "keys/public", "agents/+/hello", "agents/+/inbox",
                     "agents/+/update", "agents/+/failure", "agents/+/status"]

    def __init__(self, broker: str, *, site: str, fleet: str, identity: Identity | None = None,
                 trust: Trust | None = None, protocol: str = "5", max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 margin: float = MARGIN_S) -> None:
        log = logging.getLogger(f"senseshield.site.{site}")
        super().__init__(broker, fleet=fleet, client_id=SITE_PREFIX + site, logger=log, protocol=protocol,
                         max_frame_bytes=max_frame_bytes, status_topic=f"sites/{site}/status", identity=identity,
                         trust=trust, role="site")
        self.site, self.margin = site, margin
        self.run_id: str | None = None
        self.job = self.strategy = None
        self.scheme: str | None = None
        self.size = 0
        self.public = None
        self.members: dict[str, int] = {}  # this site's devices in the job: the samples their hellos claim
        self.offline: set[str] = set()
        self.budgets: dict[str, float] = {}  # each member's encryption budget, from its latest plan
        self.rounds: dict[tuple[int, int], SiteRound] = {}  # (round, cluster)
        self.round = 0
        self.partials_sent = 0
        for cls, handler in {
            FleetConfig: self._on_config, PublicKeyAnnouncement: self._on_key, Hello: self._on_hello,
            RoundPlan: self._on_plan, UpdateMessage: self._on_update, RoundFailure: self._on_failure,
            Status: self._on_status, Notice: self._on_notice,
            Assignment: lambda item: None, MaskDecision: lambda item: None,  # the devices' business
            Ack: lambda item: None,
        }.items():
            self.on(cls, handler)

    # ---- the job ------------------------------------------------------------------------
    def _on_config(self, item: Inbound) -> None:
        if item.sender != "coordinator":
            raise ProtocolError(f"fleet/config from {item.sender!r}; only the coordinator may set it.")
        msg: FleetConfig = item.message  # type: ignore[assignment]
        if msg.run_id == self.run_id:
            return
        job, strategy, scheme = announced_run(msg.config)
        self._reset(msg.run_id)
        self.job, self.strategy, self.scheme, self.size = job, strategy, scheme, int(msg.initial.size)
        if scheme not in SCHEMES_FOLDED:
            self.log.error("job %s encrypts with %s, whose updates a site cannot fold (the masked scheme, "
                           "packed Paillier and plaintext can); this site's updates of it are dropped", msg.run_id, scheme)
        else:
            self.log.info("site %s: job %s (%s, %s), %d parameters", self.site, msg.run_id, job.strategy,
                          scheme or "plaintext", self.size)

    def _reset(self, run_id: str | None) -> None:
        self.run_id, self.public, self.round = run_id, None, 0
        self.members, self.rounds, self.budgets = {}, {}, {}

    def _on_notice(self, item: Inbound) -> None:
        msg: Notice = item.message  # type: ignore[assignment]
        if item.sender == "coordinator" and item.suffix == "fleet/control" and self.run_id is not None \
                and getattr(msg, "run_id", None) == self.run_id:
            self.log.info("site %s: job %s ended", self.site, self.run_id)
            self._reset(None)

    def _on_key(self, item: Inbound) -> None:
        if item.sender != "keyserver":
            raise ProtocolError(f"keys/public from {item.sender!r}; only the key server may announce keys.")
        msg: PublicKeyAnnouncement = item.message  # type: ignore[assignment]
        if msg.run_id != self.run_id or msg.refused or not msg.scheme:
            return
        public = SCHEMES.get(msg.scheme).public_key_from_bytes(msg.key)
        if public.key_id != msg.key_id:
            raise ProtocolError(f"The announced key id {msg.key_id!r} is not the key's id {public.key_id!r}.")
        self.public = public

    def _on_hello(self, item: Inbound) -> None:
        agent = check_sender(item)
        msg: Hello = item.message  # type: ignore[assignment]
        if msg.run_id == self.run_id:
            self.members[agent] = msg.n_samples
            self.offline.discard(agent)

    def _on_status(self, item: Inbound) -> None:
        agent = check_sender(item)
        if item.message.online:  # type: ignore[attr-defined]
            self.offline.discard(agent)
        else:
            self.offline.add(agent)

    # ---- rounds -------------------------------------------------------------------------
    def _on_plan(self, item: Inbound) -> None:
        agent = agent_of(item.suffix)
        if agent not in self.members:
            return  # another site's device (the hub's plans reach every site)
        if item.sender != "coordinator":
            raise ProtocolError(f"A round plan from {item.sender!r}; only the coordinator plans rounds.")
        msg: RoundPlan = item.message  # type: ignore[assignment]
        r = item.round
        if r < self.round:
            return
        if r > self.round:
            self.round = r
            for key in [key for key in self.rounds if key[0] < r]:  # an older round's partials went out
                del self.rounds[key]
        sr = self.rounds.get((r, msg.cluster))
        if sr is None:
            sr = self.rounds[(r, msg.cluster)] = SiteRound(r, msg.cluster, msg.deadline, msg.ring_bits)
        sr.deadline = msg.deadline  # a re-sent plan may move it
        sr.expected.add(agent)
        self.budgets[agent] = msg.encryption_budget

    def _round_of(self, agent: str, r: int, cluster: int) -> SiteRound:
        sr = self.rounds.get((r, cluster))
        if sr is None or agent not in sr.expected:
            raise ProtocolError(f"Update of {agent!r} for round {r} cluster {cluster}, for which this site saw no plan "
                                "of it; dropped.")
        return sr

    def _on_update(self, item: Inbound) -> None:
        agent, r = check_sender(item), item.round
        msg: UpdateMessage = item.message  # type: ignore[assignment]
        if self.job is None or self.scheme not in SCHEMES_FOLDED:
            raise ProtocolError(f"Update of {agent!r} for a job this site does not fold; dropped.")
        if self.scheme is not None and self.public is None:
            raise ProtocolError(f"Update of {agent!r} arrived before the job's key; dropped.")
        n_samples = self.members.get(agent)
        if n_samples is None:
            raise ProtocolError(f"Update of {agent!r}, which has not said hello to this site in job {self.run_id}.")
        sr = self._round_of(agent, r, msg.cluster)
        if agent in sr.delivered:  # a repeat (the device did not hear the acknowledgement)
            self._ack(agent, r)
            return
        if msg.size != self.size:
            raise ProtocolError(f"Update of {agent!r} has {msg.size} parameters; the model has {self.size}.")
        weight = self.strategy.sample_weight(n_samples)
        if msg.n_samples != weight:
            raise ProtocolError(f"Update of {agent!r} claims {msg.n_samples} samples; its hello weighs {weight}.")
        key = job_key(self.public, per_client_masks=self.strategy.per_client_masks)
        update = update_from_message(msg, self.public, client_id=agent, round=r, size=self.size)
        check_receipt(self.trust, msg.receipt, agent_id=agent, r=r, run_id=self.run_id, cluster=msg.cluster,
                      n_samples=msg.n_samples, ciphertext=msg.ciphertext,
                      verifiable=self.public is not None and self.public.verifiable,
                      plain=plain_part(msg.withheld, msg.plaintext))
        ring = update.ciphertext.meta.get("ring_bits") if update.ciphertext is not None else None
        if ring is not None and ring != sr.ring_bits:
            raise ProtocolError(f"Update of {agent!r} is masked modulo 2^{ring}; the round's plan asks for "
                                f"2^{sr.ring_bits}.")
        if self.public is not None:
            reason = floor_refusal(self.strategy, self.budgets.get(agent, 0.0), update.he_ratio, agent_id=agent, r=r, size=self.size,
                                   block_size=self.public.block_size)
            if reason is not None:
                raise ProtocolError(reason)
        note = note_of(update, item.nbytes, msg.report, msg.receipt, msg.training)
        sr.fold(agent, update, note, lambda: StreamingAggregate(
            key, size=self.size, round=r, cluster=sr.cluster, min_encryptors=self.job.options.min_encryptors))
        self._ack(agent, r)
        self._flush()

    def _ack(self, agent: str, r: int) -> None:
        """The device's update is folded here: it stops re-sending it (not waited for)."""
        self.send(f"agents/{agent}/inbox", Ack(run_id=self.run_id, of="update"), round=r, wait=False)

    def _on_failure(self, item: Inbound) -> None:
        agent = check_sender(item)
        msg: RoundFailure = item.message  # type: ignore[assignment]
        if msg.run_id == self.run_id and msg.phase == "round":
            for (r, _), sr in self.rounds.items():
                if r == item.round and agent in sr.expected:
                    sr.failed.add(agent)
            self._flush()

    def _flush(self) -> None:
        """Send every cluster's partial sum that is due (coordinator.sites.SiteRound.due)."""
        now = time.time()
        for (r, k), sr in sorted(self.rounds.items()):
            if sr.due(now, offline=self.offline, margin=self.margin):
                running, notes = sr.take()
                msg, pieces = partial_message(running, notes, run_id=self.run_id, site=self.site)
                frame, count = self.frame(msg, round=r, pieces=pieces), len(notes)
                del running, notes, msg, pieces  # only the frame while it goes out
                sr.sent.append(frame)
                self.link.publish(f"sites/{self.site}/partial", frame)
                self.partials_sent += 1
                release_memory()  # the partial's notes and receipts went out
                self.log.info("round %d cluster %d: sent the partial sum of %d update(s) (%s)", r, k, count,
                              "every member in" if not sr.waiting(self.offline) else "the deadline is near")

    def on_reconnect(self) -> None:
        for sr in self.rounds.values():  # the coordinator drops a partial sum it already folded
            for frame in sr.sent:
                self.link.publish(f"sites/{self.site}/partial", frame)

    # ---- the loop -----------------------------------------------------------------------
    def serve(self) -> None:
        self.start(self.SUBSCRIPTIONS)
        self.log.info("site %s: aggregating its devices' updates for fleet %s", self.site, self.fleet)
        try:
            while not self.stopping.is_set():
                self.pump(0.2)
                self.guard("flush", self._flush)
        finally:
            self.stop()
