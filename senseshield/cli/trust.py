"""``senseshield identity`` and ``senseshield trust``: the keys of a fleet's principals.

Each host makes its own identity (``senseshield identity --name pi-7 --role agent --identity
/var/lib/senseshield/identity.key``: the secret half never leaves the host) and prints its
public entry; the operator collects the entries into the fleet's trust file
(``senseshield trust build --fleet lab entries/*.json --out trust.json``) and gives that
file to every process (``--trust``). ``deploy/ansible`` does exactly this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli.common import fail, out
from senseshield.errors import ConfigError

identity_app = typer.Typer(help="Identity keys and trust files of a fleet (signed frames, docs/security.md).",
                           no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@identity_app.command("show")
def show(
    name: Annotated[str, typer.Option(help="The principal's name: keyserver, coordinator, operator or the agent id.")],
    identity: Annotated[Path, typer.Option("--identity", help="The identity key file (0600; created if missing).")],
    role: Annotated[str, typer.Option(help="keyserver | coordinator | agent | operator (default: from the name).")] = "",
) -> None:
    """Print this principal's public trust entry (JSON), creating its identity if missing."""
    from senseshield.runtime.identity import ROLES, Identity, role_of_name

    try:
        role = role or role_of_name(name)
        if role not in ROLES or role != role_of_name(name):
            raise ConfigError(f"--role {role!r} does not fit the name {name!r}; the key server and the coordinator are "
                              "named after their roles, operators 'operator[-...]', agents anything else.")
        me = Identity.load_or_create(name, identity)
    except ConfigError as exc:
        fail(str(exc))
    entry = {"name": name, **me.principal(role).as_dict(), "fingerprint": me.fingerprint}
    out.print_json(json.dumps(entry))


@identity_app.command("build")
def build(
    entries: Annotated[list[Path], typer.Argument(help="Entries printed by `senseshield identity show` (JSON files).")],
    admin_identity: Annotated[Path, typer.Option("--admin-identity", help="The administrator's identity key (an operator's) that signs the trust file; it stays on the administrator's machine.")],
    fleet: Annotated[str, typer.Option(help="The fleet the trust file is for.")] = defaults.FLEET,
    out_file: Annotated[Path, typer.Option("--out", help="Where to write the trust file (JSON).")] = Path("trust.json"),
    admin_name: Annotated[str, typer.Option(help="The administrator's principal name: 'operator' or 'operator-...'.")] = "operator",
    serial: Annotated[Optional[int], typer.Option(help="The trust file's serial (default: the serial of the --out file it replaces plus one, else 1); services refuse a file older than one they have seen.")] = None,
) -> None:
    """Collect identity entries into the fleet's trust file (name -> role and public keys),
    numbered and signed by the administrator."""
    from senseshield.runtime.identity import Identity, Principal, Trust, fingerprint, unb64

    principals = {}
    try:
        for path in entries:
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                raise ConfigError(f"{path} is not an entry of `senseshield identity show` (JSON).") from None
            name = entry.get("name")
            if not isinstance(name, str) or name in principals:
                raise ConfigError(f"{path}: the entry has no name, or names {name!r} twice.")
            sign = unb64(entry.get("sign", ""), f"{path}: sign")
            box = unb64(entry["box"], f"{path}: box") if entry.get("box") else None
            principals[name] = Principal(name, entry.get("role", ""), sign, box, fingerprint(sign))
        admin = Identity.load_or_create(admin_name, admin_identity)
        principals.setdefault(admin_name, admin.principal("operator"))
        current = _current(out_file, fleet)
        if serial is None and current is not None and current.signer_fingerprint == admin.fingerprint and \
                {n: p.as_dict() for n, p in current.principals.items()} == {n: p.as_dict() for n, p in principals.items()}:
            out.print(f"{out_file} is unchanged: it pins these {len(principals)} principals (serial {current.serial})")
            return  # a second provisioning run changes nothing (no new serial, no restarts)
        if serial is None:
            serial = (current.serial if current is not None else 0) + 1
        trust = Trust(principals, fleet=fleet).sign(admin, serial)
        trust.save(out_file)
        Trust.load(out_file, fleet=fleet)  # the same checks as every service applies
    except ConfigError as exc:
        fail(str(exc))
    out.print(f"wrote {out_file}: {len(trust.principals)} principals of fleet {fleet!r}, serial {serial}, "
              f"signed by {admin_name} ({admin.fingerprint})")



def _current(path: Path, fleet: str):  # noqa: ANN202 - Trust | None
    """The signed trust file at ``path`` that a new build replaces (None: none, or unsigned)."""
    from senseshield.runtime.identity import Trust

    if not path.exists():
        return None
    try:
        trust = Trust.load(path, fleet=fleet)
    except ConfigError:
        return None
    return trust if trust.signature is not None else None
