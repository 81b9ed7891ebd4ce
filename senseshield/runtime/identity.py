"""Who is speaking: every role's identity key, and the fleet's trust file.

Every process of a fleet (the key server, the coordinator, each agent, an operator who
submits jobs) holds an **identity**: 32 random bytes in a 0600 file (rules of
:mod:`senseshield.runtime.keyfiles`), from which two key pairs are derived with the
``cryptography`` package (no home-made primitives):

* an Ed25519 signing key: every frame it sends is signed (:mod:`...protocol.envelope`,
  the signature covers the header, so fleet, sender, round, schema and fields, and every
  section);
* an X25519 box key: the key server seals each round's challenge seed to the agents with it
  (:func:`seal` / :func:`open_sealed`: X25519 + HKDF-SHA256 + ChaCha20-Poly1305), so the
  coordinator, which relays everything, never learns the challenge.

A **trust file** (YAML or JSON) pins the fleet's principals: name -> role and public keys
(or only the signing key's fingerprint, the first 16 bytes of its SHA-256, in hex)::

    fleet: demo
    principals:
      keyserver:   {role: keyserver,   sign: <base64>, box: <base64>}
      coordinator: {role: coordinator, sign: <base64>}
      site-north:  {role: site,        sign: <base64>}
      agent-0:     {role: agent,       sign: <base64>, box: <base64>}
      operator:    {role: operator,    fingerprint: 3f2a...}

      serial: 3
      signed_by: operator
      signature: <base64 Ed25519 over the fleet, serial, signer and principals>

The file carries a **serial number** and the **signature** of an administrator (an operator
principal of the file, ``signed_by``). A service pins the administrator's key and the highest
serial it has seen in ``trust-seen.json`` beside its identity (:class:`TrustHistory`): from
then on it refuses a file signed by another key, and a file with a lower serial (a newer
file revokes every older one). ``senseshield identity build --admin-identity FILE`` signs one
(serial: the previous file's plus one); ``senseshield fleet up`` signs its own with its
operator identity; ``deploy/ansible`` builds one from the public entries each host printed.

The CLIs refuse to start a service without a trust file (:func:`admit_trust`) unless
development mode is on (:mod:`senseshield.development`); in-process services and tests
without one run in **trust on first use** (:class:`Trust` with ``tofu=True``): the first key
seen for a name is pinned for the life of the process, and a warning says that this is for
development only (an attacker who speaks first is believed).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from senseshield.development import development_mode, how_to_allow
from senseshield.errors import ConfigError, ProtocolError
from senseshield.runtime.files import write_atomic
from senseshield.runtime.keyfiles import check_private, secure_dir, write_secret

log = logging.getLogger("senseshield.identity")

ROLES = ("keyserver", "coordinator", "site", "agent", "operator")
SIGNATURE_BYTES = 64
SEALED_SEED_BYTES = 12 + 32 + 16  # nonce, a 32-byte challenge seed, Poly1305 tag
_SEED_BYTES = 32
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw
_TRUST_CONTEXT = b"senseshield-trust-file\0"
TRUST_HISTORY = "trust-seen.json"
"""Beside a service's identity key: the administrator key and highest serial it has seen."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str, what: str, size: int = 32) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ConfigError(f"{what} is not base64.") from None
    if len(raw) != size:
        raise ConfigError(f"{what} has {len(raw)} bytes; a key has {size}.")
    return raw


def fingerprint(sign_key: bytes) -> str:
    """The pinned form of a signing key: 32 hex characters of its SHA-256."""
    return hashlib.sha256(sign_key).hexdigest()[:32]


class Identity:
    """A principal's private keys (never serialised except to its own 0600 file)."""

    def __init__(self, name: str, seed: bytes) -> None:
        if len(seed) != _SEED_BYTES:
            raise ConfigError(f"An identity seed has {_SEED_BYTES} bytes, got {len(seed)}.")
        self.name = name
        self._sign = Ed25519PrivateKey.from_private_bytes(seed)
        self._box = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"senseshield-box\0" + seed).digest())
        self.sign_key = self._sign.public_key().public_bytes(*_RAW)
        self.box_key = self._box.public_key().public_bytes(*_RAW)
        self.fingerprint = fingerprint(self.sign_key)

    @classmethod
    def generate(cls, name: str) -> "Identity":
        return cls(name, os.urandom(_SEED_BYTES))

    @classmethod
    def load_or_create(cls, name: str, path: str | Path, *, checked: bool = False) -> "Identity":
        """The identity in ``path`` (0600, in a 0700 directory), created on first use.
        ``checked``: the caller checked the directory already (:func:`secure_dir` reads every
        key file in it: once for a fleet's thousands of identities, not once each)."""
        path = Path(path)
        if not checked:
            secure_dir(path.parent, "--identity")
        if path.is_symlink():
            raise ConfigError(f"Identity file {path} is a symbolic link; give the file itself.")
        if path.exists():
            check_private(path)
            seed = path.read_bytes()
            if len(seed) != _SEED_BYTES:
                raise ConfigError(f"Identity file {path} holds {len(seed)} bytes, not a {_SEED_BYTES}-byte identity.")
            return cls(name, seed)
        identity = cls.generate(name)
        write_secret(path, identity._seed())
        log.info("created identity %s (%s) in %s", name, identity.fingerprint, path)
        return identity

    def _seed(self) -> bytes:
        return self._sign.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())

    def sign(self, data: bytes) -> bytes:
        return self._sign.sign(data)

    def principal(self, role: str) -> "Principal":
        return Principal(self.name, role, self.sign_key, self.box_key)

    def open(self, sealed: bytes, sender_box: bytes, context: bytes) -> bytes:
        """Open a box :func:`seal` made for this identity (:class:`ProtocolError` if it fails)."""
        key = _box_key(self._box, sender_box, context)
        try:
            return ChaCha20Poly1305(key).decrypt(sealed[:12], sealed[12:], context)
        except (InvalidTag, ValueError):
            raise ProtocolError("A sealed value does not open with this identity (wrong key or tampered).") from None

    def exchange(self, peer_box: bytes) -> bytes:
        """X25519 with this identity's box key: the shared secret with ``peer_box`` (for keys
        derived on both sides, e.g. the masked scheme's pads; never sent anywhere)."""
        return self._box.exchange(X25519PublicKey.from_public_bytes(peer_box))

    def seal(self, data: bytes, recipient_box: bytes, context: bytes) -> bytes:
        """``data`` readable only by the holder of ``recipient_box`` (and this identity);
        ``context`` (fleet, run, round) is bound into the key and the tag."""
        key = _box_key(self._box, recipient_box, context)
        nonce = os.urandom(12)
        return nonce + ChaCha20Poly1305(key).encrypt(nonce, data, context)

    def __repr__(self) -> str:
        return f"Identity({self.name!r}, {self.fingerprint})"

    def __reduce__(self) -> Any:
        raise TypeError("Identities do not pickle.")


def _box_key(own: X25519PrivateKey, other: bytes, context: bytes) -> bytes:
    shared = own.exchange(X25519PublicKey.from_public_bytes(other))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"senseshield-seal\0" + context).derive(shared)


@dataclass(frozen=True, slots=True)
class Principal:
    """A trusted name: its role and public keys (``sign`` may be None when only the
    fingerprint is pinned; it is then learnt from the first frame that matches it)."""

    name: str
    role: str
    sign: bytes | None
    box: bytes | None = None
    pinned_fingerprint: str | None = None

    def as_dict(self) -> dict[str, str]:
        out = {"role": self.role}
        if self.sign is not None:
            out["sign"] = b64(self.sign)
        if self.box is not None:
            out["box"] = b64(self.box)
        if self.sign is None and self.pinned_fingerprint:
            out["fingerprint"] = self.pinned_fingerprint
        return out


class Trust:
    """The keys this process believes; checks every frame's signature before it is used.

    ``tofu=True`` (no trust file): unknown names are pinned on first sight, with a warning.
    """

    def __init__(self, principals: dict[str, Principal] | None = None, *, fleet: str | None = None,
                 tofu: bool = False, serial: int | None = None, signed_by: str | None = None,
                 signature: bytes | None = None) -> None:
        self.principals: dict[str, Principal] = dict(principals or {})
        self.fleet = fleet
        self.tofu = tofu
        self.serial, self.signed_by, self.signature = serial, signed_by, signature
        self._lock = threading.Lock()

    def _signed_body(self) -> bytes:
        """What the administrator signs: fleet, serial, signer and every principal, as
        ``json.dumps(sort_keys=True, separators=(",", ":"))`` of them writes it, written one
        principal at a time (a fleet's file holds one per device: no second copy of them all
        as dicts and text)."""
        def dumps(value: Any) -> bytes:  # noqa: ANN401
            return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

        out = io.BytesIO()
        out.write(_TRUST_CONTEXT + b'{"fleet":' + dumps(self.fleet) + b',"principals":{')
        for i, name in enumerate(sorted(self.principals)):
            out.write((b"," if i else b"") + dumps(name) + b":" + dumps(self.principals[name].as_dict()))
        out.write(b'},"serial":' + dumps(self.serial) + b',"signed_by":' + dumps(self.signed_by) + b"}")
        return out.getvalue()

    @property
    def signer_fingerprint(self) -> str | None:
        p = self.principals.get(self.signed_by or "")
        return fingerprint(p.sign) if p is not None and p.sign is not None else None

    @property
    def digest(self) -> str:
        return hashlib.sha256(self._signed_body()).hexdigest()

    def sign(self, admin: "Identity", serial: int) -> "Trust":
        """Number this trust ``serial`` and sign it as ``admin`` (an operator, added if missing)."""
        if role_of_name(admin.name) != "operator":
            raise ConfigError(f"The administrator {admin.name!r} who signs a trust file must be an operator "
                              "('operator' or 'operator-...').")
        if not isinstance(serial, int) or serial < 1:
            raise ConfigError(f"Serial {serial!r} is not allowed; a trust file's serial is a whole number from 1.")
        pinned = self.principals.get(admin.name)
        if pinned is not None and pinned.sign not in (None, admin.sign_key):
            raise ConfigError(f"The trust pins another key for the administrator {admin.name!r} than "
                              f"{admin.fingerprint}; give the administrator's own --admin-identity.")
        self.principals[admin.name] = admin.principal("operator")
        self.serial, self.signed_by = serial, admin.name
        self.signature = admin.sign(self._signed_body())
        return self

    # -- files ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, *, fleet: str | None = None) -> "Trust":
        """Read a trust file; :class:`ConfigError` naming the first problem."""
        import yaml

        path = Path(path)
        try:
            text = path.read_text()
            try:  # a trust file is JSON as written; YAML only if it is not (a JSON parse of a large
                # fleet's file takes a tenth of a second and 5 MB, YAML's tens of seconds and 60 MB)
                data = json.loads(text)
            except ValueError:
                data = yaml.safe_load(text)
        except OSError as exc:
            raise ConfigError(f"--trust {str(path)!r} cannot be read ({exc.strerror or exc}).") from None
        except yaml.YAMLError:
            raise ConfigError(f"--trust {str(path)!r} is not YAML or JSON.") from None
        if not isinstance(data, dict) or not isinstance(data.get("principals"), dict):
            raise ConfigError(f"--trust {str(path)!r} needs a 'principals' mapping of name -> role and keys.")
        file_fleet = data.get("fleet")
        if fleet is not None and file_fleet is not None and file_fleet != fleet:
            raise ConfigError(f"--trust {str(path)!r} is for fleet {file_fleet!r}, not {fleet!r}.")
        principals, entries = {}, data.pop("principals")
        while entries:  # taken out as they are read (a fleet's file holds one per device), last first
            name, entry = entries.popitem()
            where = f"Trust file {path}, principal {name!r}"
            if not isinstance(entry, dict) or entry.get("role") not in ROLES:
                raise ConfigError(f"{where}: role must be one of {', '.join(ROLES)}.")
            if entry["role"] != role_of_name(str(name)):
                raise ConfigError(f"{where}: the name says role {role_of_name(str(name))!r}, the file {entry['role']!r}; "
                                  "the key server and the coordinator are named after their roles, operators "
                                  "'operator' or 'operator-...', site aggregators 'site-...', agents anything else.")
            sign = unb64(entry["sign"], f"{where}: sign") if entry.get("sign") else None
            box = unb64(entry["box"], f"{where}: box") if entry.get("box") else None
            pinned = entry.get("fingerprint")
            if sign is None and not (isinstance(pinned, str) and len(pinned) == 32):
                raise ConfigError(f"{where}: give 'sign' (base64 public key) or 'fingerprint' (32 hex characters).")
            if sign is not None and pinned and fingerprint(sign) != pinned:
                raise ConfigError(f"{where}: the fingerprint does not match the signing key.")
            role = ROLES[ROLES.index(entry["role"])]  # one string per role, not one per device
            principals[str(name)] = Principal(str(name), role, sign, box, pinned)
        trust = cls(dict(reversed(principals.items())), fleet=file_fleet or fleet)  # in the file's order
        if any(k in data for k in ("serial", "signed_by", "signature")):
            trust._check_signature(data, path)
        return trust

    def _check_signature(self, data: dict, path: Path) -> None:
        serial, signer, signature = data.get("serial"), data.get("signed_by"), data.get("signature")
        if isinstance(serial, bool) or not isinstance(serial, int) or serial < 1:
            raise ConfigError(f"--trust {str(path)!r} has serial {serial!r}; a serial is a whole number from 1.")
        admin = self.principals.get(signer) if isinstance(signer, str) else None
        if admin is None or admin.role != "operator" or admin.sign is None:
            raise ConfigError(f"--trust {str(path)!r} is signed by {signer!r}, which is not an operator with a "
                              "signing key in the file.")
        self.serial, self.signed_by = serial, signer
        self.signature = unb64(signature if isinstance(signature, str) else "", f"--trust {str(path)!r}: signature",
                               SIGNATURE_BYTES)
        try:
            Ed25519PublicKey.from_public_bytes(admin.sign).verify(self.signature, self._signed_body())
        except InvalidSignature:
            raise ConfigError(f"--trust {str(path)!r}: the signature of {signer!r} does not verify (the file was "
                              "changed after it was signed); build and sign it again.") from None

    def save(self, path: str | Path) -> Path:
        """Write the trust file (with its serial and signature when :meth:`sign` was called)."""
        data: dict[str, Any] = {"fleet": self.fleet}
        if self.signature is not None:
            data.update(serial=self.serial, signed_by=self.signed_by, signature=b64(self.signature))
        data["principals"] = {n: p.as_dict() for n, p in sorted(self.principals.items())}
        return write_atomic(path, json.dumps(data, indent=2) + "\n", mode=0o644)  # distributed to every host

    @classmethod
    def next_serial(cls, path: str | Path, fleet: str) -> int:
        """The serial of a trust file that replaces the one at ``path``: its serial plus one
        (1 if there is none, or it is unsigned or unreadable)."""
        if not Path(path).exists():
            return 1
        try:
            return (cls.load(path, fleet=fleet).serial or 0) + 1
        except ConfigError:
            return 1

    @classmethod
    def for_identities(cls, identities: dict[str, tuple["Identity", str]], *, fleet: str) -> "Trust":
        """The trust of a fleet whose identities this process made (``fleet up``)."""
        return cls({n: i.principal(role) for n, (i, role) in identities.items()}, fleet=fleet)

    # -- checks -----------------------------------------------------------------------------
    def add(self, principal: Principal) -> None:
        with self._lock:
            self.principals[principal.name] = principal

    def role(self, name: str) -> str | None:
        p = self.principals.get(name)
        return p.role if p is not None else None

    def box_key(self, name: str) -> bytes | None:
        p = self.principals.get(name)
        return p.box if p is not None else None

    def verify(self, sender: str, key: bytes, signed: bytes, signature: bytes, *, role: str | None = None) -> None:
        """Accept ``signature`` over ``signed`` from ``sender`` whose frame names ``key``;
        :class:`ProtocolError` with the reason otherwise."""
        with self._lock:
            principal = self.principals.get(sender)
            if principal is None:
                if not self.tofu:
                    raise ProtocolError(f"Frame from {sender!r}, which is not in the fleet's trust file.")
                principal = Principal(sender, role or "agent", key)
                self.principals[sender] = principal
                log.warning("trusting %s's key %s on first use (no --trust file: development only)",
                            sender, fingerprint(key))
            elif principal.sign is None:
                if fingerprint(key) != principal.pinned_fingerprint:
                    raise ProtocolError(f"Frame from {sender!r} is signed with a key whose fingerprint is not the pinned one.")
                principal = Principal(sender, principal.role, key, principal.box, principal.pinned_fingerprint)
                self.principals[sender] = principal
        if key != principal.sign:
            raise ProtocolError(f"Frame from {sender!r} is signed with key {fingerprint(key)}, not its pinned key "
                                f"{fingerprint(principal.sign)}.")
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(signature, signed)
        except InvalidSignature:
            raise ProtocolError(f"Signature of the frame from {sender!r} does not verify.") from None


class TrustHistory:
    """What one process has seen of its fleet's trust files (``trust-seen.json`` beside its
    identity): per fleet the administrator key that signed them, the highest serial, and that
    file's digest. :meth:`admit` refuses a file signed by another key, an older serial (a newer
    file revoked it) or another file under the same serial."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            raise ConfigError(f"{self.path} (the trust serials this service has seen) cannot be read; "
                              "restore it or remove it to pin the current trust file again.") from None
        return data if isinstance(data, dict) else {}

    def admit(self, trust: Trust, where: str) -> None:
        data = self._read()
        seen = data.get(trust.fleet or "")
        if isinstance(seen, dict):
            if seen.get("signer") != trust.signer_fingerprint:
                raise ConfigError(
                    f"--trust {where} is signed by {trust.signed_by!r} with key {trust.signer_fingerprint}, not the "
                    f"administrator key {seen.get('signer')} this service pinned (serial {seen.get('serial')}); give a "
                    f"trust file signed by that administrator, or remove {self.path} to pin a new one.")
            if trust.serial < seen.get("serial", 0):
                raise ConfigError(
                    f"--trust {where} has serial {trust.serial}, older than serial {seen['serial']} this service has "
                    "seen; a newer trust file revokes the older ones, so give the current one.")
            if trust.serial == seen.get("serial") and trust.digest != seen.get("digest"):
                raise ConfigError(
                    f"--trust {where} has serial {trust.serial} but other contents than the file of that serial this "
                    "service has seen; a changed trust file needs a higher serial (`senseshield identity build`).")
            if trust.serial == seen.get("serial"):
                return
        data[trust.fleet or ""] = {"serial": trust.serial, "signer": trust.signer_fingerprint, "digest": trust.digest}
        write_atomic(self.path, json.dumps(data, indent=2) + "\n", mode=0o600)


def admit_trust(path: str | Path | None, *, fleet: str, history: str | Path, required: bool = True) -> Trust | None:
    """The trust a service starts with (None: trust on first use, development mode only).

    Outside development mode a service needs a trust file with a serial and an
    administrator's signature, and refuses one older than, or signed by another key than,
    what it has seen (:class:`TrustHistory` in ``history``). ``required=False`` (the
    operator's ``job`` client, which serves nobody) lets it go on without one, with a warning."""
    if path is None:
        if development_mode() or not required:
            return None
        raise ConfigError(
            "--trust is missing: without the fleet's trust file a service believes any key on first use; give --trust "
            "FILE (`senseshield identity build`, or the OUT/trust.json of `senseshield fleet up`, docs/security.md) "
            f"or, {how_to_allow()}.")
    trust = Trust.load(path, fleet=fleet)
    if trust.signature is None:
        if development_mode():
            log.warning("trust file %s has no serial and signature (development only)", path)
            return trust
        raise ConfigError(
            f"--trust {str(path)!r} has no serial and administrator signature; sign it with `senseshield identity "
            f"build --admin-identity FILE` or, {how_to_allow()}.")
    TrustHistory(history).admit(trust, repr(str(path)))
    return trust


def role_of_name(name: str) -> str:
    """The role a name has by convention (trust on first use; trust files must agree)."""
    if name in ("keyserver", "coordinator"):
        return name
    if name.startswith("site-"):  # a site aggregator: a coordinator for its site's updates
        return "site"
    return "operator" if name == "operator" or name.startswith("operator-") else "agent"


def check_frame(trust: Trust, frame: Any) -> None:
    """Every frame a service uses must be signed by its sender's trusted key."""
    if not frame.is_signed:
        raise ProtocolError(f"Unsigned {frame.schema!r} frame from {frame.sender!r}; every frame must be signed.")
    trust.verify(frame.sender, frame.signer_key, frame.signed, frame.signature, role=role_of_name(frame.sender))
