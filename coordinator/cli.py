"""``coordinator``: registry, clustering, rounds and blind aggregation of a fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli.common import console, fail, storage_stop, version_option
from senseshield.cli.connection import Connection, connection_options
from senseshield.cli.run import InsecureDev, LogLevel, Scheme, Sets, build_run_config, development, setup_logging, starting
from senseshield.errors import ConfigError, StorageError

app = typer.Typer(help="SenseShield coordinator: clusters agents and aggregates ciphertexts it cannot read.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root(version: Annotated[bool, version_option("coordinator")] = False) -> None:
    """SenseShield coordinator."""


@app.command()
@connection_options
def serve(
    connection: Connection = Connection(),
    job: Annotated[Optional[list[Path]], typer.Option("--job", help="Queue this job file at start: a signed job (`senseshield job sign`; a key server serves only operator-signed jobs) or, for a key server in development mode or with --allow-unsigned-jobs, YAML/TOML. A restart with the same --state-dir does not queue it again; repeatable. More come from `senseshield job submit`.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Exit when the queued jobs are done (default: stay up and take jobs).")] = False,
    strategy: Annotated[Optional[str], typer.Option(help="Queue a job built from these flags (instead of --job): strategy name.")] = None,
    rounds: Annotated[Optional[int], typer.Option(help=f"With --strategy: federated rounds (default {defaults.ROUNDS}).")] = None,
    agents: Annotated[Optional[int], typer.Option(help=f"With --strategy: devices the job waits for (its min_devices, default {defaults.MIN_DEVICES}).")] = None,
    dataset: Annotated[Optional[str], typer.Option(help=f"With --strategy: built-in dataset giving input shape and classes (default {defaults.DATASET}).")] = None,
    model: Annotated[Optional[str], typer.Option(help=f"With --strategy: model name or import path (default {defaults.MODEL}).")] = None,
    partition: Annotated[Optional[str], typer.Option(help=f"With --strategy: how --shard agents cut the dataset (default {defaults.PARTITION}).")] = None,
    seed: Annotated[Optional[int], typer.Option(help=f"With --strategy: seed (default {defaults.SEED}).")] = None,
    local_epochs: Annotated[Optional[int], typer.Option(help=f"With --strategy: local epochs (default {defaults.LOCAL_EPOCHS}).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help=f"With --strategy: minibatch size (default {defaults.BATCH_SIZE}).")] = None,
    lr: Annotated[Optional[float], typer.Option(help=f"With --strategy: learning rate (default {defaults.LR}).")] = None,
    scheme: Scheme = None,
    key_bits: Annotated[Optional[int], typer.Option(help=f"With --strategy: Paillier modulus bits (default {defaults.KEY_BITS}).")] = None,
    train_threads: Annotated[Optional[int], typer.Option(help=f"With --strategy: torch threads of training (default {defaults.TRAIN_THREADS}).")] = None,
    set_: Sets = None,
    round_deadline: Annotated[Optional[float], typer.Option(help="Seconds a round waits for updates (overrides every job's round_deadline).")] = None,
    join_timeout: Annotated[Optional[float], typer.Option(help="With --once: seconds a job waits for its devices before failing (default: forever).")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(help="The job queue and the running job's state (one SQLite file, coordinator-FLEET.sqlite); a restarted coordinator resumes the running job.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Reports and models: OUT/jobs/<id>/ (with --once: OUT/ itself).")] = None,
    max_message_mb: Annotated[float, typer.Option(help="Refuse messages larger than this (MB).")] = 256.0,
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve Prometheus metrics on this port (default: off, or $SENSESHIELD_METRICS_PORT).")] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the Prometheus endpoint binds to (0.0.0.0: every interface; the metrics name every device).")] = "127.0.0.1",
    kill_before_close: Annotated[Optional[int], typer.Option(help="Fault drill: SIGKILL the coordinator once round R has every verdict, before it closes the round (not again after a restart).", hidden=True)] = None,
    kill_at_message: Annotated[Optional[list[int]], typer.Option(help="Fault drill: SIGKILL the coordinator right after it handled the job's N-th inbound message, counted over restarts in --state-dir (each N once; repeatable).", hidden=True)] = None,
    site: Annotated[Optional[str], typer.Option(help="Run as the aggregator of site NAME instead: on the site's own broker (--broker), bridged to the hub's (`senseshield fleet bridge`), fold the site's devices' updates and send one partial sum per cluster to the coordinator (masked, packed-Paillier and plaintext jobs). Identity: site-NAME.")] = None,
    insecure_dev: InsecureDev = False,
    log_level: LogLevel = defaults.LOG_LEVEL,
) -> None:
    """Run the fleet's coordinator: it stays up and runs jobs one at a time, in the order they
    are submitted (--job files, `senseshield job submit`), on the devices that are online."""
    setup_logging(log_level, "coordinator" if site is None else f"site-{site}")
    development(insecure_dev)
    broker, fleet = connection.broker, connection.fleet
    if site is not None:
        return serve_site(site, connection, state_dir=state_dir, max_message_mb=max_message_mb,
                          job_flags=[name for name, value in (("--job", job), ("--strategy", strategy), ("--once", once),
                                                              ("--out", out), ("--metrics-port", metrics_port))
                                     if value])
    if agents is not None and agents < 1:
        fail(f"--agents {agents} is not allowed; a job needs at least 1 device.")
    if metrics_port is not None and not 0 < metrics_port < 65536:
        fail(f"--metrics-port {metrics_port} is not allowed; use a port in 1..65535.")
    starting("coordinator", "coordinator", broker, fleet)  # before the imports below
    from senseshield.extras import require

    try:  # clustering and the privacy accountant (`pip install senseshield` alone is a device's install)
        require(("sklearn", "scipy", "opacus"), "The coordinator")
    except ConfigError as exc:
        fail(str(exc))
    from coordinator.jobs import OPEN
    from coordinator.service import Coordinator
    from senseshield.runtime.service import leave
    from senseshield.job import load_job, with_shape
    from senseshield.runtime.jobsig import check_signed_job, is_signed_job, read_job_bytes, signed_nonce

    flags = {"rounds": rounds, "dataset": dataset, "model": model, "partition": partition, "seed": seed,
             "local_epochs": local_epochs, "batch_size": batch_size, "lr": lr, "key_bits": key_bits,
             "train_threads": train_threads}
    given = [k for k, v in flags.items() if v is not None] + (["scheme"] if scheme else []) + (["set"] if set_ else [])
    jobs: list = []  # a Job, or (file, bytes) of a signed job, opened once the trust is loaded
    try:
        for path in job or []:
            data = read_job_bytes(path)
            jobs.append((path, data) if is_signed_job(data) else with_shape(load_job(path)))
        if strategy is not None:
            if job:
                raise ConfigError("--job and --strategy are alternatives; put the job's settings in the job file.")
            values = {k: (v if v is not None else defaults.JOB_FLAGS[k]) for k, v in flags.items()}
            devices = agents or defaults.MIN_DEVICES
            config = build_run_config(strategy=strategy, scheme=scheme, clients=devices, sets=set_, **values)
            jobs.append(with_shape(config.model_copy(update={"min_devices": devices})))
        elif given:
            raise ConfigError(f"--{given[0].replace('_', '-')} describes a job; give --strategy too, or use --job FILE.")
    except ConfigError as exc:
        fail(str(exc))
    security = connection.security()
    server = None
    try:
        from senseshield.runtime.keyfiles import writable_dir

        for flag, folder in (("--state-dir", state_dir), ("--out", out)):
            if folder is not None:  # named as such, before the identity inside it
                writable_dir(folder, flag)
        home = state_dir if state_dir is not None else Path.home() / ".senseshield" / fleet
        me, trusted = connection.identity_and_trust("coordinator", home / "identity" / "coordinator.key")
        server = Coordinator(
            broker, fleet=fleet, once=once, identity=me, trust=trusted, join_timeout=join_timeout, round_deadline=round_deadline,
            state_dir=state_dir, out_dir=out, protocol=connection.protocol,
            max_frame_bytes=int(max_message_mb * 1e6), metrics_port=metrics_port,
            metrics_host=metrics_host, kill_before_close=kill_before_close, kill_at_message=kill_at_message or (),
        )
        # restarted with the same --job: the checkpointed job resumes, and a long-running
        # coordinator (a service restarted by its supervisor) does not run a finished one again
        # (a signed job is booked under its nonce: each signature runs once)
        booked = [r.spec for r in server.book.records.values() if not once or r.state in OPEN]
        queue = []
        for e in jobs:
            if isinstance(e, tuple):  # a signed job file, checked as the key server will check it
                operator, spec = check_signed_job(e[1], trusted, fleet=fleet, where=repr(str(e[0])))
                queue.append((spec, e[1], operator))
            else:
                queue.append((e, b"", ""))
        for spec, frame, operator in queue:
            nonce = signed_nonce(frame) if frame else ""
            if (nonce and nonce not in server.book.records) or (not nonce and spec not in booked):
                server.submit(spec, nonce or None, signed=frame, operator=operator)
        server.link.secure(**security)
        server.install_signal_handlers()
        server.serve()
        leave(server)
        if once and server.failed_jobs:  # the job's sentence is its last event line (and the report's reason)
            raise typer.Exit(1)
    except StorageError as exc:  # --out or --state-dir: disk full, read-only, permission
        storage_stop(exc, "the coordinator", "its job stays running in --state-dir and resumes after the last round "
                     "it saved when the coordinator is started again (the key server answers rounds it already applied)")
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # stopped during a job (its loop raises it): exit 130, the job resumes at restart
        console.print("coordinator stopped")
        if server is not None:
            leave(server, 130)
        raise typer.Exit(130)


def serve_site(site: str, connection: Connection, *, state_dir: Path | None, max_message_mb: float,
               job_flags: list[str]) -> None:
    """``coordinator serve --site NAME``: the site aggregator (coordinator.site_service)."""
    from senseshield.runtime.sites import site_name

    try:
        site_name(site)
    except ValueError as exc:
        fail(f"--site: {exc}")
    if job_flags:
        fail(f"{job_flags[0]} is not allowed with --site; a site aggregator runs no job of its own, it folds the "
             "updates of the jobs the coordinator runs.")
    broker, fleet = connection.broker, connection.fleet
    starting(f"site-{site}", "site aggregator", broker, fleet)
    from coordinator.site_service import SiteAggregator
    from senseshield.runtime.service import leave

    security = connection.security()
    try:
        home = state_dir if state_dir is not None else Path.home() / ".senseshield" / fleet
        me, trusted = connection.identity_and_trust(f"site-{site}", home / "identity" / f"site-{site}.key")
        server = SiteAggregator(broker, site=site, fleet=fleet, identity=me, trust=trusted, protocol=connection.protocol,
                                max_frame_bytes=int(max_message_mb * 1e6))
        server.link.secure(**security)
        server.install_signal_handlers()
        server.serve()
        leave(server)
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
