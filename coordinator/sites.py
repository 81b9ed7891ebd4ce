"""Site aggregation, without a broker: what a site aggregator folds and sends, and what the
coordinator accepts of it.

A fleet spread over sites (factories, farms, campuses: each a LAN of devices behind one
uplink) runs one broker per site, bridged to the hub's broker, and one site aggregator per
site (``coordinator serve --site NAME``). The bridge carries everything but the devices'
updates (:func:`bridge_topics`); the site aggregator folds its site's updates of each
cluster's round as they arrive (:class:`SiteRound`: one running aggregate per cluster, the
updates are not kept) and sends one partial sum per cluster (:class:`SitePartial`) when
every member of the site the round planned has delivered, failed or gone offline, or shortly
before the round's deadline. With one-time pads agreed with the key server, a sum of masked
updates is itself a masked update (:mod:`senseshield.engine.partial`): the aggregator needs
no key and no trust. The coordinator folds partial sums as it folds updates
(:func:`accept_partial`), and the key server checks what it always checks: every
contributor's signed receipt, once per round, the k rule and the fingerprints of the whole
aggregate. A site aggregator that folds anything but its contributors' updates makes the
aggregate fail the fingerprint check; the coordinator's search for the part at fault then
leaves its partial sum out (:mod:`coordinator.contributions`), and the key server names its
contributors.

Schemes: the masked scheme (the default), packed Paillier (SenseCrypt's) and plaintext jobs
fold at a site; a job of per-value Paillier or CKKS is refused by the site aggregator with one
sentence (their running aggregates keep every part), and its devices then need the hub's
broker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.rounds import ClusterRound, UpdateNote, check_receipt
from senseshield.engine.aggregation import StreamingAggregate
from senseshield.engine.partial import pack_arrays, partial_from_state, partial_state, unpack_arrays
from senseshield.errors import ProtocolError
from senseshield.runtime.identity import Trust
from senseshield.runtime.sites import SITE_PREFIX
from senseshield.runtime.protocol.messages import SitePartial, frame_list, pack_mask, plain_part, unpack_frames

if TYPE_CHECKING:
    from coordinator.state import JobState

# ---- the site aggregator's side ---------------------------------------------------------
@dataclass
class SiteRound:
    """One cluster's round at a site: the members the round planned here, when the round
    closes at the coordinator, the running aggregate of the updates in, what the report keeps
    of each, and what was sent."""

    r: int
    cluster: int
    deadline: float
    ring_bits: int
    expected: set[str] = field(default_factory=set)
    running: StreamingAggregate | None = None
    # in the running aggregate, not yet sent: each update's receipt and its note as the partial
    # sum carries it (JSON), packed as it is folded
    notes: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)  # every member whose update was folded (sent or not)
    failed: set[str] = field(default_factory=set)
    sent: list[bytes] = field(default_factory=list)  # the partial frames sent (re-sent after a reconnect)

    def waiting(self, offline: set[str]) -> set[str]:
        """Members still to deliver (not failed, not offline)."""
        return self.expected - self.delivered - self.failed - offline

    def due(self, now: float, *, offline: set[str], margin: float) -> bool:
        """Whether what is folded goes now: every member delivered, failed or went offline, or
        the round's deadline is ``margin`` seconds away."""
        if self.running is None:
            return False
        return not self.waiting(offline) or now >= self.deadline - margin

    def fold(self, agent: str, update: Any, note: UpdateNote, make) -> None:  # noqa: ANN001
        """Fold ``agent``'s checked update (``make()``: a fresh running aggregate)."""
        if agent in self.delivered:
            raise ProtocolError(f"Update of {agent!r} for round {self.r} is a duplicate; dropped.")
        if self.running is None:
            self.running = make()
        self.running.add(update)
        self.notes[agent] = (note.receipt, json.dumps(note.fields(), sort_keys=True).encode())
        self.delivered.add(agent)

    def take(self) -> tuple[StreamingAggregate, dict[str, tuple[bytes, bytes]]]:
        """The running aggregate and its notes, to send; the round starts a fresh one (a member
        whose update comes later goes in a partial sum of its own)."""
        running, notes = self.running, self.notes
        self.running, self.notes = None, {}
        return running, notes


def partial_message(running: StreamingAggregate, notes: dict[str, tuple[bytes, bytes]], *, run_id: str,
                    site: str) -> tuple[SitePartial, dict[str, list[bytes]]]:
    """The :class:`SitePartial` of a site's running aggregate and the notes of its updates,
    with its ``receipts`` and ``notes`` sections as pieces (to_frame's ``pieces``: the frame
    holds them one after another, with no packed copy of a site's receipts first);
    :func:`joined` gives the message whole."""
    fields, arrays = partial_state(running)
    names = fields["contributors"]
    msg = SitePartial(run_id=run_id, site=site, cluster=running.cluster, size=running.size, state=fields,
                      arrays=pack_arrays(arrays), receipts=b"", notes=b"")
    return msg, {"receipts": frame_list([notes[a][0] for a in names]),  # notes: json.dumps of their list
                 "notes": [b"[", *(part for i, a in enumerate(names) for part in ((b", " if i else b""), notes[a][1])),
                           b"]"]}


def joined(msg: SitePartial, pieces: dict[str, list[bytes]]) -> SitePartial:
    """The message :func:`partial_message` gives in parts, whole."""
    return msg.model_copy(update={name: b"".join(parts) for name, parts in pieces.items()})


# ---- the coordinator's side -------------------------------------------------------------
@dataclass(frozen=True)
class PartialOutcome:
    """What to do with a site's partial sum that passed the checks: ``fold`` (``running`` into
    cluster ``k``'s round ``cr``, ``notes`` per contributor) or ``duplicate`` (a re-sent one:
    dropped)."""

    kind: str
    k: int
    cr: ClusterRound | None
    contributors: list[str]
    running: StreamingAggregate | None = None
    notes: dict[str, UpdateNote] = field(default_factory=dict)


def accept_partial(state: JobState | None, msg: SitePartial, *, sender: str, r: int, trust: Trust,
                   public: Any = None) -> PartialOutcome:  # noqa: ANN401 - a PublicKey
    """The outcome of site ``msg.site``'s partial sum of round ``r`` (from ``sender``), under
    the job's key ``public``; ProtocolError (one sentence) if it is rejected. Every
    contributor must be in the job and its cluster, sampled in the round and still awaited,
    with its hello's sample weight and its own signed receipt for this run, round, cluster
    and plaintext part; the running aggregate must fit the model and the key."""
    if sender != SITE_PREFIX + msg.site:
        raise ProtocolError(f"Partial sum of site {msg.site!r} from {sender!r}; only {SITE_PREFIX}{msg.site} sends it.")
    if state is None or state.plan is None or msg.run_id != state.run_id:
        raise ProtocolError(f"Partial sum of site {msg.site!r} for job {msg.run_id}, which is not running.")
    if msg.size != state.size:
        raise ProtocolError(f"Partial sum of site {msg.site!r} has {msg.size} parameters; the model has {state.size}.")
    if not 1 <= r <= state.round:
        raise ProtocolError(f"Partial sum of site {msg.site!r} is for round {r}; the current round is {state.round}.")
    names = msg.state.get("contributors")
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise ProtocolError(f"Partial sum of site {msg.site!r} does not list its contributors.")
    k = msg.cluster
    if r < state.round:
        raise ProtocolError(f"Partial sum of site {msg.site!r} is for round {r}, which is closed (now {state.round}); "
                            f"{len(names)} update(s) arrived late.")
    cr = state.clusters.get(k)
    if cr is None:
        raise ProtocolError(f"Partial sum of site {msg.site!r} for cluster {k}, which has no round {r}.")
    if names and all(a in cr.updates for a in names):
        return PartialOutcome("duplicate", k, cr, list(names))
    key = public.for_masks(state.strategy.per_client_masks) if public is not None else None
    running = partial_from_state(key, msg.state, unpack_arrays(msg.arrays), size=state.size, round=r, cluster=k,
                                 min_encryptors=state.config.options.min_encryptors)
    receipts = unpack_frames(msg.receipts)
    try:
        notes_json = json.loads(msg.notes)
    except ValueError:
        notes_json = None
    if len(receipts) != len(names) or not isinstance(notes_json, list) or len(notes_json) != len(names):
        raise ProtocolError(f"Partial sum of site {msg.site!r} carries {len(receipts)} receipts and notes for "
                            f"{len(names)} contributors.")
    weight = 0
    for a, receipt in zip(names, receipts):
        info = state.agents.get(a)
        if state.plan.cluster_of.get(a) != k or info is None:
            raise ProtocolError(f"Partial sum of site {msg.site!r} names {a!r}, which is not in cluster {k} of this run.")
        if a not in cr.members:
            raise ProtocolError(f"Partial sum of site {msg.site!r} names {a!r}, which was not sampled in round {r}.")
        if a in cr.updates:
            raise ProtocolError(f"Partial sum of site {msg.site!r} repeats the update of {a!r} in round {r}.")
        samples = state.strategy.sample_weight(info.hello.n_samples)
        weight += samples
        plain = running.plains.get(a) if running.plains is not None else None
        check_receipt(trust, receipt, agent_id=a, r=r, run_id=state.run_id, cluster=k, n_samples=samples,
                      ciphertext=None, verifiable=plain is not None,
                      plain=None if plain is None else plain_part(
                          pack_mask(plain[0]) if plain[0] is not None else np.zeros(0, np.uint8), plain[1]))
    if weight != running.total_weight:
        raise ProtocolError(f"Partial sum of site {msg.site!r} weighs {running.total_weight}; its contributors' hellos "
                            f"weigh {weight}.")
    acc = msg.state.get("accumulator") or {}
    if acc.get("ring_bits") and acc["ring_bits"] != cr.ring_bits:
        raise ProtocolError(f"Partial sum of site {msg.site!r} is masked modulo 2^{acc['ring_bits']}; the round's "
                            f"plan asks for 2^{cr.ring_bits}.")
    notes = {a: _note(a, n, receipt, msg.site) for a, n, receipt in zip(names, notes_json, receipts)}
    if cr.phase != "updates" or not set(names) <= cr.expected:
        raise ProtocolError(f"Partial sum of site {msg.site!r} arrived after cluster {k}'s round {r} stopped waiting for "
                            f"{', '.join(sorted(set(names) - cr.expected)) or 'updates'}; dropped as late.")
    return PartialOutcome("fold", k, cr, list(names), running, notes)


def _note(agent: str, data: Any, receipt: bytes, site: str) -> UpdateNote:  # noqa: ANN401 - JSON
    try:
        return UpdateNote({str(k): float(v) for k, v in dict(data["timings"]).items()}, float(data["he_ratio"]),
                          int(data["nbytes"]), dict(data["report"]), str(data["mask_sha256"]), receipt,
                          {str(k): float(v) for k, v in dict(data["training"]).items()})
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"Partial sum of site {site!r} carries a malformed note for {agent!r}.") from None


def fold_partial(cr: ClusterRound, site: str, out: PartialOutcome, *, make, keep: bool, now: float | None = None) -> None:  # noqa: ANN001
    """Fold a partial sum that :func:`accept_partial` accepted into cluster round ``cr``
    (``keep``: kept until the verdict, as one entry, so a refusal at the fingerprint check can
    be retried without it)."""
    if cr.running is None:
        cr.running = make()
    t = time.perf_counter()
    cr.running.merge(out.running)
    cr.timings["aggregate_streamed"] = cr.timings.get("aggregate_streamed", 0.0) + time.perf_counter() - t
    cr.updates.update(out.notes)
    if keep:
        cr.book.keep(f"{SITE_PREFIX}{site}#{len(cr.book.kept)}", out.running, out.notes)
