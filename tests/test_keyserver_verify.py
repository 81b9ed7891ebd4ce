"""The key server's decision on an aggregate request (keyserver.verify.decide), no broker and
no service: a real masked key, real agents' updates, fingerprints under a real seed and
signed receipts, over a KeyServerState built here; each refusal names what is wrong, and an
accepted request's plan names what is unmasked and decrypted."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from keyserver.state import KeyServerState
from keyserver.verify import (
    FINGERPRINT_MISMATCH,
    Accept,
    Decrypting,
    Refuse,
    Reject,
    Replay,
    Rules,
    at_fault,
    decide,
    signed_receipt,
)
from senseshield.engine.aggregation import aggregate_updates, protect_update
from senseshield.he import SCHEMES
from senseshield.he.base import model_digest, round_context
from senseshield.he.fingerprint import SEED_BYTES
from senseshield.job import Job
from senseshield.strategies import StrategyOptions
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    AggregateResult,
    from_frame,
    Receipt,
    aggregate_to_message,
    pack_frames,
    pack_mask,
    plain_digest,
    to_frame,
)

FLEET, RUN, SIZE, R = "f", "run-1", 24, 1
INITIAL = np.linspace(-1, 1, SIZE).astype(np.float32)  # the cluster's current model: what the receipts sign
JOB = Job(strategy="masked", model="linear", clients=2, rounds=3, input_shape=[1, 4, 6], num_classes=2)


@pytest.fixture(scope="module")
def world():
    secret = SCHEMES.get("masked").generate()
    ids = {a: Identity.generate(a) for a in "abcd"}
    trust = Trust.for_identities({a: (i, "agent") for a, i in ids.items()}, fleet=FLEET)
    return secret, ids, trust, bytes(range(SEED_BYTES))  # the round's challenge seed


def _part(world, agent: str, *, stale: bool = False, n: int = 10):
    """``agent``'s update and signed receipt; ``stale``: its fingerprint is under another
    round's challenge (what senseshield_checks.bad_contribution sends)."""
    secret, ids, _, seed = world
    public = secret.public_key
    mask = np.ones(SIZE, bool)
    key = public.for_contributor(ids[agent].exchange, round_context(FLEET, RUN, R, 0))
    update = protect_update(np.random.default_rng(ord(agent)).normal(size=SIZE) * 0.01, mask, key,
                            client_id=agent, round=R, cluster=0, n_samples=n)
    cipher = public.ciphertext_bytes(update.ciphertext)
    fp = public.fingerprint(update.ciphertext, bytes(SEED_BYTES) if stale else seed)
    receipt = Receipt(run_id=RUN, cluster=0, n_samples=n, key_id=public.key_id,
                      mask_digest=hashlib.sha256(pack_mask(mask).tobytes()).hexdigest(),
                      ciphertext_digest=hashlib.sha256(cipher).hexdigest(), fingerprint=fp,
                      start_digest=model_digest(INITIAL),
                      plain_digest=plain_digest(np.zeros(0, np.uint8), update.plaintext))
    return update, to_frame(receipt, fleet=FLEET, sender=agent, round=R, signer=ids[agent])


def _request(world, parts):
    public = world[0].public_key
    aggregate = aggregate_updates([u for u, _ in parts], public, round=R, cluster=0, min_encryptors=1)
    return aggregate_to_message(aggregate, public, run_id=RUN, receipts=[rc for _, rc in parts])


def _state(world, tmp_path=None, **over) -> KeyServerState:  # noqa: ANN001
    """Round R of run RUN opened with cluster 0 = a, b, c, d and its challenge seed; ``over``
    replaces any field."""
    secret, _, _, seed = world
    args = dict(key_dir=tmp_path or "/nonexistent", fleet=FLEET, run_id=RUN, job=JOB, initial=INITIAL,
                public=secret.public_key, secret=secret, plans={R: {0: ["a", "b", "c", "d"]}}, seeds={R: seed},
                boxes={R: {a: b"box" for a in "abcd"}})
    return KeyServerState(**{**args, **over})


def _rules(world, **over) -> Rules:
    return Rules(**{**dict(trust=world[2], min_contributors=2, min_fraction=0.0, min_encryptors=1), **over})


def _decide(world, msg, *, r: int = R, sender: str = "coordinator", rules: Rules | None = None, **over):  # noqa: ANN201
    return decide(_state(world, **over), rules or _rules(world), sender, r, msg)


def test_an_honest_aggregate_is_accepted_with_the_plan_of_what_to_unmask(world):
    msg = _request(world, [_part(world, a) for a in "abc"])
    state = _state(world)
    decision = decide(state, _rules(world), "coordinator", R, msg)
    assert isinstance(decision, Accept), decision
    assert (decision.round, decision.cluster, decision.weights) == (R, 0, {"a": 10, "b": 10, "c": 10})
    assert decision.contributors == ["a", "b", "c"] and decision.excluded == {}
    key_id = world[0].public_key.key_id
    assert decision.entries["a"] == f"{key_id}|a|{model_digest(INITIAL)}"
    # the masked scheme: exactly these contributors' pads, in the context each receipt signs
    assert decision.pads == [(b"box", 10)] * 3 and decision.masks is None
    assert decision.contexts == [round_context(FLEET, RUN, R, 0)] * 3
    assert decision.aggregate.ciphertext is not None and decision.aggregate.round == R
    # the state is read, never changed
    assert not state.reserved and not state.spent and not state.results and not state.entries


def test_what_is_kept_of_each_receipt_is_what_it_signs_with_shared_digests_held_once(world):
    """A request names every contributor of a cluster: the key server keeps the fields its
    checks read of each verified receipt, the digests most of them share as one object."""
    common: dict[str, str] = {}
    kept = []
    for a in "abcd":
        _, raw = _part(world, a)
        receipt = from_frame(decode_frame(raw))
        signed = signed_receipt(receipt, common)
        assert signed._asdict() == {f: getattr(receipt, f) for f in signed._fields}
        kept.append(signed)
    for f in ("key_id", "mask_digest", "start_digest", "plan_digest"):
        assert all(getattr(s, f) is getattr(kept[0], f) for s in kept)
    assert len({s.fingerprint for s in kept}) == 4  # what is its own stays its own


def test_each_refusal_names_what_is_wrong(world):
    parts = [_part(world, a) for a in "abc"]
    msg = _request(world, parts)
    entry = f"{world[0].public_key.key_id}|a|{model_digest(INITIAL)}"
    cases = {
        "round 1 was never opened": dict(plans={}),
        # a round the key server forgot (two later rounds were opened): over, nothing decrypted
        "round 1 is over (round 3 is open); nothing of it is decrypted": dict(plans={2: {0: ["a"]}, 3: {0: ["a"]}}),
        "cluster 0 is not in round 1's plan": dict(plans={R: {1: ["a"]}}),
        "and is not a member of cluster 0": dict(plans={R: {0: ["a", "b"]}}),
        "the contributions of ['b'] in round 1 were already decrypted in cluster 1's": dict(spent={R: {"b": 1}}),
        "the contributions of ['c'] in round 1 were already decrypted in cluster 2's": dict(reserved={R: {"c": 2}}),
        "already decrypted in job run-0 (round 2, cluster 0)": dict(ledger={entry: "run-0/2/0"}),
        # a released sum of this job bars the starting model; a refused one (nothing released) does not
        "was already released in this job (round 2, cluster 0)": dict(
            ledger={entry: f"{RUN}/2/0"}, results={(2, 0): AggregateResult(run_id=RUN, cluster=0, accepted=True)}),
        "no box key for ['c'] in round 1": dict(boxes={R: {"a": b"x", "b": b"x"}}),
        # a coordinator that has a round trained again from an older model
        "the receipts of ['a', 'b', 'c'] sign a model they trained from that is not cluster 0's current model": dict(
            initial=INITIAL + 1),
    }
    for needle, over in cases.items():
        decision = _decide(world, msg, **over)
        assert isinstance(decision, Refuse) and needle in decision.reason and not decision.retry, (needle, decision)
    assert isinstance(_decide(world, msg, ledger={entry: f"{RUN}/2/0"}), Accept)  # refused in this job: goes on
    minimums = {
        "fewer than the minimum 4 (--min-contributors 4": _rules(world, min_contributors=4),
        "fewer than the minimum 4 (--min-contributors 2, --min-fraction 1 of 4)": _rules(world, min_fraction=1.0),
    }
    for needle, rules in minimums.items():
        decision = _decide(world, msg, rules=rules)
        assert isinstance(decision, Refuse) and needle in decision.reason, (needle, decision)
    twice = msg.model_copy(update={"contributors": ["a", "a", "b", "c"]})  # a contributor listed twice
    assert _decide(world, twice).reason.startswith("the contributor list ['a', 'a', 'b', 'c'] is not the signed "
                                                   "receipts' ['a', 'b', 'c']; decrypting would reveal")
    assert _decide(world, msg.model_copy(update={"contributors": ["a", "b"]})).reason.startswith(
        "the contributor list ['a', 'b'] is not the signed receipts' ['a', 'b', 'c']")
    doubled = msg.model_copy(update={"receipts": pack_frames([parts[0][1], parts[0][1], parts[1][1]])})
    assert _decide(world, doubled).reason == "two receipts of 'a'"
    assert _decide(world, msg.model_copy(update={"total_weight": 31})).reason == \
        "the aggregate weighs 31 samples; the receipts sign 30"
    assert _decide(world, msg.model_copy(update={"plains": b""})).reason.startswith(
        "the aggregate carries no plaintext parts of its contributors")
    # a round after the job's last was never opened (the key server opens none)
    later = _request(world, parts)
    decision = _decide(world, later, r=JOB.rounds + 1)
    assert decision == Refuse(f"round {JOB.rounds + 1} was never opened (no round plan); nothing of it is decrypted",
                              attempt=decision.attempt)


def test_the_key_server_keeps_the_two_latest_rounds_only(world):
    state = _state(world, plans={r: {0: ["a"]} for r in (1, 2, 3)}, seeds={r: b"s" for r in (1, 2, 3)},
                   boxes={r: {"a": b"box"} for r in (1, 2, 3)}, spent={r: {"a": 0} for r in (1, 2, 3)})
    state.forget_before(2)
    assert (set(state.plans), set(state.seeds), set(state.boxes), set(state.spent)) == ({2, 3},) * 4


def test_what_is_not_the_key_servers_to_judge_gets_no_verdict(world):
    """Rejected (no verdict, the service rejects the message): another sender, another run, a
    round the cluster is past, a cluster still decrypting an earlier round, a malformed
    aggregate. A re-sent request gets the recorded verdict, or waits for the one under way."""
    msg = _request(world, [_part(world, a) for a in "abc"])
    cases = {
        "Aggregate from 'a'; only the coordinator may send aggregates.": dict(sender="a"),
        "Aggregate for run 'run-2'; the current run is 'run-1'.": dict(msg=msg.model_copy(update={"run_id": "run-2"})),
        "Aggregate for run 'run-1'; the current run is None.": dict(run_id=None, job=None),
        "Aggregate for round 1 of cluster 0 is stale; the cluster is at round 1.": dict(models={0: (1, INITIAL)}),
        "Aggregate for round 2 of cluster 0 while its round 1 is being decrypted; re-send it after that verdict.": dict(
            r=2, pending={(1, 0): object()}),
        f"Aggregate of cluster 0 has {SIZE} parameters; the model has {SIZE + 1}.": dict(
            initial=np.zeros(SIZE + 1, np.float32)),
    }
    for reason, over in cases.items():
        assert _decide(world, over.pop("msg", msg), **over) == Reject(reason), reason
    assert _decide(world, msg, pending={(R, 0): object()}) == Decrypting()
    recorded = {(R, 0): AggregateResult(run_id=RUN, cluster=0, accepted=True)}
    assert _decide(world, msg, results=recorded) == Replay()


def test_after_a_refusal_at_the_fingerprint_check_a_new_attempt_is_evaluated_a_few_times(world):
    """A refusal at the fingerprint check (``retry``: nothing decrypted or spent) lets the
    coordinator try again: a new attempt is evaluated, the same attempt gets the recorded
    verdict, and after members + 2 attempts the round's verdict stays (with a warning)."""
    honest = [_part(world, a) for a in "abc"]
    bad = _request(world, [honest[0], _part(world, "b", stale=True), honest[2]])
    refused = _decide(world, bad)
    assert isinstance(refused, Refuse) and refused.retry and refused.reason.startswith(FINGERPRINT_MISMATCH)
    assert sorted(refused.prints) == ["a", "b", "c"] and refused.attempt
    verdict = {(R, 0): AggregateResult(run_id=RUN, cluster=0, accepted=False, reason="refused: x", retry=True)}
    good = _request(world, honest)
    decision = _decide(world, good, results=verdict, attempts={(R, 0): {refused.attempt}}, failed={(R, 0): [refused.prints]})
    assert isinstance(decision, Accept) and list(decision.excluded) == ["b"]
    assert _decide(world, bad, results=verdict, attempts={(R, 0): {refused.attempt}}) == Replay()
    used_up = {(R, 0): {f"attempt {i}" for i in range(6)}}  # 4 members + 2
    assert _decide(world, good, results=verdict, attempts=used_up) == Replay(
        "round 1 cluster 0: 6 attempts refused at the fingerprint check; no more this round")
    final = {(R, 0): AggregateResult(run_id=RUN, cluster=0, accepted=False, reason="refused: y")}
    assert _decide(world, good, results=final) == Replay()  # any other refusal is final


def test_two_bad_fingerprints_are_refused_at_the_check_and_both_named_by_the_attempt_that_passes(world):
    """A refusal at the fingerprint check begins with FINGERPRINT_MISMATCH (the coordinator may
    try again); once an attempt without both bad updates passes, at_fault names both."""
    honest = {a: _part(world, a) for a in "abcd"}
    bad = {a: _part(world, a, stale=True) for a in "bd"}
    refused = _decide(world, _request(world, [honest["a"], bad["b"], honest["c"], bad["d"]]))
    assert isinstance(refused, Refuse) and refused.reason.startswith(FINGERPRINT_MISMATCH)
    failed = {(R, 0): [refused.prints]}  # what the service keeps of the refused attempt
    passed = _decide(world, _request(world, [honest["a"], honest["c"]]), failed=failed)
    assert isinstance(passed, Accept)
    named = passed.excluded
    assert sorted(named) == ["b", "d"] and "left out (and d too) passed" in named["b"]
    passed = _decide(world, _request(world, list(honest.values())), failed=failed)
    assert isinstance(passed, Accept)
    named = passed.excluded  # their later genuine updates in place
    assert sorted(named) == ["b", "d"] and "replaced by its later update (and b too) passed" in named["d"]
    assert at_fault(failed[(R, 0)], {}, R).keys() == {"a", "b", "c", "d"}  # an attempt that passed without any


def test_a_buffered_job_takes_work_from_a_model_it_released_before_and_no_other(world):
    """A carried device trained from an earlier model of its cluster: a buffered job's key
    server accepts any model it released to the cluster in the job (or the initial one), a
    synchronous job's only the current one, and neither a model it never released."""
    msg = _request(world, [_part(world, a) for a in "abc"])  # the receipts sign INITIAL
    buffered = JOB.model_copy(update={"options": StrategyOptions(buffer=2)})
    moved = {0: (0, INITIAL + 1)}  # the cluster's model has moved on since they started
    assert isinstance(_decide(world, msg, job=buffered, models=moved), Accept)
    assert isinstance(_decide(world, msg, job=buffered, models=moved, initial=INITIAL + 2,
                              digests={0: {1: model_digest(INITIAL)}}), Accept)  # released in round 1
    for over in (dict(job=JOB, models=moved), dict(job=buffered, models=moved, initial=INITIAL + 2)):
        decision = _decide(world, msg, **over)
        assert isinstance(decision, Refuse) and "sign a model they trained from that is not" in decision.reason, decision
