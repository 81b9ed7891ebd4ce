"""Identities, trust files and signed frames (senseshield.runtime.identity, envelope v2)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.errors import ConfigError, ProtocolError
from senseshield.runtime.identity import Identity, Principal, Trust, b64, check_frame, fingerprint
from senseshield.runtime.protocol.envelope import decode_frame, encode_frame


def _frame(identity, sender: str | None = None, *, signed: bool = True) -> bytes:  # noqa: ANN001
    return encode_frame(schema="status", version=1, fleet="lab", sender=sender or identity.name, round=2,
                        fields={"online": True}, sections={"x": np.arange(4, dtype=np.float32)},
                        signer=identity if signed else None)


def test_a_signed_frame_verifies_and_any_changed_byte_does_not():
    alice = Identity.generate("c000")
    trust = Trust({"c000": alice.principal("agent")}, fleet="lab")
    data = _frame(alice)
    frame = decode_frame(data)
    assert frame.is_signed and frame.signer_key == alice.sign_key
    check_frame(trust, frame)
    for i in range(9, len(data) - 64, 7):  # header and sections (a changed prefix no longer parses)
        tampered = bytearray(data)
        tampered[i] ^= 1
        try:
            bad = decode_frame(bytes(tampered))
        except ProtocolError:
            continue
        with pytest.raises(ProtocolError):
            check_frame(trust, bad)


def test_unsigned_unknown_and_impersonating_frames_are_rejected_with_their_reason():
    alice, bob = Identity.generate("c000"), Identity.generate("c001")
    trust = Trust({"c000": alice.principal("agent"), "c001": bob.principal("agent")}, fleet="lab")
    with pytest.raises(ProtocolError, match="Unsigned 'status' frame from 'c000'"):
        check_frame(trust, decode_frame(_frame(alice, signed=False)))
    with pytest.raises(ProtocolError, match="not its pinned key"):
        check_frame(trust, decode_frame(_frame(bob, sender="c000")))  # bob speaking as alice
    with pytest.raises(ProtocolError, match="not in the fleet's trust file"):
        check_frame(trust, decode_frame(_frame(Identity.generate("mallory"))))
    with pytest.raises(ProtocolError, match="trailing bytes after its signature"):
        decode_frame(_frame(alice) + b"x")


def test_trust_on_first_use_pins_the_first_key_and_warns(caplog):
    trust = Trust(fleet="lab", tofu=True)
    alice, impostor = Identity.generate("c000"), Identity.generate("c000")
    check_frame(trust, decode_frame(_frame(alice)))
    assert "on first use" in caplog.text and trust.role("c000") == "agent"
    check_frame(trust, decode_frame(_frame(alice)))
    with pytest.raises(ProtocolError, match="not its pinned key"):
        check_frame(trust, decode_frame(_frame(impostor)))
    check_frame(trust, decode_frame(_frame(Identity.generate("keyserver"))))
    assert trust.role("keyserver") == "keyserver"


def test_trust_files_round_trip_pin_fingerprints_and_refuse_bad_entries(tmp_path):
    ks, agent = Identity.generate("keyserver"), Identity.generate("pi-7")
    trust = Trust.for_identities({"keyserver": (ks, "keyserver"), "pi-7": (agent, "agent")}, fleet="lab")
    path = trust.save(tmp_path / "trust.json")
    loaded = Trust.load(path, fleet="lab")
    assert loaded.box_key("keyserver") == ks.box_key and loaded.role("pi-7") == "agent"
    # only a fingerprint pinned: the first frame with a matching key is accepted, others not
    only = tmp_path / "fp.yaml"
    only.write_text(f"fleet: lab\nprincipals:\n  pi-7: {{role: agent, fingerprint: {agent.fingerprint}}}\n")
    pinned = Trust.load(only)
    with pytest.raises(ProtocolError, match="fingerprint is not the pinned one"):
        check_frame(pinned, decode_frame(_frame(Identity.generate("pi-7"))))
    check_frame(pinned, decode_frame(_frame(agent)))
    for text, message in [
        ("principals: {keyserver: {role: agent, sign: " + b64(ks.sign_key) + "}}", "the name says role 'keyserver'"),
        ("principals: {x: {role: king, sign: " + b64(ks.sign_key) + "}}", "role must be one of"),
        ("principals: {x: {role: agent, sign: notbase64!}}", "is not base64"),
        ("principals: {x: {role: agent}}", "give 'sign'"),
        ("fleet: other\nprincipals: {}", "is for fleet 'other'"),
        ("[1, 2]", "needs a 'principals' mapping"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            Trust.load(bad, fleet="lab")
    with pytest.raises(ConfigError, match="cannot be read"):
        Trust.load(tmp_path / "missing.json")


def test_identity_files_are_private_and_stable(tmp_path):
    path = tmp_path / "ids" / "c000.key"
    first = Identity.load_or_create("c000", path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = Identity.load_or_create("c000", path)
    assert (again.sign_key, again.box_key) == (first.sign_key, first.box_key)
    assert fingerprint(first.sign_key) == first.fingerprint
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="must be 0600"):
        Identity.load_or_create("c000", path)
    link = tmp_path / "ids" / "link.key"
    os.chmod(path, 0o600)
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="symbolic link"):
        Identity.load_or_create("c000", link)
    with pytest.raises(TypeError):
        json.dumps(first.__reduce__())


def test_sealed_values_open_only_for_their_recipient_and_context():
    ks, alice, bob = (Identity.generate(n) for n in ("keyserver", "c000", "c001"))
    box = ks.seal(b"s" * 32, alice.box_key, b"lab/run/3")
    assert alice.open(box, ks.box_key, b"lab/run/3") == b"s" * 32
    with pytest.raises(ProtocolError, match="does not open"):
        bob.open(box, ks.box_key, b"lab/run/3")
    with pytest.raises(ProtocolError, match="does not open"):
        alice.open(box, ks.box_key, b"lab/run/4")  # another round's context


_keys = st.binary(min_size=32, max_size=32)
_principal = st.tuples(st.sampled_from(["agent", "site", "operator"]), _keys, st.none() | _keys,
                       st.none() | st.text("0123456789abcdef", min_size=32, max_size=32))


@settings(max_examples=60, deadline=None)
@given(principals=st.dictionaries(st.text(min_size=1, max_size=12), _principal, max_size=12),
       fleet=st.none() | st.text(max_size=8), serial=st.none() | st.integers(1, 10**6),
       signed_by=st.none() | st.text(max_size=8), drop_sign=st.booleans())
def test_the_signed_body_of_a_trust_is_its_canonical_json(principals, fleet, serial, signed_by, drop_sign):  # noqa: ANN001
    """What an administrator signs is written one principal at a time; it must be byte for
    byte the canonical JSON of fleet, serial, signer and every principal (the files signed
    before are checked against it)."""
    table = {name: Principal(name, role, None if drop_sign else sign, box, pinned)
             for name, (role, sign, box, pinned) in principals.items()}
    trust = Trust(table, fleet=fleet, serial=serial, signed_by=signed_by)
    body = {"fleet": fleet, "serial": serial, "signed_by": signed_by,
            "principals": {n: p.as_dict() for n, p in sorted(table.items())}}
    assert trust._signed_body() == b"senseshield-trust-file\0" + json.dumps(
        body, sort_keys=True, separators=(",", ":")).encode()


def test_a_signed_trust_file_loads_in_its_order_with_one_string_per_role(tmp_path) -> None:  # noqa: ANN001
    admin = Identity.generate("operator")
    devices = {f"dev-{i}": Identity.generate(f"dev-{i}") for i in (3, 1, 2)}
    trust = Trust({n: i.principal("agent") for n, i in devices.items()}, fleet="lab").sign(admin, 4)
    trust.save(tmp_path / "trust.json")
    loaded = Trust.load(tmp_path / "trust.json", fleet="lab")
    assert list(loaded.principals) == list(json.loads((tmp_path / "trust.json").read_text())["principals"]) \
        == sorted(trust.principals)
    assert loaded.digest == trust.digest and loaded.serial == 4
    roles = {id(p.role) for p in loaded.principals.values() if p.role == "agent"}
    assert len(roles) == 1
    text = (tmp_path / "trust.json").read_text().replace(b64(devices["dev-1"].sign_key), b64(devices["dev-2"].sign_key))
    (tmp_path / "trust.json").write_text(text)
    with pytest.raises(ConfigError, match="does not verify"):
        Trust.load(tmp_path / "trust.json", fleet="lab")
