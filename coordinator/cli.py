"""``coordinator``: registry, clustering, rounds and blind aggregation of a fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield.cli.common import console, fail
from senseshield.cli.run import (
    BatchSize, Broker, CaFile, Dataset, Fleet, KeyBits, LearningRate, LocalEpochs, LogLevel, Model, Mqtt,
    Partition, PasswordFile, Rounds, Scheme, Seed, Sets, Strategy, TrainThreads, Username, build_run_config, check_mqtt,
    mqtt_security, setup_logging,
)
from senseshield.errors import ConfigError

app = typer.Typer(help="SenseShield coordinator: clusters agents and aggregates ciphertexts it cannot read.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """SenseShield coordinator."""


@app.command()
def serve(
    broker: Broker = "mqtt://127.0.0.1:1883",
    fleet: Fleet = "default",
    strategy: Strategy = "sensecrypt",
    rounds: Rounds = 5,
    agents: Annotated[int, typer.Option(help="Agents to wait for before the bootstrap.")] = 2,
    dataset: Dataset = "digits",
    model: Model = "mlp",
    partition: Partition = "iid",
    seed: Seed = 0,
    local_epochs: LocalEpochs = 2,
    batch_size: BatchSize = 16,
    lr: LearningRate = 0.1,
    scheme: Scheme = None,
    key_bits: KeyBits = 2048,
    train_threads: TrainThreads = 1,
    set_: Sets = None,
    round_deadline: Annotated[float, typer.Option(help="Seconds a round waits for updates before closing without the late ones.")] = 120.0,
    join_timeout: Annotated[float, typer.Option(help="Seconds to wait for --agents to join before starting with who is there.")] = 300.0,
    state_dir: Annotated[Optional[Path], typer.Option(help="Checkpoint directory; a restart with the same config resumes.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write report.json and models/ here.")] = None,
    max_message_mb: Annotated[float, typer.Option(help="Refuse messages larger than this (MB).")] = 256.0,
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve Prometheus metrics on this port (default: off, or $SENSESHIELD_METRICS_PORT).")] = None,
    mqtt: Mqtt = "5",
    ca_file: CaFile = None,
    username: Username = None,
    password_file: PasswordFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run a federated job on the agents that join the fleet, then exit."""
    from coordinator.service import Coordinator
    from senseshield.data import load_dataset

    setup_logging(log_level, "coordinator")
    if agents < 1:
        fail(f"--agents {agents} is not allowed; a fleet needs at least 1 agent.")
    if metrics_port is not None and not 0 < metrics_port < 65536:
        fail(f"--metrics-port {metrics_port} is not allowed; use a port in 1..65535.")
    config = build_run_config(
        strategy=strategy, rounds=rounds, dataset=dataset, model=model, partition=partition, seed=seed,
        local_epochs=local_epochs, batch_size=batch_size, lr=lr, scheme=scheme, key_bits=key_bits,
        clients=agents, sets=set_, train_threads=train_threads,
    )
    security = mqtt_security(broker, ca_file=ca_file, username=username, password_file=password_file)
    try:
        facts = load_dataset(dataset, seed=seed)  # the model's input shape and classes
        server = Coordinator(
            broker, fleet=fleet, config=config, agents=agents, input_shape=facts.input_shape,
            num_classes=facts.num_classes, round_deadline=round_deadline, join_timeout=join_timeout,
            state_dir=state_dir, out_dir=out, protocol=check_mqtt(mqtt),
            max_frame_bytes=int(max_message_mb * 1e6), metrics_port=metrics_port,
        )
        server.link.secure(**security)
        server.install_signal_handlers()
        server.run()
    except (ConfigError, ConnectionError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        console.print("coordinator stopped")
        raise typer.Exit(130)
    if out is not None:
        console.print(f"wrote {out / 'report.json'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
