"""The key server's checks of an aggregate request (keyserver.verify), no broker and no
service: a real masked key, real agents' updates, fingerprints under a real seed and signed
receipts; each refusal names what is wrong."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from keyserver.verify import FINGERPRINT_MISMATCH, Checks, at_fault, verify
from senseshield.engine.aggregation import aggregate_updates, protect_update
from senseshield.he import SCHEMES
from senseshield.he.base import round_context
from senseshield.he.fingerprint import SEED_BYTES
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.protocol.messages import Receipt, aggregate_to_message, pack_mask, plain_digest, to_frame

FLEET, RUN, SIZE, R = "f", "run-1", 24, 1


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
                      start_digest=hashlib.sha256(b"start").hexdigest(),
                      plain_digest=plain_digest(np.zeros(0, np.uint8), update.plaintext))
    return update, to_frame(receipt, fleet=FLEET, sender=agent, round=R, signer=ids[agent])


def _request(world, parts):
    public = world[0].public_key
    aggregate = aggregate_updates([u for u, _ in parts], public, round=R, cluster=0, min_encryptors=1)
    msg = aggregate_to_message(aggregate, public, run_id=RUN, receipts=[rc for _, rc in parts])
    return msg, aggregate


def _checks(world, **over) -> Checks:
    secret, _, trust, seed = world
    args = dict(trust=trust, run_id=RUN, plan={0: ["a", "b", "c", "d"]}, taken={}, public=secret.public_key,
                secret=secret, seed=seed, boxes={a: b"box" for a in "abcd"}, ledger={},
                start_digest=hashlib.sha256(b"start").hexdigest(), min_contributors=2,
                min_fraction=0.0, min_encryptors=1, job_min_encryptors=1, allow_unverifiable=False,
                log=logging.getLogger("test.verify"))
    return Checks(**{**args, **over})


def test_an_honest_aggregate_passes_with_its_weights_and_ledger_entries(world):
    parts = [_part(world, a) for a in "abc"]
    prints: dict[str, str] = {}
    refusal, weights, entries = verify(_checks(world), R, 0, *_request(world, parts), prints)
    assert refusal is None and weights == {"a": 10, "b": 10, "c": 10} and sorted(prints) == ["a", "b", "c"]
    key_id = world[0].public_key.key_id
    assert entries["a"] == f"{key_id}|a|{hashlib.sha256(b'start').hexdigest()}"


def test_each_refusal_names_what_is_wrong(world):
    parts = [_part(world, a) for a in "abc"]
    cases = {
        "round 1 was never opened": _checks(world, plan=None),
        "cluster 0 is not in round 1's plan": _checks(world, plan={1: ["a"]}),
        "and is not a member of cluster 0": _checks(world, plan={0: ["a", "b"]}),
        "the contributions of ['b'] in round 1 were already decrypted in cluster 1's": _checks(world, taken={"b": 1}),
        "fewer than the minimum 4 (--min-contributors 4": _checks(world, min_contributors=4),
        "fewer than the minimum 4 (--min-contributors 2, --min-fraction 1 of 4)": _checks(world, min_fraction=1.0),
        "already decrypted in job run-0 (round 2, cluster 0)": _checks(
            world, ledger={f"{world[0].public_key.key_id}|a|{hashlib.sha256(b'start').hexdigest()}": "run-0/2/0"}),
        "no box key for ['c'] in round 1": _checks(world, boxes={"a": b"x", "b": b"x"}),
        # a coordinator that has a round trained again from an older model
        "the receipts of ['a', 'b', 'c'] sign a model they trained from that is not cluster 0's current model": _checks(
            world, start_digest=hashlib.sha256(b"the next model").hexdigest()),
    }
    for needle, checks in cases.items():
        refusal, weights, entries = verify(checks, R, 0, *_request(world, parts), {})
        assert refusal is not None and needle in refusal and weights == {} and entries == {}, (needle, refusal)
    msg, aggregate = _request(world, parts)
    refusal, _, _ = verify(_checks(world), R, 0, msg.model_copy(update={"contributors": ["a", "b"]}), aggregate, {})
    assert "the contributor list ['a', 'b'] is not the signed receipts' ['a', 'b', 'c']" in refusal
    refusal, _, _ = verify(_checks(world), R, 0, msg.model_copy(update={"total_weight": 31}), aggregate, {})
    assert refusal == "the aggregate weighs 31 samples; the receipts sign 30"
    refusal, _, _ = verify(_checks(world), R, 0, msg.model_copy(update={"plains": b""}), aggregate, {})
    assert refusal.startswith("the aggregate carries no plaintext parts of its contributors")


def test_two_bad_fingerprints_are_refused_at_the_check_and_both_named_by_the_attempt_that_passes(world):
    """A refusal at the fingerprint check begins with FINGERPRINT_MISMATCH (the coordinator may
    try again); once an attempt without both bad updates passes, at_fault names both."""
    honest = {a: _part(world, a) for a in "abcd"}
    bad = {a: _part(world, a, stale=True) for a in "bd"}
    failed = {}
    refusal, _, _ = verify(_checks(world), R, 0, *_request(world, [honest["a"], bad["b"], honest["c"], bad["d"]]),
                           failed)
    assert refusal.startswith(FINGERPRINT_MISMATCH)
    passed = {}
    refusal, _, _ = verify(_checks(world), R, 0, *_request(world, [honest["a"], honest["c"]]), passed)
    assert refusal is None
    named = at_fault([failed], passed, R)
    assert sorted(named) == ["b", "d"] and "left out (and d too) passed" in named["b"]
    passed = {}
    assert verify(_checks(world), R, 0, *_request(world, list(honest.values())), passed)[0] is None
    named = at_fault([failed], passed, R)  # their later genuine updates in place
    assert sorted(named) == ["b", "d"] and "replaced by its later update (and b too) passed" in named["d"]
