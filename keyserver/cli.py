"""``keyserver``: the only holder of the fleet's secret key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli.common import fail, storage_stop, version_option
from senseshield.cli.connection import Connection, connection_options
from senseshield.cli.run import InsecureDev, LogLevel, MinContributors, Threads, development, setup_logging, starting
from senseshield.errors import ConfigError, StorageError

app = typer.Typer(help="SenseShield key server: holds the secret key, decrypts aggregates only.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root(version: Annotated[bool, version_option("keyserver")] = False) -> None:
    """SenseShield key server."""


@app.command()
@connection_options
def serve(
    connection: Connection = Connection(),
    key_dir: Annotated[Path, typer.Option(help="Directory of the key pair (created 0700; secret file 0600).")] = Path("keys"),
    min_contributors: MinContributors = defaults.MIN_CONTRIBUTORS,
    min_encryptors: Annotated[int, typer.Option(help="Never decrypt a position fewer than this many agents of the cluster encrypted (per-client-mask schemes; its mean then comes from the plaintext senders). A job may ask for more, never less; 1 = the papers' rule.")] = defaults.MIN_ENCRYPTORS,
    allow_unverifiable: Annotated[bool, typer.Option("--allow-unverifiable", help="Decrypt aggregates of schemes whose sums cannot be checked against the contributors' fingerprints (CKKS): the coordinator is then trusted to sum honestly. Off: such aggregates are refused.")] = False,
    allow_unsigned_jobs: Annotated[bool, typer.Option("--allow-unsigned-jobs", help="Serve jobs no operator signed (a job built from `coordinator serve --strategy` flags or an unsigned --job file): the coordinator alone may then start jobs, e.g. re-runs with other seeds to probe the devices. Off: a job must be signed by an operator the trust file pins (docs/security.md).")] = False,
    min_fraction: Annotated[float, typer.Option(help="Also refuse an aggregate of fewer than this fraction of its cluster's members in the round (0..1; SenseCrypt Thm. 1: collusion with at most |G|-2 clients).")] = 0.0,
    threads: Threads = None,
    workers: Annotated[Optional[int], typer.Option(help="Aggregates decrypted at once, each on --threads threads (default: the usable cores, at least 2).")] = None,
    key_structure: Annotated[str, typer.Option(help="Packed-Paillier key made on first use: subgroup (256-bit decryption exponent, ~4x faster; docs/security.md) or standard. Each has its own key file.")] = "subgroup",
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve Prometheus metrics on this port (default: off, or $SENSESHIELD_KEYSERVER_METRICS_PORT).")] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the Prometheus endpoint binds to (0.0.0.0: every interface).")] = "127.0.0.1",
    insecure_dev: InsecureDev = False,
    log_level: LogLevel = defaults.LOG_LEVEL,
    kill_after_apply: Annotated[Optional[int], typer.Option(help="Fault drill: SIGKILL the key server right after it applied round R, before it answers.", hidden=True)] = None,
) -> None:
    """Publish the public key, decrypt aggregates, publish cluster models (until SIGTERM)."""
    setup_logging(log_level, "keyserver")
    development(insecure_dev)
    if metrics_port is not None and not 0 < metrics_port < 65536:
        fail(f"--metrics-port {metrics_port} is not allowed; use a port in 1..65535.")
    broker, fleet = connection.broker, connection.fleet
    starting("key server", "keyserver", broker, fleet)  # before the imports below
    from keyserver.service import KeyServer
    from senseshield.runtime.service import leave

    security = connection.security()
    try:
        from senseshield.runtime.keyfiles import secure_dir

        secure_dir(key_dir, "--key-dir")  # the key directory's problems are named as such
        me, trusted = connection.identity_and_trust("keyserver", key_dir / "identity.key")
        server = KeyServer(broker, fleet=fleet, key_dir=key_dir, min_contributors=min_contributors, min_fraction=min_fraction,
                           min_encryptors=min_encryptors, allow_unverifiable=allow_unverifiable,
                           allow_unsigned_jobs=allow_unsigned_jobs,
                           protocol=connection.protocol,
                           threads=threads, workers=workers, key_structure=key_structure, kill_after_apply=kill_after_apply, identity=me, trust=trusted,
                           metrics_port=metrics_port, metrics_host=metrics_host)
        server.link.secure(**security)
        server.install_signal_handlers()
        server.run()
        leave(server)  # a decryption the stop abandoned is not waited for
    except StorageError as exc:  # --key-dir: disk full, read-only, permission
        storage_stop(exc, "the key server", "it answers nothing it could not save, so when it is started again it "
                     "resumes from its checkpoint and the coordinator re-sends what is pending")
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
