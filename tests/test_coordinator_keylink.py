"""The coordinator's side of the key server (coordinator.keylink), no broker: real masked keys,
real protected updates and signed frames; what would go to ``keyserver/requests`` is kept in
a list and decoded."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.keylink import KeyLink, receipt_batches
from coordinator.rounds import ClusterRound, note_of
from senseshield.engine.aggregation import StreamingAggregate, protect_update
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES
from senseshield.he.base import round_context
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    AggregateRequest, AggregateResult, ClusterModel, PublicKeyAnnouncement, from_frame, to_frame, unpack_frames,
)

FLEET, RUN, SIZE = "f", "j-1", 40
log = logging.getLogger("test.keylink")


@pytest.fixture(scope="module")
def setup():
    secret = SCHEMES.get("masked").generate()
    ids = {a: Identity.generate(a) for a in ("coordinator", "a", "b", "c")}
    return secret, ids


def _link(ids, sent: list) -> KeyLink:
    sign = lambda message, r, **kw: to_frame(message, fleet=FLEET, sender="coordinator", round=r,  # noqa: E731
                                             signer=ids["coordinator"], **kw)
    return KeyLink(RUN, "masked", sign=sign, publish=sent.append, log=log)


def _announce(secret, **over) -> PublicKeyAnnouncement:
    public = secret.public_key
    return PublicKeyAnnouncement(**{"scheme": "masked", "key_id": public.key_id, "key": public.to_bytes(),
                                    "run_id": RUN, **over})


def test_the_key_is_the_key_servers_for_this_job(setup):
    secret, ids = setup
    link = _link(ids, [])
    assert not link.ready and link.block_size == 1 and not link.verifiable
    with pytest.raises(ProtocolError, match="from 'a'; only the key server"):
        link.on_key("a", _announce(secret))
    assert not link.on_key("keyserver", _announce(secret, run_id="j-0"))  # the previous job's, retained
    with pytest.raises(ProtocolError, match="announces scheme 'packed-paillier'; this run needs 'masked'"):
        link.on_key("keyserver", _announce(secret, scheme="packed-paillier"))
    with pytest.raises(ProtocolError, match="is not the key's id"):
        link.on_key("keyserver", _announce(secret, key_id="other"))
    assert link.on_key("keyserver", _announce(secret)) and link.ready and link.verifiable
    assert not link.on_key("keyserver", _announce(secret))  # the same key again
    assert not link.on_key("keyserver", _announce(secret, refused="not signed by a pinned operator"))
    assert link.refused == "not signed by a pinned operator"


def _updates(secret, ids, r: int = 1) -> dict:
    rng = np.random.default_rng(7)
    mask = np.zeros(SIZE, bool)
    mask[:8] = True
    out = {}
    for a in "abc":
        key = secret.public_key.for_contributor(ids[a].exchange, round_context(FLEET, RUN, r, 0))
        update = protect_update(rng.normal(size=SIZE) * 0.01, mask, key, client_id=a, round=r, cluster=0, n_samples=10)
        out[a] = (update, note_of(update, 100, {}, f"receipt-{a}".encode()))
    return out


def test_a_refusal_at_the_fingerprint_check_sends_the_next_attempt_then_the_verdict_is_recorded(setup):
    secret, ids = setup
    sent: list[bytes] = []
    link = _link(ids, sent)
    link.on_key("keyserver", _announce(secret))
    make = lambda: StreamingAggregate(link.public, size=SIZE, round=1, cluster=0, min_encryptors=1)  # noqa: E731
    cr = ClusterRound(["a", "b", "c"], deadline=0.0, phase="updates")
    cr.running = make()
    for a, (update, note) in _updates(secret, ids).items():
        cr.running.add(update)
        cr.updates[a] = note
        cr.book.keep(a, update, note)
    link.request(cr, cr.running.result(), 0.0, r=1)
    assert cr.phase == "decrypting" and len(sent) == 1 and cr.union_ratio == pytest.approx(0.2)
    first = from_frame(decode_frame(sent[0]))
    assert isinstance(first, AggregateRequest) and sorted(first.contributors) == ["a", "b", "c"]
    link.resend({0: cr}, 1, "the key server is back")  # the same frame again
    assert sent[1] == sent[0]
    refusal = AggregateResult(run_id=RUN, cluster=0, accepted=False, retry=True, reason="refused: not the product")
    with pytest.raises(ProtocolError, match="only the key server answers"):
        link.on_result("coordinator", refusal, cr, r=1, received=0.0, make=make)
    assert not link.on_result("keyserver", refusal, cr, r=1, received=0.0, make=make)
    assert cr.phase == "decrypting" and len(sent) == 3  # the next attempt: one update left out
    second = from_frame(decode_frame(sent[2]))
    assert len(second.contributors) == 2 and sorted(cr.updates) == sorted(second.contributors)
    accepted = AggregateResult(run_id=RUN, cluster=0, accepted=True, excluded={"a": "its update does not match"})
    assert link.on_result("keyserver", accepted, cr, r=1, received=5.0, make=make)
    assert cr.phase == "done" and cr.accepted and cr.refused == {"a": "its update does not match"}
    assert cr.book.kept == {} and cr.timestamps["result_at"] == 5.0
    assert not link.on_result("keyserver", accepted, cr, r=1, received=6.0, make=make)  # a repeat: done already


def test_a_silent_key_server_and_the_models_it_announces(setup):
    secret, ids = setup
    link = _link(ids, [])
    cr = ClusterRound(["a"], deadline=0.0, phase="decrypting", sent_at=100.0)
    assert not link.give_up(cr, now=200.0, patience=60.0, keyserver_online=False)  # offline: waited for
    assert not link.give_up(cr, now=150.0, patience=60.0, keyserver_online=True)
    assert link.give_up(cr, now=161.0, patience=60.0, keyserver_online=None)
    assert cr.phase == "done" and cr.accepted is False and cr.reason == "no answer from the key server"
    model = ClusterModel(run_id=RUN, cluster=0, model="linear", weights=np.zeros(SIZE, np.float32))
    args = dict(nbytes=321, size=SIZE, clusters=[0], current_round=2)
    assert not link.on_model("keyserver", model.model_copy(update={"run_id": "j-0"}), r=1, **args)
    with pytest.raises(ProtocolError, match="of 3 parameters; the model has 40"):
        link.on_model("keyserver", model.model_copy(update={"weights": np.zeros(3, np.float32)}), r=1, **args)
    with pytest.raises(ProtocolError, match="for round 3; the run is at round 2"):
        link.on_model("keyserver", model, r=3, **args)
    assert link.on_model("keyserver", model, r=2, **args) and link.model_round(0) == 2 and link.model_bytes == 321
    assert not link.on_model("keyserver", model, r=1, **args)  # older than the one saved


def test_two_devices_with_a_later_update_are_both_replaced_in_the_first_retry():
    """coordinator.contributions: with spares from two devices, the first attempt puts both in
    place (two bad updates sent before genuine ones are dropped in one retry); then one device
    at a time, devices with a spare first."""
    from coordinator.contributions import Contributions

    book = Contributions()
    for a in "abcd":
        book.keep(a, f"first-{a}", None)
    book.spare("d", "later-d", None)
    book.spare("b", "later-b", None)
    attempts = []
    while (attempt := book.next_attempt()) is not None:
        attempts.append({a: u for a, (u, _) in attempt.items()})
    assert attempts[0] == {"a": "first-a", "b": "later-b", "c": "first-c", "d": "later-d"}
    assert attempts[1] == {"a": "first-a", "b": "later-b", "c": "first-c", "d": "first-d"}
    assert attempts[2] == {"a": "first-a", "b": "first-b", "c": "first-c", "d": "later-d"}
    assert [sorted(x) for x in attempts[3:]] == [["b", "c", "d"], ["a", "b", "d"]]
    assert len(attempts) == 5  # with the first request: members + 2, the key server's limit per round
    one = Contributions()
    for a in "ab":
        one.keep(a, f"first-{a}", None)
    one.spare("b", "later-b", None)  # one spare: no all-spares attempt (the next one is the same)
    assert {a: u for a, (u, _) in one.next_attempt().items()} == {"a": "first-a", "b": "later-b"}


def test_a_spare_arriving_during_the_search_lists_the_attempts_again_without_repeats():
    from coordinator.contributions import Contributions

    book = Contributions()
    for a in "abc":
        book.keep(a, f"first-{a}", f"note-{a}")
    book.spare("b", "later-b", None)
    assert {a: u for a, (u, _) in book.next_attempt().items()} == {"a": "first-a", "b": "later-b", "c": "first-c"}
    assert sorted(book.next_attempt()) == ["b", "c"]  # a left out
    book.spare("c", "later-c", None)  # c's genuine update arrives now
    assert {a: u for a, (u, _) in book.next_attempt().items()} == {"a": "first-a", "b": "later-b", "c": "later-c"}
    rest = []
    while (attempt := book.next_attempt()) is not None:
        rest.append({a: u for a, (u, _) in attempt.items()})
    assert rest == [{"a": "first-a", "b": "first-b", "c": "later-c"}]  # the two attempts sent are not repeated
    assert book.first("c") == "note-c" and book.first("z") is None


def test_when_every_attempt_is_refused_the_verdict_waits_for_a_later_update_until_the_deadline(setup):
    """Every attempt refused before the deadline: the refusal is held; a device's later update
    arriving then is tried at once; at the deadline a held refusal is the verdict."""
    import time

    secret, ids = setup
    sent: list[bytes] = []
    link = _link(ids, sent)
    link.on_key("keyserver", _announce(secret))
    make = lambda: StreamingAggregate(link.public, size=SIZE, round=1, cluster=0, min_encryptors=1)  # noqa: E731
    updates = _updates(secret, ids)
    cr = ClusterRound(["a", "b"], deadline=time.time() + 600, phase="updates")
    cr.running = make()
    for a in "ab":
        cr.running.add(updates[a][0])
        cr.updates[a] = updates[a][1]
        cr.book.keep(a, *updates[a])
    link.request(cr, cr.running.result(), 0.0, r=1)
    refusal = AggregateResult(run_id=RUN, cluster=0, accepted=False, retry=True, reason="refused: not the product")
    while not link.on_result("keyserver", refusal, cr, r=1, received=1.0, make=make) and cr.held is None:
        pass  # each leave-one-out attempt refused in turn
    assert len(sent) == 3 and cr.phase == "decrypting" and cr.held is not None
    assert not link.expire(cr, r=1, now=time.time())  # before the deadline: held
    cr.book.spare("b", *updates["c"])  # b's later update (another update object)
    link.on_spare(0, cr, r=1, make=make)
    assert len(sent) == 4 and cr.held is None  # the attempt with it went out
    assert not link.on_result("keyserver", refusal, cr, r=1, received=2.0, make=make) and cr.held is not None
    assert link.expire(cr, r=1, now=cr.deadline) and cr.phase == "done" and cr.accepted is False
    assert cr.reason == "refused: not the product"


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), max_size=40), limit=st.integers(64, 1200))
def test_receipt_batches_keep_the_order_and_stay_within_the_limit(sizes, limit):
    """The receipts of a request, cut into batches: all of them, in order; every batch within
    ``limit`` packed bytes unless it is one receipt larger than that; a new batch only when
    the next receipt would not fit (as few as cut in order allows)."""
    receipts = [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    batches = receipt_batches(receipts, limit)
    assert [r for batch in batches for r in batch] == receipts
    assert len(batches) >= 1 and (batches[0] or not receipts)
    packed = [sum(4 + len(r) for r in batch) for batch in batches]
    assert all(size <= limit or len(batch) == 1 for size, batch in zip(packed, batches))
    assert all(packed[i] + 4 + len(batches[i + 1][0]) > limit for i in range(len(batches) - 1))


def test_a_large_request_sends_its_receipts_ahead_in_batches(setup, monkeypatch):
    """Receipts beyond one batch go ahead of the request, in order, under one attempt id; the
    request carries none and names how many came; a re-send repeats the whole sequence."""
    secret, ids = setup
    sent: list[bytes] = []
    link = _link(ids, sent)
    link.on_key("keyserver", _announce(secret))
    monkeypatch.setattr("coordinator.keylink.RECEIPT_BATCH_BYTES", 2 * (4 + len(b"receipt-a")))
    cr = ClusterRound(["a", "b", "c"], deadline=0.0, phase="updates")
    cr.running = StreamingAggregate(link.public, size=SIZE, round=1, cluster=0, min_encryptors=1)
    for a, (update, note) in _updates(secret, ids).items():
        cr.running.add(update)
        cr.updates[a] = note
    link.request(cr, cr.running.result(), 0.0, r=1)
    messages = [from_frame(decode_frame(f)) for f in sent]
    assert [type(m).__name__ for m in messages] == ["ReceiptBatch", "ReceiptBatch", "AggregateRequest"]
    first, second, request = messages
    assert (first.index, second.index) == (0, 1) and first.attempt == second.attempt == request.attempt
    assert unpack_frames(first.receipts) + unpack_frames(second.receipts) == [b"receipt-a", b"receipt-b", b"receipt-c"]
    assert request.batches == 2 and request.receipts == b"" and sorted(request.contributors) == ["a", "b", "c"]
    link.resend({0: cr}, 1, "the key server is back")
    assert sent[3:] == sent[:3]
