"""One cluster's round at the coordinator (:class:`ClusterRound`: members, phase, deadline, the
updates folded so far, the key server's verdict), what is kept of each update
(:class:`UpdateNote`), and the checks an update must pass before it touches the round, each
a pure function raising :class:`~senseshield.errors.ProtocolError` (one sentence naming the
agent): the facts it claims (:func:`check_facts`), its signed receipt (:func:`check_receipt`),
and its encryption floor (:func:`floor_refusal`)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import numpy as np

from coordinator.contributions import Contributions
from coordinator.roster import AgentInfo, HelloFacts
from senseshield.determinism import mask_digest
from senseshield.engine.aggregation import StreamingAggregate
from senseshield.errors import ProtocolError
from senseshield.results import RoundTally
from senseshield.runtime.identity import Trust, check_frame
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import Hello, MaskDecision, Receipt, from_frame
from senseshield.strategies import FleetPlan
from senseshield.strategies.base import Strategy


class UpdateNote:
    """What the coordinator keeps of an update once it is in the running aggregate: its
    timings, share encrypted, frame size, the device's report, mask digest, signed receipt
    and the training metrics it came with. A round holds one per contributor until it
    closes, so all but the receipt are kept packed (compact JSON, about a third of the
    objects' size) and read back as fields; immutable."""

    __slots__ = ("receipt", "packed")

    def __init__(self, timings: dict[str, float], he_ratio: float, nbytes: int, report: dict, mask_sha256: str,
                 receipt: bytes, training: dict[str, float] | None = None) -> None:
        object.__setattr__(self, "receipt", receipt)
        object.__setattr__(self, "packed", json.dumps([timings, he_ratio, nbytes, report, mask_sha256, training or {}],
                                                      separators=(",", ":"), default=float).encode())  # (numpy scalars)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"An update's note is immutable ({name!r}).")

    def fields(self) -> dict:
        """Every field but the receipt, decoded (one decode: read several at once from this)."""
        timings, he_ratio, nbytes, report, mask_sha256, training = json.loads(self.packed)
        return {"timings": timings, "he_ratio": he_ratio, "nbytes": nbytes, "report": report,
                "mask_sha256": mask_sha256, "training": training}

    timings = property(lambda self: self.fields()["timings"])
    he_ratio = property(lambda self: self.fields()["he_ratio"])
    nbytes = property(lambda self: self.fields()["nbytes"])
    report = property(lambda self: self.fields()["report"])
    mask_sha256 = property(lambda self: self.fields()["mask_sha256"])
    training = property(lambda self: self.fields()["training"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UpdateNote) and (self.receipt, self.packed) == (other.receipt, other.packed)

    def __hash__(self) -> int:
        return hash((self.receipt, self.packed))

    def __repr__(self) -> str:
        return f"UpdateNote({self.fields()!r}, receipt of {len(self.receipt)} bytes)"

    def facts(self) -> dict:
        """What the agent's round record keeps of the update."""
        f = self.fields()
        return {"he_ratio": f["he_ratio"], "bytes_up": f["nbytes"], "mask_sha256": f["mask_sha256"],
                "agent_timings": f["timings"], "training": f["training"]}


@dataclass
class ClusterRound:
    """One cluster's part of a round."""

    members: list[str]
    deadline: float
    phase: str  # "proposals" | "updates" | "decrypting" | "done"
    proposals: dict[str, np.ndarray] = field(default_factory=dict)
    decision: MaskDecision | None = None  # the consensus mask sent to the proposers (kept to re-send)
    expected: set[str] = field(default_factory=set)  # who must send an update
    # who sent an update, and what the round's report needs of it (the update itself is
    # folded into ``running`` on arrival and not kept)
    updates: dict[str, "UpdateNote"] = field(default_factory=dict)
    running: StreamingAggregate | None = None
    straggled: list[str] = field(default_factory=list)
    offline: set[str] = field(default_factory=set)  # members whose last will fired: not waited for
    failed: dict[str, str] = field(default_factory=dict)  # members that said their round failed (why): not waited for
    # the request's frames (receipt batches, then it: index -> frame, coordinator.history.Shelf), kept to re-send
    request: MutableMapping[int, bytes] | None = None
    requested_at: float = 0.0
    sent_at: float = 0.0  # latest (re-)send of the request
    accepted: bool | None = None
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    timestamps: dict[str, float] = field(default_factory=dict)  # coordinator clock
    # the updates, kept until the verdict (to aggregate again without a bad one), and the
    # devices whose update the key server found at fault (agent -> why)
    book: Contributions = field(default_factory=Contributions)
    refused: dict[str, str] = field(default_factory=dict)
    union_ratio: float | None = None  # of the aggregate sent (the share of encrypted positions)
    ring_bits: int = 64  # the masked scheme's ring of this round (Strategy.ring_bits of the members)
    sealed: dict | None = None  # positions left sealed (too few encryptors), engine.aggregation.aggregate_sealed
    held: tuple | None = None  # (refusal, arrival) while every attempt was refused and a later update may come
    # buffered rounds (senseshield.engine.buffered): the round closes at ``buffer`` updates;
    # ``carried``: members still training from an earlier round (agent -> [round it trained
    # in, model round it started from]); ``carried_on``: members still training when it closed
    buffer: int | None = None
    carried: dict[str, list[int]] = field(default_factory=dict)
    carried_on: list[str] = field(default_factory=list)

    def fold(self, agent: str, update, note: UpdateNote, *, make, keep: bool) -> None:  # noqa: ANN001
        """Fold ``agent``'s checked ``update`` (:mod:`coordinator.accept`) into the running
        aggregate (``make()``: a fresh one, for the first update); ``keep``: the update is kept
        too, so that a refusal at the fingerprint check can be retried without it. A bad
        update raises ProtocolError in the fold and changes nothing."""
        if self.running is None:
            self.running = make()
        t = time.perf_counter()
        self.running.add(update)
        self.timings["aggregate_streamed"] = self.timings.get("aggregate_streamed", 0.0) + time.perf_counter() - t
        self.updates[agent] = note
        if keep:
            self.book.keep(agent, update, note)

    def record(self) -> dict:
        """The cluster's part of the round's record (report.json ``server[].clusters``)."""
        return {"members": self.members, "updates": sorted(self.updates), "straggled": self.straggled,
                "failed": {a: self.failed[a] for a in self.straggled if a in self.failed and a not in self.offline},
                "accepted": self.accepted, "reason": self.reason, "refused": self.refused,
                "timings": self.timings, "timestamps": self.timestamps,
                **({"buffer": self.buffer, "carried": self.carried, "carried_on": self.carried_on}
                   if self.buffer is not None else {})}


def note_of(update, nbytes: int, report: dict, receipt: bytes,  # noqa: ANN001 - a ProtectedUpdate
            training: dict[str, float] | None = None) -> UpdateNote:
    """What is kept of ``update`` (its frame was ``nbytes`` long) once it is folded in."""
    return UpdateNote(dict(update.timings), update.he_ratio, nbytes, report,
                      mask_digest(update.mask, update.withheld), receipt, dict(training or {}))


def check_facts(plan: FleetPlan | None, agents: dict[str, AgentInfo], model_size: int, agent_id: str, what: str, *,
                cluster: int, size: int) -> HelloFacts:
    """An agent's message must come from an agent of the run and name its cluster and the
    model's size; returns its hello."""
    if plan is None or agent_id not in plan.cluster_of or agent_id not in agents:
        raise ProtocolError(f"{what} from {agent_id!r}, which is not in this run.")
    if size != model_size:
        raise ProtocolError(f"{what} of {agent_id!r} has {size} parameters; the model has {model_size}.")
    if cluster != plan.cluster_of[agent_id]:
        raise ProtocolError(f"{what} of {agent_id!r} is for cluster {cluster}; it belongs to {plan.cluster_of[agent_id]}.")
    return agents[agent_id].hello


def check_receipt(trust: Trust, receipt: bytes, *, agent_id: str, r: int, run_id: str, cluster: int, n_samples: int,
                  ciphertext: bytes | None, verifiable: bool, plain: bytes | None) -> None:
    """The update's ``receipt`` must be the agent's own signed statement about this update
    (the key server checks it again, and the fingerprint): one bad receipt would make the
    whole cluster's aggregate refused. ``verifiable``: the update encrypts under a key whose
    aggregates are checked against fingerprints (the receipt must carry one); ``plain``: the
    update's plaintext part (:func:`~senseshield.runtime.protocol.messages.plain_part`),
    whose digest the receipt signs. In a site's partial sum (:mod:`coordinator.sites`) the
    ciphertext was folded at the site (``ciphertext`` None: its digest and fingerprint are the
    key server's to check) and the plaintext part travels only for verifiable keys (``plain``
    None otherwise)."""
    if not receipt:
        raise ProtocolError(f"Update of {agent_id!r} carries no signed receipt.")
    frame = decode_frame(receipt)
    check_frame(trust, frame)
    statement = from_frame(frame)
    if not isinstance(statement, Receipt) or frame.sender != agent_id or frame.round != r:
        raise ProtocolError(f"Update of {agent_id!r} carries a receipt of {frame.sender!r} for round {frame.round}.")
    if (statement.run_id, statement.cluster, statement.n_samples) != (run_id, cluster, n_samples):
        raise ProtocolError(f"Update of {agent_id!r} carries a receipt for another run, cluster or sample count.")
    if plain is not None and statement.plain_digest != hashlib.sha256(plain).hexdigest():
        raise ProtocolError(f"Update of {agent_id!r} carries a receipt for another plaintext part.")
    if ciphertext is None:
        return
    if statement.ciphertext_digest != (hashlib.sha256(ciphertext).hexdigest() if ciphertext else ""):
        raise ProtocolError(f"Update of {agent_id!r} carries a receipt for another ciphertext.")
    if bool(statement.fingerprint) != bool(ciphertext and verifiable):
        raise ProtocolError(f"Update of {agent_id!r} carries a receipt without the fingerprint of its ciphertext.")


def floor_refusal(strategy: Strategy, budget: float, he_ratio: float, *, agent_id: str, r: int, size: int,
                  block_size: int) -> str | None:
    """Why an update encrypting ``he_ratio`` of the parameters is refused from a device of
    encryption budget ``budget`` (the strategy's
    :meth:`~senseshield.strategies.base.Strategy.encryption_floor`); None if it is not."""
    floor = strategy.encryption_floor(budget, size=size, block_size=block_size)
    if he_ratio + 1e-9 >= floor:
        return None
    return (f"round {r}: update of {agent_id!r} encrypts {he_ratio:.4f} of the parameters, below the "
            f"{floor:.4f} its encryption budget {budget:.4f} requires; refused")


def round_tally(r: int, clusters: dict[int, ClusterRound], *, work: dict[str, dict], plan: FleetPlan,
                model_bytes: int, min_encryptors: int, notes: list[str] = ()) -> RoundTally:
    """What round ``r`` adds up to once every cluster's round is done: the devices' planned
    ``work`` (agent -> its round record: steps, full_steps, budget), each folded update, the
    server's aggregate and decrypt seconds, the union and sealed positions, the models sent
    (``model_bytes`` to every member of an accepted cluster), and the notes (``notes`` first,
    then per cluster: model unchanged, refused updates, who it closed without and why)."""
    tally = RoundTally()
    tally.notes.extend(notes)
    for a, planned in work.items():
        if "full_steps" in planned:
            tally.add_work(a, steps=planned["steps"], full_steps=planned["full_steps"], budget=planned["budget"])
    for k, cr in sorted(clusters.items()):
        for a in sorted(cr.updates):
            f = cr.updates[a].fields()
            tally.add_update(a, f["timings"], f["he_ratio"], f["nbytes"], f["report"])
        tally.phases["aggregate"] += cr.timings.get("aggregate", 0.0)
        tally.phases["decrypt"] += cr.timings.get("decrypt", 0.0)
        if cr.union_ratio is not None:
            tally.union_ratios.append(cr.union_ratio)
            tally.add_sealed(r, k, cr.sealed, min_encryptors)
        if cr.accepted:
            tally.bytes_down += len(plan.members(k)) * model_bytes
        else:
            tally.notes.append(f"round {r} cluster {k}: model unchanged ({cr.reason})")
        for a, why in sorted(cr.refused.items()):
            tally.notes.append(f"round {r} cluster {k}: refused the update of {a} ({why})")
        for why, who in (("offline", [a for a in cr.straggled if a in cr.offline]),
                         ("failed", [a for a in cr.straggled if a not in cr.offline and a in cr.failed]),
                         ("deadline", [a for a in cr.straggled if a not in cr.offline and a not in cr.failed])):
            if who:
                tally.notes.append(f"round {r} cluster {k}: closed without {', '.join(sorted(who))} ({why})")
    return tally


@dataclass
class Closed:
    """What closing a phase of cluster ``k``'s round asks of the service (:func:`advance`):
    ``decision``: the proposers and the consensus mask to send them (proposals closed);
    ``aggregate`` and ``started`` (its fold's ``perf_counter`` start): the aggregate to
    request the key server's verdict on (updates closed)."""

    k: int
    decision: tuple[list[str], np.ndarray] | None = None
    aggregate: object | None = None
    started: float = 0.0


def advance(clusters: dict[int, ClusterRound], *, r: int, now: float, round_deadline: float, straggling: list[dict],
            consensus, online, then, log) -> None:  # noqa: ANN001
    # consensus(proposals) -> mask, online(agent) -> bool, then(Closed) -> None
    """Close what is due in round ``r``'s cluster rounds at time ``now``: the proposals at half
    the deadline, or as soon as every member missing went offline (last will) or failed its
    round (the consensus of the proposals in, ``consensus``, is then what the proposers are
    sent, and they are the members expected to update); the updates at the deadline, or as
    soon as every expected member missing went offline or failed (the running aggregate is
    then closed, or the round is done when none arrived or it does not close), or in a buffered
    job as soon as its buffer is full (the members still training are not straggling: they
    carry on into the next round, ``carried_on``). Each other missing
    member is recorded as straggling (``straggling``, with ``online(agent)`` at that time).
    What a closed phase asks of the service goes to ``then`` at once (a :class:`Closed`)."""
    for k, cr in clusters.items():
        if cr.phase == "proposals":
            half = cr.deadline - round_deadline / 2
            missing = [a for a in cr.members if a not in cr.proposals]
            if set(missing) <= cr.offline | cr.failed.keys() or now >= half:
                straggle(cr, missing, "proposal", half, r=r, k=k, straggling=straggling, online=online, log=log)
                proposers = sorted(cr.proposals)
                closed = Closed(k)
                if proposers:
                    closed.decision = (proposers, consensus([cr.proposals[a] for a in proposers]))
                    then(closed)
                cr.expected = set(proposers)
                cr.phase = "updates"
        if cr.phase == "updates":
            missing = cr.expected - set(cr.updates)
            full = cr.buffer is not None and len(cr.updates) >= cr.buffer
            if missing <= cr.offline | cr.failed.keys() or now >= cr.deadline or full:
                if full:  # buffered: who is still training carries on into the next round
                    cr.carried_on = sorted(missing - cr.offline - cr.failed.keys())
                    missing -= set(cr.carried_on)
                    if cr.carried_on:
                        log.info("round %d cluster %d: buffer of %d full; %s carry on into the next round", r, k,
                                 cr.buffer, ", ".join(cr.carried_on))
                straggle(cr, sorted(missing), "update", cr.deadline, r=r, k=k, straggling=straggling, online=online,
                         log=log)
                closed = close_updates(cr, r=r, k=k, log=log)
                if closed is not None:
                    then(closed)


def straggle(cr: ClusterRound, missing: list[str], what: str, deadline: float, *, r: int, k: int,
             straggling: list[dict], online, log) -> None:  # noqa: ANN001
    """Cluster ``k``'s round ``r`` closes its ``what`` phase (due at ``deadline``) without
    ``missing``: each is recorded as straggled, offline (last will) or failed (its round)."""
    for a in missing:
        cr.straggled.append(a)
        gone = a in cr.offline
        failed = cr.failed.get(a) if not gone else None
        straggling.append({"round": r, "cluster": k, "agent": a,
                           "missing": "offline" if gone else "failed" if failed else what,
                           "deadline": deadline, "online": online(a), "arrived_late": False,
                           **({"reason": failed} if failed else {})})
        if gone:
            log.warning("round %d cluster %d: %s went offline (last will); closing without it", r, k, a)
        elif failed:
            log.warning("round %d cluster %d: %s failed its round (%s); closing without it", r, k, a, failed)
        else:
            log.warning("round %d cluster %d: no %s from %s by the deadline; closing without it", r, k, what, a)


def no_update_reason(cr: ClusterRound) -> str:
    """Why a cluster's round closed without any update: its members failed their round, went
    offline, or were late (each named with how many)."""
    failed = [a for a in cr.members if a in cr.failed and a not in cr.offline]
    offline = [a for a in cr.members if a in cr.offline]
    late = [a for a in cr.members if a not in cr.failed and a not in cr.offline]
    parts = [f"{len(who)} {what}" for who, what in ((failed, "failed their round"), (offline, "went offline"),
                                                    (late, "sent none before the deadline")) if who]
    if failed and len(failed) == len(cr.members):
        return f"no update arrived: every member failed its round ({cr.failed[failed[0]]})"
    return "no update arrived: " + (", ".join(parts) if parts else "no member")


def close_updates(cr: ClusterRound, *, r: int, k: int, log) -> Closed | None:  # noqa: ANN001
    """The running aggregate of cluster ``k``'s round, closed (the updates are already in;
    closing costs the fold of the plaintext); None, and the round done, when no update arrived
    or it does not close (e.g. the key's weight head-room: the cluster's round fails alone)."""
    if not cr.updates:
        cr.phase, cr.accepted, cr.reason = "done", False, no_update_reason(cr)
        return None
    cr.timestamps["closed_at"] = time.time()
    t = time.perf_counter()
    try:
        aggregate = cr.running.result()
    except ProtocolError as exc:
        cr.phase, cr.accepted, cr.reason = "done", False, f"aggregation failed: {exc}"
        log.warning("round %d cluster %d: %s", r, k, cr.reason)
        return None
    cr.running = None  # the memory goes with it
    return Closed(k, aggregate=aggregate, started=t)
