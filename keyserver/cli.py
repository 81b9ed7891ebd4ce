"""``keyserver``: the only holder of the fleet's secret key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield.cli.common import fail
from senseshield.cli.run import (
    Broker, CaFile, Fleet, LogLevel, Mqtt, PasswordFile, Username, check_mqtt, mqtt_security, setup_logging,
)
from senseshield.errors import ConfigError

app = typer.Typer(help="SenseShield key server: holds the secret key, decrypts aggregates only.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """SenseShield key server."""


@app.command()
def serve(
    broker: Broker = "mqtt://127.0.0.1:1883",
    fleet: Fleet = "default",
    key_dir: Annotated[Path, typer.Option(help="Directory of the key pair (created 0700; secret file 0600).")] = Path("keys"),
    min_contributors: Annotated[int, typer.Option(help="Refuse aggregates with fewer distinct contributors.")] = 2,
    threads: Annotated[Optional[int], typer.Option(help="Decryption threads (packed Paillier; default: every core).")] = None,
    mqtt: Mqtt = "5",
    ca_file: CaFile = None,
    username: Username = None,
    password_file: PasswordFile = None,
    log_level: LogLevel = "info",
    kill_after_apply: Annotated[Optional[int], typer.Option(help="Fault drill: SIGKILL the key server right after it applied round R, before it answers.", hidden=True)] = None,
) -> None:
    """Publish the public key, decrypt aggregates, publish cluster models (until SIGTERM)."""
    from keyserver.service import KeyServer

    setup_logging(log_level, "keyserver")
    security = mqtt_security(broker, ca_file=ca_file, username=username, password_file=password_file)
    try:
        server = KeyServer(broker, fleet=fleet, key_dir=key_dir, min_contributors=min_contributors, protocol=check_mqtt(mqtt),
                           threads=threads, kill_after_apply=kill_after_apply)
        server.link.secure(**security)
        server.install_signal_handlers()
        server.run()
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
