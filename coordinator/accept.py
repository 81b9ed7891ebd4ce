"""What becomes of an agent's update: :func:`accept_update` is the one place that decides it.

It takes the job's state (:class:`~coordinator.state.JobState`: the plan, the agents, the
round under way and its cluster rounds), the decoded :class:`UpdateMessage` and the facts of
its frame (sender, round, size), and either raises
:class:`~senseshield.errors.ProtocolError` with one sentence (the update is rejected and
changes nothing) or returns an :class:`Outcome` the service applies. The checks, in order:

1. the round is one the job has reached (:class:`Late` if it is closed: the sender is
   noted as arriving late);
2. the agent is in the job and the update names its cluster and the model's size
   (:func:`~coordinator.rounds.check_facts`), and claims the sample weight of its hello
   (discounted for its staleness in a buffered job, :func:`~senseshield.rounds.update_weight`);
3. the update decodes under the job's key;
4. its receipt is the agent's own signed statement about it (:func:`~coordinator.rounds.check_receipt`);
5. the agent was sampled in the round (:func:`cluster_round_of`), and a masked update uses
   the round's ring;
6. a second update of the agent in the round is a *duplicate* (the same receipt, or no
   search possible) or a *spare* (a different update while the key server may still find the
   first at fault, :mod:`coordinator.contributions`);
7. its encryption meets the floor of the agent's budget (:func:`~coordinator.rounds.floor_refusal`):
   else *refused* (named in the report, not waited for);
8. the round still waits for it: else *late* (straggling), otherwise it is *folded* into the
   cluster's running aggregate.

:func:`accept_update` changes nothing, neither the state nor the round: the service applies the outcome
(``Coordinator._on_update``). The other messages of a device about the job are checked
here too, and recorded in the state when they pass: its bootstrap vector
(:func:`accept_vector`), a decline (:func:`accept_decline`), a round failure
(:func:`accept_failure`) and its metrics (:func:`accept_metrics`).
tests/test_coordinator_accept.py checks them without a broker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.rounds import ClusterRound, UpdateNote, check_facts, check_receipt, floor_refusal, note_of
from senseshield.errors import ProtocolError
from senseshield.rounds import update_weight
from senseshield.runtime.identity import Trust
from senseshield.runtime.protocol.messages import Decline, Metrics, RoundFailure, UpdateMessage, plain_part, update_from_message

if TYPE_CHECKING:
    from coordinator.state import JobState

FOLD, SPARE, DUPLICATE, REFUSED, LATE = "fold", "spare", "duplicate", "refused", "late"


class Late(ProtocolError):
    """A message of ``agent`` for round ``r``, which is closed (``what``: proposal, update,
    round failure; ``when``: our clock): rejected, and its straggling event notes it late."""

    def __init__(self, message: str, *, agent: str, r: int, what: str, when: float) -> None:
        super().__init__(message)
        self.agent, self.r, self.what, self.when = agent, r, what, when


@dataclass(frozen=True)
class Outcome:
    """What to do with an update that passed the checks (see the module docstring):
    ``kind`` is ``fold`` (into cluster ``k``'s round ``cr``), ``spare`` (kept aside),
    ``duplicate`` (dropped), ``refused`` (``reason``: the floor's sentence) or ``late``."""

    kind: str
    k: int
    cr: ClusterRound
    update: Any = None  # the decoded ProtectedUpdate
    note: UpdateNote | None = None  # what is kept of it (fold, spare)
    reason: str = ""


def cluster_round_of(state: JobState | None, agent_id: str, r: int, what: str, *,
                     now: float | None = None) -> ClusterRound:
    """The cluster round of the round under way that ``agent_id``'s ``what`` of round ``r``
    belongs to; ProtocolError if it is not in the job (``state`` None: no job yet), the round
    is not the current one (:class:`Late` for a closed round) or it was not sampled."""
    if state is None or state.plan is None or agent_id not in state.plan.cluster_of:
        raise ProtocolError(f"{what.capitalize()} from {agent_id!r}, which is not in this run.")
    if r != state.round:
        if 0 < r < state.round:
            raise Late(f"{what.capitalize()} of {agent_id!r} is for round {r}, which is closed (now {state.round}).",
                       agent=agent_id, r=r, what=what, when=time.time() if now is None else now)
        raise ProtocolError(f"{what.capitalize()} of {agent_id!r} is for round {r}; the current round is {state.round}.")
    cr = state.clusters.get(state.plan.cluster_of[agent_id])
    if cr is None or agent_id not in cr.members:
        raise ProtocolError(f"{what.capitalize()} from {agent_id!r}, which was not sampled in round {r}.")
    return cr


def accept_update(state: JobState | None, msg: UpdateMessage, *, agent_id: str, r: int, nbytes: int, trust: Trust,
                  public: Any = None, now: float | None = None) -> Outcome:  # noqa: ANN401 - a PublicKey
    """The outcome of update ``msg`` of ``agent_id`` for round ``r`` (its frame's payload is
    ``nbytes`` long), under the job's key ``public`` (None: nothing encrypted); ProtocolError
    (one sentence) if it is rejected. See the module docstring for the checks."""
    if state is None:
        raise ProtocolError(f"Update from {agent_id!r}, which is not in this run (no job is running).")
    if not 1 <= r <= state.round:
        raise ProtocolError(f"Update of {agent_id!r} is for round {r}; the current round is {state.round}.")
    hello = check_facts(state.plan, state.agents, state.size, agent_id, "Update", cluster=msg.cluster, size=msg.size)
    strategy = state.strategy
    tau = state.staleness_of(agent_id, r)
    weight = update_weight(strategy, hello.n_samples, tau)
    if msg.n_samples != weight:
        stale = f" {tau} round(s) stale" if tau else ""
        raise ProtocolError(f"Update of {agent_id!r} claims {msg.n_samples} samples; it joined with {hello.n_samples}, "
                            f"which {strategy.name} weighs {weight}{stale}.")
    update = update_from_message(msg, public, client_id=agent_id, round=r, size=state.size)
    verifiable = public is not None and public.verifiable
    check_receipt(trust, msg.receipt, agent_id=agent_id, r=r, run_id=state.run_id, cluster=msg.cluster,
                  n_samples=msg.n_samples, ciphertext=msg.ciphertext, verifiable=verifiable,
                  plain=plain_part(msg.withheld, msg.plaintext))
    cr = cluster_round_of(state, agent_id, r, "update", now=now)
    k = state.plan.cluster_of[agent_id]
    ring = update.ciphertext.meta.get("ring_bits") if update.ciphertext is not None else None
    if ring is not None and ring != cr.ring_bits:
        raise ProtocolError(f"Update of {agent_id!r} is masked modulo 2^{ring}; the round's plan asks for "
                            f"2^{cr.ring_bits}.")
    first = cr.book.first(agent_id) or cr.updates.get(agent_id)  # (an attempt in flight may leave it out)
    if first is not None:
        if msg.receipt != first.receipt and cr.phase in ("updates", "decrypting") and verifiable:
            return Outcome(SPARE, k, cr, update, note_of(update, nbytes, msg.report, msg.receipt, msg.training))
        return Outcome(DUPLICATE, k, cr)  # a re-sent duplicate
    if public is not None:
        reason = floor_refusal(strategy, state.plan.budget_of.get(agent_id, 0.0), update.he_ratio, agent_id=agent_id,
                               r=r, size=state.size, block_size=public.block_size)
        if reason is not None:
            return Outcome(REFUSED, k, cr, reason=reason)
    if cr.phase != "updates" or agent_id not in cr.expected:
        return Outcome(LATE, k, cr)
    return Outcome(FOLD, k, cr, update, note_of(update, nbytes, msg.report, msg.receipt, msg.training))


def accept_failure(state: JobState | None, msg: RoundFailure, *, agent_id: str, r: int) -> bool:
    """A device said its round ``r`` failed (``msg.phase`` round: the round closes without it,
    as without a device gone offline) or its evaluation of round ``r``'s model did; both go
    into its round record. True when it is new (False: said before); ProtocolError if it is
    not of the job, of a round it was in, or its update arrived."""
    if state is None or msg.run_id != state.run_id:
        raise ProtocolError(f"Round failure of job {msg.run_id} from {agent_id!r}; the current job is "
                            f"{state.run_id if state is not None else ''}.")
    if msg.phase == "evaluation":
        if r not in state.agent_rounds.get(agent_id, {}):
            raise ProtocolError(f"Evaluation failure of {agent_id!r} for round {r}, which it was not in.")
    else:
        cr = cluster_round_of(state, agent_id, r, "round failure")
        if agent_id in cr.updates:
            raise ProtocolError(f"Round failure of {agent_id!r} for round {r}, whose update arrived; ignored.")
        cr.failed[agent_id] = msg.reason
    failed = state.agent_rounds[agent_id][r].setdefault("failed", {})
    if msg.phase in failed:
        return False  # said once
    failed[msg.phase] = msg.reason
    return True


def accept_metrics(state: JobState | None, msg: Metrics, *, agent_id: str, r: int, announced: int = 0) -> bool:
    """A device's evaluation of round ``r``'s model of its cluster (``announced``: the round
    of the key server's latest model of that cluster); True when it is recorded (the first
    report of a round stands: devices repeat theirs after a restart). ProtocolError if the
    device is not in the job, names another cluster, or its cluster got no model in round ``r``."""
    if state is None or state.plan is None or agent_id not in state.plan.cluster_of:
        raise ProtocolError(f"Metrics from {agent_id!r}, which is not in this run.")
    k = state.plan.cluster_of[agent_id]
    if msg.cluster != k:
        raise ProtocolError(f"Metrics of {agent_id!r} are for cluster {msg.cluster}; it belongs to {k}.")
    if not state.has_model(k, r, announced=announced):
        raise ProtocolError(f"Metrics of {agent_id!r} for round {r}, in which cluster {k} got no model (now round "
                            f"{state.round}).")
    if (agent_id, r) in state.metrics:
        return False
    state.metrics[(agent_id, r)] = msg
    return True


def accept_vector(state: JobState | None, agent_id: str, vector: Any) -> bool:  # noqa: ANN401 - an array
    """A device's bootstrap ``vector``, kept with its hello (a repeat once the fleet is planned
    changes nothing); True when the device can now be admitted to the planned fleet.
    ProtocolError if it said no hello in the job or the vector is not of the model's size."""
    info = state.agents.get(agent_id) if state is not None else None
    if info is None:
        raise ProtocolError(f"Bootstrap vector from {agent_id!r}, which has not said hello in this run.")
    if vector.size != state.size:
        raise ProtocolError(f"Bootstrap vector of {agent_id!r} has {vector.size} values; the model has {state.size}.")
    if state.plan is not None and info.vector is not None:
        return False  # the fleet is planned: a repeated vector changes nothing
    info.vector = vector
    return state.plan is not None and agent_id not in state.plan.cluster_of


def accept_decline(state: JobState | None, msg: Decline, *, agent_id: str) -> bool:
    """A device does not take the job (``msg.reason``); True when it is new for the running
    job (``state`` None: none). ProtocolError if the device said hello to the job: it takes part."""
    if state is None or msg.run_id != state.run_id or agent_id in state.declined:
        return False
    if agent_id in state.agents:
        raise ProtocolError(f"Decline of job {msg.run_id} from {agent_id!r}, which takes part in it; ignored.")
    state.declined[agent_id] = msg.reason
    return True
