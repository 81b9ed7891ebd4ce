"""The checks an update passes before it touches a round (coordinator.rounds), with real
Ed25519 identities and signed frames, no broker: the facts it claims, its signed receipt,
its encryption floor. Each refusal is one sentence naming the agent."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.roster import AgentInfo, HelloFacts
from coordinator.rounds import (
    ClusterRound, UpdateNote, advance, check_facts, check_receipt, floor_refusal, note_of, round_tally,
)
from senseshield.errors import ProtocolError
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.protocol.messages import Hello, Receipt, to_frame
from senseshield.strategies import FleetPlan, build_strategy
from senseshield.strategies.base import StrategyOptions

FLEET, RUN = "f", "j-1"
CIPHER = b"ciphertext bytes"
PLAIN = b"plaintext part bytes"


@pytest.fixture(scope="module")
def ids() -> dict[str, Identity]:
    return {a: Identity.generate(a) for a in ("a0", "a1", "a9")}


def _receipt(ids, *, sender="a0", signer="a0", r=2, run=RUN, cluster=0, n=100, cipher=CIPHER, fp=b"fp") -> bytes:
    receipt = Receipt(run_id=run, cluster=cluster, n_samples=n, key_id="k", mask_digest="0" * 64,
                      ciphertext_digest=hashlib.sha256(cipher).hexdigest() if cipher else "", fingerprint=fp,
                      plain_digest=hashlib.sha256(PLAIN).hexdigest())
    return to_frame(receipt, fleet=FLEET, sender=sender, round=r, signer=ids[signer])


def _check(trust, frame, **over) -> None:
    args = dict(agent_id="a0", r=2, run_id=RUN, cluster=0, n_samples=100, ciphertext=CIPHER, verifiable=True,
                plain=PLAIN)
    check_receipt(trust, frame, **{**args, **over})


def test_a_receipt_must_be_the_agents_own_statement_about_this_update(ids):
    trust = Trust.for_identities({"a0": (ids["a0"], "agent"), "a1": (ids["a1"], "agent")}, fleet=FLEET)
    _check(trust, _receipt(ids))  # genuine
    _check(trust, _receipt(ids, cipher=b"", fp=b""), ciphertext=b"")  # nothing encrypted, no fingerprint
    cases = {
        "carries no signed receipt": (b"", {}),
        "carries a receipt of 'a1' for round 2": (_receipt(ids, sender="a1", signer="a1"), {}),
        "carries a receipt of 'a0' for round 1": (_receipt(ids, r=1), {}),
        "for another run, cluster or sample count": (_receipt(ids, run="j-2"), {}),
        "for another run, cluster or sample count.": (_receipt(ids, n=99), {}),
        "carries a receipt for another ciphertext": (_receipt(ids), {"ciphertext": b"other bytes"}),
        "carries a receipt for another plaintext part": (_receipt(ids), {"plain": b"other bytes"}),
        "without the fingerprint of its ciphertext": (_receipt(ids, fp=b""), {}),
    }
    for needle, (frame, over) in cases.items():
        with pytest.raises(ProtocolError) as err:
            _check(trust, frame, **over)
        assert needle in str(err.value) and "'a0'" in str(err.value), (needle, str(err.value))
    with pytest.raises(ProtocolError):  # signed by a key the trust file does not pin for a0
        _check(trust, _receipt(ids, signer="a9"))


def test_a_message_must_name_its_run_cluster_and_size():
    hello = Hello(run_id=RUN, agent_id="a0", n_samples=100, bandwidth=1.0, cpu_speed=1.0)
    plan, agents = FleetPlan({"a0": 1}, {"a0": 0.5}), {"a0": AgentInfo(hello)}
    assert check_facts(plan, agents, 10, "a0", "Update", cluster=1, size=10) == HelloFacts(hello)
    for args, needle in (((None, "a0", 1, 10), "Update from 'a0', which is not in this run."),
                         ((plan, "a5", 1, 10), "Update from 'a5', which is not in this run."),
                         ((plan, "a0", 1, 11), "Update of 'a0' has 11 parameters; the model has 10."),
                         ((plan, "a0", 0, 10), "Update of 'a0' is for cluster 0; it belongs to 1.")):
        p, agent, cluster, size = args
        with pytest.raises(ProtocolError, match="^" + needle.replace(".", r"\.") + "$"):
            check_facts(p, agents, 10, agent, "Update", cluster=cluster, size=size)


def test_an_update_below_the_budgets_floor_is_refused():
    full = build_strategy("paillier-full", StrategyOptions())  # every parameter, whatever the budget
    assert floor_refusal(full, 0.1, 1.0, agent_id="a0", r=3, size=100, block_size=1) is None
    reason = floor_refusal(full, 0.1, 0.5, agent_id="a0", r=3, size=100, block_size=1)
    assert reason == ("round 3: update of 'a0' encrypts 0.5000 of the parameters, below the 1.0000 its encryption "
                      "budget 0.1000 requires; refused")
    default = build_strategy("sensecrypt", StrategyOptions())  # a positive budget: at least one block
    assert floor_refusal(default, 0.3, 0.0, agent_id="a0", r=1, size=100, block_size=10) is not None
    assert floor_refusal(default, 0.3, 0.1, agent_id="a0", r=1, size=100, block_size=10) is None
    assert floor_refusal(default, 0.0, 0.0, agent_id="a0", r=1, size=100, block_size=10) is None


def test_a_rounds_tally_and_notes():
    note = lambda n: UpdateNote({"train": 1.0}, 0.25, n, {}, "m", b"r")  # noqa: E731
    plan = FleetPlan({"a0": 0, "a1": 0, "a2": 0, "b0": 1, "b1": 1, "b2": 1}, dict.fromkeys(["a0", "b0"], 0.5))
    ok = ClusterRound(["a0", "a1", "a2"], 0.0, "done", updates={"a0": note(100), "a1": note(300)},
                      straggled=["a2"], accepted=True, timings={"aggregate": 0.5, "decrypt": 1.0}, union_ratio=0.5)
    lost = ClusterRound(["b0", "b1", "b2"], 0.0, "done", updates={"b0": note(50)}, straggled=["b1", "b2"],
                        offline={"b1"}, failed={"b2": "out of memory"}, accepted=False, reason="key server away",
                        refused={"b9": "bad fingerprint"}, timings={"aggregate": 0.25})
    work = {"a0": {"steps": 3, "full_steps": 5, "budget": 0.5}, "a1": {"cluster": 0}}
    tally = round_tally(4, {1: lost, 0: ok}, work=work, plan=plan, model_bytes=1000, min_encryptors=2,
                        notes=["round 4: c9 offline, not sampled"])
    assert tally.bytes_up == 450 and tally.bytes_down == 3000  # the accepted cluster's three members
    assert tally.work == {"a0": {"steps": 3, "full_steps": 5, "budget": 0.5}}
    assert tally.phases["aggregate"] == 0.75 and tally.phases["decrypt"] == 1.0 and tally.union_ratios == [0.5]
    assert tally.notes == [
        "round 4: c9 offline, not sampled",
        "round 4 cluster 0: closed without a2 (deadline)",
        "round 4 cluster 1: model unchanged (key server away)",
        "round 4 cluster 1: refused the update of b9 (bad fingerprint)",
        "round 4 cluster 1: closed without b1 (offline)",
        "round 4 cluster 1: closed without b2 (failed)",
    ]
    assert ok.record()["updates"] == ["a0", "a1"] and note(7).facts()["bytes_up"] == 7


def test_a_round_closes_its_phases_when_due():
    """coordinator.rounds.advance: proposals close at half the deadline (or once the missing
    went offline or failed), with the consensus of the proposals in sent to the proposers; the
    updates close at the deadline (or once the missing went offline or failed) with the
    running aggregate; each member missing is recorded as straggling."""
    import logging

    from senseshield.engine.aggregation import StreamingAggregate, protect_update

    log = logging.getLogger("test.advance")
    mask = np.zeros(10, bool)
    neg = ClusterRound(["a0", "a1", "a2"], deadline=100.0, phase="proposals", offline={"a2"})
    neg.proposals = {"a0": mask, "a1": mask}
    lone = ClusterRound(["b0", "b1"], deadline=100.0, phase="updates", expected={"b0", "b1"}, failed={"b1": "oom"})
    lone.running = StreamingAggregate(None, size=10, round=2, cluster=1, min_encryptors=1)
    update = protect_update(np.ones(10), mask, None, client_id="b0", round=2, cluster=1, n_samples=5)
    lone.running.add(update)
    lone.updates["b0"] = note_of(update, 10, {}, b"r")
    late = ClusterRound(["c0"], deadline=100.0, phase="updates", expected={"c0"})
    closed, straggling = [], []
    args = dict(r=2, round_deadline=60.0, straggling=straggling, consensus=lambda ps: ps[0] | True,
                online=lambda a: a != "a2", then=closed.append, log=log)
    advance({0: neg, 1: lone, 2: late}, now=10.0, **args)
    assert [(c.k, c.decision is not None, c.aggregate is not None) for c in closed] == [(0, True, False), (1, False, True)]
    assert closed[0].decision[0] == ["a0", "a1"] and closed[0].decision[1].all()
    assert neg.phase == "updates" and neg.expected == {"a0", "a1"} and lone.running is None
    assert late.phase == "updates"  # nothing due before its deadline
    assert [(s["agent"], s["missing"], s["online"]) for s in straggling] == [("a2", "offline", False),
                                                                             ("b1", "failed", True)]
    advance({0: neg, 2: late}, now=100.0, **args)  # the deadline: closed without who is missing
    assert late.phase == "done" and not late.accepted and late.reason == "no update arrived: 1 sent none before the deadline"
    assert neg.phase == "done" and [s["missing"] for s in straggling[2:]] == ["update", "update", "update"]


@settings(max_examples=60, deadline=None)
@given(timings=st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False, width=64), max_size=4),
       he_ratio=st.floats(0, 1), nbytes=st.integers(0, 10**9),
       report=st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False) | st.booleans() | st.text(max_size=5),
                              max_size=3),
       training=st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False), max_size=3),
       receipt=st.binary(max_size=64))
def test_an_update_note_reads_back_what_it_was_given(timings, he_ratio, nbytes, report, training, receipt):  # noqa: ANN001
    """A note is kept packed (a round holds one per contributor): every field reads back as
    given, numpy scalars as floats, and equal notes compare equal."""
    note = UpdateNote(timings, np.float64(he_ratio), nbytes, report, "m" * 64, receipt, training)
    assert (note.timings, note.he_ratio, note.nbytes, note.report, note.mask_sha256, note.training, note.receipt) == \
        (timings, he_ratio, nbytes, report, "m" * 64, training, receipt)
    assert note.facts() == {"he_ratio": he_ratio, "bytes_up": nbytes, "mask_sha256": "m" * 64,
                            "agent_timings": timings, "training": training}
    assert note == UpdateNote(dict(timings), he_ratio, nbytes, dict(report), "m" * 64, bytes(receipt), dict(training))
    with pytest.raises(AttributeError, match="immutable"):
        note.receipt = b""
