"""The coordinator's side of the key server (:class:`KeyLink`): the key it announces for the
job (or its refusal of the job), the aggregate requests of the round's clusters (built,
sent, re-sent while the key server is away, given up on when an online key server stays
silent), its verdicts (recorded on the cluster's round; after a refusal at the fingerprint
check the next attempt over the kept updates, :mod:`coordinator.contributions`), and the
cluster models it announces.

It holds no transport: the service gives it ``sign`` (a message of a round -> its signed
frame) and ``publish`` (a request frame -> ``keyserver/requests``), and passes each message
in with its sender, round and arrival facts. A request whose receipts would not fit in one
:class:`~senseshield.runtime.protocol.messages.ReceiptBatch` sends them ahead of it in
batches (:func:`receipt_batches`), so that neither side holds a fleet's receipts in one
message.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import numpy as np

from coordinator.contributions import aggregate_of, notes_of
from coordinator.history import Shelf
from coordinator.rounds import ClusterRound
from senseshield.engine.aggregation import StreamingAggregate, aggregate_sealed
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES, PublicKey
from senseshield.runtime.protocol.messages import (
    RECEIPT_BATCH_BYTES, AggregateResult, ClusterModel, Message, PublicKeyAnnouncement, ReceiptBatch,
    aggregate_to_message, frame_list,
)

Sign = Callable[..., bytes]  # (message, round, *, pieces=None) -> its signed frame


def receipt_batches(receipts: list[bytes], limit: int | None = None) -> list[list[bytes]]:
    """``receipts`` in order, cut into batches of at most ``limit`` packed bytes each
    (default :data:`RECEIPT_BATCH_BYTES`; a receipt larger than that alone); one batch (the
    request carries them) when they fit."""
    limit = RECEIPT_BATCH_BYTES if limit is None else limit
    batches: list[list[bytes]] = [[]]
    size = 0
    for receipt in receipts:
        need = 4 + len(receipt)  # pack_frames: its length, then the frame
        if batches[-1] and size + need > limit:
            batches.append([])
            size = 0
        batches[-1].append(receipt)
        size += need
    return batches


class KeyLink:
    """One job's exchange with the key server (see the module docstring). ``scheme``: the
    job's HE scheme (None: nothing is encrypted; the key server announces no key)."""

    def __init__(self, run_id: str, scheme: str | None, *, sign: Sign, publish: Callable[[bytes], None],
                 log: logging.Logger) -> None:
        self.run_id, self.scheme = run_id, scheme
        self.sign, self.publish, self.log = sign, publish, log
        self.public: PublicKey | None = None
        self.key_id: str | None = None
        self.refused = ""  # the key server's one sentence if it refuses this job
        self.models: dict[int, tuple[int, np.ndarray]] = {}  # last announced model per cluster
        self.model_bytes: int | None = None  # the frame size of a model announcement

    def for_job(self, run_id: str, scheme: str | None) -> "KeyLink":
        """A fresh link for job ``run_id`` of HE scheme ``scheme``, sending the same way."""
        return KeyLink(run_id, scheme, sign=self.sign, publish=self.publish, log=self.log)

    # ---- the key ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The key is in (or the key server said the job encrypts nothing)."""
        return self.public is not None or (self.key_id is not None and self.scheme is None)

    @property
    def verifiable(self) -> bool:
        """Aggregates under the key are checked against fingerprints (a refusal there can be retried)."""
        return self.public is not None and self.public.verifiable

    @property
    def block_size(self) -> int:
        """Mask granularity of the job's HE scheme (1 without HE)."""
        return self.public.block_size if self.public is not None else 1

    def on_key(self, sender: str, msg: PublicKeyAnnouncement) -> bool:
        """An announcement on ``keys/public``; True when it brings a new key for this job
        (the service checks its agents' keys again and re-sends what is pending)."""
        if sender != "keyserver":
            raise ProtocolError(f"keys/public from {sender!r}; only the key server may announce keys.")
        if msg.run_id and msg.run_id != self.run_id:
            return False  # a key for another job (e.g. the previous job's, retained)
        if msg.refused:  # e.g. not signed by a pinned operator: the job fails with this sentence
            self.log.error("the key server refuses job %s: %s", self.run_id, msg.refused)
            self.refused = msg.refused
            return False
        want = self.scheme or ""
        if msg.scheme != want:
            raise ProtocolError(f"The key server announces scheme {msg.scheme!r}; this run needs {want!r}.")
        if msg.key_id == self.key_id:
            return False  # the same key again (retained message after a reconnect)
        public = SCHEMES.get(msg.scheme).public_key_from_bytes(msg.key) if msg.scheme else None
        if public is not None and public.key_id != msg.key_id:
            raise ProtocolError(f"The announced key id {msg.key_id!r} is not the key's id {public.key_id!r}.")
        self.public, self.key_id = public, msg.key_id
        return True

    # ---- requests -----------------------------------------------------------------------
    def request(self, cr: ClusterRound, aggregate, t: float, *, r: int) -> None:  # noqa: ANN001
        """Send cluster round ``cr``'s aggregate of round ``r`` (of the updates in
        ``cr.updates``; its fold began at ``perf_counter`` ``t``) to the key server."""
        request = aggregate_to_message(aggregate, self.public, run_id=self.run_id)
        cr.timings["aggregate"] = cr.timings.get("aggregate", 0.0) + time.perf_counter() - t
        cr.union_ratio = float(aggregate.union_mask.mean())
        cr.sealed = aggregate_sealed(aggregate, self.public)
        # the receipts go into the signed frames as they are kept (not packed into a copy
        # first); a fleet's go ahead of the request in batches the key server checks as they come
        batches = receipt_batches([cr.updates[a].receipt for a in sorted(cr.updates)])
        cr.request = Shelf()  # kept on disk to re-send (coordinator.history), not beside the receipts in memory
        if len(batches) == 1:
            cr.request[0] = self.sign(request, r, pieces={"receipts": frame_list(batches[0])})
        else:
            attempt = secrets.token_hex(16)
            for i, batch in enumerate(batches):
                cr.request[i] = self.sign(ReceiptBatch(run_id=self.run_id, cluster=request.cluster, attempt=attempt,
                                                       index=i, receipts=b""), r, pieces={"receipts": frame_list(batch)})
            cr.request[len(batches)] = self.sign(request.model_copy(update={"attempt": attempt,
                                                                            "batches": len(batches)}), r)
        del request, batches
        cr.requested_at = time.time()
        cr.timestamps["requested_at"] = cr.requested_at
        cr.phase = "decrypting"
        self.send(cr)

    def send(self, cr: ClusterRound) -> None:
        cr.sent_at = time.time()
        for frame in cr.request.values():  # its receipt batches, then the request (in order, on one topic)
            self.publish(frame)

    def resend(self, clusters: dict[int, ClusterRound], r: int, why: str) -> None:
        """Re-send every aggregate request of round ``r`` still waiting for its verdict (the key
        server answers a repeat with the verdict it gave, so duplicates are harmless)."""
        for k, cr in clusters.items():
            if cr.phase == "decrypting" and cr.request is not None:
                self.log.info("round %d cluster %d: %s; re-sending the aggregate request", r, k, why)
                self.send(cr)

    def give_up(self, cr: ClusterRound, *, now: float, patience: float, keyserver_online: bool | None) -> bool:
        """An online key server silent for ``patience`` seconds since the request was (re-)sent
        lost it: the cluster's round is done, refused (True). An offline one is waited for
        (the request is re-sent when it is back)."""
        if cr.phase != "decrypting" or keyserver_online is False or now - cr.sent_at <= patience:
            return False
        cr.phase, cr.accepted, cr.reason = "done", False, "no answer from the key server"
        return True

    # ---- verdicts -----------------------------------------------------------------------
    def on_result(self, sender: str, msg: AggregateResult, cr: ClusterRound | None, *, r: int, received: float,
                  make: Callable[[], StreamingAggregate]) -> bool:
        """The key server's verdict ``msg`` on round ``r``'s aggregate of cluster round ``cr``
        (None: no such cluster this round). After a refusal at the fingerprint check the next
        attempt goes out (``make``: a fresh running aggregate of the cluster) and the round
        waits; else the verdict is recorded on ``cr``. True when it was recorded and accepted."""
        if sender != "keyserver":
            raise ProtocolError(f"Aggregate result from {sender!r}; only the key server answers.")
        if cr is None or cr.phase != "decrypting":
            return False
        if msg.retry and not msg.accepted:
            self.log.warning("round %d cluster %d: key server %s; looking for the update at fault", r, msg.cluster,
                             msg.reason)
            if self.retry(msg.cluster, cr, r=r, make=make):
                return False
            if time.time() < cr.deadline:  # a device's later update may still come: it is tried then
                self.log.info("round %d cluster %d: every attempt refused; waiting until the deadline for a later "
                              "update", r, msg.cluster)
                cr.held = (msg, received)
                return False
        return self._record(cr, msg, r=r, received=received)

    def on_spare(self, k: int, cr: ClusterRound, *, r: int, make: Callable[[], StreamingAggregate]) -> None:
        """A device's later update arrived while every attempt was refused (the verdict held):
        the attempts with it go out."""
        if cr.phase == "decrypting" and cr.held is not None and self.retry(k, cr, r=r, make=make):
            cr.held = None

    def expire(self, cr: ClusterRound, *, r: int, now: float) -> bool:
        """At the deadline a held refusal (no later update came) is the verdict (True)."""
        if cr.phase != "decrypting" or cr.held is None or now < cr.deadline:
            return False
        msg, received = cr.held
        cr.held = None
        self._record(cr, msg, r=r, received=received)
        return True

    def _record(self, cr: ClusterRound, msg: AggregateResult, *, r: int, received: float) -> bool:
        cr.refused.update(msg.excluded)
        cr.book.clear()
        cr.accepted, cr.reason, cr.phase = msg.accepted, msg.reason, "done"
        cr.timings.update(msg.timings)
        cr.timings["decrypt_roundtrip"] = time.time() - cr.requested_at
        cr.timestamps["result_at"] = received
        if not msg.accepted:
            self.log.warning("round %d cluster %d: key server %s", r, msg.cluster, msg.reason)
        return msg.accepted

    def retry(self, k: int, cr: ClusterRound, *, r: int, make: Callable[[], StreamingAggregate]) -> bool:
        """After a refusal at the fingerprint check: send the next attempt (updates left out or
        replaced by later ones, coordinator.contributions); False when none is left."""
        while (attempt := cr.book.next_attempt()) is not None:
            t = time.perf_counter()
            try:
                aggregate = aggregate_of(attempt, make, cr.book.load).result()
            except ProtocolError as exc:  # a spare that does not fold: the next attempt
                self.log.warning("round %d cluster %d: an attempt does not aggregate (%s)", r, k, exc)
                continue
            cr.updates = notes_of(attempt)
            self.log.info("round %d cluster %d: aggregating again over %s", r, k, sorted(attempt))
            self.request(cr, aggregate, t, r=r)
            return True
        return False

    # ---- models -------------------------------------------------------------------------
    def on_model(self, sender: str, msg: ClusterModel, *, r: int, nbytes: int, size: int, clusters: list[int],
                 current_round: int) -> bool:
        """A cluster model the key server announced for round ``r``; True when it is new
        (the service saves it), False for another job's, an older one, or the same again."""
        if sender != "keyserver" or msg.run_id != self.run_id:
            return False
        if msg.weights.size != size:
            raise ProtocolError(f"Cluster model of {msg.weights.size} parameters; the model has {size}.")
        if msg.cluster not in clusters or not 1 <= r <= current_round:
            raise ProtocolError(f"Cluster model of cluster {msg.cluster} for round {r}; the run is at round {current_round}.")
        if r <= self.models.get(msg.cluster, (0, None))[0]:
            return False  # an older model or the same again (a repeat of a retained message): saved already
        self.models[msg.cluster] = (r, msg.weights)
        self.model_bytes = nbytes
        return True

    def model_round(self, k: int) -> int:
        """The round of cluster ``k``'s latest announced model (0: none yet)."""
        return self.models.get(k, (0, None))[0]
