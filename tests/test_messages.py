"""Every fleet message survives the wire; engine objects convert exactly; bad ones are refused."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from senseshield.engine.aggregation import aggregate_updates, decrypt_aggregate, protect_update
from senseshield.errors import KeyMismatchError, ProtocolError
from senseshield.he import generate_keys
from senseshield.runtime.protocol import decode_frame, encode_frame
from senseshield.runtime.protocol.messages import (
    MESSAGES,
    AggregateRequest,
    ClusterModel,
    Hello,
    PublicKeyAnnouncement,
    RoundPlan,
    Status,
    aggregate_from_message,
    aggregate_to_message,
    frame_list,
    from_frame,
    pack_frames,
    pack_mask,
    parse_plain_part,
    plain_part,
    to_frame,
    update_from_message,
    update_to_message,
)


def wire(msg):
    return from_frame(decode_frame(to_frame(msg, fleet="lab", sender="x", round=3)))


@pytest.fixture(scope="module")
def keys():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "paillier": generate_keys("paillier", key_bits=512),
            "packed-paillier": generate_keys("packed-paillier", key_bits=1024),
            "other": generate_keys("paillier", key_bits=512),
        }


def test_small_messages_round_trip():
    mask = np.arange(20) % 3 == 0
    for msg in (
        Status(online=False),
        Hello(run_id="r1", agent_id="pi-1", n_samples=70, bandwidth=40.0, cpu_speed=9.6, profile={"board": "Raspberry Pi 4"}),
        RoundPlan(cluster=2, encryption_budget=0.4, deadline=1e9, block_size=1, size=20,
                  has_shared_mask=True, shared_mask=pack_mask(mask)),
        ClusterModel(run_id="r1", cluster=1, model="mlp", weights=np.linspace(-1, 1, 7, dtype=np.float32)),
    ):
        back = wire(msg)
        assert type(back) is type(msg)
        for name in type(msg).model_fields:
            a, b = getattr(msg, name), getattr(back, name)
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
    assert np.array_equal(wire(RoundPlan(cluster=0, encryption_budget=1, deadline=0, block_size=1, size=20,
                                         has_shared_mask=True, shared_mask=pack_mask(mask))).mask(), mask)


@pytest.mark.parametrize("scheme", ["paillier", "packed-paillier"])
def test_updates_and_aggregates_survive_the_wire_exactly(keys, scheme):
    secret = keys[scheme]
    pk = secret.public_key
    size = 3 * pk.block_size + 5
    rng = np.random.default_rng(0)
    updates, wired = [], []
    for i in range(3):
        delta = rng.normal(scale=0.05, size=size)
        mask = np.zeros(size, bool)
        mask[i * pk.block_size : (i + 1) * pk.block_size] = True  # whole blocks
        withheld = np.zeros(size, bool)
        withheld[-1 - i] = True
        update = protect_update(delta, mask, pk, client_id=f"c{i}", round=3, cluster=0, n_samples=10 + i)
        update.withheld = withheld
        keep = ~mask & ~withheld
        update.plaintext = delta[keep].astype(np.float32)
        updates.append(update)
        msg = wire(update_to_message(update, pk))
        back = update_from_message(msg, pk, client_id=f"c{i}", round=3, size=size)
        assert np.array_equal(back.mask, update.mask) and np.array_equal(back.withheld, withheld)
        assert np.array_equal(back.plaintext, update.plaintext)
        wired.append(back)
    direct = decrypt_aggregate(aggregate_updates(updates, pk, round=3, cluster=0), secret)
    aggregate = aggregate_updates(wired, pk, round=3, cluster=0)
    request = wire(aggregate_to_message(aggregate, pk, run_id="r1"))
    assert isinstance(request, AggregateRequest) and request.contributors == ["c0", "c1", "c2"]
    via_wire = decrypt_aggregate(aggregate_from_message(request, pk, round=3, size=size), secret)
    np.testing.assert_array_equal(via_wire, direct)
    # (version 4) every contributor's plaintext part, the bytes its receipt's digest covers
    for name, part in request.contributor_plains().items():
        sent = update_to_message(updates[int(name[1])], pk)
        assert part == plain_part(sent.withheld, sent.plaintext)
        withheld, plaintext = parse_plain_part(part, size)
        assert np.array_equal(withheld, updates[int(name[1])].withheld) and np.array_equal(plaintext, sent.plaintext)


def test_a_plaintext_part_that_does_not_fit_is_refused_with_one_sentence():
    part = plain_part(pack_mask(np.array([1, 0, 0, 0, 0], bool)), np.arange(4, dtype=np.float32))
    assert parse_plain_part(part, 5)[0].tolist() == [True, False, False, False, False]
    assert parse_plain_part(plain_part(np.zeros(0, np.uint8), np.ones(3, np.float32)), 3)[0] is None
    for bad, reason in ((part[:2], "shorter than its header"), (part[:-1], "does not hold a 1-byte bitset"),
                        (b"\x00\x00\x00\x05" + part[4:], "needs 1 bytes")):
        with pytest.raises(ProtocolError, match=reason):
            parse_plain_part(bad, 5)


def test_ciphertext_under_another_key_is_refused(keys):
    pk, other = keys["paillier"].public_key, keys["other"].public_key
    update = protect_update(np.ones(4), np.array([1, 1, 0, 0], bool), other, client_id="c", round=1, cluster=0, n_samples=1)
    msg = wire(update_to_message(update, other))
    with pytest.raises(KeyMismatchError):
        update_from_message(msg, pk, client_id="c", round=1, size=4)


def test_public_key_announcement_carries_no_secret(keys):
    secret = keys["paillier"]
    public = secret.public_key
    frame = to_frame(PublicKeyAnnouncement(scheme="paillier", key_id=public.key_id, key=public.to_bytes()),
                     fleet="lab", sender="keyserver", round=0)
    import json

    primes = json.loads(secret.to_bytes(include_secret=True))
    for prime_hex in (primes["p"], primes["q"]):
        prime = int(prime_hex, 16)
        for form in (prime_hex.encode(), str(prime).encode(), prime.to_bytes((prime.bit_length() + 7) // 8, "big")):
            assert form not in frame
    assert wire(PublicKeyAnnouncement(scheme="paillier", key_id=public.key_id, key=public.to_bytes())).key_id == public.key_id


@pytest.mark.parametrize(
    "frame_kwargs, reason",
    [
        (dict(schema="nope", version=1, fields={}), "Unknown message schema 'nope'"),
        (dict(schema="status", version=2, fields={"online": True}), "this receiver is out of date"),
        (dict(schema="status", version=0, fields={"online": True}), "the sender is out of date"),
        (dict(schema="status", version=1, fields={}), "field 'online'"),
        (dict(schema="status", version=1, fields={"online": True, "evil": 1}), "field 'evil'"),
        (dict(schema="hello", version=2, fields={"run_id": "r", "agent_id": "a", "n_samples": 0, "bandwidth": 1, "cpu_speed": 1}), "n_samples"),
        (dict(schema="cluster-model", version=1, fields={"cluster": 0, "model": "mlp"}), "expected ['weights']"),
        # issue 23: no coercion (a signed {"online": "no"} took a connected device out of rounds)
        (dict(schema="status", version=1, fields={"online": "no"}), "field 'online' input should be a valid boolean"),
        (dict(schema="status", version=1, fields={"online": 0}), "field 'online'"),
        (dict(schema="hello", version=2, fields={"run_id": "r", "agent_id": "a", "n_samples": "12", "bandwidth": 1,
                                                 "cpu_speed": 1}), "field 'n_samples' input should be a valid integer"),
        (dict(schema="assignment", version=1, fields={"cluster": 1.0, "encryption_budget": 0.5}), "field 'cluster'"),
        (dict(schema="assignment", version=1, fields={"cluster": 0, "encryption_budget": "0.5"}), "encryption_budget"),
        (dict(schema="notice", version=1, fields={"run_id": 7, "kind": "done"}), "field 'run_id'"),
        (dict(schema="aggregate-result", version=1, fields={"run_id": "r", "cluster": 0, "accepted": "yes"}),
         "field 'accepted'"),
    ],
)
def test_bad_messages_are_refused_with_a_reason(frame_kwargs, reason):
    data = encode_frame(fleet="lab", sender="x", round=1, **frame_kwargs)
    with pytest.raises(ProtocolError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        from_frame(decode_frame(data))


def test_section_of_the_wrong_dtype_is_refused():
    data = encode_frame(schema="cluster-model", version=1, fleet="lab", sender="x", round=1,
                        fields={"cluster": 0, "model": "mlp"}, sections={"weights": np.zeros(3, np.float64)})
    with pytest.raises(ProtocolError, match="1-D f32"):
        from_frame(decode_frame(data))


def test_every_message_is_registered_once():
    from senseshield.runtime.protocol.messages import Message

    classes = Message.__subclasses__()
    assert sorted(MESSAGES.names()) == sorted(c.schema_name for c in classes)
    assert len(set(MESSAGES.names())) == len(classes) >= 15


def test_a_coerced_status_is_rejected_with_its_reason_and_the_service_goes_on(mosquitto):
    """A status signed by a genuine device but saying ``{"online": "no"}``: the service logs
    and rejects it (the device is not marked offline), and handles the next frame."""
    import logging
    import threading
    import time

    from senseshield.runtime.identity import Identity, Trust
    from senseshield.runtime.service import Service
    from senseshield.runtime.transport import Link

    device = Identity.generate("pi-1")
    trust = Trust({"pi-1": device.principal("agent")}, fleet="strict")
    service = Service(mosquitto.url, fleet="strict", client_id="watcher", logger=logging.getLogger("test.strict"),
                      trust=trust, role="coordinator")
    seen: list[bool] = []
    service.on(Status, lambda item: seen.append(item.message.online))
    service.start(["agents/+/status"])
    thread = threading.Thread(target=lambda: service.wait_until(lambda: len(seen) >= 1, 60), daemon=True)
    thread.start()
    sender = Link(mosquitto.url, client_id="pi-1", fleet="strict", on_frame=lambda t, f: None)
    sender.start()
    try:
        for online in ("no", True):
            sender.publish("agents/pi-1/status", encode_frame(schema="status", version=1, fleet="strict",
                                                              sender="pi-1", round=0, fields={"online": online},
                                                              signer=device))
        thread.join(60)
        assert seen == [True]
        reasons = " | ".join(service.rejected)
        assert "field 'online' input should be a valid boolean" in reasons, reasons
    finally:
        sender.stop()
        service.stop()


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_a_section_given_as_pieces_is_the_section_packed(frames):
    """The coordinator puts a fleet's receipts into its signed request as they are kept
    (to_frame's ``pieces``): the frame carries what packing them first would have carried."""
    msg = AggregateRequest(run_id="r", cluster=0, size=8, total_weight=2, contributors=["a"],
                           union_mask=pack_mask(np.ones(8, bool)), plain_sum=np.zeros(0),
                           position_weight=np.zeros(0), ciphertext=b"x" * 8)
    got = from_frame(decode_frame(to_frame(msg, fleet="lab", sender="x", round=3,
                                           pieces={"receipts": frame_list(frames)})))
    assert got.receipts == pack_frames(frames)
    assert got.model_dump(exclude={"receipts"}).keys() == msg.model_dump(exclude={"receipts"}).keys()
    assert all(np.array_equal(v, getattr(msg, k)) for k, v in got.model_dump(exclude={"receipts"}).items())
    with pytest.raises(ValueError, match="not an empty bytes section"):
        to_frame(msg.model_copy(update={"receipts": b"held"}), fleet="lab", sender="x", round=3,
                 pieces={"receipts": [b"more"]})
