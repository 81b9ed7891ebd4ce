"""What the coordinator accepts of a site's partial sum (coordinator.sites.accept_partial),
without a broker: a hand-made job state with one round under way, a site that folds its
devices' updates as a site aggregator does (SiteRound), the partial sum it sends, and every
way a site aggregator that lies is refused, in one sentence, changing nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.accept import FOLD, accept_update
from coordinator.rounds import note_of
from coordinator.sites import SiteRound, accept_partial, fold_partial, joined, partial_message
from senseshield.errors import ProtocolError
from senseshield.runtime.identity import Trust
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    SitePartial, from_frame, pack_frames, to_frame, unpack_frames, update_from_message,
)
from tests.test_coordinator_accept import RUN, SIZE, ids, state, trust, update  # noqa: F401 - fixtures


def site_fold(s, ids, agents=("a0", "a1"), *, r: int = 2, site: str = "north") -> SitePartial:  # noqa: ANN001
    """The partial sum a site sends after folding ``agents``' updates of round ``r``."""
    sr = SiteRound(r, 0, deadline=100.0, ring_bits=64, expected=set(agents))
    for i, a in enumerate(agents):
        msg = update(ids, a, r=r, value=0.25 * (i + 1))
        u = update_from_message(msg, None, client_id=a, round=r, size=SIZE)
        sr.fold(a, u, note_of(u, 100 + i, msg.report, msg.receipt, {"training_loss": 0.5}),
                lambda: s.new_aggregate(0, r, None))
    running, notes = sr.take()
    return joined(*partial_message(running, notes, run_id=RUN, site=site))


def accept(s, msg: SitePartial, trust: Trust, *, sender: str = "site-north", r: int = 2):  # noqa: ANN001, ANN201
    return accept_partial(s, msg, sender=sender, r=r, trust=trust, public=None)


def test_a_partial_sum_is_folded_as_its_updates_would_be(ids, trust):
    direct, sited = state(), state()
    for i, a in enumerate(("a0", "a1")):  # the same updates straight to the coordinator
        out = accept_update(direct, update(ids, a, value=0.25 * (i + 1)), agent_id=a, r=2, nbytes=1, trust=trust)
        out.cr.fold(a, out.update, out.note, make=lambda: direct.new_aggregate(0, 2, None), keep=False)
    out = accept(sited, site_fold(sited, ids), trust)
    assert out.kind == FOLD and out.contributors == ["a0", "a1"]
    assert sited.clusters[0].updates == {}  # deciding changes nothing
    fold_partial(out.cr, "north", out, make=lambda: sited.new_aggregate(0, 2, None), keep=True)
    a, b = direct.clusters[0].running.result(), sited.clusters[0].running.result()
    assert a.plain_sum.tobytes() == b.plain_sum.tobytes() and a.total_weight == b.total_weight == 200
    assert sorted(sited.clusters[0].updates) == ["a0", "a1"]
    assert sited.clusters[0].updates["a1"].training == {"training_loss": 0.5}
    assert list(sited.clusters[0].book.kept) == ["site-north#0"]  # kept as one part until the verdict
    assert accept(sited, site_fold(sited, ids), trust).kind == "duplicate"  # re-sent after a reconnect


def _tamper(msg: SitePartial, **changes) -> SitePartial:  # noqa: ANN003
    return msg.model_copy(update=changes)


@pytest.mark.parametrize("case, sentence", [
    (lambda m, ids: (m, {"sender": "site-south"}), "Partial sum of site 'north' from 'site-south'; only site-north"),
    (lambda m, ids: (_tamper(m, run_id="j-2"), {}), "for job j-2, which is not running"),
    (lambda m, ids: (m, {"r": 1}), "is for round 1, which is closed (now 2); 2 update(s) arrived late"),
    (lambda m, ids: (m, {"r": 3}), "is for round 3; the current round is 2"),
    (lambda m, ids: (_tamper(m, cluster=1), {}), "for cluster 1, which has no round 2"),
    (lambda m, ids: (_tamper(m, size=SIZE + 1), {}), "has 9 parameters; the model has 8"),
    (lambda m, ids: (_tamper(m, state={**m.state, "total_weight": 300}), {}), "weighs 300; its contributors' hellos weigh 200"),
    (lambda m, ids: (_tamper(m, receipts=pack_frames(unpack_frames(m.receipts)[:1])), {}), "carries 1 receipts and notes for 2"),
    (lambda m, ids: (_tamper(m, notes=b"[]"), {}), "receipts and notes for 2 contributors"),
])
def test_a_partial_sum_that_fails_a_check_is_one_sentence_and_changes_nothing(ids, trust, case, sentence):
    s = state()
    msg, kw = case(site_fold(s, ids), ids)
    with pytest.raises(ProtocolError) as err:
        accept(s, msg, trust, **kw)
    assert sentence in str(err.value)
    assert s.clusters[0].updates == {} and s.clusters[0].running is None


def test_a_site_cannot_name_a_device_it_has_no_receipt_of(ids, trust):
    """A partial sum naming a2 (not sampled), or one whose receipt a1 did not sign, or a device
    whose update the coordinator already folded, is refused."""
    s = state()
    msg = site_fold(s, ids)
    forged = msg.model_copy(update={"state": {**msg.state, "contributors": ["a0", "a2"]}})
    with pytest.raises(ProtocolError, match="names 'a2', which is not in cluster 0"):
        accept(s, forged, trust)
    # a1's receipt replaced by one a0 signed for a1's update: the signature check refuses it
    other = site_fold(s, ids, agents=("a0",))
    a0_receipt = unpack_frames(other.receipts)[0]
    swapped = msg.model_copy(update={"receipts": pack_frames([a0_receipt, a0_receipt])})
    with pytest.raises(ProtocolError, match="a receipt of 'a0' for round 2"):
        accept(s, swapped, trust)
    out = accept_update(s, update(ids, "a0"), agent_id="a0", r=2, nbytes=1, trust=trust)
    out.cr.fold("a0", out.update, out.note, make=lambda: s.new_aggregate(0, 2, None), keep=False)
    with pytest.raises(ProtocolError, match="repeats the update of 'a0'"):
        accept(s, msg, trust)


def test_a_partial_sum_after_the_round_stopped_waiting_is_late(ids, trust):
    s = state(phase="decrypting")
    with pytest.raises(ProtocolError, match="stopped waiting"):
        accept(s, site_fold(s, ids), trust)


def test_a_site_round_sends_when_every_member_is_in_or_the_deadline_is_near(ids):
    s = state()
    sr = SiteRound(2, 0, deadline=100.0, ring_bits=64, expected={"a0", "a1"})
    assert not sr.due(0.0, offline=set(), margin=1.0)  # nothing folded
    msg = update(ids, "a0")
    u = update_from_message(msg, None, client_id="a0", round=2, size=SIZE)
    sr.fold("a0", u, note_of(u, 1, {}, msg.receipt), lambda: s.new_aggregate(0, 2, None))
    assert not sr.due(50.0, offline=set(), margin=1.0)  # a1 still to come
    assert sr.due(50.0, offline={"a1"}, margin=1.0)  # a1 went offline
    assert sr.due(99.0, offline=set(), margin=1.0)  # the deadline is near
    with pytest.raises(ProtocolError, match="duplicate"):
        sr.fold("a0", u, note_of(u, 1, {}, msg.receipt), lambda: s.new_aggregate(0, 2, None))
    running, notes = sr.take()
    assert running.contributors == ["a0"] and list(notes) == ["a0"] and sr.running is None
    sr.failed.add("a1")
    assert not sr.waiting(set())


def test_a_partial_sums_frame_from_its_pieces_is_the_frame_of_the_whole_message(ids):
    """A site sends its partial sum's receipts and notes as pieces the frame holds one after
    another: the frame is byte for byte the one of the whole message, whose notes are the
    JSON list of the contributors' notes and receipts their packed receipts."""
    s = state()
    sr = SiteRound(2, 0, deadline=100.0, ring_bits=64, expected={"a0", "a1"})
    folded = {}
    for i, a in enumerate(("a0", "a1")):
        msg = update(ids, a, r=2, value=0.25 * (i + 1))
        u = update_from_message(msg, None, client_id=a, round=2, size=SIZE)
        folded[a] = note_of(u, 100 + i, msg.report, msg.receipt, {"training_loss": 0.5 + i})
        sr.fold(a, u, folded[a], lambda: s.new_aggregate(0, 2, None))
    running, notes = sr.take()
    msg, pieces = partial_message(running, notes, run_id=RUN, site="north")
    whole = joined(msg, pieces)
    sent = from_frame(decode_frame(to_frame(msg, fleet="f", sender="site-north", round=2, signer=ids["a9"],
                                            pieces=pieces)))
    assert sent.model_dump(exclude={"arrays"}) == whole.model_dump(exclude={"arrays"})
    assert sent.arrays == whole.arrays
    assert unpack_frames(whole.receipts) == [folded[a].receipt for a in ("a0", "a1")]
    assert whole.notes == json.dumps([folded[a].fields() for a in ("a0", "a1")], sort_keys=True).encode()
