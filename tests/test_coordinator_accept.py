"""What becomes of an agent's update (coordinator.accept.accept_update), without a broker: a
hand-made job state with one round under way, updates built as agents build them (plaintext
parts; a stub key where the outcome depends on one), each outcome and each rejection; and
the other messages of a device about the job (failure, metrics, vector, decline)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.accept import (
    DUPLICATE, FOLD, LATE, REFUSED, SPARE, Late, accept_decline, accept_failure, accept_metrics, accept_update,
    accept_vector, cluster_round_of,
)
from coordinator.roster import AgentInfo
from coordinator.state import JobState
from senseshield.errors import ProtocolError
from senseshield.job import Job
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.protocol.messages import (
    Decline, Hello, Metrics, Receipt, RoundFailure, UpdateMessage, pack_mask, plain_part, to_frame,
)
from senseshield.strategies import FleetPlan

FLEET, RUN, SIZE = "f", "j-1", 8
KEY = SimpleNamespace(verifiable=True, block_size=1)  # a key whose aggregates are checked (no ciphertext here)


@pytest.fixture(scope="module")
def ids() -> dict[str, Identity]:
    return {a: Identity.generate(a) for a in ("a0", "a1", "a2", "a9")}


@pytest.fixture(scope="module")
def trust(ids) -> Trust:
    return Trust.for_identities({a: (i, "agent") for a, i in ids.items()}, fleet=FLEET)


def state(strategy: str = "plaintext", *, r: int = 2, phase: str = "updates") -> JobState:
    """Job j-1 at round ``r``: a0, a1 in cluster 0 (both sampled), a2 in cluster 1 (not sampled)."""
    s = JobState(RUN, Job(strategy=strategy, model="linear", rounds=3), SIZE, [SIZE], 2, completed=r - 1)
    s.agents = {a: AgentInfo(Hello(run_id=RUN, agent_id=a, n_samples=100, bandwidth=1.0, cpu_speed=1.0, index=i))
                for i, a in enumerate(["a0", "a1", "a2"])}
    s.plan = FleetPlan({"a0": 0, "a1": 0, "a2": 1}, {"a0": 0.5, "a1": 0.5, "a2": 0.5})
    s.round, s.sampled = r, {"a0", "a1"}
    s.open_clusters(now=0.0)
    s.clusters[0].phase = phase
    s.agent_rounds = {a: {r: {"cluster": 0}} for a in ("a0", "a1")}
    return s


def update(ids, agent: str = "a0", *, r: int = 2, cluster: int = 0, n: int = 100, size: int = SIZE, value: float = 0.5,
           signer: str | None = None) -> UpdateMessage:
    """A plaintext update of ``agent`` with its signed receipt (``signer``: who signs it)."""
    plaintext = np.full(size, value, dtype=np.float32)
    withheld = np.zeros(0, np.uint8)
    receipt = Receipt(run_id=RUN, cluster=cluster, n_samples=n, key_id="k", mask_digest="0" * 64, ciphertext_digest="",
                      fingerprint=b"", plain_digest=hashlib.sha256(plain_part(withheld, plaintext)).hexdigest())
    frame = to_frame(receipt, fleet=FLEET, sender=agent, round=r, signer=ids[signer or agent])
    return UpdateMessage(cluster=cluster, n_samples=n, size=size, mask=pack_mask(np.zeros(size, bool)),
                         withheld=withheld, plaintext=plaintext, ciphertext=b"", receipt=frame)


def accept(s: JobState, msg: UpdateMessage, trust: Trust, *, agent: str = "a0", r: int = 2, public=None):  # noqa: ANN001, ANN201
    return accept_update(s, msg, agent_id=agent, r=r, nbytes=123, trust=trust, public=public, now=10.0)


def test_an_update_the_round_waits_for_is_folded(ids, trust):
    s = state()
    out = accept(s, update(ids), trust)
    assert (out.kind, out.k, out.cr) == (FOLD, 0, s.clusters[0])
    assert out.note.nbytes == 123 and out.update.client_id == "a0" and np.all(out.update.plaintext == 0.5)
    assert s.clusters[0].updates == {} and s.clusters[0].running is None  # deciding changes nothing
    out.cr.fold("a0", out.update, out.note, make=lambda: s.new_aggregate(0, 2, None), keep=False)
    assert list(s.clusters[0].updates) == ["a0"] and s.clusters[0].running is not None


def test_a_second_update_is_a_duplicate_or_a_spare(ids, trust):
    s = state()
    first = update(ids)
    out = accept(s, first, trust)
    out.cr.fold("a0", out.update, out.note, make=lambda: s.new_aggregate(0, 2, None), keep=False)
    assert accept(s, first, trust).kind == DUPLICATE  # re-sent
    other = update(ids, value=0.25)
    assert accept(s, other, trust).kind == DUPLICATE  # another one, but no fingerprint search possible
    spare = accept(s, other, trust, public=KEY)
    assert spare.kind == SPARE and spare.note.receipt == other.receipt  # kept aside for the key server's search
    s.clusters[0].phase = "done"
    assert accept(s, other, trust, public=KEY).kind == DUPLICATE  # the verdict is in


def test_an_update_below_its_floor_is_refused_and_a_closed_phase_is_late(ids, trust):
    s = state("sensecrypt")
    out = accept(s, update(ids), trust, public=KEY)  # encrypts nothing; its budget asks for a block
    assert out.kind == REFUSED and "encrypts 0.0000 of the parameters, below the" in out.reason
    assert accept(state(phase="decrypting"), update(ids), trust).kind == LATE
    s = state()
    s.clusters[0].expected.discard("a1")  # a proposer's round: a1 sent no proposal
    assert accept(s, update(ids, "a1"), trust, agent="a1").kind == LATE


@pytest.mark.parametrize("case, sentence", [
    (dict(r=3), "Update of 'a0' is for round 3; the current round is 2."),
    (dict(r=0), "Update of 'a0' is for round 0; the current round is 2."),
    (dict(agent="a9"), "Update from 'a9', which is not in this run."),
    (dict(size=SIZE + 1), "Update of 'a0' has 9 parameters; the model has 8."),
    (dict(cluster=1), "Update of 'a0' is for cluster 1; it belongs to 0."),
    (dict(n=99), "Update of 'a0' claims 99 samples; it joined with 100, which plaintext weighs 100."),
    (dict(signer="a1"), "Frame from 'a0' is signed with key "),  # a receipt a1 signed as a0
    (dict(agent="a2", cluster=1), "Update from 'a2', which was not sampled in round 2."),
])
def test_an_update_that_fails_a_check_is_one_sentence_and_changes_nothing(ids, trust, case, sentence):
    s = state()
    agent, r = case.pop("agent", "a0"), case.pop("r", 2)
    msg = update(ids, agent, r=r, **case)
    with pytest.raises(ProtocolError) as err:
        accept(s, msg, trust, agent=agent, r=r)
    assert sentence in str(err.value) and "\n" not in str(err.value)
    assert all(not cr.updates for cr in s.clusters.values()) and s.refused == {} and s.straggling == []


def test_an_update_for_a_closed_round_is_late(ids, trust):
    s = state(r=3)
    with pytest.raises(Late) as err:
        accept(s, update(ids, r=2), trust, r=2)
    late = err.value
    assert str(late) == "Update of 'a0' is for round 2, which is closed (now 3)."
    assert (late.agent, late.r, late.what, late.when) == ("a0", 2, "update", 10.0)
    with pytest.raises(ProtocolError, match="no job|not in this run"):
        cluster_round_of(None, "a0", 2, "proposal")


def test_a_devices_failure_metrics_vector_and_decline(ids):
    s = state()
    assert accept_failure(s, RoundFailure(run_id=RUN, phase="round", reason="NaN labels"), agent_id="a0", r=2)
    assert s.clusters[0].failed == {"a0": "NaN labels"} and s.agent_rounds["a0"][2]["failed"] == {"round": "NaN labels"}
    assert not accept_failure(s, RoundFailure(run_id=RUN, phase="round", reason="again"), agent_id="a0", r=2)
    with pytest.raises(ProtocolError, match="the current job is j-1"):
        accept_failure(s, RoundFailure(run_id="j-0", phase="round", reason="x"), agent_id="a0", r=2)
    with pytest.raises(ProtocolError, match="which it was not in"):
        accept_failure(s, RoundFailure(run_id=RUN, phase="evaluation", reason="x"), agent_id="a2", r=2)
    metrics = Metrics(cluster=0, metric=0.5, n_test=10)
    with pytest.raises(ProtocolError, match="cluster 0 got no model"):
        accept_metrics(s, metrics, agent_id="a0", r=2)
    s.model_round[0] = 2
    assert accept_metrics(s, metrics, agent_id="a0", r=2) and s.metrics[("a0", 2)] is metrics
    assert not accept_metrics(s, Metrics(cluster=0, metric=0.9, n_test=10), agent_id="a0", r=2)  # the first stands
    with pytest.raises(ProtocolError, match="are for cluster 1; it belongs to 0"):
        accept_metrics(s, Metrics(cluster=1, metric=0.5, n_test=10), agent_id="a1", r=2)
    assert not accept_vector(s, "a0", np.zeros(SIZE))  # planned already
    s.agents["a3"] = AgentInfo(Hello(run_id=RUN, agent_id="a3", n_samples=10, bandwidth=1.0, cpu_speed=1.0))
    assert accept_vector(s, "a3", np.zeros(SIZE))  # a late device, ready to be admitted
    with pytest.raises(ProtocolError, match="has 3 values; the model has 8"):
        accept_vector(s, "a0", np.zeros(3))
    assert accept_decline(s, Decline(run_id=RUN, reason="no data"), agent_id="a8") and s.declined == {"a8": "no data"}
    assert not accept_decline(s, Decline(run_id=RUN, reason="no data"), agent_id="a8")
    with pytest.raises(ProtocolError, match="which takes part in it"):
        accept_decline(s, Decline(run_id=RUN, reason="x"), agent_id="a0")


def test_a_carried_update_of_a_buffered_job_claims_its_staleness_discount(ids, trust):
    """Round 3 of a buffered job: a0 was carried from model 0 (two rounds stale), so its 100
    samples weigh round(100 / sqrt(3)) = 58; its full weight is refused, as is a discount the
    plan did not give a1 (which starts from the latest model)."""
    from senseshield.strategies import StrategyOptions

    s = state(r=3)
    s.config = s.config.model_copy(update={"options": StrategyOptions(buffer=2)})
    s.__dict__.pop("strategy", None)  # the cached strategy follows the job's options
    s.agent_rounds = {"a0": {3: {"cluster": 0, "model_round": 0, "trained_in": 1}},
                      "a1": {3: {"cluster": 0, "model_round": 2, "trained_in": 3}}}
    assert s.staleness_of("a0", 3) == 2 and s.staleness_of("a1", 3) == 0
    assert accept(s, update(ids, r=3, n=58), trust, r=3).kind == FOLD
    with pytest.raises(ProtocolError, match=r"claims 100 samples; it joined with 100, which plaintext weighs 58 2 round"):
        accept(s, update(ids, r=3, n=100), trust, r=3)
    with pytest.raises(ProtocolError, match=r"claims 58 samples; .* weighs 100\."):
        accept(s, update(ids, "a1", r=3, n=58), trust, agent="a1", r=3)
