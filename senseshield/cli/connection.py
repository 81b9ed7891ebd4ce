"""The options that connect a command to a fleet, defined once: broker, fleet, MQTT version,
TLS CA file, credentials, identity and trust file.

A command takes them by declaring one parameter ``connection: Connection`` and the
:func:`connection_options` decorator: the parameter becomes the eight options (``--broker``,
``--fleet``, ``--mqtt``, ``--ca-file``, ``--username``, ``--password-file``, ``--identity``,
``--trust``) at its place in the command's signature, and the command receives them as one
:class:`Connection`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from senseshield import defaults
from senseshield.cli.run import (
    Broker, CaFile, Fleet, IdentityFile, Mqtt, PasswordFile, TrustFile, Username, check_mqtt, identity_and_trust,
    mqtt_security,
)


@dataclass(frozen=True)
class Connection:
    """What the connection options say, as one value."""

    broker: str = defaults.BROKER
    fleet: str = defaults.FLEET
    mqtt: str = defaults.MQTT
    ca_file: Optional[Path] = None
    username: Optional[str] = None
    password_file: Optional[Path] = None
    identity: Optional[Path] = None
    trust: Optional[Path] = None

    def security(self) -> dict[str, object]:
        """:func:`~senseshield.cli.run.mqtt_security` of these options (a mistake: one sentence, exit 2)."""
        return mqtt_security(self.broker, ca_file=self.ca_file, username=self.username,
                             password_file=self.password_file)

    @property
    def protocol(self) -> str:
        """The checked ``--mqtt`` version."""
        return check_mqtt(self.mqtt)

    def identity_and_trust(self, name: str, default: Path, *, identity: Path | None = None,
                           required: bool = True):  # noqa: ANN201
        """:func:`~senseshield.cli.run.identity_and_trust` with ``--identity`` (or ``identity``)
        and ``--trust``."""
        return identity_and_trust(name, identity if identity is not None else self.identity, default, self.trust,
                                  self.fleet, required=required)


_ANNOTATIONS: dict[str, Any] = {
    "broker": Broker, "fleet": Fleet, "mqtt": Mqtt, "ca_file": CaFile, "username": Username,
    "password_file": PasswordFile, "identity": IdentityFile, "trust": TrustFile,
}
_NAMES = tuple(f.name for f in fields(Connection))
assert set(_NAMES) == set(_ANNOTATIONS)


def connection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``func``'s parameter ``connection`` by the eight connection options (same
    names, help and defaults everywhere) and call ``func`` with them as a :class:`Connection`."""
    signature = inspect.signature(func, eval_str=True)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("connection")
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY if params[at].kind is inspect.Parameter.KEYWORD_ONLY
                                 else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 default=getattr(Connection, name), annotation=_ANNOTATIONS[name])
               for name in _NAMES]
    params[at : at + 1] = options

    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        bound = command.__signature__.bind(*args, **kwargs)  # type: ignore[attr-defined]
        bound.apply_defaults()
        values = dict(bound.arguments)
        connection = Connection(**{name: values.pop(name) for name in _NAMES})
        return func(connection=connection, **values)

    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
    return command
