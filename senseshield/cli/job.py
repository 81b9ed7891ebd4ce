"""``senseshield job``: submit, list, follow and cancel jobs on a running coordinator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from senseshield import defaults
from senseshield.cli.common import console, fail, out
from senseshield.cli.connection import Connection, connection_options
from senseshield.cli.run import Fleet
from senseshield.errors import ConfigError, StorageError

job_app = typer.Typer(help="Jobs on a running coordinator (`coordinator serve`): submit, list, status, logs, cancel.",
                      no_args_is_help=True)

JobId = Annotated[str, typer.Argument(help="The job's id (see `senseshield job list`).", metavar="ID")]


def _client(connection: Connection):  # noqa: ANN202
    from senseshield.runtime.jobs import JobClient

    security = connection.security()
    me, trusted = connection.identity_and_trust(
        "operator", Path.home() / ".senseshield" / "identities" / "operator.key", required=False)
    return JobClient(connection.broker, fleet=connection.fleet, protocol=connection.protocol, identity=me,
                     trust=trusted, **security)


def _when(stamp: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _follow(client, job_id: str) -> int:  # noqa: ANN001
    record = client.follow(job_id, lambda line: out.print(line, highlight=False, soft_wrap=True))  # one event, one line
    if record.get("out"):
        console.print(f"report: {record['out']}/report.json (on the coordinator's host)")
    return 0 if record["state"] == "done" else 1


@job_app.command("submit")
@connection_options
def submit(
    job_file: Annotated[Path, typer.Argument(help="The job (YAML or TOML): strategy, options, model, model_args, input_shape, num_classes, rounds, ...", metavar="FILE")],
    connection: Connection = Connection(),
    follow: Annotated[bool, typer.Option("--follow", help="Print the job's events until it ends (exit 0 if done, 1 if it failed or was cancelled).")] = False,
) -> None:
    """Queue a job on the fleet's coordinator; it starts when the jobs before it are done and
    its minimum number of devices is ready."""
    from senseshield.job import load_job, with_shape

    try:
        # a bad key or value is refused here, before anything is sent; a job on a built-in
        # dataset gets its input shape and classes from it (as `fleet up` does)
        job = with_shape(load_job(job_file))
        with _client(connection) as client:
            job_id = client.submit(job)
            ahead = [j for j in client.board() if j["state"] in ("queued", "waiting", "running") and j["id"] != job_id]
            console.print(f"job {job_id} queued: {job.label}" + (f" ({len(ahead)} ahead of it)" if ahead else ""))
            out.print(job_id)
            if follow:
                raise typer.Exit(_follow(client, job_id))
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))


@job_app.command("sign")
def sign(
    job_file: Annotated[Path, typer.Argument(help="The job (YAML or TOML), as for `job submit`.", metavar="FILE")],
    identity: Annotated[Path, typer.Option("--identity", help="The operator's identity key (it must exist; the trust file pins its public half).")],
    out_file: Annotated[Path, typer.Option("--out", help="Write the signed job here (give it to `coordinator serve --job`).")],
    fleet: Fleet = defaults.FLEET,
    name: Annotated[str, typer.Option("--name", help="The operator's name in the trust file ('operator' or 'operator-...').")] = "operator",
    trust: Annotated[Optional[Path], typer.Option("--trust", help="Check the signed job against this trust file now, as the coordinator and key server will.")] = None,
) -> None:
    """Sign a job as the fleet's operator: the file `coordinator serve --job` takes. A key
    server serves only jobs an operator its trust file pins has signed (docs/security.md)."""
    from senseshield.job import load_job, with_shape
    from senseshield.runtime.files import write_atomic
    from senseshield.runtime.identity import Identity, Trust
    from senseshield.runtime.jobsig import check_signed_job, sign_job

    try:
        if not identity.is_file():
            raise ConfigError(f"--identity {str(identity)!r} is not a file; give the operator's existing identity key "
                              "(a new one would be pinned by no trust file).")
        job = with_shape(load_job(job_file))  # its input shape and classes, as `job submit` sends it
        frame = sign_job(job, Identity.load_or_create(name, identity), fleet=fleet)
        if trust is not None:
            check_signed_job(frame, Trust.load(trust, fleet=fleet), fleet=fleet, where=repr(str(out_file)))
        write_atomic(out_file, frame, mode=0o644)  # sent to the coordinator, key server and agents
    except (ConfigError, StorageError) as exc:
        fail(str(exc))
    from senseshield.runtime.jobsig import signed_initial, signed_nonce

    initial = signed_initial(frame)
    console.print(f"job {signed_nonce(frame)} ({job.label}) signed by {name} for fleet {fleet!r}: {out_file}"
                  + ("" if initial else " (its model does not build here: the agents check its initial model "
                     "against the signed seed themselves)"))
    console.print("it runs once: sign the job again to run it again")


def _metric(j: dict) -> str:
    """``accuracy 0.912`` / ``mse 0.0312``: a board entry's latest metric ("" before any;
    books written before the metric column have only ``accuracy``)."""
    value = j.get("metric")
    if value is None and j.get("accuracy") is not None:
        return f"accuracy {j['accuracy']:.3f}"
    return f"{j.get('metric_name') or 'accuracy'} {value:.4g}" if value is not None else ""


@job_app.command("list")
@connection_options
def list_jobs(
    connection: Connection = Connection(),
) -> None:
    """The coordinator's jobs, oldest first: state, progress, the job's metric (accuracy, mse, ...), devices."""
    try:
        with _client(connection) as client:
            jobs = client.board()
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    table = Table()
    for name in ("id", "name", "state", "round", "metric", "devices", "submitted", "finished"):
        table.add_column(name, no_wrap=name in ("id", "state"), overflow="fold")
    for j in jobs:
        table.add_row(j["id"], j["name"], j["state"], f"{j['round']}/{j['rounds']}", _metric(j) or "-", str(j["devices"]),
                      _when(j["submitted_at"]), _when(j["finished_at"]))
    out.print(table)
    if not jobs:
        console.print("no jobs yet; submit one with `senseshield job submit FILE`")


@job_app.command("status")
@connection_options
def status(
    job_id: JobId,
    connection: Connection = Connection(),
) -> None:
    """One job: state, progress, its metric, where its report is, and its latest events."""
    try:
        with _client(connection) as client:
            j = client.record(job_id)
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    spec = j["job"]
    out.print(f"job {j['id']}: {j['name']} ({spec['strategy']}, model {spec['model']})", highlight=False)
    out.print(f"state {j['state']}" + (f" ({j['reason']})" if j.get("reason") else "")
              + f"; round {j['round']}/{j['rounds']}; devices {j['devices']}"
              + (f"; {_metric(j)}" if _metric(j) else ""), highlight=False)
    out.print(f"submitted {_when(j['submitted_at'])}, started {_when(j['started_at'])}, "
              f"finished {_when(j['finished_at'])}", highlight=False)
    if j.get("out"):
        out.print(f"report: {j['out']}/report.json (on the coordinator's host)", highlight=False)
    for line in j["events"][-8:]:
        out.print(f"  {line}", highlight=False, soft_wrap=True)


@job_app.command("logs")
@connection_options
def logs(
    job_id: JobId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until the job ends.")] = False,
    connection: Connection = Connection(),
) -> None:
    """The job's event lines (queued, waiting for devices, one line per round, joins, refusals, end)."""
    try:
        with _client(connection) as client:
            if follow:
                raise typer.Exit(_follow(client, job_id))
            for line in client.record(job_id)["events"]:
                out.print(line, highlight=False, soft_wrap=True)
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))


@job_app.command("cancel")
@connection_options
def cancel(
    job_id: JobId,
    connection: Connection = Connection(),
) -> None:
    """Cancel a queued job, or stop a running one (its devices stay for the next job)."""
    try:
        with _client(connection) as client:
            client.cancel(job_id)
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    console.print(f"job {job_id} cancelled")
