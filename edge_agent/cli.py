"""``edge-agent``: the light agent on each device (join a fleet, profile, predict)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli.common import fail, storage_stop, version_option
from senseshield.cli.connection import Connection, connection_options
from senseshield.cli.run import InsecureDev, LogLevel, Threads, development, setup_logging, starting
from senseshield.errors import ConfigError, StorageError

app = typer.Typer(help="SenseShield edge agent: trains locally and sends protected updates.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root(version: Annotated[bool, version_option("edge-agent")] = False) -> None:
    """SenseShield edge agent."""


@app.command()
@connection_options
def join(
    connection: Connection = Connection(),
    agent_id: Annotated[Optional[str], typer.Option(help="This device's id (default: the host name).")] = None,
    profile: Annotated[str, typer.Option(help="auto (measure now) | auto:NAME or auto:FILE.yaml (measure, bounded by that declared profile) | NAME (profiles/NAME.yaml) | FILE.yaml.")] = "auto",
    probe: Annotated[str, typer.Option(help="Bandwidth probe plan with --profile auto: robust | single (the old best-of-two, for before/after benchmarks).", hidden=True)] = "robust",
    data: Annotated[Optional[list[str]], typer.Option("--data", help="This device's data, [NAME=]PATH, repeatable: a .npz (x, y[, x_test, y_test]), a .csv with a header (label column 'label' or a sidecar FILE.csv.yaml), a folder of one sub-folder of images per class, or python:module:function (docs/your-model-and-data.md). A job uses the source it names (data: NAME), else the only one.")] = None,
    index: Annotated[Optional[int], typer.Option(help="Seed index of this device's randomness (default: the shard's, else a hash of the agent id).")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Built-in data for simulations and trials: digits | mnist5k | idx:<dir> | synthetic (default: the run's).")] = None,
    shard: Annotated[Optional[str], typer.Option(help="Use shard I/N of the dataset (0 <= I < N), cut by the run's partition.")] = None,
    partition: Annotated[Optional[str], typer.Option(help="How shards are cut (default: the run's partition).")] = None,
    threads: Threads = None,
    model_dir: Annotated[Optional[Path], typer.Option(help="Where the agent keeps its cluster's latest ONNX model, merged with its personalised zone (default: ~/.senseshield/FLEET/ID).")] = None,
    insecure_dev: InsecureDev = False,
    min_he_ratio: Annotated[Optional[float], typer.Option(help="In a job that encrypts, encrypt at least this fraction of the parameters whatever budget the coordinator assigns, and never send an update that encrypts less (0..1; default: the profile's min_he_ratio, else 0).")] = None,
    require_he: Annotated[bool, typer.Option("--require-he", help="Decline jobs whose strategy encrypts nothing, even without a --min-he-ratio floor.")] = False,
    allow_plaintext: Annotated[bool, typer.Option("--allow-plaintext", help="With a --min-he-ratio floor, still take jobs whose strategy encrypts nothing (e.g. fedavg, dp-fedavg; default: decline them).")] = False,
    allow_unsigned_jobs: Annotated[bool, typer.Option("--allow-unsigned-jobs", help="Take jobs no operator signed (the coordinator alone may then start jobs and choose their run ids and initial models). Off: a job must be signed by an operator the trust file pins, under the nonce and initial model it signed (docs/security.md).")] = False,
    log_level: LogLevel = defaults.LOG_LEVEL,
    once: Annotated[bool, typer.Option("--once", help="Exit when the first job ends (default: stay connected and take every job).")] = False,
    device_class: Annotated[Optional[str], typer.Option(help="What a job's select.device_class matches (default: the declared profile's name, else the board).")] = None,
    label: Annotated[Optional[list[str]], typer.Option("--label", help="KEY=VALUE a job's select.labels matches, repeatable (e.g. --label site=lab).")] = None,
    kill_at_round: Annotated[Optional[int], typer.Option(help="Fault drill: SIGKILL this agent when round R's plan arrives.", hidden=True)] = None,
    fail_at_round: Annotated[Optional[int], typer.Option(help="Fault drill: this agent's training raises in round R.", hidden=True)] = None,
    lose_plan_at_round: Annotated[Optional[int], typer.Option(help="Fault drill: drop round R's first plan and say hello again, as after a broker restart that lost the plan.", hidden=True)] = None,
    slowdown: Annotated[float, typer.Option(help="Fault drill: train F times slower than this machine does (after each round's training, wait F - 1 times as long), as a slower board would.", hidden=True, min=1.0)] = 1.0,
    dev_noise_seed: Annotated[Optional[int], typer.Option(help="Test only: replay this device's privacy noise from seed N (anyone who knows N can remove it); refused unless --insecure-dev (SENSESHIELD_DEVELOPMENT=1).")] = None,
) -> None:
    """Join a fleet and take its jobs: stays connected between jobs (SIGTERM ends it); with
    --once it exits 0 when the first job ends, 3 if refused."""
    import logging
    import socket

    broker, fleet, identity = connection.broker, connection.fleet, connection.identity
    setup_logging(log_level, f"agent:{agent_id or socket.gethostname()}")
    development(insecure_dev)
    starting("edge agent", agent_id or socket.gethostname(), broker, fleet)  # before the imports below
    from edge_agent.probes import is_measured, load_profile
    from edge_agent.padlog import file_name
    from edge_agent.service import DataSpec, EdgeAgent
    from senseshield.runtime.service import leave
    from senseshield.device_noise import check_noise_seed

    security = connection.security()
    try:
        noise = check_noise_seed(dev_noise_seed)
        if index is not None and index < 0:
            raise ConfigError(f"--index {index} is not allowed; use 0 or more.")
        if min_he_ratio is not None and not 0.0 <= min_he_ratio <= 1.0:
            raise ConfigError(f"--min-he-ratio {min_he_ratio} is not allowed; give a fraction of the parameters in 0..1.")
        spec = DataSpec(dataset=dataset, shard=DataSpec.parse_shard(shard), partition=partition,
                        sources=DataSpec.parse_sources(data), index=index)
        if spec.sources and (dataset is not None or shard is not None):
            raise ConfigError("--data and --dataset/--shard are alternatives; give the device's own data or a built-in shard.")
        if threads is not None and threads < 1:
            raise ConfigError(f"--threads {threads} is not allowed; use 1 or more.")
        if is_measured(profile) and security:
            # the bandwidth probe's anonymous client and topic are not allowed on a secured broker
            logging.getLogger("edge_agent").warning(
                "--profile auto on a secured broker: bandwidth not measured, declared default used")
        measure = {"broker": None if security else broker, "fleet": fleet, "quick": True, "mqtt": connection.protocol,
                   "probe": probe}
        device = load_profile(profile, **measure)  # the measuring keywords apply to auto[:SPEC] only
        rate = device.measurements.get("he_encryptions_per_s")
        if rate is not None and device.he_encryptions_per_s:
            logging.getLogger("edge_agent").info(
                "measured %.0f values/s encrypted (%s/%s, best of %d bursts; min %.0f, median %.0f)",
                device.he_encryptions_per_s, device.he_scheme, device.he_key_bits, rate.probes, rate.min, rate.median)
        labels = {}
        for item in label or []:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--label {item!r} is not allowed; use KEY=VALUE, e.g. --label site=lab.")
            labels[key.strip()] = value.strip()
        declared = profile.removeprefix("auto:") if profile != "auto" else None
        if declared is not None and declared.endswith((".yaml", ".yml", ".json")):
            declared = None  # a file: its board says what it is
        device_class = device_class or declared
        name = agent_id or socket.gethostname()
        home = model_dir if model_dir is not None else Path.home() / ".senseshield" / fleet / name
        identity_file = identity if identity is not None else home / "identity" / "agent.key"
        me, trusted = connection.identity_and_trust(name, identity_file)
        agent = EdgeAgent(
            broker, fleet=fleet, agent_id=name, identity=me, trust=trusted, bandwidth=device.bandwidth, cpu_speed=device.cpu_speed, profile=device.model_dump(mode="json"), data=spec, threads=threads,
            protocol=connection.protocol, kill_at_round=kill_at_round, fail_at_round=fail_at_round,
            lose_plan_at_round=lose_plan_at_round, slowdown=slowdown, model_dir=model_dir, once=once,
            device_class=device_class, labels=labels, require_he=require_he, allow_plaintext=allow_plaintext,
            min_he_ratio=min_he_ratio if min_he_ratio is not None else (device.min_he_ratio or 0.0), noise=noise,
            allow_unsigned_jobs=allow_unsigned_jobs, pad_log=identity_file.parent / file_name(name),
        )
        agent.link.secure(**security)
        agent.install_signal_handlers()
        code = agent.serve()
        leave(agent, code)
    except StorageError as exc:  # --model-dir: disk full, read-only, permission
        storage_stop(exc, "the agent", "started again, it joins the running job")
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    raise typer.Exit(code)


from edge_agent.profile import profile_command  # noqa: E402
from senseshield.cli.inference import predict_command  # noqa: E402

app.command(name="profile")(profile_command)
app.command(name="predict")(predict_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
