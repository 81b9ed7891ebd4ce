"""The coordinator's side of the key server (coordinator.keylink), no broker: real masked keys,
real protected updates and signed frames; what would go to ``keyserver/requests`` is kept in
a list and decoded."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from coordinator.keylink import KeyLink
from coordinator.rounds import ClusterRound, note_of
from senseshield.engine.aggregation import StreamingAggregate, protect_update
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES
from senseshield.he.base import round_context
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    AggregateRequest, AggregateResult, ClusterModel, PublicKeyAnnouncement, from_frame, to_frame,
)

FLEET, RUN, SIZE = "f", "j-1", 40
log = logging.getLogger("test.keylink")


@pytest.fixture(scope="module")
def setup():
    secret = SCHEMES.get("masked").generate()
    ids = {a: Identity.generate(a) for a in ("coordinator", "a", "b", "c")}
    return secret, ids


def _link(ids, sent: list) -> KeyLink:
    sign = lambda message, r: to_frame(message, fleet=FLEET, sender="coordinator", round=r,  # noqa: E731
                                       signer=ids["coordinator"])
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
