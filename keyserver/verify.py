"""The key server's decision on an aggregate request: :func:`decide`, the one function that
says whether a request is accepted, and what then is decrypted and unmasked (:class:`Accept`),
or why not (:class:`Refuse`: a verdict; :class:`Reject`: no verdict), or that the recorded
verdict answers it (:class:`Replay`) or follows (:class:`Decrypting`).

It reads what a request is checked against from the key server's state
(:class:`keyserver.state.KeyServerState`: the run, the cluster's current model, the round's
pinned plan, challenge seed and box keys, the contributions already taken, the key, the
ledger, what was released) and the operator's :class:`Rules` (trust file, minimums); it
changes neither and touches no transport. Its steps: the request's sender and run, a re-sent
request or a new attempt after a refusal at the fingerprint check, the cluster's pending and
applied rounds, the aggregate decoded from the message, then the checks before anything is
decrypted (:func:`verify`, with the k-encryptors rule of per-client-mask schemes,
:func:`check_encryptors`, and the plaintext side of verifiable aggregates recomputed from the
contributors' signed plaintext parts, :func:`check_plain_side`), and the contributors it
names at fault after a refusal at the fingerprint check (:func:`at_fault`). The service acts
on the outcome: it records, decrypts, answers.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from keyserver.state import KeyServerState
from senseshield.engine.aggregation import (
    EncryptedAggregate,
    PlainContribution,
    recompute_plain_side,
    thin_positions,
    thin_report,
    unit_starts,
)
from senseshield.errors import ProtocolError
from senseshield.he.base import round_context
from senseshield.runtime.identity import Trust, check_frame
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    AggregateRequest,
    Receipt,
    ReceiptBatch,
    aggregate_from_message,
    from_frame,
    iter_frames,
    pack_mask,
    parse_plain_part,
)

FINGERPRINT_MISMATCH = "the aggregate is not the product of the signed contributions"
"""How a refusal at the fingerprint check begins (the one refusal after which the coordinator
may try again without a contributor: nothing was decrypted or spent)."""


def at_fault(failed: list[dict[str, str]], passed: dict[str, str], r: int) -> dict[str, str]:
    """The contributors at fault, once an attempt whose fingerprints are ``passed`` (agent ->
    fingerprint) verified after attempts ``failed`` did not: every update of a failed attempt
    that the passing one left out or replaced (agent -> why), all named in one verdict (an
    attempt that left several out or replaced several names each, and the others with it)."""
    out: dict[str, str] = {}
    for prints in failed:
        changed = [a for a, fp in prints.items() if passed.get(a) != fp]
        for a in changed:
            if a in out:
                continue
            fate = "left out" if a not in passed else "replaced by its later update"
            others = sorted(set(changed) - {a})
            also = f" (and {', '.join(others)} too)" if others else ""
            out[a] = (f"its round {r} update does not match the fingerprint it signed: the aggregate with it "
                      f"failed the key server's check, the same aggregate with it {fate}{also} passed")
    return out


class Signed(NamedTuple):
    """What the checks read of one contributor's verified :class:`Receipt` (its signature,
    run, round and cluster already checked). A request names every contributor of a
    cluster, so the key server keeps this much of each, not the receipt and its frame; the
    digests most contributors share (the mask, the plan, the model they trained from, the
    key) are held once (:func:`signed_receipt`)."""

    n_samples: int
    key_id: str
    mask_digest: str
    fingerprint: bytes
    start_digest: str
    shares: int
    plan_digest: str
    plain_digest: str


def signed_receipt(receipt: Receipt, common: dict[str, str]) -> Signed:
    """:class:`Signed` of ``receipt``; ``common`` (one per request) holds each shared digest
    once."""
    def once(text: str) -> str:
        return common.setdefault(text, text)
    return Signed(receipt.n_samples, once(receipt.key_id), once(receipt.mask_digest), receipt.fingerprint,
                  once(receipt.start_digest), receipt.shares, once(receipt.plan_digest), receipt.plain_digest)


@dataclass
class Staged:
    """The receipts of one request attempt as the key server checked them, batch by batch
    (:func:`stage`): what the checks read of each (:class:`Signed`), the SHA-256 of their
    bytes in order (the attempt's digest with the ciphertext), the batches taken and the
    first reason found to refuse the attempt (then nothing more of it is read)."""

    members: frozenset[str]  # the cluster's, in the round's pinned plan
    receipts: dict[str, Signed] = field(default_factory=dict)
    common: dict[str, str] = field(default_factory=dict)
    hash: Any = field(default_factory=hashlib.sha256)
    batches: int = 0
    error: str | None = None
    seconds: float = 0.0  # spent checking them (the verdict's verify time counts it)


STAGED_PER_CLUSTER = 2
"""Request attempts whose receipt batches the key server holds at once per round and cluster
(a coordinator sends one attempt at a time); a new one beyond drops the oldest."""


def stage(staged: Staged, trust: Trust, run_id: str, r: int, k: int, data: bytes) -> None:
    """Check the receipts ``data`` (pack_frames) of round ``r``'s aggregate of cluster ``k``
    into ``staged``: every receipt's signature, round, run, cluster and membership, each
    contributor once. The first failure is kept as the attempt's refusal."""
    t = time.perf_counter()
    staged.hash.update(data)
    staged.batches += 1
    if staged.error is None:
        _check_receipts(staged, trust, run_id, r, k, data)
    staged.seconds += time.perf_counter() - t


def _check_receipts(staged: Staged, trust: Trust, run_id: str, r: int, k: int, data: bytes) -> None:
    members = staged.members
    try:
        for raw in iter_frames(data):
            frame = decode_frame(raw)
            check_frame(trust, frame)  # signed by the agent it names, with its pinned key
            receipt = from_frame(frame)
            if not isinstance(receipt, Receipt):
                staged.error = f"a receipt of {frame.sender!r} is a {frame.schema!r} message"
            elif frame.round != r or receipt.run_id != run_id:
                staged.error = f"the receipt of {frame.sender!r} is for round {frame.round} of run {receipt.run_id!r}"
            elif receipt.cluster != k or frame.sender not in members:
                staged.error = f"{frame.sender!r} signed for cluster {receipt.cluster}, and is not a member of cluster {k}"
            elif frame.sender in staged.receipts:
                staged.error = f"two receipts of {frame.sender!r}"
            if staged.error is not None:
                return
            staged.receipts[sys.intern(frame.sender)] = signed_receipt(receipt, staged.common)  # (the plan's string)
    except ProtocolError as exc:  # a malformed receipt: the attempt's verdict, not silence
        staged.error = str(exc)


def stage_batch(state: KeyServerState, rules: Rules, sender: str, r: int, msg: ReceiptBatch) -> str | None:
    """Take receipt batch ``msg`` of round ``r`` into the state's staged attempts (the
    service's one change of state here); the reason to reject it (no verdict), or None."""
    if sender != "coordinator":
        return f"Receipt batch from {sender!r}; only the coordinator sends aggregates."
    if state.job is None or msg.run_id != state.run_id:
        return f"Receipt batch for run {msg.run_id!r}; the current run is {state.run_id!r}."
    k = msg.cluster
    plan = state.plans.get(r)
    if plan is None or k not in plan:
        return f"Receipt batch for round {r} of cluster {k}, which no open round's plan has."
    key = (r, k, msg.attempt)
    staged = state.staged.get(key)
    if staged is None:
        if msg.index != 0:
            return f"Receipt batch {msg.index} of attempt {msg.attempt} came before its batch 0; re-send them in order."
        others = [key for key in state.staged if key[:2] == (r, k)]
        for old in others[: max(0, len(others) - STAGED_PER_CLUSTER + 1)]:
            del state.staged[old]
        staged = state.staged[key] = Staged(frozenset(plan[k]))
    if msg.index < staged.batches:
        return None  # a re-sent batch (reconnect): taken already
    if msg.index > staged.batches:
        del state.staged[key]
        return (f"Receipt batch {msg.index} of attempt {msg.attempt} came after batch {staged.batches - 1}; "
                "re-send them in order.")
    stage(staged, rules.trust, state.run_id, r, k, msg.receipts)
    return None


@dataclass(frozen=True)
class Rules:
    """What the operator holds every request to: the trust file (whose keys sign the receipts)
    and ``keyserver serve``'s minimums."""

    trust: Trust
    min_contributors: int = 2
    min_fraction: float = 0.0
    min_encryptors: int = 2  # the operator's (--min-encryptors); a job may ask for more
    allow_unverifiable: bool = False


@dataclass(frozen=True)
class Accept:
    """The accepted plan of round ``round``'s aggregate of cluster ``cluster``: decrypt
    ``aggregate`` (its plaintext side the key server's own), after binding exactly the
    contributors' pads when ``pads`` is given (the masked scheme: ``(box key, weight)`` per
    contributor, the contexts their pads were made in, their signed masks with per-client
    masks), then spend the contributions of ``weights`` and record ``entries`` in the ledger."""

    round: int
    cluster: int
    aggregate: EncryptedAggregate
    weights: dict[str, int]  # contributor -> signed sample count
    entries: dict[str, str] = field(default_factory=dict)  # contributor -> "key|agent|starting model"
    excluded: dict[str, str] = field(default_factory=dict)  # at_fault: updates of failed attempts left out
    pads: list[tuple[bytes, int]] | None = None
    contexts: list[bytes] | None = None
    masks: list[np.ndarray] | None = None
    notes: tuple[str, ...] = ()  # what the log says of the checks (positions left sealed)

    @property
    def contributors(self) -> list[str]:
        return sorted(self.weights)


@dataclass(frozen=True)
class Refuse:
    """A verdict that refuses the request; ``reason`` is one sentence (the result says
    ``refused: <reason>``). ``retry``: refused at the fingerprint check, nothing decrypted or
    spent, so the coordinator may try again; ``attempt`` (the request's digest) and
    ``prints`` (contributor -> signed fingerprint) are then kept to name who was at fault."""

    reason: str
    retry: bool = False
    attempt: str = ""
    prints: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reject:
    """No verdict: a request that is not this key server's to judge (another sender or run,
    a stale round, a cluster still decrypting, a malformed aggregate); the service rejects
    the message (logged and counted)."""

    reason: str


@dataclass(frozen=True)
class Replay:
    """A re-sent request (reconnect, restart): the recorded verdict answers it again.
    ``warning``: why a new attempt is not evaluated (the round's attempts are used up)."""

    warning: str | None = None


@dataclass(frozen=True)
class Decrypting:
    """A re-sent request while its aggregate is being decrypted: the verdict follows."""


Decision = Accept | Refuse | Reject | Replay | Decrypting


def decide(state: KeyServerState, rules: Rules, sender: str, r: int, msg: AggregateRequest) -> Decision:
    """Whether round ``r``'s aggregate request ``msg`` from ``sender`` (its frame's facts) is
    accepted, over ``state`` and ``rules``, neither of which it changes (see the module
    docstring). The aggregate is decoded from ``msg`` here; the checks set its sealed
    positions and the key server's own plaintext side on the :class:`Accept`'s aggregate."""
    if sender != "coordinator":
        return Reject(f"Aggregate from {sender!r}; only the coordinator may send aggregates.")
    if state.job is None or msg.run_id != state.run_id:
        return Reject(f"Aggregate for run {msg.run_id!r}; the current run is {state.run_id!r}.")
    k = msg.cluster
    staged = None  # receipts inline: checked with the rest
    if msg.batches:
        staged = state.staged.get((r, k, msg.attempt))
        if staged is None or staged.batches != msg.batches:
            if (r, k) in state.results and staged is None:
                return Replay()  # a request re-sent alone after its verdict
            return Reject(f"Aggregate for round {r} of cluster {k} came after {staged.batches if staged else 0} of "
                          f"its {msg.batches} receipt batches; re-send them before it.")
    attempt = staged.hash.copy() if staged is not None else hashlib.sha256(msg.receipts)
    attempt.update(b"|")
    attempt.update(msg.ciphertext)
    attempt = attempt.hexdigest()
    if (r, k) in state.results:
        warning = _no_new_attempt(state, r, k, attempt)
        if warning is not None:
            return Replay(warning or None)
    if (r, k) in state.pending:
        return Decrypting()
    busy = sorted(rr for rr, kk in state.pending if kk == k)
    if busy:
        return Reject(f"Aggregate for round {r} of cluster {k} while its round {busy[0]} is being "
                      "decrypted; re-send it after that verdict.")
    last = state.model(k)[0]
    if r <= last:
        return Reject(f"Aggregate for round {r} of cluster {k} is stale; the cluster is at round {last}.")
    # sizes, masks, weights and the ciphertext's blocks: a malformed request is rejected
    # (no verdict) before anything is verified or decrypted
    try:
        aggregate = aggregate_from_message(msg, state.public, round=r, size=state.initial.size)
    except ProtocolError as exc:
        return Reject(str(exc))
    prints: dict[str, str] = {}
    plans: dict[str, str] = {}  # contributor -> the plan digest its receipt signs (its pads' context)
    notes: list[str] = []
    try:
        refusal, weights, entries = verify(state, rules, r, k, msg, aggregate, prints, plans, notes, staged=staged)
    except ProtocolError as exc:  # a malformed receipt or ciphertext: a verdict, not silence
        refusal, weights, entries = str(exc), {}, {}
    if refusal is not None:
        return Refuse(refusal, retry=refusal.startswith(FINGERPRINT_MISMATCH), attempt=attempt, prints=prints)
    distinct = sorted(weights)
    pads = contexts = masks = None
    if aggregate.ciphertext is not None and state.public.needs_contributors:  # masked: remove exactly their pads
        signed = msg.contributor_masks() if state.public.ragged_masks else {}  # checked against the receipts
        pads = [(state.boxes[r][a], weights[a]) for a in distinct]
        made = {digest: round_context(state.fleet, state.run_id, r, k, digest) for digest in set(plans.values())}
        contexts = [made[plans[a]] for a in distinct]  # one object per plan (a cluster's contributors share one)
        masks = [signed[a] for a in distinct] if signed else None
    return Accept(round=r, cluster=k, aggregate=aggregate, weights=weights, entries=entries,
                  excluded=at_fault(state.failed.get((r, k), []), prints, r), pads=pads, contexts=contexts,
                  masks=masks, notes=tuple(notes))


def _no_new_attempt(state: KeyServerState, r: int, k: int, attempt: str) -> str | None:
    """None if a request for round ``r`` of cluster ``k``, which has a verdict, is a new
    attempt to evaluate: the verdict refused at the fingerprint check (nothing decrypted or
    spent) and this request is not one already refused; at most a cluster's members plus
    two attempts per round. Else the recorded verdict answers it: "", or the warning to log
    when the round's attempts are used up."""
    prior = state.results[(r, k)]
    tried = state.attempts.get((r, k), set())
    if not prior.retry or attempt in tried:
        return ""
    limit = len(state.plans.get(r, {}).get(k, [])) + 2
    if len(tried) >= limit:
        return f"round {r} cluster {k}: {len(tried)} attempts refused at the fingerprint check; no more this round"
    return None


def verify(state: KeyServerState, rules: Rules, r: int, k: int, msg: AggregateRequest,
           aggregate: EncryptedAggregate, prints: dict[str, str], plans: dict[str, str], notes: list[str],
           *, staged: Staged | None = None) -> tuple[str | None, dict[str, int], dict[str, str]]:
    """The checks of :func:`decide` before anything is decrypted (its one caller):
    ``(None, {contributor: weight}, ledger entries)`` if round ``r``'s aggregate of cluster
    ``k`` may be decrypted, else ``(reason, {}, {})``: the plan, every receipt's signature, round, run,
    cluster and membership, no contribution used twice in the round, the minimum of
    contributors, the weights, (shared-mask schemes) every receipt signs the aggregate's
    mask, (verifiable schemes) the fingerprint equation and the plaintext side the key
    server recomputes (:func:`check_plain_side`; decryption then uses its own), (the masked
    scheme) a box key for every contributor, and every encrypted contribution trained from
    the cluster's current model (the coordinator cannot have a round trained again from an
    older model; in a buffered job from a model the key server released to the cluster in
    this job, :meth:`~keyserver.state.KeyServerState.start_digests`). ``prints`` receives each contributor's signed fingerprint (hex), ``plans``
    each contributor's signed plan digest (its masked pads' context), ``notes`` what the log
    says. The ledger entries (contributor -> "key|agent|starting model") are recorded once
    the aggregate is decrypted. ``staged``: the receipts as their batches were checked (None:
    they are the request's own, checked here the same way, :func:`stage`)."""
    ciphertext = aggregate.ciphertext
    plan = state.plans.get(r)
    if plan is None and state.plans and r < min(state.plans):
        return f"round {r} is over (round {max(state.plans)} is open); nothing of it is decrypted", {}, {}
    if plan is None:
        return f"round {r} was never opened (no round plan); nothing of it is decrypted", {}, {}
    if k not in plan:
        return f"cluster {k} is not in round {r}'s plan (clusters {sorted(plan)})", {}, {}
    if staged is None:
        staged = Staged(frozenset(plan[k]))
        stage(staged, rules.trust, state.run_id, r, k, msg.receipts)
    if staged.error is not None:
        return staged.error, {}, {}
    receipts = staged.receipts
    names = sorted(receipts)
    if sorted(set(msg.contributors)) != names or len(msg.contributors) != len(names):
        return (f"the contributor list {sorted(msg.contributors)} is not the signed receipts' "
                f"{names}; decrypting would reveal an individual update"), {}, {}
    taken = state.taken(r)
    used = {a: taken.get(a) for a in names}
    reused = sorted(a for a, cl in used.items() if cl is not None)
    if reused:
        return (f"the contributions of {reused} in round {r} were already decrypted in cluster "
                f"{used[reused[0]]}'s aggregate; each enters one aggregate per round"), {}, {}
    need = max(rules.min_contributors, math.ceil(rules.min_fraction * len(plan[k]) - 1e-9))
    if len(names) < need:
        return (f"{len(names)} distinct contributor(s) {names}, fewer than the minimum {need} "
                f"(--min-contributors {rules.min_contributors}, --min-fraction {rules.min_fraction:g} of "
                f"{len(plan[k])}); decrypting would reveal an individual update"), {}, {}
    shares = max((rc.shares for rc in receipts.values()), default=0)
    if shares > len(names):  # distributed DP: each share is sized for this many contributors
        return (f"{len(names)} contributor(s) {names}, fewer than the {shares} the noise shares of their receipts "
                "are sized for; the sum would carry less than the job's DP noise (a job may allow dropouts "
                "with dp_quorum below 1)"), {}, {}
    weight = sum(rc.n_samples for rc in receipts.values())
    if weight != msg.total_weight:
        return f"the aggregate weighs {msg.total_weight} samples; the receipts sign {weight}", {}, {}
    public = state.public
    if ciphertext is not None and public is not None and not public.verifiable and not rules.allow_unverifiable:
        return (f"{public.scheme} aggregates cannot be checked against the contributors' fingerprints, so "
                "this key server does not decrypt them (start it with --allow-unverifiable to trust the "
                "coordinator to sum honestly, or run the job on a Paillier or masked scheme)"), {}, {}
    if ciphertext is not None and public is not None and public.verifiable:
        missing = [a for a, rc in receipts.items() if rc.key_id != public.key_id]
        if missing:
            return f"the receipts of {missing} are not under the current key", {}, {}
        # (a scheme whose encryptors fold their weight in: each contribution enters once)
        parts = [(rc.fingerprint, 1 if public.prefolds_weight else rc.n_samples)
                 for rc in receipts.values() if rc.fingerprint]
        prints.update({a: rc.fingerprint.hex() for a, rc in receipts.items()})
        # with the fold the coordinator declares, which must then be the key server's own
        # (check_plain_side): the equation holds with the recomputed fold
        if not state.secret.verify_aggregate(ciphertext, state.seeds.get(r), parts, msg.plain_fold):
            return (f"{FINGERPRINT_MISMATCH} under round {r}'s challenge (forged, altered or from "
                    "another round, or one contributor's update does not match the fingerprint it signed)"), {}, {}
    if ciphertext is not None and public is not None and not public.ragged_masks:
        union = hashlib.sha256(pack_mask(aggregate.union_mask).tobytes()).hexdigest()
        other = sorted(a for a, rc in receipts.items() if rc.mask_digest != union)
        if other:
            return (f"the receipts of {other} sign another mask than the aggregate's; a shared-mask "
                    "scheme's contributors all encrypt the same positions"), {}, {}
    if ciphertext is not None and public is not None and public.needs_contributors:
        boxes = state.boxes.get(r, {})
        unknown = sorted(a for a in names if a not in boxes)
        if unknown:
            return f"no box key for {unknown} in round {r}; their contributions cannot be unmasked", {}, {}
    if ciphertext is not None and public is not None and public.ragged_masks:
        refusal = check_encryptors(state, rules, msg, aggregate, receipts, notes)
        if refusal is not None:
            return refusal, {}, {}
    if ciphertext is not None and public is not None and public.verifiable:
        # what the aggregate adds in plaintext is the key server's own recomputation, never
        # the coordinator's word (which must equal it)
        refusal = check_plain_side(state, rules, msg, aggregate, receipts)
        if refusal is not None:
            return refusal, {}, {}
    entries: dict[str, str] = {}
    if ciphertext is not None and public is not None:
        # across jobs: one (key, agent, starting model) enters one decrypted aggregate, so a
        # re-run job cannot difference sums of the same updates in other pairings
        entries = {a: f"{public.key_id}|{a}|{receipts[a].start_digest}" for a in names}
        unsigned = sorted(a for a in names if not receipts[a].start_digest)
        if unsigned:
            return f"the receipts of {unsigned} do not sign the model they trained from", {}, {}
        start, allowed = state.start_digest(k), state.start_digests(k)
        stale = sorted(a for a in names if receipts[a].start_digest not in allowed)
        if stale:
            which = (f"cluster {k}'s current model" if len(allowed) == 1
                     else f"a model the key server released to cluster {k} in this job")
            return (f"the receipts of {stale} sign a model they trained from that is not {which} (current: "
                    f"SHA-256 {start[:16]}...); a round trains from the cluster's latest model (a buffered job's "
                    "carried devices from one released before)"), {}, {}
        # one (key, agent, starting model) enters one released sum, in this job too: fresh
        # cluster ids start from the initial model, and a device's update from one model is the
        # same in every round when its batch covers its data, so pairing it again would solve
        # it. A round that trains again from a model whose aggregate was refused (nothing
        # released) goes on.
        released = state.released()
        used = sorted((a, state.ledger[e]) for a, e in entries.items()
                      if e in state.ledger and _bars(state.run_id, released, state.ledger[e]))
        if used:
            a, where = used[0]
            run, rr, kk = where.rsplit("/", 2)
            if run == state.run_id:
                return (f"the contribution of {a!r} from this starting model was already released in this job "
                        f"(round {rr}, cluster {kk}); an update from one model enters one released sum, since "
                        "sums of it in other pairings would isolate it"), {}, {}
            return (f"the contribution of {a!r} from this starting model was already decrypted in job {run} "
                    f"(round {rr}, cluster {kk}); a contribution enters one aggregate across jobs, so "
                    "run the job from another initial model (another seed)"), {}, {}
    plans.update({a: receipts[a].plan_digest for a in names})
    return None, {a: receipts[a].n_samples for a in names}, entries


def _bars(run_id: str, released: frozenset[tuple[int, int]], where: str) -> bool:
    """Whether the ledger's use ``where`` ("run/round/cluster") bars a contribution: any use
    in another job (released or refused at unmasking), a released one in this job (run
    ``run_id``, whose ``released`` (round, cluster) sums were accepted)."""
    run, rr, kk = where.rsplit("/", 2)
    return run != run_id or (int(rr), int(kk)) in released


def check_encryptors(state: KeyServerState, rules: Rules, msg: AggregateRequest, aggregate: EncryptedAggregate,
                     receipts: dict[str, Signed], notes: list[str]) -> str | None:
    """Never a sum of fewer than k (per-client-mask schemes): count the encryptors of every
    union position from the contributors' masks, each checked against its signed receipt;
    positions fewer than k encrypted stay sealed (``aggregate.thin_mask``), and an
    aggregate that does not leave exactly those to its plaintext senders is refused.
    ``notes`` receives what stays sealed."""
    public = state.public
    need = max(rules.min_encryptors, state.job_min_encryptors)
    if need <= 1 and not public.needs_contributors and not public.verifiable:
        return None  # (masked: the masks say whose pads go where; verifiable: the plaintext side is recomputed)
    masks = msg.contributor_masks()
    if not masks and need <= 1:
        return ("the aggregate carries no contributor masks; with per-client masks the key server needs each "
                "contributor's signed mask (its pads, the encryptors per position, the plaintext side)")
    if not masks:
        return (f"the aggregate carries no contributor masks; this key server decrypts no position fewer than "
                f"{need} agents encrypted (--min-encryptors {rules.min_encryptors}) and counts them from the masks")
    wrong = sorted(a for a, m in masks.items() if hashlib.sha256(m.tobytes()).hexdigest() != receipts[a].mask_digest)
    if wrong:
        return f"the masks of {wrong} are not the ones their receipts sign"
    union = aggregate.union_mask
    if not np.array_equal(np.bitwise_or.reduce(np.stack(list(masks.values()))), pack_mask(union)):
        return "the aggregate's union mask is not the union of its contributors' signed masks"
    thin = thin_positions(list(masks.values()), union, need)
    said = thin_report(masks, thin, block_size=public.block_size, limit=3)
    if int(thin.sum()) != msg.thin_sum.size:
        first = said["blocks"][0] if said["blocks"] else None
        example = f" (block {first[0]} encrypted only by {first[1]})" if first else ""
        return (f"{said['positions']} union positions{example} were encrypted by fewer than {need} agents, but "
                f"the aggregate leaves {msg.thin_sum.size} sealed; a sum of fewer than {need} encryptors is "
                "never decrypted (start the key server with --min-encryptors 1 for the papers' rule)")
    if thin.any():
        if aggregate.position_weight is None:
            return "an aggregate with sealed positions must give the plaintext senders' weights"
        aggregate.thin_mask, aggregate.thin_sum = thin, msg.thin_sum
        first = "; ".join(f"block {b} by {a}" for b, a in said["blocks"])
        notes.append(f"{said['positions']} position(s) in {said['blocks_total']} block(s) encrypted by fewer than "
                     f"{need} agents stay sealed (first: {first})")
    return None


def check_plain_side(state: KeyServerState, rules: Rules, msg: AggregateRequest, aggregate: EncryptedAggregate,
                     receipts: dict[str, Signed]) -> str | None:
    """What a verifiable aggregate adds in plaintext, recomputed from its contributors'
    plaintext parts (each checked against the digest its receipt signs), their signed masks
    and sample counts (:func:`~senseshield.engine.aggregation.recompute_plain_side`): an
    aggregate that declares another plaintext fold (the one its fingerprint equation was
    checked with), other plaintext sums, position, block or sealed weights or sums is
    refused, naming what differs. Else None, and ``aggregate`` carries the key server's own
    plaintext sums and weights, which decryption uses."""
    side, refusal = _recompute(state, rules, msg, aggregate, receipts)
    if refusal is None:
        refusal = _declared_differs(state.public, msg, aggregate.ciphertext, side)
    if refusal is not None:
        return refusal
    aggregate.plain_sum, aggregate.position_weight = side.plain_sum, side.position_weight
    aggregate.thin_mask, aggregate.thin_sum = side.thin_mask, side.thin_sum
    return None


def _recompute(state: KeyServerState, rules: Rules, msg: AggregateRequest, aggregate: EncryptedAggregate,
               receipts: dict[str, Signed]):  # noqa: ANN202
    """``(PlainSide, None)`` from the contributors' signed plaintext parts and masks, or
    ``(None, reason)``."""
    public = state.public
    if not public.ragged_masks and msg.plain_fold:
        units = _units(public, aggregate.ciphertext)
        return None, (f"the aggregate folds plaintext into {_nonzero_units(msg.plain_fold, units)} of its {units} "
                      "ciphertext units, positions every contributor encrypted (a shared-mask scheme: nobody sends "
                      "plaintext there)")
    plains = msg.contributor_plains()
    if not plains:
        return None, ("the aggregate carries no plaintext parts of its contributors; the key server recomputes what "
                      "an aggregate adds in plaintext from them")
    wrong = sorted(a for a, part in plains.items() if hashlib.sha256(part).hexdigest() != receipts[a].plain_digest)
    if wrong:
        return None, f"the plaintext parts of {wrong} are not the ones their receipts sign"
    signed = msg.contributor_masks() if public.ragged_masks else None
    if signed is not None and sorted(signed) != sorted(plains):
        return None, "the aggregate's contributor masks do not name its contributors"

    def parts() -> Iterator[PlainContribution]:  # one at a time, in the contributors' order (a fleet's masks
        for a in sorted(plains):                 # unpacked at once would be contributors x model bytes)
            mask = np.unpackbits(signed[a], count=msg.size).astype(bool) if signed is not None \
                else aggregate.union_mask
            yield PlainContribution(a, receipts[a].n_samples, mask, *parse_plain_part(plains[a], msg.size))

    need = max(rules.min_encryptors, state.job_min_encryptors) if public.ragged_masks else 1
    side = recompute_plain_side(public, aggregate, parts(), min_encryptors=need)
    if not np.array_equal(side.union, aggregate.union_mask):
        return None, "the aggregate's union mask is not the union of its contributors' signed masks"
    return side, None


def _declared_differs(public, msg: AggregateRequest, ciphertext, side) -> str | None:  # noqa: ANN001
    """What the coordinator declares of the plaintext side against the key server's ``side``:
    the first difference, in one sentence, or None."""
    units = _units(public, ciphertext)
    if msg.plain_fold != side.fold:
        if not side.fold:
            return (f"the aggregate folds plaintext into {_nonzero_units(msg.plain_fold, units)} of its {units} "
                    "ciphertext units, positions every contributor encrypted (no contributor sent plaintext there)")
        return (f"the plaintext folded into the aggregate's ciphertext differs from its contributors' signed "
                f"plaintext parts at {_differing_units(msg.plain_fold, side.fold, units)} of its {units} units")
    if not np.array_equal(msg.plain_sum, side.plain_sum):
        return (f"the aggregate's plaintext sums differ from its contributors' signed plaintext parts at "
                f"{_differing(msg.plain_sum, side.plain_sum)} of {side.plain_sum.size} positions")
    weights = side.position_weight if side.position_weight is not None else np.zeros(0)
    if not np.array_equal(msg.position_weight, weights):
        return (f"the aggregate's position weights differ from its contributors' signed masks, withheld zones and "
                f"sample counts at {_differing(msg.position_weight, weights, msg.size)} of {msg.size} positions")
    thin_sum = side.thin_sum if side.thin_sum is not None else np.zeros(0)
    if not np.array_equal(msg.thin_sum, thin_sum):
        return (f"the plaintext senders' sums at the sealed positions differ from their signed plaintext parts at "
                f"{_differing(msg.thin_sum, thin_sum)} of {thin_sum.size} positions")
    carried = public.unit_weights(ciphertext)
    if carried is not None and not np.array_equal(carried, side.unit_weights):
        return (f"the aggregate's block weights differ from its contributors' signed sample counts at "
                f"{_differing(carried, side.unit_weights)} of {units} blocks")
    return None


def _units(public, ciphertext) -> int:  # noqa: ANN001
    """The ciphertext units (positions, or blocks of ``block_size``) of an aggregate."""
    return int(unit_starts(ciphertext.positions, public.block_size).size)


def _differing(a: np.ndarray, b: np.ndarray, size: int | None = None) -> int:
    """Positions where ``a`` and ``b`` differ (an empty array reads as zeros; ``size``: its length)."""
    n = size if size is not None else max(a.size, b.size)
    a = a if a.size else np.zeros(n)
    b = b if b.size else np.zeros(n)
    return int(np.count_nonzero(a != b)) if a.shape == b.shape else n


def _nonzero_units(fold: bytes, units: int) -> int:
    """Units of a plaintext fold (``units`` equal chunks) that are not zero."""
    return _differing_units(fold, b"", units)


def _differing_units(a: bytes, b: bytes, units: int) -> int:
    """Units (``units`` equal chunks; empty: all zero) where two plaintext folds differ."""
    width = max(len(a), len(b)) // max(units, 1)
    if not width or any(len(x) not in (0, width * units) for x in (a, b)):
        return units
    a, b = a or bytes(width * units), b or bytes(width * units)
    return sum(a[i * width : (i + 1) * width] != b[i * width : (i + 1) * width] for i in range(units))
